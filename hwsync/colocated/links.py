"""How a sender tells receivers a bucket is ready, and learns they released it.

Two ways, one interface: `DoorbellLink` through the shared doorbell segment (same host, x86-64;
no system call per bucket), `FrameLink` through a ZeroMQ frame per bucket (anywhere). Buckets
carry a sequence number that keeps growing across the syncs of one set of buffers; a receiver
releases buckets in order, so "released up to n" is all either side needs to track.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from hwsync.colocated.doorbell import Doorbell, spin_wait
from hwsync.protocol import Bucket, Frame, Release, encode

#: receive(what) -> (identity, frame): the sender's own wait for one control frame
RecvFn = Callable[[str], tuple[bytes, Frame]]


class BucketLink(Protocol):
    """What the sender's stream needs from either way of signalling."""

    def post(self, seq: int, frame: Bucket) -> None:
        """Make bucket `seq` (described by `frame`) available to every receiver."""

    def wait_released(self, seq: int, what: str) -> None:
        """Return once every receiver has released bucket `seq`."""

    def check(self, what: str) -> None:
        """Raise if a receiver failed or went away, or close() was called (cheap: called while packing too)."""


class FrameLink:
    """One ZeroMQ frame per bucket out, one release frame per bucket back."""

    def __init__(self, identities: list[bytes], first: int, broadcast: Callable[[Frame], None],
                 recv: RecvFn, on_frame: Callable[[Frame], None], poll: Callable[[str], None]) -> None:
        self._released = {identity: first for identity in identities}
        self._broadcast = broadcast
        self._recv = recv
        self._on_frame = on_frame  # raises on an error frame
        self._poll = poll  # poll(what): what is queued now goes to note(); raises on failures

    def post(self, seq: int, frame: Bucket) -> None:
        """Send the bucket frame to every receiver."""
        self._broadcast(frame)

    def wait_released(self, seq: int, what: str) -> None:
        """Read release frames until every receiver is past `seq`."""
        while min(self._released.values()) <= seq:
            self.note(*self._recv(what))

    def note(self, identity: bytes, frame: Frame) -> None:
        """Take one frame of a receiver: raise on an error, count a release."""
        self._on_frame(frame)
        if isinstance(frame, Release) and identity in self._released:
            self._released[identity] = max(self._released[identity], frame.seq + 1)

    def check(self, what: str) -> None:
        """Read what is queued without waiting (releases are counted), raising on failures."""
        self._poll(what)


class DoorbellLink:
    """Descriptors and counters in the doorbell segment; ZeroMQ is only polled for failures."""

    def __init__(self, doorbell: Doorbell, ranks: int, poll: Callable[[str], None], timeout_s: float,
                 endpoint: str) -> None:
        self._bell = doorbell
        self._ranks = ranks
        self._poll = poll  # poll(what) raises on an error frame or a vanished receiver
        self._timeout_s = timeout_s
        self._endpoint = endpoint

    def post(self, seq: int, frame: Bucket) -> None:
        """Write the descriptor and ring."""
        self._bell.post(seq, encode(frame))

    def wait_released(self, seq: int, what: str) -> None:
        """Spin on the receivers' counters until all are past `seq`."""
        bell, ranks = self._bell, self._ranks
        spin_wait(lambda: bell.min_released(ranks) > seq, lambda: self._poll(what), timeout_s=self._timeout_s, what=what,
                  endpoint=self._endpoint)

    def check(self, what: str) -> None:
        """Poll ZeroMQ for failures (the counters need no reading until a buffer is wanted)."""
        self._poll(what)


def timed_wait(link: BucketLink, seq: int, what: str) -> float:
    """wait_released, returning the seconds it took."""
    t0 = time.perf_counter()
    link.wait_released(seq, what)
    return time.perf_counter() - t0
