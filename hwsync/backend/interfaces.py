"""The interfaces a backend implements (Device, Communicator, Transport, DeviceSegments), and its backend object.

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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class DeviceEvent(Protocol):
    """A point in a device stream (a CUDA or NPU event, the sim's): the host may wait for it."""

    def synchronize(self) -> None:
        """Block the host until the work queued before the event has run."""

    def query(self) -> bool:
        """Whether that work has run (never waits)."""


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

    def record_event(self, index: int | None = None) -> DeviceEvent | None:
        """An event recorded now on the current stream of device `index` (this thread's current device when None):
        done once the work queued on that stream so far has run. None where the backend has none (the default;
        the CPU queues nothing): callers then synchronize the device. Waiting on it waits for that stream only,
        not for the trainer's other streams (its collectives, its prefetches), as a device synchronize would."""
        return None

    #: the address of a tensor's first byte in this device's memory, where two tensors with one address, shape,
    #: strides and dtype read the same bytes, and 0 where the tensor has no memory of its own to say it by (what a
    #: replayed sync checks its tensors by: colocated/replay.py). torch's own by default, the C function itself (a
    #: plan's checks call it once a tensor); a backend whose tensors hold no storage of their own gives its own.
    data_ptr: Callable[[torch.Tensor], int] = staticmethod(torch.Tensor.data_ptr)

    def counters(self) -> dict[str, int] | None:
        """What this process's device work counted so far (copies, bytes, exports, opens), where a backend counts
        it: the simulated accelerator does, for tests and benchmarks; None elsewhere (the default)."""
        return None

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
        torch counts one consumer per export (hwsync.backend.exports); the rest hand everyone handles()."""
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


#: one export of device memory for one receiver process, as msgpack-safe values (the backend's own fields)
Record = dict[str, Any]


@dataclass(frozen=True)
class SegmentPlace:
    """Where a device tensor's bytes lie: in allocator segment `key` (`size` bytes), from byte `offset` on."""

    #: the segment, in this process, while it lives (the sim: its allocation; CUDA: device and base address)
    key: Hashable
    size: int
    offset: int


class DeviceSegments(ABC):
    """Device memory receiver processes read in place: the allocator segments that hold a sender's tensors.

    A backend whose IPC maps device memory offers this (Transport.device_segments); the core's rules
    (hwsync.colocated.mapped) are:
    - an allocator segment (one cudaMalloc of torch's caching allocator; one allocation on the sim) is
      exported once per receiver process, through one block in it (the anchor), and the export covers the
      whole segment; every export has one consumer, as torch counts IPC (hwsync.backend.exports);
    - the anchor is held weakly: a freed anchor that a receiver still maps stays allocated (torch's IPC
      limbo), so the segment cannot go back to the driver under the receiver; the sender notices the death at
      its next sync and drops the segment on both sides, and collect() then frees the block;
    - a receiver maps each export once, on its own current device, and keeps it until the sender drops it.
    """

    @abstractmethod
    def locate(self, tensor: torch.Tensor) -> SegmentPlace | None:
        """The segment holding `tensor`'s bytes; None where it lies in none that can be shared (another device
        type, memory the allocator does not own, a tensor subclass the backend cannot export)."""

    @abstractmethod
    def held_elsewhere(self, tensor: torch.Tensor) -> bool:
        """Whether something besides `tensor` keeps its memory (it is a Parameter, or another tensor shares its
        storage): only such tensors outlive the source's next step; a cast or a gathered copy does not."""

    @abstractmethod
    def anchor(self, tensor: torch.Tensor) -> Any:
        """A weak reference to the block that holds `tensor` (it keeps nothing alive)."""

    @abstractmethod
    def alive(self, anchor: Any) -> bool:
        """Whether the anchor's block still belongs to a live tensor."""

    @abstractmethod
    def export(self, anchor: Any, place: SegmentPlace) -> Record:
        """One export of the anchor's whole segment (`place.size` bytes) for one receiver process."""

    @abstractmethod
    def release_export(self, record: Record) -> None:
        """Release an export for a receiver that will never unmap it (it never mapped it, or died)."""

    @abstractmethod
    def open(self, record: Record, size: int) -> torch.Tensor:
        """Map another process's export on this thread's current device: a flat uint8 tensor of the segment's
        `size` bytes. Dropping every view of it unmaps it, after this process's queued work on it."""

    def collect(self) -> None:
        """Free blocks that were parked for receivers which have since let go (torch's ipc_collect)."""


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

    def device_segments(self) -> DeviceSegments | None:
        """How receivers read the sender's device memory in place through this transport's IPC (mapped sources);
        None where they cannot (the default: host memory, or no IPC), and device tensors then go packed."""
        return None


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
