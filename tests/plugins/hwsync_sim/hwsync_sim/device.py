"""The simulated accelerator as an hwsync Device.

Like a real backend's Device, nothing here touches the simulated runtime until a method needs
it: `probe()` and `count()` read only the environment, so loading and probing the plugin (as
`hwsync info` and the test suite's backend listing do) never claims torch's PrivateUse1 slot.
"""

from __future__ import annotations

import os

import torch

from hwsync.backend import Device, ProbeResult
from hwsync_sim.runtime import ENV_VISIBLE, TYPE, NodeConfig, Runtime, SimError, initialized, runtime
from hwsync_sim.streams import SimEvent, SimStream, SimStreamError
from hwsync_sim.tensor import block_of


def _writable(start: int, nbytes: int) -> bool:
    """Whether every page of [start, start + nbytes) lies in a writable mapping of this process."""
    end, covered = start + nbytes, start
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= covered < high:
                if "w" not in perms:
                    return False
                covered = high
                if covered >= end:
                    return True
    return False


class SimDeviceEvent:
    """An event on a sim stream, as torch.cuda.Event: the host waits for the stream up to it, no further."""

    def __init__(self, rt: Runtime, stream: SimStream, event: SimEvent) -> None:
        self._rt, self._stream, self._event = rt, stream, event

    def synchronize(self) -> None:
        """Run the stream up to the event and wait (counted as an event wait); a failed operation raises here."""
        self._rt.tally("event_waits")
        self._event.synchronize()
        if self._stream.error is not None:
            raise SimStreamError(f"an earlier operation on stream {self._stream.name} failed: "
                                 f"{type(self._stream.error).__name__}: {self._stream.error}") from self._stream.error

    def query(self) -> bool:
        """Whether the work before the event has run."""
        return self._event.query()


def sim_data_ptr(tensor: torch.Tensor) -> int:
    """A sim tensor's address: its allocation's device address (runtime.Memory.address) plus its offset; torch's own
    for a host tensor; 0 for a sim tensor the simulator did not make."""
    if tensor.device.type != TYPE:
        return torch.Tensor.data_ptr(tensor)
    try:
        block = block_of(tensor)
    except SimError:
        return 0
    return block.mem.address + tensor.storage_offset() * tensor.element_size()


class SimDevice(Device):
    """N simulated devices on host memory (test-only; see hwsync_sim)."""

    name = TYPE
    torch_type = TYPE
    visible_devices_env = ENV_VISIBLE

    def probe(self) -> ProbeResult:
        """Always usable where its environment parses: it is simulated; says so, and what it models."""
        try:
            config = NodeConfig.from_env()
        except (SimError, ValueError) as exc:
            return ProbeResult(False, f"the simulated accelerator's settings are wrong: {exc}")
        return ProbeResult(
            True,
            f"SIMULATED accelerator for tests (not hardware): {len(config.visible)} of {config.devices} devices "
            f"visible, {config.memory_bytes >> 30} GiB each, in host memory",
            {"visible": list(config.visible), "devices": config.devices, "stream_delay_s": config.delay_s},
        )

    def count(self) -> int:
        """Visible simulated devices."""
        return len(NodeConfig.from_env().visible)

    def current_index(self) -> int:
        """This thread's current device (a new thread starts on 0)."""
        return runtime().current()

    def set_index(self, index: int) -> None:
        """Make `index` this thread's current device."""
        runtime().set_current(index)

    def synchronize(self) -> None:
        """Wait for every stream of this thread's current device."""
        rt = runtime()
        rt.synchronize(rt.current())

    def pin_host_memory(self, tensor: torch.Tensor, *, read_only: bool = False) -> bool:
        """Model cudaHostRegister: host-to-device copies from these bytes read them when they run, not before.

        As CUDA does, pages this process may only read are refused unless registered read-only
        (cudaHostRegisterReadOnly): the mapping's permissions are read from /proc/self/maps.
        """
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes or tensor.device.type != "cpu":
            return False
        if not read_only and not _writable(tensor.data_ptr(), nbytes):
            return False
        runtime().pinned.append((tensor.data_ptr(), nbytes))
        return True

    def unpin_host_memory(self, tensor: torch.Tensor) -> None:
        """Forget a pinned range (cudaHostUnregister)."""
        rt = runtime()
        rt.pinned = [r for r in rt.pinned if r[0] != tensor.data_ptr()]

    def record_event(self, index: int | None = None) -> SimDeviceEvent:
        """An event on device `index`'s stream (the current device's when None), as torch.cuda.Event().record()."""
        rt = runtime()
        stream = rt.stream(rt.current() if index is None else index)
        return SimDeviceEvent(rt, stream, stream.record())

    #: a sim tensor holds no storage of its own (torch's data_ptr says 0 plus its offset): its allocation's address
    data_ptr = staticmethod(sim_data_ptr)

    def counters(self) -> dict[str, int] | None:
        """What this process's sim work counted (hwsync_sim.runtime); empty before the sim started here."""
        return dict(runtime().counts) if initialized() else {}

    def runtime_in_use(self) -> bool:
        """Whether this process has used the sim (only then can device work be in flight); never starts it."""
        return initialized()

    def staging_device(self) -> torch.device | None:
        """This thread's current sim device, always (the sim is usable wherever it parses; starts the runtime)."""
        return self.torch_device()

    def _index(self, index: int | None) -> int:
        return runtime().current() if index is None else index

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(free, total): the device's size minus what every live process on the node holds on it."""
        return runtime().mem_get_info(self._index(index))

    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes of this process's live allocations on the device."""
        return runtime().allocated(self._index(index))

    def memory_reserved(self, index: int | None = None) -> int:
        """The sim has no caching allocator: what is reserved is what is allocated."""
        return runtime().allocated(self._index(index))

    def empty_cache(self) -> None:
        """Nothing is cached."""

    def physical_id(self, index: int | None = None) -> str:
        """SIM-<host>-<physical index>: the same in every process whatever its visible devices."""
        return runtime().physical_id(self._index(index))

    def local_index(self, physical_id: str) -> int:
        """This process's index of the device named `physical_id`; the error says how to see it."""
        rt = runtime()
        prefix = f"SIM-{rt.host}-"
        local = None
        if physical_id.startswith(prefix) and physical_id[len(prefix):].isdigit():
            local = rt.local_of_physical(int(physical_id[len(prefix):]))
        if local is None:
            raise LookupError(f"sim device {physical_id} is not visible to this process "
                              f"({ENV_VISIBLE}={os.environ.get(ENV_VISIBLE, 'unset')!r}); add its physical index there")
        return local

    def torch_device(self, index: int | None = None) -> torch.device:
        """torch.device("sim", index), the current device when index is None."""
        return torch.device(TYPE, self._index(index))
