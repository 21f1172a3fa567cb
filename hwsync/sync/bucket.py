"""Packing named tensors into flat byte buckets, and taking them out again.

Where each tensor's bytes go is decided by one rule (BucketPacker), which both the same-host
sender and the disaggregated plan follow; each placement is a protocol.Entry. A tensor that
fits a bucket is never split, so the receiver can hand out zero-copy views; a tensor larger
than a bucket is cut into chunks over consecutive buckets and reassembled on the receiving
side before anyone sees it (BucketReader). Bucket size is a performance knob, never a limit.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hwsync.errors import DestinationError
from hwsync.protocol import Entry
from hwsync.sync.host_copy import Moves
from hwsync.sync.spec import dtype_from_name

#: into(name, dtype, shape): the caller's own tensor to receive straight into, or None
IntoFn = Callable[[str, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]
#: load(pairs): a receiver's callback, called with each bucket's complete (name, tensor) pairs
LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]

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


#: views hwsync lends to a `load` callback (of a bucket buffer, of a sender's mapped memory), by id: valid during
#: the call only, so a WeightSender fed from them (LocalForwarder) copies each at once and never reads one in place
_LENT: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def lend(tensor: torch.Tensor) -> torch.Tensor:
    """Mark `tensor` as memory hwsync lends for one `load` call (it is reused, or changed, once the call returns)."""
    _LENT[id(tensor)] = tensor
    return tensor


def lent(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a view hwsync lent to a `load` call (see lend)."""
    return _LENT.get(id(tensor)) is tensor


