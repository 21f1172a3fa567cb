"""The wire protocol: every control frame and bucket layout, defined once; the only encoder and decoder.

Frames are msgpack maps `{"t": TYPE, field: value, ...}`; nothing is ever pickled. Each frame
type below is a frozen dataclass whose annotations are its definition. `decode` checks a
peer's bytes against the definitions of the frames that may arrive on that socket (`TO_SENDER`,
`TO_RECEIVER`, `TO_HUB`, `TO_RANK`): a map, a known type tag, every field present, no unknown
field, each value of its declared type, and each frame's own rules (an entry that fits its
bucket, sizes that agree). Anything else raises BadFrame before any code sees the frame.

Bucket entries travel as lists `[name, dtype, shape, offset, chunk_offset, chunk_bytes,
total_bytes]` (Entry); manifest items as `[name, dtype, shape]` (manifest.TensorSpec); a
disaggregated plan's buckets as `[owner, nbytes, [entries]]` (BucketSpec).

Two paths speak it. Same host (hwsync.colocated): a receiver says `Ready`; the sender answers
with an `Offer` (geometry, handles, manifest), the receiver `Accept`s, then each bucket is a
`Bucket` (a ZeroMQ frame, or a doorbell descriptor) and a `Release`; `Done` and `Complete` end
the sync; `Error` and `Abort` end it early. Across nodes (hwsync.disaggregated): every rank says
`RankReady` to sender 0's hub, which answers `Setup` (group addresses), `PlanFrame`, `Go`,
`Commit`, and keeps everyone honest with `Ping`/`Pong`/`Alive`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from hwsync.errors import ProtocolError
from hwsync.manifest import WIRE_DTYPES, TensorSpec, dtype_from_name

#: bump when frames change incompatibly; a receiver refuses any other version
PROTOCOL_VERSION = 3

#: a msgpack map with string keys whose values the protocol does not constrain (stats, state, handles)
Map = dict[str, Any]


class BadFrame(ProtocolError):
    """A frame that does not match its definition (or no definition at all)."""


# -- field checks ----------------------------------------------------------------------------------


def _to_wire(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and value and hasattr(value[0], "to_wire"):
        return [v.to_wire() for v in value]
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _count(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise BadFrame(f"{what}: expected a non-negative int, got {_short(value)}")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or any(type(d) is not int or d < 0 for d in value):
        raise BadFrame(f"{what}: a shape must be a list of non-negative ints, got {_short(value)}")
    return tuple(value)


def _scalar(kind: type) -> Callable[[Any, str], Any]:
    def check(value: Any, what: str) -> Any:
        # bool is an int to Python but not to the protocol; an int is a fine float
        if type(value) is kind or (kind is float and type(value) is int):
            return value
        raise BadFrame(f"{what}: expected {kind.__name__}, got {type(value).__name__}")

    return check


def _checker(tp: Any) -> Callable[[Any, str], Any]:
    """A function that checks (and converts) one wire value against an annotation."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda value, what: value
    if tp in (int, float, str, bool, bytes):
        return _scalar(tp)
    if origin in (types.UnionType, typing.Union) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        check = _checker(inner)
        return lambda value, what: None if value is None else check(value, what)
    if origin is list:
        item = _checker(args[0])

        def check_list(value: Any, what: str) -> list[Any]:
            if not isinstance(value, list):
                raise BadFrame(f"{what}: expected a list, got {type(value).__name__}")
            return [item(v, what) for v in value]

        return check_list
    if origin is dict:
        def check_map(value: Any, what: str) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise BadFrame(f"{what}: expected a map, got {type(value).__name__}")
            return value

        return check_map
    if hasattr(tp, "from_wire"):  # Entry, BucketSpec, TensorSpec
        def check_wire(value: Any, what: str) -> Any:
            try:
                return tp.from_wire(value)
            except BadFrame:
                raise
            except Exception as exc:
                raise BadFrame(f"{what}: {_short(value)} is not a {tp.__name__} ({exc})") from None

        return check_wire
    raise TypeError(f"the protocol cannot check fields of type {tp!r}")


