"""Packing named tensors into flat byte buckets, and taking them out again.

Each bucket entry is [name, dtype, shape, offset, chunk_offset, chunk_bytes, total_bytes].
A tensor that fits a bucket is never split, so the receiver can hand out zero-copy views; a
tensor larger than a bucket is cut into chunks over consecutive buckets and reassembled on the
receiving side before anyone sees it. Bucket size is a performance knob, never a limit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hwsync.manifest import dtype_from_name, dtype_name

#: into(name, dtype, shape): the caller's own tensor to receive straight into, or None
IntoFn = Callable[[str, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]

#: byte alignment of every entry: enough for any dtype view and for device copy engines
ALIGN = 256


def align_up(n: int, to: int = ALIGN) -> int:
    """Round `n` up to a multiple of `to`."""
    return (n + to - 1) // to * to


def copy_bytes(dst: torch.Tensor, dst_offset: int, src: torch.Tensor, src_offset: int, nbytes: int) -> None:
    """Copy `nbytes` between flat uint8 tensors; a plain memmove when both are in host memory.

    torch's copy_ costs ~3 us of dispatch per call and copies cache-resident bytes ~30% slower
    than libc's memmove; with thousands of MiB-sized buckets per sync both show.
    """
    if not nbytes:
        return
    if dst.device.type == "cpu" and src.device.type == "cpu":
        if dst_offset + nbytes > dst.numel() or src_offset + nbytes > src.numel():
            raise IndexError(f"copy of {nbytes} bytes runs past a tensor's end")
        ctypes.memmove(dst.data_ptr() + dst_offset, src.data_ptr() + src_offset, nbytes)
    else:
        dst[dst_offset : dst_offset + nbytes].copy_(src[src_offset : src_offset + nbytes])


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's data (a contiguous copy first if it is strided)."""
    if hasattr(tensor, "full_tensor"):  # a DTensor: materialise the global tensor, one at a time
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class Entry:
    """Where one tensor (or one chunk of it) sits in a bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    chunk_offset: int
    chunk_bytes: int
    total_bytes: int

    def to_wire(self) -> list[Any]:
        """Compact list form for a frame."""
        return [self.name, self.dtype, list(self.shape), self.offset, self.chunk_offset, self.chunk_bytes,
                self.total_bytes]

    @classmethod
    def from_wire(cls, item: list[Any]) -> "Entry":
        """Inverse of to_wire."""
        name, dtype, shape, offset, chunk_offset, chunk_bytes, total = item
        return cls(name, dtype, tuple(shape), offset, chunk_offset, chunk_bytes, total)


def entry_wire_bytes(name: str, ndim: int) -> int:
    """An upper bound of one entry's size in a msgpack frame."""
    return len(name.encode()) + 10 * ndim + 80


class BucketWriter:
    """Fills one buffer at a time; the caller flushes it when `full` says so.

    `max_wire_bytes` bounds the size of the bucket's entries as a frame (the doorbell's
    descriptor slot): `has_room` turns false before they would outgrow it.
    """

    def __init__(self, bucket_bytes: int, max_wire_bytes: int | None = None) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes} is below the minimum of {ALIGN}")
        self.bucket_bytes = bucket_bytes
        self.max_wire_bytes = max_wire_bytes
        self.entries: list[Entry] = []
        self.used = 0
        self.wire_bytes = 0
        self._last_entry_bytes = 0

    def reset(self) -> None:
        """Start an empty bucket."""
        self.entries = []
        self.used = 0
        self.wire_bytes = 0
        self._last_entry_bytes = 0

    def has_room(self, name: str, ndim: int) -> bool:
        """Whether one more entry for this tensor fits the frame-size bound."""
        if self.max_wire_bytes is None:
            return True
        need = entry_wire_bytes(name, ndim)
        if need > self.max_wire_bytes // 2:
            raise ValueError(f"tensor name of {len(name)} characters is too long for a bucket descriptor "
                             f"({self.max_wire_bytes // 2 - 10 * ndim - 80} at most); shorten the name")
        return self.wire_bytes + need <= self.max_wire_bytes

    def fits_whole(self, nbytes: int) -> bool:
        """Whether a tensor of `nbytes` fits in what is left of this bucket."""
        return align_up(self.used) + nbytes <= self.bucket_bytes

    def chunks(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[torch.Tensor, Entry]]:
        """Plan a tensor's pieces from the current fill level on: (its flat bytes, entry) each.

        The caller copies `entry.chunk_bytes` from `entry.chunk_offset` of the flat bytes to
        `entry.offset` of the buffer, and flushes the bucket whenever `full` is true after a piece.
        """
        flat = as_bytes(tensor)
        total = flat.numel()
        spec = (name, dtype_name(tensor.dtype), tuple(tensor.shape))
        entry_bytes = self._last_entry_bytes = entry_wire_bytes(name, tensor.dim())
        if total == 0:
            entry = Entry(*spec, align_up(self.used), 0, 0, 0)
            self.entries.append(entry)
            self.wire_bytes += entry_bytes
            yield flat, entry
            return
        done = 0
        while done < total:
            start = align_up(self.used)
            room = self.bucket_bytes - start
            if room <= 0:
                raise RuntimeError("bucket is full: flush it before placing more bytes")
            take = min(room, total - done)
            entry = Entry(*spec, start, done, take, total)
            self.entries.append(entry)
            self.wire_bytes += entry_bytes
            self.used = start + take
            yield flat, entry
            done += take

    @property
    def full(self) -> bool:
        """No aligned room left for another byte, or no room in the frame for another entry."""
        if self.max_wire_bytes is not None and self.wire_bytes + self._last_entry_bytes > self.max_wire_bytes:
            return True
        return align_up(self.used) >= self.bucket_bytes

    def wire_entries(self) -> list[list[Any]]:
        """The entries of the current bucket as frame lists."""
        return [e.to_wire() for e in self.entries]


