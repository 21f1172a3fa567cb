"""CpuBackend: the host as the Device, gloo Communicators, the core's POSIX shared memory."""

from __future__ import annotations

import torch

from hwsync.backend import (
    GROUP_TIMEOUT_S,
    Backend,
    Communicator,
    Device,
    Nic,
    ProcessGroupCommunicator,
    ShmTransport,
    Transport,
)
from hwsync_cpu.device import CpuDevice
from hwsync_cpu.gloo import GLOO_REDUCE_DTYPES, gloo_factory


class CpuBackend(Backend):
    """Backend for machines without an accelerator, and for tests everywhere."""

    name = "cpu"

    def __init__(self) -> None:
        self._device = CpuDevice()
        # Host memory needs no device copies, so the core's transport serves as it is.
        self._transports: dict[str, Transport] = {"shm": ShmTransport()}

    def device(self) -> Device:
        """The host."""
        return self._device

    def communicator(self, init_method: str, rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S,
                     *, nic: Nic | None = None) -> Communicator:
        """A gloo group of its own, bound to `nic` (the interface hwsync chose) unless GLOO_SOCKET_IFNAME is set."""
        factory, note = gloo_factory(nic)
        return ProcessGroupCommunicator(
            "gloo", factory, init_method, rank, world_size, torch.device("cpu"), GLOO_REDUCE_DTYPES, timeout_s,
            interface_note=note,
        )

    def transports(self) -> dict[str, Transport]:
        """POSIX shared memory."""
        return dict(self._transports)
