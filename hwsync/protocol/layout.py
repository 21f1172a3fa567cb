"""The bucket layout on the wire: where each tensor's bytes sit in a bucket, a plan's buckets, and references
that a one-copy sync sends instead of bytes: into shared parameter segments in host memory (SegmentSpec,
Ref), and into the trainer's own device allocator segments (DeviceSegment, DeviceRef)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hwsync.backend.owners import OWNER
from hwsync.protocol.fields import INT_MAX, BadFrame, short, wire_count, wire_shape
from hwsync.sync.spec import WIRE_DTYPES, dtype_from_name


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
            raise BadFrame(f"a bucket entry must be a list of 7 fields, got {short(item)}")
        name, dtype, shape, offset, chunk_offset, chunk_bytes, total = item
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise BadFrame(f"bucket entry {short(item)}: bad name or dtype")
        what = f"bucket entry {short(name)}"
        shape = wire_shape(shape, what)
        for value in (offset, chunk_offset, chunk_bytes, total):
            wire_count(value, what)
        numel = 1
        for dim in shape:
            numel *= dim
        if total != numel * dtype_from_name(dtype).itemsize or chunk_offset + chunk_bytes > total:
            raise BadFrame(f"bucket entry {short(name)}: {total} total bytes, chunk {chunk_offset}+{chunk_bytes}, "
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
            raise BadFrame(f"a planned bucket must be [owner, nbytes, [entries]], got {short(item)}")
        owner, nbytes = wire_count(item[0], "planned bucket owner"), wire_count(item[1], "planned bucket size")
        entries = tuple(Entry.from_wire(e) for e in item[2])
        entries_within(entries, nbytes)
        return cls(owner, nbytes, entries)


def entries_within(entries: Iterable[Entry], nbytes: int) -> None:
    """Raise BadFrame for an entry that ends past the bucket's `nbytes`."""
    for e in entries:
        if e.offset + e.chunk_bytes > nbytes:
            raise BadFrame(f"bucket entry {short(e.name)} ends at byte {e.offset + e.chunk_bytes}, past the bucket's "
                           f"{nbytes} bytes")


# Names begin with their owner, hwsync-<pid>-<start>-<pidns>- (hwsync.backend.owners.OWNER: the creating process, its
# start time and pid namespace), so that what a dead process left is told apart from what a live one holds.
#: names of transport buffers and doorbells: <owner>-<16 hex>
BUFFER_SEGMENT_NAME = re.compile(OWNER + r"[0-9a-f]{16}")
#: names of shared parameter segments: <owner>-params-<16 hex>; nothing else is ever mapped from a Refs frame
SHARED_SEGMENT_NAME = re.compile(OWNER + r"params-[0-9a-f]{16}")


def segment_name(name: Any, pattern: re.Pattern[str], pid: int | None, what: str) -> str:
    """`name` if it is a segment name of `pattern` made by process `pid` (any, when None); BadFrame otherwise.

    A name that passes has no separator and no dot: it can only ever name a file in /dev/shm.
    """
    if not isinstance(name, str):
        raise BadFrame(f"{what}: a segment name must be a str, got {type(name).__name__}")
    match = pattern.fullmatch(name)
    if match is None:
        raise BadFrame(f"{what}: {short(name)} is not the name of an hwsync shared segment ({_FORMS[pattern]})")
    if pid is not None and int(match.group(1)) != pid:
        raise BadFrame(f"{what}: segment {name} is process {match.group(1)}'s, not the sender's (pid {pid}); a sender "
                       "only ever names segments it created")
    return name


_FORMS = {BUFFER_SEGMENT_NAME: "hwsync-<pid>-<start>-<pidns>-<16 hex digits>",
          SHARED_SEGMENT_NAME: "hwsync-<pid>-<start>-<pidns>-params-<16 hex digits>"}


def check_shm_handles(handles: dict[str, Any], pid: int | None) -> tuple[list[str], int]:
    """(names, bytes) of the core shm transport's handles, each a buffer segment of process `pid`; else BadFrame."""
    if not isinstance(handles, dict) or set(handles) != {"kind", "names", "bytes"} or handles["kind"] != "shm":
        raise BadFrame(f"shm handles must be {{kind: 'shm', names, bytes}}, got {short(handles)}")
    names, size = handles["names"], wire_count(handles["bytes"], "the shm buffers' size")
    if not isinstance(names, list) or not names:
        raise BadFrame(f"shm handles: names must be a non-empty list, got {short(names)}")
    return [segment_name(n, BUFFER_SEGMENT_NAME, pid, "shm buffer") for n in names], size


