"""torch's IPC ref counters, read: release an export only while its consumer has not.

torch gives every export of a device block (CUDA IPC; the NPU runtime's is built the same way) a
counter in the exporting process's ref-counter file: a shared-memory file, /dev/shm/<handle>,
made by torch's RefcountedMapAllocator, whose first 64 bytes are the allocator's own header,
then one int64 per export. An export starts at 1; its consumer takes it to 0 when it unmaps; a
release (`_release_ipc_counter_cuda`) takes it down by one for a consumer that never will. torch
reads the counter as unsigned: one taken below 0, released by both, holds its block until the
process exits, where torch prints "Producer process has been terminated before all shared CUDA
tensors released" (the H200 showed both, docs/cuda.md). A releaser cannot always know whether
the consumer unmapped (a receiver that closed and exited looks like one that was killed), so it
reads the counter first and releases only while it is above 0.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

SHM_DIR = "/dev/shm"
HEADER_BYTES = 64  # at::map_alloc_alignment: where RefcountedMapAllocator's data begins
_NAME = re.compile(r"/?[A-Za-z0-9_][A-Za-z0-9_.-]*")  # torch's "/torch_<pid>_<n>_<n>"; never a path elsewhere


def counter(handle: bytes | str, offset: int) -> int | None:
    """The export's counter; None where its file is gone (the exporter let every export in it go, or exited)."""
    name = handle.decode("ascii", "replace") if isinstance(handle, bytes) else handle
    if not _NAME.fullmatch(name) or offset < 0:
        raise ValueError(f"not a torch ref-counter slot: {name!r} at {offset}")
    try:
        fd = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        raw = os.pread(fd, 8, HEADER_BYTES + 8 * offset)
    finally:
        os.close(fd)
    return int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else None


def release_if_held(handle: bytes, offset: int, release: Callable[[bytes, int], object]) -> bool:
    """Call torch's `release(handle, offset)` only while the counter is above 0; whether it ran."""
    value = counter(handle, offset)
    if value is None or value <= 0:
        return False
    release(handle, offset)
    return True