#: integer dtypes by width: a batch of byte copies goes as views of the widest one its offsets allow
_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class CopyBatch:
    """Byte copies between flat uint8 tensors, gathered into as few launches as the devices allow.

    Each launch from Python costs ~20 us on a GPU (a 4 GB sync of 458 tensors spent 10 ms packing), so the
    device pieces of one bucket go together: pieces whose two sides lie on one device wait for `flush`,
    which copies them with one torch._foreach_copy_ per device and width (a multi-tensor kernel on CUDA and
    the NPU, issued from C++), over views of the widest integer type all their offsets and lengths allow.
    Host-to-host pieces are memmoves at once (no launch to save); a piece between host and device is a
    copy_ at once (foreach has no fast path across devices). Sources must stay unchanged until `flush`.
    """

    def __init__(self) -> None:
        self._pieces: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._non_blocking = False

    def add(self, dst: torch.Tensor, dst_offset: int, src: torch.Tensor, src_offset: int, nbytes: int,
            non_blocking: bool = False) -> None:
        """Copy `nbytes` from `src[src_offset:]` to `dst[dst_offset:]`, now or at `flush`."""
        if not nbytes:
            return
        if dst.device != src.device or dst.device.type == "cpu":
            copy_bytes(dst, dst_offset, src, src_offset, nbytes, non_blocking=non_blocking)
            return
        self._non_blocking = self._non_blocking or non_blocking
        self._pieces.setdefault(dst.device, []).append(
            (dst[dst_offset: dst_offset + nbytes], src[src_offset: src_offset + nbytes]))

    def __len__(self) -> int:
        return sum(len(pieces) for pieces in self._pieces.values())

    def flush(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Launch the gathered device copies: one foreach copy per device and width (a single piece: a copy_);
        the launches, as (destinations, sources), for a caller that runs them again (a replay)."""
        pieces, self._pieces = self._pieces, {}
        launches = []
        for group in pieces.values():
            by_width: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for dst, src in group:
                width, dtype = next((w, t) for w, t in _WIDE if not (dst.storage_offset() % w or src.storage_offset()
                                                                      % w or dst.numel() % w))
                dsts, srcs = by_width.setdefault(dtype, ([], []))
                dsts.append(dst.view(dtype) if width > 1 else dst)
                srcs.append(src.view(dtype) if width > 1 else src)
            for dsts, srcs in by_width.values():
                launch(dsts, srcs, self._non_blocking)
                launches.append((dsts, srcs))
        self._non_blocking = False
        return launches


def launch(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
    """Copy each source into its destination, one launch (a foreach copy; a single pair: a copy_)."""
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0], non_blocking=non_blocking)
    else:
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def checked_destination(name: str, dtype: torch.dtype, shape: tuple[int, ...], dest: torch.Tensor | None
                        ) -> torch.Tensor | None:
    """What into(name) returned as flat bytes, or None; DestinationError naming the tensor unless it matches."""
    dest = matching_destination(name, dtype, shape, dest)
    return None if dest is None else flat_bytes(dest)


def flat_bytes(dest: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view of its bytes (three new tensor objects: a host copy that needs only
    the address takes `data_ptr()` of the tensor itself)."""
    return dest.detach().reshape(-1).view(torch.uint8)


def matching_destination(name: str, dtype: torch.dtype, shape: tuple[int, ...], dest: torch.Tensor | None
                         ) -> torch.Tensor | None:
    """What into(name) returned, or None; DestinationError naming the tensor and both specs unless it is a
    contiguous tensor of exactly `dtype` and `shape` (the full and the delta path check it alike)."""
    if dest is None:
        return None
    # torch.Size equals a tuple of the same ints; only a shape given as a list needs the conversions
    if dest.dtype is not dtype or (dest.shape != shape and tuple(dest.shape) != tuple(shape)):
        raise DestinationError(f"into({name!r}) gave a {dest.dtype} tensor of shape {tuple(dest.shape)}, "
                               f"but the sender sent {dtype} of shape {tuple(shape)}; return a matching tensor "
                               "or None to get this one through load")
    if not dest.is_contiguous():
        raise DestinationError(f"into({name!r}) gave a non-contiguous tensor; return a contiguous one "
                               "or None to get this one through load")
    if dest.is_conj() or dest.is_neg():  # bytes written into its memory would read back conjugated or negated
        raise DestinationError(f"into({name!r}) gave a lazy {'conjugate' if dest.is_conj() else 'negative'} view; "
                               "return the tensor it views, or None to get this one through load")
    return dest


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

    def _destination(self, e: Entry, dtype: torch.dtype, into: IntoFn, record: BucketRecord | None
                     ) -> torch.Tensor | None:
        """The caller's tensor for this entry as flat bytes (asked once per tensor), or None."""
        if e.chunk_offset == 0:
            given = into(e.name, dtype, e.shape)
            self._into[e.name] = checked_destination(e.name, dtype, e.shape, given)
            if record is not None and given is not None:
                record.add_destination(e.name, dtype, tuple(e.shape), given)
        return self._into.get(e.name)

    def pending(self) -> list[str]:
        """Names of tensors whose chunks have not all arrived."""
        return list(self._partial)

    def read(self, view: torch.Tensor, entries: list[Entry], into: IntoFn | None = None,
             record: BucketRecord | None = None) -> list[tuple[str, torch.Tensor]]:
        """Complete tensors of one bucket for `load`; whole ones are zero-copy views into `view`.

        Tensors `into` gives a destination for are copied there and left out of the result; `record` notes each
        destination and each copy out of the bucket (a replay runs them again).
        """
        out: list[tuple[str, torch.Tensor]] = []
        self.aliases_view = False
        batch = CopyBatch()  # the bucket's device copies in one launch (flushed before anyone sees a tensor)
        pieces: list[tuple[torch.Tensor, int, int, int]] = []
        for e in entries:
            dtype = dtype_from_name(e.dtype)
            if into is not None:
                dest = self._destination(e, dtype, into, record)
                if dest is not None:
                    batch.add(dest, e.chunk_offset, view, e.offset, e.chunk_bytes)
                    pieces.append((dest, e.chunk_offset, e.offset, e.chunk_bytes))
                    if e.is_last:
                        del self._into[e.name]
                    continue
            if e.total_bytes == 0:
                out.append((e.name, torch.empty(e.shape, dtype=dtype, device=view.device)))
                continue
            piece = view[e.offset : e.offset + e.chunk_bytes]
            if e.is_whole:  # the buffer is refilled once released: lent for the load call only
                out.append((e.name, lend(piece.view(dtype).view(e.shape))))
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
            batch.add(buf, e.chunk_offset, view, e.offset, e.chunk_bytes)
            got += e.chunk_bytes
            if got == e.total_bytes:
                del self._partial[e.name]
                out.append((e.name, buf.view(dtype).view(e.shape)))
            else:
                self._partial[e.name] = (buf, got)
        batch.flush()
        if record is not None:
            record.buckets.append((view.numel(), pieces))
        return out


class BucketRecord(Protocol):
    """Where BucketReader.read notes what it did, for a replay (hwsync.colocated.replay.ReadPlan)."""

    buckets: list[tuple[int, list[tuple[torch.Tensor, int, int, int]]]]

    def add_destination(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], given: torch.Tensor) -> None:
        """Note a destination `into` gave."""


def replay_bucket(view: torch.Tensor, pieces: list[tuple[torch.Tensor, int, int, int]]) -> None:
    """Copy a recorded bucket's pieces out of `view` again (BucketReader.read's copies, launched together)."""
    batch = CopyBatch()
    for dest, dest_offset, offset, nbytes in pieces:
        batch.add(dest, dest_offset, view, offset, nbytes)
    batch.flush()


def host_moves(pieces: list[tuple[torch.Tensor, int, int, int]]) -> Moves | None:
    """Recorded copies (tensor, offset in it, offset in the buffer, bytes) as Moves (address, buffer offset, bytes),
    for memmoves without a torch call each; None unless every tensor is in host memory. The tensors must stay alive
    and in place (a replay checks it) as long as the moves are used."""
    if any(t.device.type != "cpu" for t, _, _, _ in pieces):
        return None
    for t, at, _, nbytes in pieces:  # flat byte views, or contiguous tensors packed on their address
        if at + nbytes > t.numel() * t.element_size():
            raise IndexError(f"a recorded copy of {nbytes} bytes at {at} runs past a tensor of "
                             f"{t.numel() * t.element_size()} bytes")
    return Moves([(t.data_ptr() + at, offset, nbytes) for t, at, offset, nbytes in pieces])
