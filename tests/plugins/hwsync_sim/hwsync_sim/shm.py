"""shm on the sim: the core's shared-memory transport with device copies around it.

Built like hwsync_cuda's CudaShmTransport, so the same kinds of bugs show here: the sender packs
device tensors into host segments and publish() synchronizes the device (device-to-host copies
may still be in flight); the receiver copies each bucket into a device staging buffer of its own
(on the device current when it opened the transport) and hands out that device view; release()
synchronizes the device. Handles are the core's, so a cpu receiver meets a sim sender.
As in sim_ipc, a segment the receivers released is poisoned when the sender starts refilling it.
As CUDA's, both sides pin the segments they map (SimDevice.pin_host_memory), so the sender's
non_blocking device-to-host packing and the receiver's staging copies run later on the stream,
and a missing wait before publish, release or unpinning shows as wrong bytes.
"""

from __future__ import annotations

import torch

from hwsync.interfaces import Handles, ReceiveBuffers, SendBuffers
from hwsync.shm import ShmReceiveBuffers, ShmSendBuffers, ShmTransport
from hwsync_sim.runtime import POISON, TYPE, initialized, runtime


def _pin(segments: list) -> list[torch.Tensor]:
    from hwsync_sim.device import SimDevice

    device = SimDevice()
    return [s.tensor for s in segments if device.pin_host_memory(s.tensor)]


def _unpin(pinned: list[torch.Tensor]) -> None:
    """Wait for the device (queued copies still read or write the pages), then forget the pinned ranges."""
    from hwsync_sim.device import SimDevice

    if pinned:
        _synchronize_current()
        for t in pinned:
            SimDevice().unpin_host_memory(t)
        pinned.clear()


def _synchronize_current() -> None:
    # Only a process that used the sim can have device work in flight.
    if initialized():
        rt = runtime()
        rt.synchronize(rt.current())


class SimShmSendBuffers(ShmSendBuffers):
    """Host segments; publishing waits for the device-to-host copies that filled them."""

    def __init__(self, bucket_bytes: int, num_buffers: int) -> None:
        super().__init__(bucket_bytes, num_buffers)
        self._published: set[int] = set()
        self._pinned = _pin(self.segments) if initialized() else []

    def buffer(self, index: int) -> torch.Tensor:
        """Segment `index` to pack into; a released one is poisoned as refilling starts."""
        segment = super().buffer(index)
        if index in self._published:
            self._published.discard(index)
            segment.fill_(POISON)
        return segment

    def publish(self, index: int, nbytes: int) -> None:
        """Wait for queued device work, then the segment holds finished bytes."""
        _synchronize_current()
        self._published.add(index)

    def close(self) -> None:
        """Unpin (after the device is done with the pages), then unmap and unlink the segments."""
        _unpin(self._pinned)
        super().close()


class SimShmReceiveBuffers(ShmReceiveBuffers):
    """Host segments, each copied into a device staging buffer of this process."""

    def __init__(self, handles: Handles) -> None:
        super().__init__(handles)
        self.bucket_bytes = int(handles["bytes"])
        self.device = torch.device(TYPE, runtime().current())
        self._staging: dict[int, torch.Tensor] = {}
        self._pinned = _pin(self.segments)

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """The bucket's bytes on this process's device (staged)."""
        host = super().view(index, nbytes)
        staging = self._staging.get(index)
        if staging is None:
            staging = self._staging[index] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        staging[:nbytes].copy_(host, non_blocking=True)  # from pinned pages: read when the copy runs
        return staging[:nbytes]

    def release(self, index: int) -> None:
        """Wait for this process's reads of the bucket to finish."""
        _synchronize_current()

    def close(self) -> None:
        """Unpin, unmap the segments and drop the staging buffers."""
        _unpin(self._pinned)
        self._staging = {}
        super().close()


class SimShmTransport(ShmTransport):
    """POSIX shared memory between processes on one node, with sim device copies on both sides."""

    # as CUDA's: each bucket costs two device synchronizations, so the core's small into= buckets do not pay
    into_geometry = None

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Create `num_buffers` host segments of `bucket_bytes`."""
        return SimShmSendBuffers(bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles) -> ReceiveBuffers:
        """Map the announced segments; stage buckets on this process's current sim device."""
        return SimShmReceiveBuffers(handles)
