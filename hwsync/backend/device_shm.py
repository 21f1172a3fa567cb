"""Shared memory for device backends: the core's POSIX segments with the device copies around them.

One design for every accelerator (CUDA, the NPU, the simulated one); whatever is vendor-specific
comes from the backend's Device (docs/backends.md, "Shared memory on a device"):
- the sender packs device tensors straight into the host segments: the packer's copies are
  non_blocking device-to-host copies, so publish() waits for the device (Device.synchronize)
  before a segment is announced;
- the receiver copies each bucket into a device staging buffer of its own, one large
  non_blocking host-to-device copy (Device.staging_device), and hands out that view; release()
  waits for the device before the sender may refill the segment. Without a staging device (a
  receiver that has no accelerator) it hands out the host view, which holds the same bytes;
- only a process that has started the device runtime can have copies in flight
  (Device.runtime_in_use, which never starts it): a sender of host tensors only never waits,
  never pins, and never initialises CUDA or the NPU runtime for this;
- both sides page-lock the segments they map (Device.pin_host_memory) where they copy between
  them and the device: from pageable pages every copy goes through the driver's bounce buffer
  and is synchronous (measured on an H100: 6.4 GB/s for a whole sync against 55 GB/s for one
  pinned copy); from pinned pages it runs at the bus's speed and asynchronously, which is what
  the two waits are for. A refusal leaves a segment pageable: slower, still correct. Pinned
  pages are unpinned after the device has finished every copy that touches them, before they
  are unmapped.
Handles are the core's shm handles, so a device sender and a CPU receiver (or the reverse) meet.
"""

from __future__ import annotations

import logging

import torch

from hwsync.backend.interfaces import Device, Handles, ReceiveBuffers, SendBuffers
from hwsync.backend.shm import ShmReceiveBuffers, ShmSendBuffers, ShmTransport

log = logging.getLogger("hwsync")


def pin_segments(device: Device, tensors: list[torch.Tensor], *, read_only: bool) -> list[torch.Tensor]:
    """Page-lock each segment through `device`; those pinned (a refusal leaves that one pageable)."""
    pinned = [tensor for tensor in tensors if device.pin_host_memory(tensor, read_only=read_only)]
    wanted = sum(1 for tensor in tensors if tensor.numel())
    if len(pinned) < wanted:
        # one line for the lot: a limit on locked memory refuses every segment alike
        log.warning("hwsync: %d of %d shared segments could not be page-locked for the %s device; their copies "
                    "stay pageable (slower, still correct)", wanted - len(pinned), wanted, device.name)
    return pinned


def unpin_segments(device: Device, pinned: list[torch.Tensor]) -> None:
    """Wait for the device (a queued copy may still read or write the pages), then unpin; safe to call twice."""
    if not pinned:
        return
    if device.runtime_in_use():
        device.synchronize()
    for tensor in pinned:
        device.unpin_host_memory(tensor)
    pinned.clear()


class DeviceShmSendBuffers(ShmSendBuffers):
    """Host segments, pinned where this process uses the device; publishing waits for the copies that filled them."""

    def __init__(self, device: Device, bucket_bytes: int, num_buffers: int) -> None:
        # set before the segments exist: a failure creating them calls close()
        self.device = device
        self._pinned: list[torch.Tensor] = []
        super().__init__(bucket_bytes, num_buffers)
        try:
            if device.runtime_in_use():  # a sender of host tensors only never starts the runtime for this
                self._pinned = pin_segments(device, [segment.tensor for segment in self.segments], read_only=False)
        except BaseException:
            self.close()
            raise

    def publish(self, index: int, nbytes: int) -> None:
        """Wait for queued device work; then the segment holds finished bytes."""
        if self.device.runtime_in_use():
            self.device.synchronize()

    def close(self) -> None:
        """Unpin (after the device is done with the pages), then unmap and unlink the segments; safe to call twice."""
        unpin_segments(self.device, self._pinned)
        super().close()


class DeviceShmReceiveBuffers(ShmReceiveBuffers):
    """Host segments, each copied into a device staging buffer of this process where it has a staging device."""

    def __init__(self, device: Device, handles: Handles, stage_on_device: bool = True,
                 owner_pid: int | None = None) -> None:
        # set before the segments are mapped: a failure mapping them calls close()
        self.device = device
        self._pinned: list[torch.Tensor] = []
        self._staging: dict[int, torch.Tensor] = {}
        super().__init__(handles, owner_pid)
        self.bucket_bytes = int(handles["bytes"])
        self.staging_device: torch.device | None = None
        try:
            self.staging_device = device.staging_device() if stage_on_device else None
            if self.staging_device is not None:
                self._pinned = pin_segments(device, [segment.tensor for segment in self.segments], read_only=True)
        except BaseException:
            self.close()
            raise

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """The bucket's bytes on this process's device (staged), or the host view without one."""
        host = super().view(index, nbytes)
        if self.staging_device is None:
            return host
        staging = self._staging.get(index)
        if staging is None:
            staging = self._staging[index] = torch.empty(self.bucket_bytes, dtype=torch.uint8,
                                                         device=self.staging_device)
        # From pinned pages the copy is queued and returns at once; release() waits for it before the
        # sender may refill the segment. From pageable pages it returns once the bytes are read.
        staging[:nbytes].copy_(host, non_blocking=True)
        return staging[:nbytes]

    def release(self, index: int) -> None:
        """Wait for this process's reads of the bucket (staged or host) to finish."""
        if self.device.runtime_in_use():
            self.device.synchronize()

    def close(self) -> None:
        """Unpin (after the device is done with the pages), unmap the segments, drop the staging buffers."""
        unpin_segments(self.device, self._pinned)
        self._staging = {}
        super().close()


class DeviceShmTransport(ShmTransport):
    """POSIX shared memory between processes on one node, with `device`'s copies on both sides."""

    # The core's small-bucket geometry for into= receivers pays off by keeping buckets in the CPU
    # cache between two host copies; here each bucket costs two device synchronizations instead.
    into_geometry = None

    def __init__(self, device: Device, stage_on_device: bool = True) -> None:
        """`stage_on_device=False`: receivers hand out the host view even where they have a device."""
        self.device = device
        self.stage_on_device = stage_on_device

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Create `num_buffers` host segments of `bucket_bytes`."""
        return DeviceShmSendBuffers(self.device, bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles, owner_pid: int | None = None) -> ReceiveBuffers:
        """Map the announced segments (read-only, of process `owner_pid` when given); stage buckets on this
        process's device when it has one."""
        return DeviceShmReceiveBuffers(self.device, handles, self.stage_on_device, owner_pid)
