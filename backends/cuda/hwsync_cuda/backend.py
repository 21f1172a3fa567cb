"""CudaBackend: NVIDIA GPUs as the Device, NCCL Communicators, CUDA IPC or shared memory (hwsync.backend.device_shm).

Instantiating it never touches CUDA; only `communicator()` and the transports' buffers do.
"""

from __future__ import annotations

import torch

from hwsync.backend import (
    GROUP_TIMEOUT_S,
    Backend,
    Communicator,
    Device,
    DeviceShmTransport,
    HwsyncError,
    Nic,
    ProcessGroupCommunicator,
    Transport,
)
from hwsync_cuda.device import CudaDevice
from hwsync_cuda.ipc import CudaIpcTransport
from hwsync_cuda.nccl import NCCL_REDUCE_DTYPES, nccl_group, nccl_interface, nccl_missing_reason


class CudaBackend(Backend):
    """Backend for NVIDIA GPUs."""

    name = "cuda"

    def __init__(self) -> None:
        self._device = CudaDevice()
        # Preferred first: IPC moves buckets GPU to GPU; shm goes through host memory.
        self._transports: dict[str, Transport] = {
            "cuda_ipc": CudaIpcTransport(self._device),
            "shm": DeviceShmTransport(self._device),  # the core's, with this device's pinning and waits
        }

    def device(self) -> Device:
        """The process's NVIDIA GPUs."""
        return self._device

    def communicator(self, init_method: str, rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S,
                     *, nic: Nic | None = None) -> Communicator:
        """An NCCL group of its own on the current GPU (one GPU per rank, as NCCL requires), its sockets on `nic`
        unless NCCL_SOCKET_IFNAME is set."""
        reason = nccl_missing_reason()
        if reason is not None:
            raise HwsyncError(f"the cuda backend's communicator needs NCCL: {reason}")
        probe = self._device.probe()
        if not probe.usable:
            raise HwsyncError(f"the cuda backend's communicator needs a GPU: {probe.reason}")
        device = torch.device("cuda", torch.cuda.current_device())
        note = nccl_interface(nic)
        return ProcessGroupCommunicator(
            "nccl", nccl_group, init_method, rank, world_size, device, NCCL_REDUCE_DTYPES, timeout_s,
            interface_note=note,
        )

    def transports(self) -> dict[str, Transport]:
        """CUDA IPC, then POSIX shared memory."""
        return dict(self._transports)
