"""A third-party backend: reuses the CPU device and shared memory under its own name."""

from hwsync.backend import GROUP_TIMEOUT_S, Backend, Communicator, Device, ProbeResult, ShmTransport, Transport
from hwsync_cpu import CpuBackend, CpuDevice


class ToyDevice(CpuDevice):
    """The host, under another name."""

    name = "toy"


class ToyBackend(Backend):
    """Selected only by HWSYNC_BACKEND=toy."""

    name = "toy"

    def device(self) -> Device:
        """The host."""
        return ToyDevice()

    def communicator(self, init_method: str, rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S) -> Communicator:
        """gloo, as the cpu backend does."""
        return CpuBackend().communicator(init_method, rank, world_size, timeout_s)

    def transports(self) -> dict[str, Transport]:
        """Shared memory."""
        return {"shm": ShmTransport()}


class AbsentDevice(CpuDevice):
    """A device whose hardware is never there."""

    name = "absent"

    def probe(self) -> ProbeResult:
        """Always unusable, with a reason a user can act on."""
        return ProbeResult(False, "no absent-accelerator card found (ABSENT_VISIBLE_DEVICES is empty)")


class AbsentBackend(ToyBackend):
    """Installed, but its hardware is missing."""

    name = "absent"

    def device(self) -> Device:
        """A device that is never there."""
        return AbsentDevice()