# -- the bucket layout ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """Where one tensor (or one chunk of it) sits in a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    chunk_offset: int
    chunk_bytes: int
    total_bytes: int

    @property
    def is_last(self) -> bool:
        """Whether this chunk completes its tensor."""
        return self.chunk_offset + self.chunk_bytes == self.total_bytes

    @property
    def is_whole(self) -> bool:
        """Whether the tensor sits in this bucket in one piece."""
        return self.chunk_bytes == self.total_bytes

    def to_wire(self) -> list[Any]:
        """Compact list form for a frame."""
        return [self.name, self.dtype, list(self.shape), self.offset, self.chunk_offset, self.chunk_bytes,
                self.total_bytes]

    @classmethod
    def from_wire(cls, item: Any) -> Entry:
        """Inverse of to_wire, checking every field and that the sizes agree."""
        if not isinstance(item, list) or len(item) != 7:
            raise BadFrame(f"a bucket entry must be a list of 7 fields, got {_short(item)}")
        name, dtype, shape, offset, chunk_offset, chunk_bytes, total = item
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise BadFrame(f"bucket entry {_short(item)}: bad name or dtype")
        shape = _shape(shape, f"bucket entry {name!r}")
        for value in (offset, chunk_offset, chunk_bytes, total):
            _count(value, f"bucket entry {name!r}")
        numel = 1
        for dim in shape:
            numel *= dim
        if total != numel * dtype_from_name(dtype).itemsize or chunk_offset + chunk_bytes > total:
            raise BadFrame(f"bucket entry {name!r}: {total} total bytes, chunk {chunk_offset}+{chunk_bytes}, "
                           f"do not fit {dtype} of shape {list(shape)}")
        return cls(name, dtype, shape, offset, chunk_offset, chunk_bytes, total)


@dataclass(frozen=True)
class BucketSpec:
    """One bucket of a disaggregated plan: the sender rank that broadcasts it, its used bytes, its entries."""

    owner: int
    nbytes: int
    entries: tuple[Entry, ...]

    def to_wire(self) -> list[Any]:
        """[owner, nbytes, [entries]]."""
        return [self.owner, self.nbytes, [e.to_wire() for e in self.entries]]

    @classmethod
    def from_wire(cls, item: Any) -> BucketSpec:
        """Inverse of to_wire, checking that every entry lies inside the bucket."""
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[2], list):
            raise BadFrame(f"a planned bucket must be [owner, nbytes, [entries]], got {_short(item)}")
        owner, nbytes = _count(item[0], "planned bucket owner"), _count(item[1], "planned bucket size")
        entries = tuple(Entry.from_wire(e) for e in item[2])
        _entries_within(entries, nbytes)
        return cls(owner, nbytes, entries)


def _entries_within(entries: Iterable[Entry], nbytes: int) -> None:
    for e in entries:
        if e.offset + e.chunk_bytes > nbytes:
            raise BadFrame(f"bucket entry {e.name!r} ends at byte {e.offset + e.chunk_bytes}, past the bucket's "
                           f"{nbytes} bytes")


# -- frames ----------------------------------------------------------------------------------------


class Frame:
    """Base of every frame: `T` is its type tag on the wire; dataclass fields are its fields."""

    T: ClassVar[str]
    _checks: ClassVar[tuple[tuple[str, Callable[[Any, str], Any]], ...]]

    def validate(self) -> None:
        """Rules across fields (overridden where a frame has some)."""


