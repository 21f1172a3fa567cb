"""POSIX shared-memory transport: every backend's fallback and the CPU default.

Segments are files in /dev/shm named `hwsync-<pid>-<random>`. The sender creates and owns
them; it registers each with Python's resource tracker, a separate process that unlinks them
if the sender is killed before it can, so no exit path leaves one behind. Receivers only map
them (never register), so a receiver exiting never removes a segment the sender still uses.
"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import resource_tracker

import torch

from hwsync.sizes import MiB
from hwsync.interfaces import Handles, ProbeResult, ReceiveBuffers, SendBuffers, Transport

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "hwsync-"


class SharedSegment:
    """One named, mapped POSIX shared-memory segment."""

    def __init__(self, name: str, size: int, create: bool) -> None:
        self.name = name
        self.size = size
        self.owner = create
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                resource_tracker.register("/" + name, "shared_memory")
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"shared segment {name} is smaller than the announced {size} bytes")
            # Populate the whole mapping now: a buffer first used in the middle of a sync would
            # otherwise pay a page fault per 4 KiB there (and skew the buffer pool's timing).
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(fd)
            if create:
                self._unlink()
            raise
        os.close(fd)
        # frombuffer shares the mapping: packing into this tensor writes the segment itself.
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int) -> "SharedSegment":
        """Create a new uniquely named segment of `size` bytes."""
        return cls(f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}", size, create=True)

    def mapping(self) -> mmap.mmap:
        """The raw mapping (for ctypes counters laid over it)."""
        return self._mmap

    def _unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        resource_tracker.unregister("/" + self.name, "shared_memory")

    def close(self) -> None:
        """Unmap, and unlink if this process created the segment; safe to call twice."""
        if self._mmap is None:
            return
        self.tensor = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when the view does
        self._mmap = None  # type: ignore[assignment]
        if self.owner:
            self._unlink()


class ShmSendBuffers(SendBuffers):
    """N shared segments the sender packs into; publishing needs no copy."""

    def __init__(self, bucket_bytes: int, num_buffers: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.num_buffers = num_buffers
        self.segments: list[SharedSegment] = []
        try:
            for _ in range(num_buffers):
                self.segments.append(SharedSegment.create(bucket_bytes))
        except BaseException:
            self.close()
            raise

    def handles(self) -> Handles:
        """Segment names and size."""
        return {"kind": "shm", "names": [s.name for s in self.segments], "bytes": self.bucket_bytes}

    def buffer(self, index: int) -> torch.Tensor:
        """The mapped segment as a uint8 tensor."""
        return self.segments[index].tensor

    def publish(self, index: int, nbytes: int) -> None:
        """Nothing to do: the receiver maps the same pages."""

    def close(self) -> None:
        """Unmap and unlink every segment."""
        for segment in self.segments:
            segment.close()
        self.segments = []


class ShmReceiveBuffers(ReceiveBuffers):
    """Maps the sender's segments; views are zero-copy."""

    def __init__(self, handles: Handles) -> None:
        if handles.get("kind") != "shm":
            raise ValueError(f"shared-memory receiver got handles of kind {handles.get('kind')!r}")
        self.segments: list[SharedSegment] = []
        try:
            for name in handles["names"]:
                self.segments.append(SharedSegment(name, int(handles["bytes"]), create=False))
        except BaseException:
            self.close()
            raise

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """Zero-copy view of the segment's first `nbytes`."""
        return self.segments[index].tensor[:nbytes]

    def release(self, index: int) -> None:
        """Nothing to do: the sender reuses the segment once acknowledged."""

    def close(self) -> None:
        """Unmap every segment (the sender unlinks them)."""
        for segment in self.segments:
            segment.close()
        self.segments = []


class ShmTransport(Transport):
    """POSIX shared memory between processes on one node."""

    name = "shm"
    # Receivers copying into their own tensors never reassemble, so small buckets cost nothing
    # and two of them stay in the CPU cache between the two copies; 32 buffers give the pool
    # room to go through memory instead when the cache is not shared (see buffer_pool).
    into_geometry = (4 * MiB, 16)

    def available(self) -> ProbeResult:
        """Usable where /dev/shm is a writable directory."""
        if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK):
            return ProbeResult(True, f"{SHM_DIR} is writable")
        return ProbeResult(False, f"{SHM_DIR} is missing or not writable")

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Create `num_buffers` segments of `bucket_bytes`."""
        return ShmSendBuffers(bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles) -> ReceiveBuffers:
        """Map the announced segments."""
        return ShmReceiveBuffers(handles)


def leftover_segments(pid: int | None = None) -> list[str]:
    """Names of hwsync segments in /dev/shm (of one creating process, when `pid` is given)."""
    prefix = SEGMENT_PREFIX if pid is None else f"{SEGMENT_PREFIX}{pid}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []
