"""How a sender tells receivers a bucket is ready, and learns they released it.

Two ways, one interface: `DoorbellLink` through the shared doorbell segment (same host, x86-64;
no system call per bucket), `FrameLink` through a ZeroMQ frame per bucket (anywhere). Buckets
carry a sequence number that keeps growing across the syncs of one set of buffers; a receiver
releases buckets in order, so "released up to n" is all either side needs to track.
"""

from __future__ import annotations

import time
from typing import Protocol

from hwsync.colocated.doorbell import Doorbell, spin_wait
from hwsync.colocated.sender_control import SyncReceivers
from hwsync.protocol import Bucket, Frame, Release, encode


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

    def __init__(self, receivers: SyncReceivers, first: int) -> None:
        self._receivers = receivers
        self._released = {identity: first for identity in receivers.identities}

    def post(self, seq: int, frame: Bucket) -> None:
        """Send the bucket frame to every receiver."""
        self._receivers.broadcast(frame)

    def wait_released(self, seq: int, what: str) -> None:
        """Read release frames until every receiver is past `seq`."""
        while min(self._released.values()) <= seq:
            self._note(*self._receivers.recv(what))

    def _note(self, identity: bytes, frame: Frame) -> None:
        """Count a receiver's release."""
        if isinstance(frame, Release) and identity in self._released:
            self._released[identity] = max(self._released[identity], frame.seq + 1)

    def check(self, what: str) -> None:
        """Read what is queued without waiting (releases are counted), raising on failures."""
        for identity, frame in self._receivers.poll(what):
            self._note(identity, frame)


class DoorbellLink:
    """Descriptors and counters in the doorbell segment; ZeroMQ is only polled for failures."""

    def __init__(self, doorbell: Doorbell, receivers: SyncReceivers) -> None:
        self._bell = doorbell
        self._receivers = receivers
        self._ranks = len(receivers.peers)

    def post(self, seq: int, frame: Bucket) -> None:
        """Write the descriptor and ring."""
        self._bell.post(seq, encode(frame))

    def wait_released(self, seq: int, what: str) -> None:
        """Spin on the receivers' counters until all are past `seq`."""
        control = self._receivers.control
        spin_wait(lambda: self._bell.min_released(self._ranks) > seq, lambda: self.check(what),
                  timeout_s=control.timeout_s, what=what, endpoint=control.address)

    def check(self, what: str) -> None:
        """Poll ZeroMQ for failures (the counters need no reading until a buffer is wanted)."""
        self._receivers.poll(what)


def timed_wait(link: BucketLink, seq: int, what: str) -> float:
    """wait_released, returning the seconds it took."""
    t0 = time.perf_counter()
    link.wait_released(seq, what)
    return time.perf_counter() - t0
