"""The settings every sender takes, whichever the path, in one typed object (one docstring a field).

Topology stays with each sender class (a WeightSender's endpoint and receivers, a CrossNodeSender's rank and
group address); what both share is here, checked once when the object is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hwsync.sizes import MIN_NUM_BUFFERS
from hwsync.sync.bucket import ALIGN as MIN_BUCKET_BYTES  # the smallest bucket: buckets are packed at this alignment
from hwsync.timing import DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class SenderOptions:
    """Settings of a sender, the same for WeightSender and CrossNodeSender."""

    #: bytes a bucket holds: a count; None, the transport's default (same host: chosen at the first send from how
    #: the receivers take tensors); "auto", sized at the first send from the least free memory of sender and
    #: receivers. A tensor larger than a bucket is split: the size is a speed knob, never a limit
    bucket_bytes: int | Literal["auto"] | None = None
    #: buckets in flight: one is packed while the receivers load another (at least 2); None, the transport's default
    num_buffers: int | None = None
    #: seconds any wait may take (for a receiver, the other ranks, a collective) before the sync fails
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: send only what changed since what every receiver holds (after a first full sync; `send(delta=...)` overrides
    #: it for one sync); the sender then keeps a baseline of what it sent
    delta: bool = False
    #: keep the delta baseline on the trainer's device (faster diffs, device memory) rather than in host memory
    delta_on_device: bool = False
    #: True: each tensor a source yields keeps its memory until send() returns. False: the source may reuse a
    #: tensor's memory once it yields the next (a gather into one staging buffer), so each tensor is copied as it
    #: is taken and none is read in place
    stable_sources: bool = True

    def __post_init__(self) -> None:
        bucket = self.bucket_bytes
        if bucket is not None and bucket != "auto" and (not isinstance(bucket, int) or isinstance(bucket, bool)):
            raise ValueError(f"bucket_bytes={bucket!r} must be a byte count, None (the transport's default) or "
                             "'auto' (from the least free memory of sender and receivers)")
        if isinstance(bucket, int) and bucket < MIN_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes={bucket} is below the minimum of {MIN_BUCKET_BYTES} bytes")
        if self.num_buffers is not None and self.num_buffers < MIN_NUM_BUFFERS:
            raise ValueError(f"num_buffers={self.num_buffers}: at least {MIN_NUM_BUFFERS} are needed to overlap "
                             "packing with loading")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a positive number of seconds")


@dataclass(frozen=True)
class CrossNodeOptions(SenderOptions):
    """SenderOptions, and what a cross-node sender's network needs beyond its topology."""

    #: the port this rank's group binds (0: a free one at each build)
    group_port: int = 0
    #: sender 0 only, with an endpoint chosen ahead (`ADDRESS#TOKEN#KEY`): the secret half of KEY's CURVE key pair
    #: (hwsync.control.sockets.curve_key_pair()); without it a key pair is made here
    secret_key: str | None = None