#: the fields of a doorbell handle (hwsync.colocated.doorbell.Doorbell.handle)
DOORBELL_FIELDS = ("name", "bytes", "receivers", "slots")


def check_doorbell_handle(handle: dict[str, Any], pid: int | None, rank: int) -> None:
    """BadFrame unless `handle` is a doorbell of process `pid` with a counter for receiver `rank`."""
    if not isinstance(handle, dict) or set(handle) != set(DOORBELL_FIELDS):
        raise BadFrame(f"a doorbell handle has the fields {list(DOORBELL_FIELDS)}, got {short(handle)}")
    segment_name(handle["name"], BUFFER_SEGMENT_NAME, pid, "doorbell")
    for key in DOORBELL_FIELDS[1:]:
        wire_count(handle[key], f"doorbell {key}")
    if rank >= handle["receivers"] or not handle["slots"]:
        raise BadFrame(f"a doorbell of {handle['receivers']} receivers and {handle['slots']} slots has no room for "
                       f"receiver {rank}")


@dataclass(frozen=True)
class SegmentSpec:
    """A shared segment a Refs frame points into: its name in /dev/shm and its size in bytes."""

    name: str
    size: int

    def to_wire(self) -> list[Any]:
        """[name, size]."""
        return [self.name, self.size]

    @property
    def pid(self) -> int:
        """The process that created (and owns) the segment."""
        match = SHARED_SEGMENT_NAME.fullmatch(self.name)
        assert match is not None
        return int(match.group(1))

    @classmethod
    def from_wire(cls, item: Any) -> SegmentSpec:
        """Inverse of to_wire; the name must be a shared parameter segment's (no path, no other file)."""
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
            raise BadFrame(f"a shared segment must be [name, size], got {short(item)}")
        name = segment_name(item[0], SHARED_SEGMENT_NAME, None, "shared parameter segment")
        return cls(name, wire_count(item[1], f"size of shared segment {name}"))


@dataclass(frozen=True)
class Ref:
    """A whole tensor the receiver reads in place: `nbytes` at byte `offset` of segment number `segment`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    segment: int
    offset: int
    nbytes: int

    def to_wire(self) -> list[Any]:
        """Compact list form for a frame."""
        return [self.name, self.dtype, list(self.shape), self.segment, self.offset, self.nbytes]

    @classmethod
    def from_wire(cls, item: Any) -> Ref:
        """Inverse of to_wire, checking every field and that the size is the dtype's and shape's."""
        # a frame holds thousands: every check inline first; what fails any is checked again, field by field, by
        # _checked, which names what is wrong (it accepts nothing this refuses)
        if type(item) is list and len(item) == 6:
            name, dtype, shape, segment, offset, nbytes = item
            itemsize = _ITEMSIZE.get(dtype) if type(dtype) is str else None
            if (itemsize is not None and type(name) is str and type(shape) is list and type(segment) is int
                    and type(offset) is int and type(nbytes) is int and 0 <= segment <= INT_MAX
                    and 0 <= offset <= INT_MAX and 0 <= nbytes <= INT_MAX and not offset % ALIGNMENT):
                numel = 1
                for dim in shape:
                    if type(dim) is not int or not 0 <= dim <= INT_MAX:
                        break
                    numel *= dim
                else:
                    if nbytes == numel * itemsize:
                        return cls(name, dtype, tuple(shape), segment, offset, nbytes)
        return cls._checked(item)

    @classmethod
    def _checked(cls, item: Any) -> Ref:
        """from_wire field by field, raising BadFrame that names the first wrong one."""
        if not isinstance(item, list) or len(item) != 6:
            raise BadFrame(f"a shared tensor reference must be a list of 6 fields, got {short(item)}")
        name, dtype, shape, segment, offset, nbytes = item
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise BadFrame(f"shared tensor reference {short(item)}: bad name or dtype")
        what = f"shared tensor {short(name)}"
        shape = wire_shape(shape, what)
        for value in (segment, offset, nbytes):
            wire_count(value, what)
        if nbytes != math.prod(shape) * dtype_from_name(dtype).itemsize:
            raise BadFrame(f"shared tensor {short(name)}: {nbytes} bytes do not fit {dtype} of shape {list(shape)}")
        if offset % ALIGNMENT:
            raise BadFrame(f"shared tensor {short(name)} at byte {offset}: offsets are multiples of {ALIGNMENT}")
        return cls(name, dtype, shape, segment, offset, nbytes)


#: bytes per element of each wire dtype
_ITEMSIZE = {name: dtype_from_name(name).itemsize for name in WIRE_DTYPES}

#: byte alignment of every tensor in a shared segment (the bucket alignment: any dtype view, device copy engines)
ALIGNMENT = 256


def refs_within(refs: Iterable[Ref], segments: list[SegmentSpec]) -> None:
    """Raise BadFrame for a reference to a segment not in `segments`, or reaching past its segment's end."""
    for r in refs:
        if r.segment >= len(segments):
            raise BadFrame(f"shared tensor {short(r.name)} points to segment #{r.segment} of {len(segments)}")
        if r.offset + r.nbytes > segments[r.segment].size:
            raise BadFrame(f"shared tensor {short(r.name)} ends at byte {r.offset + r.nbytes}, past the "
                           f"{segments[r.segment].size} bytes of {segments[r.segment].name}")


