"""Shared memory with a device copy on each side: the NPU fallback when NPU IPC is unavailable.

The sender packs into a device buffer; publishing copies it into the core's POSIX segment
(device to host). The receiver copies the segment into a device buffer of its own (host to
device) and hands that out. Handles are the core's shm handles, unchanged, so a CPU receiver
can read an NPU sender's buckets too. The device is a callable so the same code runs with
"cpu" standing in for the NPU in tests.

Both sides page-lock the segments they map through `host` (the NpuDevice: torch_npu's npuHostRegister):
from pageable pages every copy goes through the runtime's bounce buffer. The copies here are
synchronous, so a segment is unregistered, before it is unmapped, with no copy reading it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hwsync.interfaces import Device, Handles, ProbeResult, ReceiveBuffers, SendBuffers, Transport
from hwsync.shm import ShmReceiveBuffers, ShmSendBuffers, ShmTransport

DeviceFn = Callable[[], torch.device]

log = logging.getLogger("hwsync")


def pin_segments(host: Device | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Page-lock each segment through `host`; those pinned (a refusal leaves that one pageable: slower, correct)."""
    if host is None:
        return []
    pinned = [tensor for tensor in tensors if host.pin_host_memory(tensor)]
    if len(pinned) < len(tensors):
        log.warning("hwsync: %d of %d shared segments could not be page-locked; their NPU copies stay pageable "
                    "(slower)", len(tensors) - len(pinned), len(tensors))
    return pinned


def unpin_segments(host: Device | None, pinned: list[torch.Tensor]) -> None:
    """Unregister what pin_segments registered (the copies are synchronous: none is reading them)."""
    for tensor in pinned if host is not None else []:
        host.unpin_host_memory(tensor)
    pinned.clear()


class DeviceCopySendBuffers(SendBuffers):
    """Device buffers to pack into, each copied into its shared segment when published."""

    def __init__(self, device: torch.device, bucket_bytes: int, num_buffers: int,
                 host: Device | None = None) -> None:
        self.bucket_bytes = bucket_bytes
        self.num_buffers = num_buffers
        self._host = host
        self._shm = ShmSendBuffers(bucket_bytes, num_buffers)
        self._pinned: list[torch.Tensor] = []
        try:
            self._device_buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
                                    for _ in range(num_buffers)]
            self._pinned = pin_segments(host, [segment.tensor for segment in self._shm.segments])
        except BaseException:
            self.close()
            raise

    def handles(self) -> Handles:
        """The shared segments' handles (a plain shm receiver can attach)."""
        return self._shm.handles()

    def buffer(self, index: int) -> torch.Tensor:
        """The device buffer to pack bucket `index` into."""
        return self._device_buffers[index]

    def publish(self, index: int, nbytes: int) -> None:
        """Copy the packed bytes to the segment; returns once they are in host memory."""
        # non_blocking=False: the copy into pageable shared memory must finish before the
        # receiver is told the bucket is there.
        self._shm.buffer(index)[:nbytes].copy_(self._device_buffers[index][:nbytes], non_blocking=False)
        self._shm.publish(index, nbytes)

    def close(self) -> None:
        """Free the device buffers, unregister and unlink the segments; safe to call twice."""
        self._device_buffers = []
        unpin_segments(self._host, self._pinned)
        self._shm.close()


class DeviceCopyReceiveBuffers(ReceiveBuffers):
    """Copies each announced segment into a device buffer and hands that out."""

    def __init__(self, device: torch.device, handles: Handles, host: Device | None = None) -> None:
        self._device = device
        self._host = host
        self._shm = ShmReceiveBuffers(handles)
        self._device_buffers: dict[int, torch.Tensor] = {}
        self._bytes = int(handles["bytes"])
        self._pinned = pin_segments(host, [segment.tensor for segment in self._shm.segments])

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """Device copy of the segment's first `nbytes` (the buffer is reused per index)."""
        target = self._device_buffers.get(index)
        if target is None:
            target = self._device_buffers[index] = torch.empty(self._bytes, dtype=torch.uint8, device=self._device)
        target[:nbytes].copy_(self._shm.view(index, nbytes), non_blocking=False)
        return target[:nbytes]

    def release(self, index: int) -> None:
        """Nothing to do: the device buffer is overwritten by the next view."""

    def close(self) -> None:
        """Drop the device buffers, unregister and unmap the segments; safe to call twice."""
        self._device_buffers = {}
        unpin_segments(self._host, self._pinned)
        self._shm.close()


class DeviceCopyShmTransport(Transport):
    """POSIX shared memory between processes on one node, staged through device copies."""

    name = "shm"
    default_bucket_bytes = ShmTransport.default_bucket_bytes

    def __init__(self, device_fn: DeviceFn, host: Device | None = None) -> None:
        """`host`: the Device that page-locks the segments (the NpuDevice); None keeps them pageable."""
        self._device_fn = device_fn
        self._host = host
        self._shm = ShmTransport()

    def available(self) -> ProbeResult:
        """Usable wherever the core shm transport is."""
        return self._shm.available()

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Device buffers plus shared segments of `bucket_bytes` each."""
        return DeviceCopySendBuffers(self._device_fn(), bucket_bytes, num_buffers, self._host)

    def open_receiver(self, handles: Handles) -> ReceiveBuffers:
        """Map the announced segments; views are device copies."""
        return DeviceCopyReceiveBuffers(self._device_fn(), handles, self._host)
