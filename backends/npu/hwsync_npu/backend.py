"""NpuBackend: the Ascend NPU Device, HCCL Communicators, and NPU IPC or shared memory."""

from __future__ import annotations

import torch

from hwsync.backend import (
    GROUP_TIMEOUT_S,
    Backend,
    Communicator,
    Device,
    DeviceShmTransport,
    Nic,
    ProbeResult,
    ProcessGroupCommunicator,
    Transport,
)
from hwsync_npu.device import NpuDevice, npu_device
from hwsync_npu.hccl import hccl_group, hccl_interface, hccl_reduce_dtypes
from hwsync_npu.ipc import NpuIpcTransport


class NpuShmTransport(DeviceShmTransport):
    """The core's shared memory with NPU copies (hwsync.backend.device_shm); available() also says whether those copies
    are pinned, and how (what `hwsync info` shows)."""

    device: NpuDevice

    def available(self) -> ProbeResult:
        """Usable where /dev/shm is; the reason says how host pages are registered, or why they are not."""
        result = super().available()
        if not result.usable:
            return result
        return ProbeResult(True, f"{result.reason}; {self.device.host_pinning().note}")


class NpuBackend(Backend):
    """Backend for Ascend NPUs through torch_npu (vllm-ascend's runtime)."""

    name = "npu"

    def __init__(self) -> None:
        self._device = NpuDevice()
        # NPU IPC first where the driver and CANN allow it; shared memory is always there.
        self._transports: dict[str, Transport] = {
            "npu_ipc": NpuIpcTransport(self._current_device),
            "shm": NpuShmTransport(self._device),  # the core's, with this device's pinning and waits
        }

    def _current_device(self) -> torch.device:
        return npu_device(self._device.current_index())

    def device(self) -> Device:
        """The NPUs visible to this process."""
        return self._device

    def communicator(self, init_method: str, rank: int, world_size: int, timeout_s: float = GROUP_TIMEOUT_S,
                     *, nic: Nic | None = None) -> Communicator:
        """An HCCL group of its own, on `nic` unless HCCL_IF_IP / HCCL_SOCKET_IFNAME are set; reductions limited
        to what HCCL reduces on this chip."""
        note = hccl_interface(nic)
        return ProcessGroupCommunicator(
            "hccl", hccl_group, init_method, rank, world_size, self._current_device(),
            hccl_reduce_dtypes(self._device.soc_name()), timeout_s, interface_note=note,
        )

    def transports(self) -> dict[str, Transport]:
        """npu_ipc (where supported), then shm with device copies (hwsync.backend.device_shm)."""
        return dict(self._transports)
