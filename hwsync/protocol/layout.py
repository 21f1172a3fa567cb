"""The bucket layout on the wire: where each tensor's bytes sit in a bucket, and a plan's buckets."""

from __future__ import annotations

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
