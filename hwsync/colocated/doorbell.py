"""The doorbell: per-bucket signalling through shared memory instead of ZeroMQ frames.

With small buckets a sync is thousands of buckets, and a ZeroMQ frame per bucket (two I/O
thread hops, a wake-up each) costs as much as copying the bucket. On one host the sender and
its receivers instead share one small segment holding:

- `posted`: how many buckets the sender has posted (a sequence number kept across syncs);
- `released[i]`: how many buckets receiver i has released;
- one descriptor slot per buffer: the encoded protocol.Bucket frame (buffer index, entries) of the bucket
  last posted into it.

Each counter is written by one process only and read by the others. The sender writes a
descriptor, then bumps `posted`; a receiver that sees `posted` move reads the descriptor. That
order is guaranteed by x86-64's total store order, so the doorbell is used only there; other
hosts (aarch64 Ascend servers, say) keep the per-bucket ZeroMQ frames. ZeroMQ still carries the
handshake, errors, aborts and the end of a sync.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import time
from collections.abc import Callable
from typing import Any

from hwsync.backend.shm import SharedSegment
from hwsync.control.endpoints import timeout_error
from hwsync.errors import ProtocolError
from hwsync.protocol.layout import check_doorbell_handle
from hwsync.sync.bucket import align_up
from hwsync.timing import DOORBELL_CHECK_S, DOORBELL_FIRST_CHECK_S, DOORBELL_MAX_SLEEP_S

#: bytes of one descriptor slot; a bucket whose entries would not fit is flushed early
DESCRIPTOR_BYTES = 64 << 10
_LINE = 64  # one cache line per counter, so writers never share a line
_LENGTH = struct.Struct("<I")
#: spins before the first sleep: a bucket is usually ready within this
_SPINS = 2000
#: the most receivers and descriptor slots a doorbell a receiver maps may claim (a sender's word: 64 MiB of slots)
MAX_RECEIVERS, MAX_SLOTS = 4096, 1024


def doorbell_supported() -> bool:
    """Whether this host may signal through shared counters (x86-64 and not HWSYNC_DOORBELL=0)."""
    if os.environ.get("HWSYNC_DOORBELL", "1") == "0":
        return False
    return platform.machine().lower() in ("x86_64", "amd64")


class Doorbell:
    """The shared counters and descriptor slots of one sender's buffers."""

    def __init__(self, segment: SharedSegment, num_receivers: int, num_slots: int) -> None:
        self.segment = segment
        self.num_receivers = num_receivers
        self.num_slots = num_slots
        mapping = segment.mapping()
        self._map = mapping
        self._posted = ctypes.c_int64.from_buffer(mapping, 0)
        self._released = [ctypes.c_int64.from_buffer(mapping, _LINE * (1 + i)) for i in range(num_receivers)]
        self._slots_at = _slots_offset(num_receivers)

    @classmethod
    def create(cls, num_receivers: int, num_slots: int) -> "Doorbell":
        """A new doorbell segment (the sender owns and unlinks it)."""
        return cls(SharedSegment.create(layout_bytes(num_receivers, num_slots)), num_receivers, num_slots)

    @classmethod
    def attach(cls, handle: dict[str, Any], owner_pid: int | None = None, rank: int = 0) -> "Doorbell":
        """Map a sender's doorbell from its handle: a segment of process `owner_pid` (the sender; any, when None).

        The receiver writes one thing there, its own `released[rank]` counter, so the segment is
        mapped writable; the handle is checked first (protocol.layout.check_doorbell_handle: a
        segment name, never a path) and so is its size, which must be the layout's exactly.
        """
        check_doorbell_handle(handle, owner_pid, rank)
        receivers, slots = handle["receivers"], handle["slots"]
        if receivers > MAX_RECEIVERS or slots > MAX_SLOTS or handle["bytes"] != layout_bytes(receivers, slots):
            raise ProtocolError(f"doorbell {handle['name']}: {handle['bytes']} bytes do not hold {receivers} "
                                f"receivers and {slots} slots (at most {MAX_RECEIVERS} and {MAX_SLOTS})")
        segment = SharedSegment.open(handle["name"], handle["bytes"], owner_pid=owner_pid, writable=True)
        return cls(segment, receivers, slots)

    def handle(self) -> dict[str, Any]:
        """What a receiver needs to map this doorbell."""
        return {"name": self.segment.name, "bytes": self.segment.size, "receivers": self.num_receivers,
                "slots": self.num_slots}

    @property
    def posted(self) -> int:
        """Buckets posted so far (the sequence number of the next one)."""
        return self._posted.value

    def released(self, rank: int) -> int:
        """Buckets receiver `rank` has released so far."""
        return self._released[rank].value

    def min_released(self, ranks: int) -> int:
        """The fewest buckets any of the first `ranks` receivers has released."""
        return min(counter.value for counter in self._released[:ranks])

    def start_sync(self, ranks: int, first: int) -> None:
        """Sender, before the offer: the sync's buckets start at `first`; every receiver is caught up."""
        self._posted.value = first
        for i in range(ranks):
            self._released[i].value = first

    def post(self, seq: int, frame: bytes) -> None:
        """Sender: write bucket `seq`'s descriptor, then make it visible."""
        if len(frame) + _LENGTH.size > DESCRIPTOR_BYTES:
            raise ValueError(f"bucket descriptor of {len(frame)} bytes exceeds the {DESCRIPTOR_BYTES}-byte slot")
        offset = self._slots_at + (seq % self.num_slots) * DESCRIPTOR_BYTES
        _LENGTH.pack_into(self._map, offset, len(frame))
        self._map[offset + _LENGTH.size : offset + _LENGTH.size + len(frame)] = frame
        self._posted.value = seq + 1  # after the descriptor: stores are seen in order on x86-64

    def read(self, seq: int) -> bytes:
        """Receiver: the descriptor of posted bucket `seq`."""
        offset = self._slots_at + (seq % self.num_slots) * DESCRIPTOR_BYTES
        (length,) = _LENGTH.unpack_from(self._map, offset)
        if length > DESCRIPTOR_BYTES - _LENGTH.size:  # the sender's word: never read past the slot
            raise ProtocolError(f"bucket {seq}'s descriptor claims {length} bytes, over its {DESCRIPTOR_BYTES}-byte "
                                "slot")
        return bytes(self._map[offset + _LENGTH.size : offset + _LENGTH.size + length])

    def release(self, rank: int, seq: int) -> None:
        """Receiver `rank`: bucket `seq` (and every one before it) is free to refill."""
        self._released[rank].value = seq + 1

    def close(self) -> None:
        """Drop the counters, then unmap (and unlink, on the sender)."""
        self._posted = None  # type: ignore[assignment]
        self._released = []
        self._map = None  # type: ignore[assignment]
        self.segment.close()


def _slots_offset(num_receivers: int) -> int:
    return align_up(_LINE * (1 + num_receivers), 4096)


def layout_bytes(num_receivers: int, num_slots: int) -> int:
    """The size of a doorbell segment: the counters, then the descriptor slots."""
    return _slots_offset(num_receivers) + num_slots * DESCRIPTOR_BYTES


def spin_wait(ready: Callable[[], bool], check: Callable[[], None], *, timeout_s: float, what: str,
              endpoint: str) -> None:
    """Wait until `ready()`; spin first, then sleep briefly; call `check()` every few ms.

    `check` raises when the peer failed or died (an error frame, a vanished process); every 5 ms
    is often enough, and cheap (a non-blocking socket poll, a /proc read per peer). Spinning
    is right here: the peer is copying on another core and answers within microseconds, and a
    sleep costs at least the kernel's 50 us timer slack, about a bucket's worth of copying.
    """
    if ready():
        return
    start = time.monotonic()
    deadline = start + timeout_s
    next_check = start + DOORBELL_FIRST_CHECK_S
    spins = 0
    pause = 0.0
    while not ready():
        spins += 1
        if spins < _SPINS:
            if spins % 64 == 0:
                os.sched_yield()  # let a thread of our own (ZeroMQ's, a loader's) have the core
            continue
        now = time.monotonic()
        if now >= next_check:
            check()
            next_check = now + DOORBELL_CHECK_S
        if now >= deadline:
            raise timeout_error(timeout_s, what, endpoint)
        pause = min(max(pause * 2, 50e-6), DOORBELL_MAX_SLEEP_S)
        time.sleep(pause)
