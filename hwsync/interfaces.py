"""The three interfaces a backend implements, and the backend object that hands them out.

Rules every backend follows (the conformance test checks the shape, reviews check the rest):
- importing a backend module never imports a vendor runtime or touches device state:
  those are looked up inside methods, so `hwsync info` runs on any machine;
- `probe()` says whether the hardware is usable, and why not, without initialising a runtime;
- data crosses a Communicator as contiguous uint8 views, which every collective library accepts;
- transport handles are plain JSON/msgpack values (str, int, float, bool, None, bytes, lists,
  dicts): they travel in the handshake, and nothing on the wire is ever pickled.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from hwsync.sizes import DEFAULT_BUCKET_BYTES
from hwsync.timing import GROUP_TIMEOUT_S

#: A description of a transport's buffers that travels in the handshake (msgpack-safe values).
Handles = dict[str, Any]


@dataclass(frozen=True)
class ProbeResult:
    """Whether a backend's hardware is usable here, and the reason either way."""

    usable: bool
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


class Device(ABC):
    """One kind of accelerator (or the host) as seen by this process."""

    name: str
    #: torch device type, e.g. "cpu", "cuda", "npu"
    torch_type: str
    #: environment variable that selects visible devices, or None (the CPU has none)
    visible_devices_env: str | None = None

    @abstractmethod
    def probe(self) -> ProbeResult:
        """Say whether the hardware is usable, without initialising the runtime."""

    @abstractmethod
    def count(self) -> int:
        """Number of devices visible to this process."""

    @abstractmethod
    def current_index(self) -> int:
        """Index of the current device."""

    @abstractmethod
    def set_index(self, index: int) -> None:
        """Make `index` the current device."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until all work queued on the current device has finished."""

    @abstractmethod
    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(free, total) bytes from the driver's own query, not total minus allocated."""

    @abstractmethod
    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes held by live tensors of this process's allocator."""

    @abstractmethod
    def memory_reserved(self, index: int | None = None) -> int:
        """Bytes reserved by this process's caching allocator."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused blocks to the driver."""

    @abstractmethod
    def physical_id(self, index: int | None = None) -> str:
        """Stable identity of a device (uuid or physical index) valid across processes."""

    def pin_host_memory(self, tensor: torch.Tensor, *, read_only: bool = False) -> bool:
        """Page-lock a host tensor's memory for fast device copies; False where the backend cannot (the default).

        `read_only`: the pages are mapped read-only (a receiver's view of a sender's segment): the device only
        reads them, and a runtime that needs to be told so (CUDA's cudaHostRegisterReadOnly) is told."""
        return False

    def unpin_host_memory(self, tensor: torch.Tensor) -> None:
        """Undo pin_host_memory (call only after it returned True)."""

    def runtime_in_use(self) -> bool:
        """Whether this process has started the device runtime, so device work may be in flight; never starts it.

        False by default, which is right for the host: nothing is ever queued there. Transports wait
        for the device only where this is True, so a process that moves host tensors only never
        initialises an accelerator it does not use."""
        return False

    def staging_device(self) -> torch.device | None:
        """Where a receiver copies host bytes for this process's engine; None keeps them on the host.

        By default: None for the CPU and where the probe says the hardware is unusable here, else
        the current device."""
        if self.torch_type == "cpu" or not self.probe().usable:
            return None
        return self.torch_device()

    def torch_device(self, index: int | None = None) -> torch.device:
        """The torch.device for `index` (the current device when None)."""
        if self.torch_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.torch_type, self.current_index() if index is None else index)


class Communicator(ABC):
    """A process group over the backend's collective library (gloo, NCCL, HCCL)."""

    rank: int
    world_size: int

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast `tensor` in place from rank `src` to every rank."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather an equally shaped tensor from every rank, in rank order."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduce `tensor` in place across ranks; op is "sum", "min" or "max"."""

    @abstractmethod
    def barrier(self) -> None:
        """Block until every rank has reached the barrier."""

    @abstractmethod
    def destroy(self) -> None:
        """Tear the group down; the communicator is unusable afterwards."""


class SendBuffers(ABC):
    """The sender's side of a transport: N buffers to pack, each published when full."""

    bucket_bytes: int
    num_buffers: int

    @abstractmethod
    def handles(self) -> Handles:
        """What a receiver needs to reach these buffers (msgpack-safe)."""

    def handles_for(self, receiver: str, pid: int | None, host: str | None) -> Handles:
        """What receiver `receiver` (a key that stays the same while it stays connected; its process id
        and host) needs. Transports that share device memory export it here, once per receiver, as
        torch counts one consumer per export (hwsync.exports); the rest hand everyone handles()."""
        return self.handles()

    def release_for(self, receiver: str) -> None:
        """`receiver` will not map what handles_for gave it (it failed before accepting, or died)."""

    @abstractmethod
    def buffer(self, index: int) -> torch.Tensor:
        """Flat uint8 tensor of `bucket_bytes` to pack bucket data into."""

    @abstractmethod
    def publish(self, index: int, nbytes: int) -> None:
        """Make the first `nbytes` of buffer `index` visible to the receivers."""

    @abstractmethod
    def close(self) -> None:
        """Release the buffers; safe to call twice."""


class ReceiveBuffers(ABC):
    """The receiver's side of a transport: a view of buffer k once its bytes are there."""

    @abstractmethod
    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """Flat uint8 view of the first `nbytes` of buffer `index`, valid until release."""

    @abstractmethod
    def release(self, index: int) -> None:
        """Done reading buffer `index`; the sender may refill it once told."""

    @abstractmethod
    def close(self) -> None:
        """Detach from the buffers; safe to call twice."""


class Transport(ABC):
    """How one bucket's bytes get from a sender to its receiver(s)."""

    name: str
    #: a bucket size that performs well on this transport when the user sets none
    default_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    #: (bucket bytes, buffers) for when every receiver copies straight into its own tensors
    #: (receive(into=...)), if that differs from default_bucket_bytes and 2 buffers
    into_geometry: tuple[int, int] | None = None

    @abstractmethod
    def available(self) -> ProbeResult:
        """Whether this transport can be used here, and why not."""

    @abstractmethod
    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Allocate the sender's buffers."""

    @abstractmethod
    def open_receiver(self, handles: Handles, owner_pid: int | None = None) -> ReceiveBuffers:
        """Attach to buffers a sender announced; `owner_pid`, the sender's pid, where the buffers name its process."""


class Backend(ABC):
    """A plugin: one Device, Communicators over its collective library, and its Transports."""

    name: str

    @abstractmethod
    def device(self) -> Device:
        """The backend's Device."""

    @abstractmethod
    def communicator(
        self, init_method: str, rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S
    ) -> Communicator:
        """A process group of its own, rendezvousing at `init_method` (tcp://host:port)."""

    @abstractmethod
    def transports(self) -> dict[str, Transport]:
        """Same-node transports by name, the preferred one first."""

    def probe(self) -> ProbeResult:
        """Whether this backend is usable here (its Device's probe)."""
        return self.device().probe()

    def default_transport(self) -> Transport:
        """The first available transport, in the backend's order of preference."""
        for transport in self.transports().values():
            if transport.available().usable:
                return transport
        raise RuntimeError(f"backend {self.name!r} has no usable transport here")