@dataclass(frozen=True)
class DeviceSegment:
    """A device allocator segment newly exported to one receiver: the sender's id for it (never reused in its
    session), its size, and the transport's export record (msgpack values only; the transport checks them)."""

    id: int
    size: int
    export: dict[str, Any]

    def to_wire(self) -> list[Any]:
        """[id, size, export]."""
        return [self.id, self.size, self.export]

    @classmethod
    def from_wire(cls, item: Any) -> DeviceSegment:
        """Inverse of to_wire: a count, a size above zero, a map with str keys."""
        if not isinstance(item, list) or len(item) != 3:
            raise BadFrame(f"a device segment must be [id, size, export], got {short(item)}")
        ident, size = wire_count(item[0], "device segment id"), wire_count(item[1], "device segment size")
        export = item[2]
        if not size:
            raise BadFrame(f"device segment {ident} has no bytes")
        if not isinstance(export, dict) or any(type(k) is not str for k in export):
            raise BadFrame(f"device segment {ident}: its export must be a map with str keys, got {short(export)}")
        return cls(ident, size, export)


@dataclass(frozen=True)
class DeviceRef:
    """A whole, contiguous tensor a receiver reads in place: `dtype` of `shape` at byte `offset` of device segment
    `segment` (an id the sender exported to this receiver, in this frame or before and not dropped since)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    segment: int
    offset: int

    @property
    def nbytes(self) -> int:
        """The tensor's bytes."""
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    def to_wire(self) -> list[Any]:
        """Compact list form for a frame."""
        return [self.name, self.dtype, list(self.shape), self.segment, self.offset]

    @classmethod
    def from_wire(cls, item: Any) -> DeviceRef:
        """Inverse of to_wire, checking every field and that the offset is aligned for the dtype's view."""
        if not isinstance(item, list) or len(item) != 5:
            raise BadFrame(f"a device tensor reference must be a list of 5 fields, got {short(item)}")
        name, dtype, shape, segment, offset = item
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise BadFrame(f"device tensor reference {short(item)}: bad name or dtype")
        what = f"device tensor {short(name)}"
        shape = wire_shape(shape, what)
        wire_count(segment, f"{what}'s segment")
        wire_count(offset, f"{what}'s offset")
        if offset % dtype_from_name(dtype).itemsize:
            raise BadFrame(f"device tensor {short(name)} at byte {offset} is not aligned for {dtype}")
        if math.prod(shape) * dtype_from_name(dtype).itemsize > INT_MAX:
            raise BadFrame(f"device tensor {short(name)} of shape {short(list(shape))} is larger than any segment")
        return cls(name, dtype, shape, segment, offset)


def device_refs_within(refs: Iterable[DeviceRef], segments: Iterable[DeviceSegment]) -> None:
    """Raise BadFrame for two exports of one id, or a reference reaching past the end of a segment given with it
    (a reference to an id exported earlier is checked by the receiver against what it mapped)."""
    sizes: dict[int, int] = {}
    for s in segments:
        if s.id in sizes:
            raise BadFrame(f"device segment {s.id} is exported twice in one frame")
        sizes[s.id] = s.size
    for r in refs:
        size = sizes.get(r.segment)
        if size is not None and r.offset + r.nbytes > size:
            raise BadFrame(f"device tensor {short(r.name)} ends at byte {r.offset + r.nbytes}, past the {size} bytes "
                           f"of device segment {r.segment}")
