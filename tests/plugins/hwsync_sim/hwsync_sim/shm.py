"""shm on the sim: the core's device shared-memory transport (hwsync.backend.device_shm) over SimDevice.

The copies, the pinning and the waits are the core's, exactly as on CUDA and the NPU: the sender
packs sim tensors into host segments it pinned (SimDevice.pin_host_memory), so the packer's
non_blocking device-to-host copies are queued on the stream and land only when they run; the
receiver pins the segments it maps and stages each bucket on its current sim device with a
queued host-to-device copy that reads the segment when it runs. A missing wait in publish() or
release() therefore shows as wrong bytes: tests/test_ipc_on_devices.py fails when publish() skips
its wait, tests/test_sim_accelerator.py when release() does.

The one thing added here is the sim's strictness: as in sim_ipc, a segment the receivers
released is poisoned when the sender starts refilling it, so a reader still queued on it reads
garbage every time instead of, now and then, the next bucket.
"""

from __future__ import annotations

import torch

from hwsync.backend import Device, DeviceShmSendBuffers, DeviceShmTransport, SendBuffers
from hwsync_sim.runtime import POISON


class SimShmSendBuffers(DeviceShmSendBuffers):
    """The core's device shm sender; a segment published before is poisoned as refilling starts."""

    def __init__(self, device: Device, bucket_bytes: int, num_buffers: int) -> None:
        self._published: set[int] = set()
        super().__init__(device, bucket_bytes, num_buffers)

    def buffer(self, index: int) -> torch.Tensor:
        """Segment `index` to pack into; a released one is poisoned as refilling starts."""
        segment = super().buffer(index)
        if index in self._published:
            self._published.discard(index)
            segment.fill_(POISON)
        return segment

    def publish(self, index: int, nbytes: int) -> None:
        """The core's publish (waits for the device), then remember the segment as handed out."""
        super().publish(index, nbytes)
        self._published.add(index)


class SimShmTransport(DeviceShmTransport):
    """The core's device shm transport on the sim, with published segments poisoned on refill."""

    def __init__(self, device: Device | None = None, stage_on_device: bool = True) -> None:
        """`device`: the sim's Device (a fresh SimDevice when None)."""
        if device is None:
            from hwsync_sim.device import SimDevice

            device = SimDevice()
        super().__init__(device, stage_on_device)

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Create `num_buffers` host segments of `bucket_bytes`, poisoned when refilled."""
        return SimShmSendBuffers(self.device, bucket_bytes, num_buffers)
