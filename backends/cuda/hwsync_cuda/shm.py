"""The core shared-memory transport with the device copies a GPU needs around it.

The sender packs GPU tensors into host segments; a copy from the GPU into host memory may still
be in flight when the packer returns (non_blocking copies), so publish() synchronizes the GPU
first. The receiver copies each bucket into a device staging buffer of its own, one large
host-to-device copy instead of one per tensor, and hands out that device view; where this
process cannot use CUDA it hands out the host view, which holds the same bytes. Handles are
the core's, so a CUDA sender and a CPU receiver (or the reverse) still meet.
"""

from __future__ import annotations

import torch

from hwsync.interfaces import Handles, ReceiveBuffers, SendBuffers
from hwsync.shm import ShmReceiveBuffers, ShmSendBuffers, ShmTransport


def _cuda_in_use() -> bool:
    # Only a process that already initialised CUDA can have GPU work in flight; asking never
    # initialises it, so a CPU-only sender pays nothing.
    return torch.cuda.is_initialized()


class CudaShmSendBuffers(ShmSendBuffers):
    """Host segments; publishing waits for the GPU-to-host copies that filled them."""

    def publish(self, index: int, nbytes: int) -> None:
        """Wait for queued GPU work, then the segment holds finished bytes."""
        if _cuda_in_use():
            torch.cuda.synchronize()


class CudaShmReceiveBuffers(ShmReceiveBuffers):
    """Host segments, copied into a device staging buffer per index when CUDA is usable."""

    def __init__(self, handles: Handles, stage_on_device: bool) -> None:
        super().__init__(handles)
        self.bucket_bytes = int(handles["bytes"])
        self.device: torch.device | None = None
        if stage_on_device and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._staging: dict[int, torch.Tensor] = {}

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """The bucket's bytes on this process's GPU (staged), or the host view without one."""
        host = super().view(index, nbytes)
        if self.device is None:
            return host
        staging = self._staging.get(index)
        if staging is None:
            staging = self._staging[index] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        # From pageable memory the copy returns once the source bytes are read (CUDA's rule for
        # pageable host-to-device copies), so the segment is free as soon as this returns.
        staging[:nbytes].copy_(host)
        return staging[:nbytes]

    def release(self, index: int) -> None:
        """Wait for this process's reads of the bucket (staged or host) to finish."""
        if _cuda_in_use():
            torch.cuda.synchronize()

    def close(self) -> None:
        """Unmap the segments and drop the staging buffers."""
        self._staging = {}
        super().close()


class CudaShmTransport(ShmTransport):
    """POSIX shared memory between processes on one node, with GPU copies on both sides."""

    # The core's small-bucket geometry for into= receivers pays off by keeping buckets in the CPU
    # cache between two host copies; here each bucket costs two GPU synchronizations instead.
    into_geometry = None

    def __init__(self, stage_on_device: bool = True) -> None:
        self.stage_on_device = stage_on_device

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Create `num_buffers` host segments of `bucket_bytes`."""
        return CudaShmSendBuffers(bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles) -> ReceiveBuffers:
        """Map the announced segments; stage buckets on this process's GPU when it has one."""
        return CudaShmReceiveBuffers(handles, self.stage_on_device)
