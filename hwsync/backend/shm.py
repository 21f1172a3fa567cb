"""POSIX shared-memory transport: every backend's fallback and the CPU default.

Segments are files in /dev/shm named after the process that made them,
`hwsync-<pid>-<start>-<pidns>-<random>` (hwsync.backend.owners). The sender creates and owns them; it
registers each with Python's resource tracker, a separate process that unlinks them if the
sender is killed before it can, and any hwsync process that starts later removes those whose
owner died (hwsync.backend.owners.sweep_dead_owners: a spawned sender's tracker is its parent's, which
may live on). Receivers only map them (never register), so a receiver exiting never removes a
segment the sender still uses.

A receiver maps a segment only by a name a sender may send (SharedSegment.open): one of
hwsync's names in /dev/shm, of the sender's own pid, opened without following a link, a
regular file of this user; and read-only where it only reads (the transport's buffers, the
one-copy path's parameter segments). Writing into a read-only view crashes the process
(SIGSEGV) instead of changing the sender's memory: hwsync never does, and a `load` handed such
views must not either (they are the sender's bytes, valid during the call only).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
import warnings
from multiprocessing import resource_tracker

import torch

from hwsync.backend.interfaces import Handles, ProbeResult, ReceiveBuffers, SendBuffers, Transport
from hwsync.backend.owners import SHM_DIR, owner_prefix, sweep_dead_owners
from hwsync.protocol.layout import BUFFER_SEGMENT_NAME, check_shm_handles, segment_name
from hwsync.sizes import MiB

SEGMENT_PREFIX = "hwsync-"
#: what no segment name may hold: a name is only ever a file directly in /dev/shm
_NOT_A_NAME = re.compile(r"[/\x00]|^\.|^$")


def _tensor_over(mapping: mmap.mmap, writable: bool) -> torch.Tensor:
    """A uint8 tensor sharing `mapping`'s memory."""
    if writable:
        return torch.frombuffer(mapping, dtype=torch.uint8)
    with warnings.catch_warnings():
        # torch has no read-only tensors and says so (once per process); hwsync never writes these
        # views, and a write would fault (PROT_READ) rather than reach the sender's memory
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)


class SharedSegment:
    """One named, mapped POSIX shared-memory segment."""

    def __init__(self, name: str, size: int, create: bool, *, writable: bool = True) -> None:
        """Create (`create`) or map segment `name` of `size` bytes; `writable=False` maps an existing one read-only.

        `name` is a file directly in /dev/shm, never a path, and never followed through a link.
        """
        if not isinstance(name, str) or _NOT_A_NAME.search(name):
            raise ValueError(f"{name!r} is not a shared segment name (a file name in {SHM_DIR}, no path)")
        if not create and size < 1:
            raise ValueError(f"shared segment {name}: {size} bytes announced; a segment holds at least one")
        self.name = name
        self.size = size
        self.owner = create
        self._creator = os.getpid()  # a forked child inherits the object, not the ownership
        self.writable = writable or create
        path = os.path.join(SHM_DIR, name)
        if create:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        else:
            flags = os.O_RDWR if writable else os.O_RDONLY
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC  # a link in /dev/shm is refused (ELOOP), never followed
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise ValueError(f"{path} is a symbolic link; a shared segment is a file of its own, never followed "
                             "elsewhere") from None
        try:
            if create:
                resource_tracker.register("/" + name, "shared_memory")
                os.ftruncate(fd, size)
            else:
                _check_opened(name, os.fstat(fd), size)
            # Populate the whole mapping now: a buffer first used in the middle of a sync would
            # otherwise pay a page fault per 4 KiB there (and skew the buffer pool's timing).
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
        except BaseException:
            os.close(fd)
            if create:
                self._unlink()
            raise
        os.close(fd)
        # frombuffer shares the mapping: packing into this tensor writes the segment itself.
        self.tensor = _tensor_over(self._mmap, self.writable) if size else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int, kind: str = "") -> "SharedSegment":
        """Create a new uniquely named segment of `size` bytes: owner_prefix, then `kind-` if given, then 16 hex."""
        sweep_dead_owners()  # once per process: what killed processes left behind
        infix = f"{kind}-" if kind else ""
        return cls(f"{owner_prefix()}{infix}{secrets.token_hex(8)}", size, create=True)

    @classmethod
    def open(cls, name: str, size: int, *, owner_pid: int | None, pattern: re.Pattern[str] = BUFFER_SEGMENT_NAME,
             writable: bool = False) -> "SharedSegment":
        """Map a segment a peer named: a name of `pattern` made by process `owner_pid` (any, when None), read-only
        unless `writable`. A name of another form or process raises BadFrame, a link or a file that is not a
        segment ValueError, a missing one FileNotFoundError, each naming the segment."""
        segment_name(name, pattern, owner_pid, "a peer's shared segment")
        sweep_dead_owners()
        return cls(name, size, create=False, writable=writable)

    @property
    def created_here(self) -> bool:
        """Whether this process created the segment (a forked child holds its parent's, never its own)."""
        return self.owner and self._creator == os.getpid()

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
        if self.created_here:  # a forked child closing its copy leaves the parent's segment (and tracker) alone
            self._unlink()


def _check_opened(name: str, st: os.stat_result, size: int) -> None:
    """ValueError unless an opened segment is a regular file of this user (root: any) of at least `size` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{SHM_DIR}/{name} is not a regular file; a shared segment is one")
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise ValueError(f"{SHM_DIR}/{name} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}); a "
                         "sender's segments are made by a process of the same user")
    if st.st_size < size:
        raise ValueError(f"shared segment {name} is smaller than the announced {size} bytes")


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
    """Maps the sender's segments read-only; views are zero-copy (and must not be written: see the module doc)."""

    def __init__(self, handles: Handles, owner_pid: int | None = None) -> None:
        """`owner_pid`: the sender's pid, whose segments alone are mapped (the offer's pid; None: any one process)."""
        self.segments: list[SharedSegment] = []
        names, size = check_shm_handles(handles, owner_pid)
        if owner_pid is None and len({n.split("-", 2)[1] for n in names}) > 1:
            raise ValueError(f"shm handles name segments of several processes: {names[:4]}; a sender names its own")
        try:
            for name in names:
                self.segments.append(SharedSegment.open(name, size, owner_pid=owner_pid))
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
    into_geometry: tuple[int, int] | None = (4 * MiB, 16)

    def available(self) -> ProbeResult:
        """Usable where /dev/shm is a writable directory."""
        if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK):
            return ProbeResult(True, f"{SHM_DIR} is writable")
        return ProbeResult(False, f"{SHM_DIR} is missing or not writable")

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Create `num_buffers` segments of `bucket_bytes`."""
        return ShmSendBuffers(bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles, owner_pid: int | None = None) -> ReceiveBuffers:
        """Map the announced segments (of process `owner_pid`, the sender, when given), read-only."""
        return ShmReceiveBuffers(handles, owner_pid)


def leftover_segments(pid: int | None = None) -> list[str]:
    """Names of hwsync segments in /dev/shm (of one creating process, when `pid` is given)."""
    prefix = SEGMENT_PREFIX if pid is None else f"{SEGMENT_PREFIX}{pid}-"
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []
