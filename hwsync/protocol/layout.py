"""The bucket layout on the wire: where each tensor's bytes sit in a bucket, a plan's buckets, and references
into shared parameter segments (SegmentSpec, Ref) that a one-copy sync sends instead of bytes."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hwsync.manifest import WIRE_DTYPES, dtype_from_name
from hwsync.protocol.fields import BadFrame, short, wire_count, wire_shape

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
        shape = wire_shape(shape, f"bucket entry {name!r}")
        for value in (offset, chunk_offset, chunk_bytes, total):
            wire_count(value, f"bucket entry {name!r}")
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
            raise BadFrame(f"a planned bucket must be [owner, nbytes, [entries]], got {short(item)}")
        owner, nbytes = wire_count(item[0], "planned bucket owner"), wire_count(item[1], "planned bucket size")
        entries = tuple(Entry.from_wire(e) for e in item[2])
        entries_within(entries, nbytes)
        return cls(owner, nbytes, entries)


def entries_within(entries: Iterable[Entry], nbytes: int) -> None:
    """Raise BadFrame for an entry that ends past the bucket's `nbytes`."""
    for e in entries:
        if e.offset + e.chunk_bytes > nbytes:
            raise BadFrame(f"bucket entry {e.name!r} ends at byte {e.offset + e.chunk_bytes}, past the bucket's "
                           f"{nbytes} bytes")


#: names of shared parameter segments: hwsync-<creating pid>-params-<hex>; nothing else is ever mapped from a Refs frame
SHARED_SEGMENT_NAME = re.compile(r"hwsync-([0-9]{1,10})-params-[0-9a-f]{1,32}")


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
        if not SHARED_SEGMENT_NAME.fullmatch(item[0]):
            raise BadFrame(f"shared segment name {short(item[0])} is not an hwsync parameter segment's "
                           "(hwsync-<pid>-params-<hex>)")
        return cls(item[0], wire_count(item[1], f"size of shared segment {item[0]!r}"))


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
        if not isinstance(item, list) or len(item) != 6:
            raise BadFrame(f"a shared tensor reference must be a list of 6 fields, got {short(item)}")
        name, dtype, shape, segment, offset, nbytes = item
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
            raise BadFrame(f"shared tensor reference {short(item)}: bad name or dtype")
        shape = wire_shape(shape, f"shared tensor {name!r}")
        for value in (segment, offset, nbytes):
            wire_count(value, f"shared tensor {name!r}")
        if nbytes != math.prod(shape) * dtype_from_name(dtype).itemsize:
            raise BadFrame(f"shared tensor {name!r}: {nbytes} bytes do not fit {dtype} of shape {list(shape)}")
        if offset % ALIGNMENT:
            raise BadFrame(f"shared tensor {name!r} at byte {offset}: offsets are multiples of {ALIGNMENT}")
        return cls(name, dtype, shape, segment, offset, nbytes)


#: byte alignment of every tensor in a shared segment (the bucket alignment: any dtype view, device copy engines)
ALIGNMENT = 256


def refs_within(refs: Iterable[Ref], segments: list[SegmentSpec]) -> None:
    """Raise BadFrame for a reference to a segment not in `segments`, or reaching past its segment's end."""
    for r in refs:
        if r.segment >= len(segments):
            raise BadFrame(f"shared tensor {r.name!r} points to segment #{r.segment} of {len(segments)}")
        if r.offset + r.nbytes > segments[r.segment].size:
            raise BadFrame(f"shared tensor {r.name!r} ends at byte {r.offset + r.nbytes}, past the "
                           f"{segments[r.segment].size} bytes of {segments[r.segment].name}")
