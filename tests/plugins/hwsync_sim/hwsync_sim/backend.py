"""SimBackend: the simulated accelerator's Device, simccl Communicators, sim_ipc and shm (hwsync.backend.device_shm)."""

from __future__ import annotations

import torch

from hwsync.backend import GROUP_TIMEOUT_S, Backend, Communicator, Device, ProcessGroupCommunicator, Transport
from hwsync_sim.device import SimDevice
from hwsync_sim.ipc import SimIpcTransport
from hwsync_sim.runtime import TYPE, runtime
from hwsync_sim.shm import SimShmTransport
from hwsync_sim.simccl import SIMCCL_REDUCE_DTYPES, make_simccl_group


class SimBackend(Backend):
    """Test-only: selected only by HWSYNC_BACKEND=sim (auto never picks a third-party backend first)."""

    name = TYPE

    def __init__(self) -> None:
        self._device = SimDevice()
        # Preferred first, as CUDA's: IPC moves buckets device to device; shm goes through host memory.
        self._transports: dict[str, Transport] = {
            "sim_ipc": SimIpcTransport(self._device),
            "shm": SimShmTransport(self._device),  # the core's device shm, with the sim's poisoning
        }

    def device(self) -> Device:
        """The simulated devices."""
        return self._device

    def communicator(self, init_method: str, rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S) -> Communicator:
        """A simccl group of its own on the current sim device (one device per rank, as NCCL)."""
        device = torch.device(TYPE, runtime().current())
        return ProcessGroupCommunicator("simccl", make_simccl_group, init_method, rank, world_size, device,
                                        SIMCCL_REDUCE_DTYPES, timeout_s)

    def transports(self) -> dict[str, Transport]:
        """sim_ipc, then shm."""
        return dict(self._transports)