def _frame(tag: str) -> Callable[[type], type]:
    """Make a frozen dataclass frame with wire tag `tag` and compile its field checks."""

    def wrap(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        cls.T = tag
        hints = typing.get_type_hints(cls)
        cls._checks = tuple((f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls))
        return cls

    return wrap


# same host: receiver -> sender


@_frame("ready")
class Ready(Frame):
    """A receiver is ready for the next sync; `state` is what the sender may plan from."""

    token: str
    proto: int
    pid: int
    host: str
    state: Map
    doorbell: bool
    into: bool


@_frame("gone")
class Gone(Frame):
    """A receiver that said Ready gave up before an offer came: skip it."""


@_frame("accept")
class Accept(Frame):
    """The receiver checked the offer (protocol, transport, manifest) and mapped the buffers."""

    sync: int


@_frame("release")
class Release(Frame):
    """The receiver is done with bucket `seq` in buffer `buf` (and every bucket before it)."""

    sync: int
    buf: int
    seq: int


@_frame("complete")
class Complete(Frame):
    """The receiver loaded the whole sync; `stats` are its own figures."""

    sync: int
    stats: Map


@_frame("error")
class Error(Frame):
    """A side failed; `kind` is "protocol", "load", "collective" or "local"; `message` says why."""

    sync: int | None
    kind: str
    message: str


# same host: sender -> receiver


@_frame("offer")
class Offer(Frame):
    """One sync's geometry, buffers and announced tensors, for receiver `rank`."""

    sync: int
    proto: int
    backend: str
    transport: str
    handles: Map
    bucket_bytes: int
    num_buffers: int
    version: int
    pid: int
    host: str
    manifest: list[TensorSpec] | None
    tensors: int | None
    total_bytes: int | None
    first: int
    doorbell: Map | None
    rank: int


@_frame("bucket")
class Bucket(Frame):
    """Bucket `seq` (the `index`-th of this sync) is in buffer `buf`: `nbytes` used, laid out as `entries`."""

    sync: int
    index: int
    seq: int
    buf: int
    nbytes: int
    entries: list[Entry]

    def validate(self) -> None:
        """Every entry lies inside the bucket's used bytes."""
        _entries_within(self.entries, self.nbytes)


@_frame("done")
class Done(Frame):
    """The sender posted every bucket of the sync."""

    sync: int
    buckets: int
    tensors: int
    bytes: int


@_frame("abort")
class Abort(Frame):
    """The sync failed on the sending side (or the hub); `message` says why."""

    sync: int | None
    message: str


# across nodes: ranks -> hub (sender 0)


@_frame("ready")
class RankReady(Frame):
    """A sender rank > 0 or a receiver is ready; `epoch` names the groups it still holds."""

    token: str
    role: str
    rank: int
    epoch: int | None
    pid: int
    host: str
    address: str | None
    state: Map


@_frame("joined")
class Joined(Frame):
    """This rank has built its groups."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("accept")
class PlanAccept(Frame):
    """A receiver checked the plan's manifest."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("progress")
class Progress(Frame):
    """A receiver loaded bucket `k`."""

    k: int
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("sent")
class Sent(Frame):
    """A sender rank > 0 broadcast all its buckets."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("complete")
class RankComplete(Frame):
    """A receiver loaded `version` completely; `stats` are its own figures."""

    version: int
    stats: Map
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("pong")
class Pong(Frame):
    """The answer to ping `n`."""

    n: int
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


# across nodes: hub -> ranks


@_frame("setup")
class Setup(Frame):
    """Build new groups: sender s's group rendezvous at `addresses[s]`, with `num_receivers` receivers."""

    pid: int
    host: str
    epoch: int
    addresses: list[str]
    num_receivers: int
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("plan")
class PlanFrame(Frame):
    """The sync's plan: which bytes go in which bucket and which sender broadcasts it."""

    pid: int
    host: str
    epoch: int
    version: int
    bucket_bytes: int
    num_senders: int
    manifest: list[TensorSpec]
    buckets: list[BucketSpec]
    #: the receivers' reported state, for a callable source on every sender rank
    state: Map
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0

    def validate(self) -> None:
        """Owners are sender ranks and buckets fit the bucket size."""
        for bucket in self.buckets:
            if bucket.owner >= self.num_senders or bucket.nbytes > self.bucket_bytes:
                raise BadFrame(f"planned bucket of owner {bucket.owner} and {bucket.nbytes} bytes does not fit "
                               f"{self.num_senders} senders of {self.bucket_bytes}-byte buckets")


@_frame("go")
class Go(Frame):
    """Every receiver accepted the plan: start broadcasting."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("commit")
class Commit(Frame):
    """Every receiver confirmed `version`."""

    version: int
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("ping")
class Ping(Frame):
    """Answer with Pong(n): the hub is finding out who is still alive."""

    n: int
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


@_frame("alive")
class Alive(Frame):
    """The hub is alive (sent while a sync is quiet)."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: int = 0


def frame_set(*classes: type[Frame]) -> dict[str, type[Frame]]:
    """The frames that may arrive on one kind of socket, by tag (a tag means one frame there)."""
    table = {cls.T: cls for cls in classes}
    if len(table) != len(classes):
        raise ValueError("two frames of one set share a tag")
    return table


TO_SENDER = frame_set(Ready, Gone, Accept, Release, Complete, Error)
TO_RECEIVER = frame_set(Offer, Bucket, Done, Abort)
TO_HUB = frame_set(RankReady, Joined, PlanAccept, Progress, Sent, RankComplete, Pong, Error)
TO_RANK = frame_set(Setup, PlanFrame, Go, Commit, Ping, Alive, Abort)


def encode(frame: Frame) -> bytes:
    """The frame's bytes on the wire."""
    out: dict[str, Any] = {"t": frame.T}
    for name, _check in frame._checks:
        out[name] = _to_wire(getattr(frame, name))
    return msgpack.packb(out, use_bin_type=True)


def decode(data: bytes, expected: dict[str, type[Frame]]) -> Frame:
    """The frame in `data`, checked against its definition in `expected`; BadFrame otherwise."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several types for truncated or garbage bytes
        raise BadFrame(f"not a msgpack frame ({type(exc).__name__}: {_short(exc)})") from None
    if not isinstance(raw, dict):
        raise BadFrame(f"a frame must be a msgpack map, got {type(raw).__name__}")
    tag = raw.pop("t", None)
    cls = expected.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise BadFrame(f"frame type {_short(tag)} is not one this socket accepts ({', '.join(sorted(expected))})")
    values = {}
    for name, check in cls._checks:
        if name not in raw:
            raise BadFrame(f"{tag} frame lacks field {name!r}")
        values[name] = check(raw.pop(name), f"{tag}.{name}")
    if raw:
        raise BadFrame(f"{tag} frame has unknown fields {sorted(map(str, raw))[:5]}")
    frame = cls(**values)
    frame.validate()
    return frame
