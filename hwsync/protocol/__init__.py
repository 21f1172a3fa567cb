"""The wire protocol: every control frame and bucket layout, defined once; the only encoder and decoder.

Frames are msgpack maps `{"t": TYPE, field: value, ...}`; nothing is ever pickled. Each frame
type is a frozen dataclass whose annotations are its definition. `decode` checks a
peer's bytes against the definitions of the frames that may arrive on that socket (`TO_SENDER`,
`TO_RECEIVER`, `TO_HUB`, `TO_RANK`): a map, a known type tag, every field present, no unknown
field, each value of its declared type, and each frame's own rules (an entry that fits its
bucket, sizes that agree). Anything else raises BadFrame before any code sees the frame.

Bucket entries travel as lists `[name, dtype, shape, offset, chunk_offset, chunk_bytes,
total_bytes]` (Entry); shared tensor references as `[name, dtype, shape, segment, offset, nbytes]`
(Ref) with segments as `[name, size]` (SegmentSpec); manifest items as `[name, dtype, shape]` (manifest.TensorSpec); a
disaggregated plan's buckets as `[owner, nbytes, [entries]]` (BucketSpec).

Files: fields.py (how a frame is defined and checked), layout.py (Entry, BucketSpec),
colocated.py (the same-host frames, with Welcome, Refused, Error and Abort), disaggregated.py
(the cross-node frames), limits.py (the largest frame each side may send); this module holds
the version, the frame sets of each socket, `encode`, `decode` and `peek`.

Two paths speak it, and each one's message sequence is drawn once, in its module's docstring: colocated.py
(same host: Ready, Welcome or Refused, Offer, Accept, Bucket and Release, Refs, Done, Complete, then Apply and
Applied for receivers that stage; Error and Abort end a sync early, and each receiver answers an Abort
with Stopped) and disaggregated.py (across nodes:
RankReady to sender 0's hub, Welcome or Refused, Setup, PlanFrame, Go, Commit; Ping, Pong and Alive
meanwhile). A peer proves the token in its Ready (RankReady), which binds its connection's identity; every
frame of an identity that never presented it is dropped (hwsync.control.sockets).
"""

from __future__ import annotations

from typing import Any

import msgpack

from hwsync.errors import ProtocolError
from hwsync.protocol.colocated import (
    Abort,
    Accept,
    Applied,
    Apply,
    Bucket,
    Complete,
    Done,
    Error,
    Gone,
    Offer,
    Ready,
    Refs,
    Refused,
    Release,
    Replay,
    Stopped,
    Welcome,
)
from hwsync.protocol.disaggregated import (
    Alive,
    Commit,
    Go,
    Joined,
    Listening,
    Ping,
    PlanAccept,
    PlanFrame,
    Pong,
    Progress,
    RankComplete,
    RankReady,
    Sent,
    Setup,
    Start,
    Waiting,
)
from hwsync.protocol.fields import BadFrame, Count, Frame, Map, short, value_to_wire
from hwsync.protocol.layout import BucketSpec, Entry, Ref, SegmentSpec

#: bump when frames change incompatibly; a receiver refuses any other version
PROTOCOL_VERSION = 14

__all__ = ["PROTOCOL_VERSION", "TO_HUB", "TO_RANK", "TO_RECEIVER", "TO_SENDER", "Abort", "Accept", "Alive",
           "Applied", "Apply", "BadFrame", "Bucket", "BucketSpec", "Commit", "Complete", "Count", "Done", "Entry",
           "Error", "Frame", "Go", "Gone",
           "Joined", "Listening", "Map", "Offer", "Ping", "PlanAccept", "PlanFrame", "Pong", "Progress", "RankComplete",
           "RankReady", "Ready", "Ref", "Refs", "Refused", "Release", "Replay", "SegmentSpec", "Sent", "Setup", "Start",
           "Stopped", "Waiting", "Welcome", "decode", "encode", "frame_set", "peek", "refused_reason"]


def frame_set(*classes: type[Frame]) -> dict[str, type[Frame]]:
    """The frames that may arrive on one kind of socket, by tag (a tag means one frame there)."""
    table = {cls.T: cls for cls in classes}
    if len(table) != len(classes):
        raise ValueError("two frames of one set share a tag")
    return table


TO_SENDER = frame_set(Ready, Gone, Accept, Release, Complete, Applied, Error, Stopped)
TO_RECEIVER = frame_set(Welcome, Refused, Offer, Replay, Bucket, Refs, Done, Apply, Abort)
TO_HUB = frame_set(RankReady, Listening, Joined, PlanAccept, Progress, Sent, RankComplete, Pong, Error)
TO_RANK = frame_set(Welcome, Refused, Start, Waiting, Setup, PlanFrame, Go, Commit, Ping, Alive, Abort)


def encode(frame: Frame) -> bytes:
    """The frame's bytes on the wire."""
    out: dict[str, Any] = {"t": frame.T}
    for name, _check in frame._checks:
        out[name] = value_to_wire(getattr(frame, name))
    return msgpack.packb(out, use_bin_type=True)


def _unpack(data: bytes | memoryview) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for truncated or garbage bytes
        raise BadFrame(f"not a msgpack frame ({type(exc).__name__}: {short(exc)})") from None


#: the values peek keeps: scalars, which a caller may compare or look up without a TypeError
_SCALARS = (str, int, float, bool, bytes, type(None))


def peek(data: bytes | memoryview) -> dict[str, str | int | float | bool | bytes | None] | None:
    """The scalar fields of the raw map in `data`, unchecked against any definition; None if it is no map.

    Only for what must be read across protocol versions: a Ready's `proto` and `token` (to refuse
    another version with the reason) and a Refused frame's `reason`. Fields whose key is not a
    str or whose value is a container are left out, so nothing a peer sends can make a caller's
    `raw.get("t") in table` raise (a map as the type is unhashable); a caller still checks each
    value's type before using it as more than a key.
    """
    try:
        raw = _unpack(data)
    except BadFrame:
        return None
    if not isinstance(raw, dict):
        return None
    return {k: v for k, v in raw.items() if type(k) is str and type(v) in _SCALARS}


def refused_reason(data: bytes | memoryview) -> str | None:
    """The reason of a Refused frame of any protocol version in `data`, or None if it is not one."""
    raw = peek(data)
    reason = None if raw is None or raw.get("t") != Refused.T else raw.get("reason")
    return reason if isinstance(reason, str) else None


def decode(data: bytes | memoryview, expected: dict[str, type[Frame]]) -> Frame:
    """The frame in `data`, checked against its definition in `expected`; BadFrame otherwise."""
    raw = _unpack(data)
    if not isinstance(raw, dict):
        raise BadFrame(f"a frame must be a msgpack map, got {type(raw).__name__}")
    tag = raw.pop("t", None)
    cls = expected.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise BadFrame(f"frame type {short(tag)} is not one this socket accepts ({', '.join(sorted(expected))})")
    sync = raw.get("sync")
    try:
        values = {}
        for name, check in cls._checks:
            if name not in raw:
                raise BadFrame(f"{tag} frame lacks field {name!r}")
            values[name] = check(raw.pop(name), f"{tag}.{name}")
        if raw:
            raise BadFrame(f"{tag} frame has unknown fields {', '.join(short(k) for k in list(raw)[:5])}")
        frame = cls(**values)
        frame.validate()
    except BadFrame as exc:
        exc.sync = sync if type(sync) is int and 0 <= sync < 1 << 63 else None
        raise
    return frame


# -- frame limits: how large a frame may be, by who sends it (every socket refuses more: ZMQ_MAXMSGSIZE) ---
#: the largest frame a receiver or collective rank may send (the sender's and hub's ZMQ_MAXMSGSIZE)
MAX_PEER_FRAME_BYTES = 256 << 10
#: the largest frame a sender or hub may send: an Offer or PlanFrame with its manifest (receivers' ZMQ_MAXMSGSIZE)
MAX_SENDER_FRAME_BYTES = 64 << 20
#: an error or refusal message is cut to this many characters before it travels
MAX_MESSAGE_CHARS = 8 << 10
#: messages a bound socket queues per connected peer before it stops reading from that peer (ZMQ_RCVHWM): a
#: stranger can park at most this many frames; a receiver that reaches it only waits (nothing is lost)
PEER_QUEUE_FRAMES = 64


def cut(message: str) -> str:
    """A message short enough for an Error, Abort or Refused frame."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 20] + f" ... ({len(message)} chars)"


def check_size(data: bytes, limit: int, what: str) -> bytes:
    """`data` if it fits `limit`, else ProtocolError naming the frame, its size and the limit."""
    if len(data) > limit:
        raise ProtocolError(f"{what} takes {len(data)} bytes on the wire, over the protocol's {limit}-byte limit "
                            "(hwsync.protocol); send fewer or shorter-named tensors per sync, or less state")
    return data
