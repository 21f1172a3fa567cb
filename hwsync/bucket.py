"""Packing named tensors into flat byte buckets, and taking them out again.

Where each tensor's bytes go is decided by one rule (BucketPacker), which both the same-host
sender and the disaggregated plan follow; each placement is a protocol.Entry. A tensor that
fits a bucket is never split, so the receiver can hand out zero-copy views; a tensor larger
than a bucket is cut into chunks over consecutive buckets and reassembled on the receiving
side before anyone sees it (BucketReader). Bucket size is a performance knob, never a limit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hwsync.manifest import TensorSpec, dtype_from_name
from hwsync.protocol import Entry

#: into(name, dtype, shape): the caller's own tensor to receive straight into, or None
IntoFn = Callable[[str, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]
#: load(pairs): a receiver's callback, called with each bucket's complete (name, tensor) pairs
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]
#: on_start(version, manifest): a receiver's hook once the sync is announced, before any byte moves
StartFn = Callable[[int, "list[TensorSpec] | None"], None]

#: byte alignment of every entry: enough for any dtype view and for device copy engines
ALIGN = 256


def align_up(n: int, to: int = ALIGN) -> int:
    """Round `n` up to a multiple of `to`."""
    return (n + to - 1) // to * to


def copy_bytes(dst: torch.Tensor, dst_offset: int, src: torch.Tensor, src_offset: int, nbytes: int,
               non_blocking: bool = False) -> None:
    """Copy `nbytes` between flat uint8 tensors; a plain memmove when both are in host memory.

    torch's copy_ costs ~3 us of dispatch per call and copies cache-resident bytes ~30% slower
    than libc's memmove; with thousands of MiB-sized buckets per sync both show. `non_blocking`
    lets a device copy to or from pinned host memory return before it is done: only for callers
    that wait for the device before the bytes are read or the source changes (a sender's publish).
    """
    if not nbytes:
        return
    if dst.device.type == "cpu" and src.device.type == "cpu":
        if dst_offset + nbytes > dst.numel() or src_offset + nbytes > src.numel():
            raise IndexError(f"copy of {nbytes} bytes runs past a tensor's end")
        ctypes.memmove(dst.data_ptr() + dst_offset, src.data_ptr() + src_offset, nbytes)
    else:
        dst[dst_offset : dst_offset + nbytes].copy_(src[src_offset : src_offset + nbytes], non_blocking=non_blocking)


def checked_destination(name: str, dtype: torch.dtype, shape: tuple[int, ...], dest: torch.Tensor | None
                        ) -> torch.Tensor | None:
    """What into(name) returned as flat bytes, or None; ValueError naming the tensor unless it matches."""
    if dest is None:
        return None
    if dest.dtype != dtype or tuple(dest.shape) != shape:
        raise ValueError(f"into({name!r}) gave a {dest.dtype} tensor of shape {tuple(dest.shape)}, "
                         f"but the sender sent {dtype} of shape {shape}; return a matching tensor "
                         "or None to get this one through load")
    if not dest.is_contiguous():
        raise ValueError(f"into({name!r}) gave a non-contiguous tensor; return a contiguous one "
                         "or None to get this one through load")
    return dest.detach().reshape(-1).view(torch.uint8)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's data (a contiguous copy first if it is strided)."""
    if hasattr(tensor, "full_tensor"):  # a DTensor: materialise the global tensor, one at a time
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def entry_wire_bytes(name: str, ndim: int) -> int:
    """An upper bound of one entry's size in a msgpack frame."""
    return len(name.encode()) + 10 * ndim + 80


@dataclass(frozen=True)
class Piece:
    """Copy `entry.chunk_bytes` from byte `entry.chunk_offset` of the tensor to `entry.offset` of the open bucket."""

    entry: Entry


@dataclass(frozen=True)
class Closed:
    """The open bucket is complete: post it (`nbytes` used, laid out as `entries`)."""

    nbytes: int
    entries: list[Entry]


class BucketPacker:
    """The one packing rule, for the colocated sender's stream and the disaggregated plan alike.

    `place` says, for one tensor, where each of its pieces goes and when a bucket is complete:
    - a tensor that fits a bucket is never split: if it does not fit what is left, the open
      bucket is closed first (so receivers get it as a zero-copy view);
    - a larger tensor is cut over consecutive buckets, and its tail ends its bucket (that bucket
      then holds no views, so a receiver may release it before loading the reassembled tensor);
    - `dense` (every receiver copies into its own tensors: nothing is viewed or reassembled)
      drops both rules: every bucket is filled to the end;
    - a bucket is closed as soon as it is full, so it can be posted before the next tensor is
      even produced; `max_wire_bytes` also bounds its entries as a frame (a doorbell slot).
    """

    def __init__(self, bucket_bytes: int, *, dense: bool = False, max_wire_bytes: int | None = None) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes} is below the minimum of {ALIGN}")
        self.bucket_bytes = bucket_bytes
        self.dense = dense
        self.max_wire_bytes = max_wire_bytes
        #: entries and used bytes of the open bucket
        self.entries: list[Entry] = []
        self.used = 0
        self._wire_bytes = 0

    def _full(self, next_entry_bytes: int) -> bool:
        if self.max_wire_bytes is not None and self._wire_bytes + next_entry_bytes > self.max_wire_bytes:
            return True
        return align_up(self.used) >= self.bucket_bytes

    def close(self) -> Closed | None:
        """Close the open bucket (None when it holds nothing)."""
        if not self.entries:
            return None
        closed = Closed(self.used, self.entries)
        self.entries, self.used, self._wire_bytes = [], 0, 0
        return closed

    def place(self, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> list[Piece | Closed]:
        """The pieces of one tensor and the buckets closed around them, in order."""
        entry_bytes = entry_wire_bytes(name, len(shape))
        if self.max_wire_bytes is not None and entry_bytes > self.max_wire_bytes // 2:
            raise ValueError(f"tensor name of {len(name)} characters is too long for a bucket descriptor "
                             f"({self.max_wire_bytes // 2 - 10 * len(shape) - 80} at most); shorten the name")
        steps: list[Piece | Closed] = []
        whole_fits = nbytes <= self.bucket_bytes
        if self.entries and (self._full(entry_bytes) or (
                not self.dense and whole_fits and align_up(self.used) + nbytes > self.bucket_bytes)):
            steps.append(self.close())  # type: ignore[arg-type]
        done, pieces = 0, 0
        while True:
            start = align_up(self.used)
            take = min(self.bucket_bytes - start, nbytes - done)
            entry = Entry(name, dtype, shape, start, done, take, nbytes)
            self.entries.append(entry)
            self._wire_bytes += entry_bytes
            self.used = start + take
            steps.append(Piece(entry))
            done, pieces = done + take, pieces + 1
            if done >= nbytes:
                break
            steps.append(self.close())  # type: ignore[arg-type]  # full: the tensor goes on in the next bucket
        if self._full(entry_bytes) or (pieces > 1 and not self.dense):
            steps.append(self.close())  # type: ignore[arg-type]  # full, or a split tensor's tail ends its bucket
        return steps


class BucketReader:
    """Turns received buckets back into complete (name, tensor) pairs.

    A split tensor is reassembled into a scratch tensor that is kept and reused by the next
    sync: writing into fresh memory every step costs as much as the copy itself (page faults),
    so a reassembled tensor is valid until the next sync begins. Scratch lives on the receiver's
    own device (the one `begin` names; the view's device when none is named), not on the device
    of the buffer it is copied from, which may be another process's; scratch that a sync did not
    use is freed when the next one begins, and all of it at `clear`. With `into`, a tensor whose
    destination the caller names is copied there chunk by chunk and never reassembled.
    """

    def __init__(self) -> None:
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}
        self._scratch: dict[tuple[str, int, str], torch.Tensor] = {}
        self._used: set[tuple[str, int, str]] = set()
        self._device: torch.device | None = None
        #: destinations of tensors being received `into` (flat bytes), or None where declined
        self._into: dict[str, torch.Tensor | None] = {}
        #: whether the last read() returned a view into its buffer (else it may be released early)
        self.aliases_view = False

    def begin(self, device: torch.device | None = None) -> None:
        """Start a new sync reassembling on `device`: forget partial tensors of an abandoned one, and
        free scratch the last sync did not use (what it used stays, for reuse)."""
        self._partial = {}
        self._into = {}
        self._device = device
        self._scratch = {key: t for key, t in self._scratch.items() if key in self._used}
        self._used = set()

    def clear(self) -> None:
        """Free every scratch tensor (the receiver is closing); reassembled tensors handed out stay valid."""
        self._partial, self._into, self._scratch, self._used = {}, {}, {}, set()

    def _destination(self, e: Entry, dtype: torch.dtype, into: IntoFn) -> torch.Tensor | None:
        """The caller's tensor for this entry as flat bytes (asked once per tensor), or None."""
        if e.chunk_offset == 0:
            self._into[e.name] = checked_destination(e.name, dtype, e.shape, into(e.name, dtype, e.shape))
        return self._into.get(e.name)

    def pending(self) -> list[str]:
        """Names of tensors whose chunks have not all arrived."""
        return list(self._partial)

    def read(self, view: torch.Tensor, entries: list[Entry], into: IntoFn | None = None
             ) -> list[tuple[str, torch.Tensor]]:
        """Complete tensors of one bucket for `load`; whole ones are zero-copy views into `view`.

        Tensors `into` gives a destination for are copied there and left out of the result.
        """
        out: list[tuple[str, torch.Tensor]] = []
        self.aliases_view = False
        for e in entries:
            dtype = dtype_from_name(e.dtype)
            if into is not None:
                dest = self._destination(e, dtype, into)
                if dest is not None:
                    copy_bytes(dest, e.chunk_offset, view, e.offset, e.chunk_bytes)
                    if e.is_last:
                        del self._into[e.name]
                    continue
            if e.total_bytes == 0:
                out.append((e.name, torch.empty(e.shape, dtype=dtype, device=view.device)))
                continue
            piece = view[e.offset : e.offset + e.chunk_bytes]
            if e.is_whole:
                out.append((e.name, piece.view(dtype).view(e.shape)))
                self.aliases_view = True
                continue
            if e.chunk_offset == 0:
                where = self._device or view.device
                key = (e.name, e.total_bytes, str(where))
                if key not in self._scratch:
                    self._scratch[key] = torch.empty(e.total_bytes, dtype=torch.uint8, device=where)
                self._used.add(key)
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