class BucketReader:
    """Turns received buckets back into complete (name, tensor) pairs.

    A split tensor is reassembled into a scratch tensor that is kept and reused by the next
    sync: writing into fresh memory every step costs as much as the copy itself (page faults),
    so a reassembled tensor is valid until the next sync begins. With `into`, a tensor whose
    destination the caller names is copied there chunk by chunk and never reassembled.
    """

    def __init__(self) -> None:
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}
        self._scratch: dict[tuple[str, int, str], torch.Tensor] = {}
        #: destinations of tensors being received `into` (flat bytes), or None where declined
        self._into: dict[str, torch.Tensor | None] = {}
        #: whether the last read() returned a view into its buffer (else it may be released early)
        self.aliases_view = False

    def begin(self) -> None:
        """Start a new sync: forget partial tensors of an abandoned one (scratch memory stays)."""
        self._partial = {}
        self._into = {}

    def _destination(self, e: Entry, dtype: torch.dtype, into: IntoFn) -> torch.Tensor | None:
        """The caller's tensor for this entry as flat bytes (asked once per tensor), or None."""
        if e.chunk_offset == 0:
            dest = into(e.name, dtype, e.shape)
            if dest is not None:
                if dest.dtype != dtype or tuple(dest.shape) != e.shape:
                    raise ValueError(f"into({e.name!r}) gave a {dest.dtype} tensor of shape {tuple(dest.shape)}, "
                                     f"but the sender sent {dtype} of shape {e.shape}; return a matching tensor "
                                     "or None to get this one through load")
                if not dest.is_contiguous():
                    raise ValueError(f"into({e.name!r}) gave a non-contiguous tensor; return a contiguous one "
                                     "or None to get this one through load")
                dest = dest.detach().reshape(-1).view(torch.uint8)
            self._into[e.name] = dest
        return self._into.get(e.name)

    def pending(self) -> list[str]:
        """Names of tensors whose chunks have not all arrived."""
        return list(self._partial)

    def read(self, view: torch.Tensor, entries: list[list[Any]], into: IntoFn | None = None
             ) -> list[tuple[str, torch.Tensor]]:
        """Complete tensors of one bucket for `load`; whole ones are zero-copy views into `view`.

        Tensors `into` gives a destination for are copied there and left out of the result.
        """
        out: list[tuple[str, torch.Tensor]] = []
        self.aliases_view = False
        for item in entries:
            e = Entry.from_wire(item)
            dtype = dtype_from_name(e.dtype)
            if into is not None:
                dest = self._destination(e, dtype, into)
                if dest is not None:
                    copy_bytes(dest, e.chunk_offset, view, e.offset, e.chunk_bytes)
                    if e.chunk_offset + e.chunk_bytes == e.total_bytes:
                        del self._into[e.name]
                    continue
            if e.total_bytes == 0:
                out.append((e.name, torch.empty(e.shape, dtype=dtype, device=view.device)))
                continue
            piece = view[e.offset : e.offset + e.chunk_bytes]
            if e.chunk_bytes == e.total_bytes:
                out.append((e.name, piece.view(dtype).view(e.shape)))
                self.aliases_view = True
                continue
            if e.chunk_offset == 0:
                key = (e.name, e.total_bytes, str(view.device))
                if key not in self._scratch:
                    self._scratch[key] = torch.empty(e.total_bytes, dtype=torch.uint8, device=view.device)
                self._partial[e.name] = (self._scratch[key], 0)
            elif e.name not in self._partial:
                raise ValueError(f"chunk of {e.name!r} at byte {e.chunk_offset} arrived without its start")
            buf, got = self._partial[e.name]
            copy_bytes(buf, e.chunk_offset, view, e.offset, e.chunk_bytes)
            got += e.chunk_bytes
            if got == e.total_bytes:
                del self._partial[e.name]
                out.append((e.name, buf.view(dtype).view(e.shape)))
            else:
                self._partial[e.name] = (buf, got)
        return out
