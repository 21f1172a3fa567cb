"""Encode what changed in one tensor since its baseline, and apply it: exact on bit patterns, chunk by chunk.

The diff runs where the baseline lives, in chunks that stay in cache (an fp32 trainer chunk is cast to the
engine's dtype first, the cast fused into the same pass), so a sync reads the new tensor and the baseline
once. The apply runs where the destination lives, with torch ops that exist on every device.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from hwsync.delta import bits, digest as dg
from hwsync.delta.header import BITMAP, BLOCK, BLOCKS, DENSE, SAME, DeltaHeader, blocks, int_view, pad8, \
    payload_bytes, smallest_code
from hwsync.manifest import WIRE_DTYPES, dtype_name

#: elements per chunk of the diff: a multiple of BLOCK; 2 Mi bf16 elements is 4 MiB per operand, measured best here
CHUNK_ELEMS = 1 << 21
_APPLY_BLOCKS = 64  # blocks (4 Mi elements) per scatter when applying: bounds the index temporaries
_APPLY_WORDS = 1 << 16  # bitmap words (4 Mi elements) per scatter


def to_engine_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype` as the engine's loader stores it (`param.data.copy_(loaded)`): the same op."""
    if tensor.dtype == dtype:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
    out.copy_(tensor)
    return out


@dataclass(frozen=True)
class Delta:
    """One encoded tensor: its header and its payload (flat uint8; for dense, may be a view of the new tensor).

    `changed` is the number of changed elements found, or None when the scan stopped early because dense
    had already won.
    """

    header: DeltaHeader
    payload: torch.Tensor
    changed: int | None


def _dense_from(numel: int, itemsize: int) -> int:
    """The fewest changes at which no sparse code is smaller than dense (payload sizes grow with changes)."""
    lo, hi = 1, max(1, numel)
    while lo < hi:
        mid = (lo + hi) // 2
        if min(payload_bytes(c, numel, mid, itemsize) for c in (BLOCKS, BITMAP)) >= numel * itemsize:
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Scratch:
    """Chunk buffers of one device and dtype, kept across tensors and syncs (no page faults per chunk)."""

    def __init__(self, elems: int, dtype: torch.dtype, device: torch.device) -> None:
        ints = int_view(dtype)
        self.xor = torch.empty(elems, dtype=ints, device=device)
        self.mask = torch.empty(elems, dtype=torch.bool, device=device)
        self.words = torch.empty(elems // 8, dtype=torch.int64, device=device)
        self.packed = torch.empty(elems // 8, dtype=torch.uint8, device=device)
        self.cast = torch.empty(elems, dtype=dtype, device=device)


def _as_words(x: torch.Tensor) -> torch.Tensor:
    """An integer chunk's bytes as int64 words (a zero-padded copy when its length is not whole words)."""
    raw = x.view(torch.uint8)
    if raw.numel() % 8 == 0:
        return raw.view(torch.int64)
    padded = torch.zeros(pad8(raw.numel()), dtype=torch.uint8, device=raw.device)
    padded[: raw.numel()] = raw
    return padded.view(torch.int64)


class DeltaEncoder:
    """Diffs new tensors against baselines; holds the chunk buffers, so keep one per sending thread."""

    def __init__(self, chunk_elems: int = CHUNK_ELEMS) -> None:
        if chunk_elems <= 0 or chunk_elems % BLOCK:
            raise ValueError(f"chunk_elems must be a positive multiple of {BLOCK}, got {chunk_elems}")
        self.chunk_elems = chunk_elems
        self._scratch: dict[tuple[torch.device, torch.dtype], _Scratch] = {}

    def _buffers(self, dtype: torch.dtype, device: torch.device) -> _Scratch:
        key = (device, dtype)
        if key not in self._scratch:
            self._scratch[key] = _Scratch(self.chunk_elems, dtype, device)
        return self._scratch[key]

    def _changed(self, a: torch.Tensor, b: torch.Tensor, s: _Scratch) -> torch.Tensor:
        """Sorted chunk-local positions where the bit patterns of `a` and `b` differ."""
        if a.device.type != "cpu":
            return torch.nonzero(a != b).view(-1)
        n = a.numel()
        x = torch.bitwise_xor(a, b, out=s.xor[:n])
        padded = (n + 63) // 64 * 64
        s.mask[:n].copy_(x)  # int -> bool: non-zero where any bit differs (a vectorised cast; `!=` is not)
        if padded > n:
            s.mask[n:padded].zero_()
        packed = bits.pack_mask_into(s.mask[:padded], s.packed, s.words)
        return bits.set_positions(packed.view(torch.int64))

    def encode(self, new: torch.Tensor, base: torch.Tensor, *, base_digest: int | None = None,
               name: str = "tensor") -> Delta:
        """Encode `new` against `base` (the engine's dtype, which `new` is cast to) in the smallest code.

        `base_digest` is `tensor_digest(base)`, kept with the baseline: given, the new digest is updated
        from the changed words only; without it the new tensor is hashed whole.
        """
        if new.numel() != base.numel():
            raise ValueError(f"{name}: the new tensor has {new.numel()} elements, its baseline {base.numel()}: "
                             "a changed shape needs a full sync")
        dtype, n = base.dtype, base.numel()
        size, ints = dtype.itemsize, int_view(dtype, name)
        wire = dtype_name(dtype)
        base_i = base.contiguous().view(-1).view(ints)
        new_flat = new.contiguous().view(-1)
        direct = new.dtype == dtype and new.device == base.device
        new_i = new_flat.view(ints) if direct else None
        cap = _dense_from(n, size)
        s = self._buffers(dtype, base.device)
        offsets: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        counts: list[torch.Tensor] = []
        found, gained = 0, 0
        per_word = 8 // size
        for start in range(0, n, self.chunk_elems):
            stop = min(n, start + self.chunk_elems)
            if direct:
                a = new_i[start:stop]
            else:
                a = s.cast[: stop - start]
                a.copy_(new_flat[start:stop])
                a = a.view(ints)
            b = base_i[start:stop]
            pos = self._changed(a, b, s)
            found += pos.numel()
            if found >= cap:  # no sparse code can beat dense any more: stop scanning
                return self._dense(new, dtype, wire, n, name)
            counts.append(torch.bincount(pos >> 16, minlength=blocks(stop - start)))
            if pos.numel():
                values.append(a.index_select(0, pos))
                offsets.append(pos.to(torch.int16))  # keeps the low 16 bits: the offset in the block
                if base_digest is not None:
                    words = torch.unique_consecutive(pos // per_word)
                    gained += dg.word_delta(words + start * size // 8, _as_words(b).index_select(0, words),
                                            _as_words(a).index_select(0, words))
        if base_digest is None:
            new_digest = dg.tensor_digest(to_engine_dtype(new, dtype) if found else base)
        else:
            new_digest = (base_digest + gained) % (1 << 64)
        code = smallest_code(n, found, size)
        header = DeltaHeader(code, wire, n, found, new_digest)
        if code == SAME:
            return Delta(header, torch.empty(0, dtype=torch.uint8, device=base.device), 0)
        if code == DENSE:
            return self._dense(new, dtype, wire, n, name, new_digest, found)
        payload = torch.empty(payload_bytes(code, n, found, size), dtype=torch.uint8, device=base.device)
        at = 0
        if code == BLOCKS:
            nb = blocks(n)
            payload[: 4 * nb].view(torch.int32).copy_(torch.cat(counts))
            at = pad8(4 * nb)
            payload[4 * nb: at].zero_()
            torch.cat(offsets, out=payload[at: at + 2 * found].view(torch.int16))
            at, end = pad8(at + 2 * found), at + 2 * found
        else:
            positions = _positions_from_blocks(torch.cat(counts), torch.cat(offsets), found)
            end = (n + 7) // 8
            acc = torch.zeros(end, dtype=torch.int32, device=base.device)
            acc.index_add_(0, positions >> 3, (torch.ones_like(positions) << (positions & 7)).to(torch.int32))
            payload[:end].copy_(acc)  # each byte's bits are distinct: their sum is their OR
            at = pad8(end)
        payload[end:at].zero_()
        torch.cat(values, out=payload[at:].view(ints))
        return Delta(header, payload, found)

    def _dense(self, new: torch.Tensor, dtype: torch.dtype, wire: str, n: int, name: str,
               new_digest: int | None = None, changed: int | None = None) -> Delta:
        engine = to_engine_dtype(new, dtype).contiguous()
        if new_digest is None:
            new_digest = dg.tensor_digest(engine)
        return Delta(DeltaHeader(DENSE, wire, n, n, new_digest), engine.view(-1).view(torch.uint8), changed)


_local = threading.local()


def encode(new: torch.Tensor, base: torch.Tensor, *, base_digest: int | None = None, name: str = "tensor") -> Delta:
    """`DeltaEncoder.encode` with this thread's encoder."""
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        encoder = _local.encoder = DeltaEncoder()
    return encoder.encode(new, base, base_digest=base_digest, name=name)


# ---------------------------------------------------------------- apply


def _section(payload: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of `dtype` at byte `start` of the payload (copied when not aligned for `dtype`)."""
    raw = payload[start: start + count * dtype.itemsize]
    if raw.data_ptr() % dtype.itemsize == 0 and raw.storage_offset() % dtype.itemsize == 0:
        return raw.view(dtype)
    return raw.clone().view(dtype)


def _positions_from_blocks(counts: torch.Tensor, offsets: torch.Tensor, total: int,
                           first_block: int = 0) -> torch.Tensor:
    """Flat positions of the block code: each block's start repeated `count` times plus the uint16 offsets."""
    starts = (torch.arange(counts.numel(), dtype=torch.int64, device=counts.device) + first_block) * BLOCK
    rep = torch.repeat_interleave(starts, counts.to(torch.int64), output_size=total)
    return rep.add_(offsets.to(torch.int64).bitwise_and_(0xFFFF))


def _check(dest: torch.Tensor, header: DeltaHeader, payload: torch.Tensor, name: str) -> torch.dtype:
    if dtype_name(dest.dtype) != header.dtype or dest.numel() != header.numel:
        raise ValueError(f"{name}: the delta is for {header.numel} elements of {header.dtype}, the destination "
                         f"holds {dest.numel()} of {dtype_name(dest.dtype)}: it is not this delta's base")
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != header.nbytes:
        raise ValueError(f"{name}: a {header.code} delta of {header.count} values needs a flat uint8 payload of "
                         f"{header.nbytes} bytes, got {payload.dtype} of shape {tuple(payload.shape)}")
    return int_view(dest.dtype, name)


def apply_into(dest: torch.Tensor, header: DeltaHeader, payload: torch.Tensor, *, name: str = "tensor") -> None:
    """Write the changed elements into `dest` (the delta's base) in place, on whatever device it lives."""
    ints = _check(dest, header, payload, name)
    if header.code == SAME:
        return
    target = dest if dest.is_contiguous() else dest.contiguous()
    flat = target.view(-1).view(ints)
    size, n, k = dest.dtype.itemsize, header.numel, header.count
    if header.code == DENSE:
        flat.copy_(_section(payload, 0, n, ints))
    elif header.code == BLOCKS:
        nb = blocks(n)
        counts_host = _section(payload, 0, nb, torch.int32).cpu()  # small: one int per 65536 elements
        ends = counts_host.to(torch.int64).cumsum(0).tolist()
        if ends[-1] != k:
            raise ValueError(f"{name}: the block counts of the delta add up to {ends[-1]}, its header says {k}")
        data = payload.to(flat.device)
        counts = _section(data, 0, nb, torch.int32)
        offsets = _section(data, pad8(4 * nb), k, torch.int16)
        values = _section(data, pad8(4 * nb) + pad8(2 * k), k, ints)
        last = n - (nb - 1) * BLOCK
        tail = offsets[(ends[-2] if nb > 1 else 0):].to(torch.int64).bitwise_and_(0xFFFF)
        if tail.numel() and int(tail.max()) >= last:  # checked here: on a GPU a bad index is a device assert
            raise ValueError(f"{name}: the delta's last block has an offset past the tensor's {n} elements")
        for b0 in range(0, nb, _APPLY_BLOCKS):
            b1 = min(nb, b0 + _APPLY_BLOCKS)
            c0, c1 = (ends[b0 - 1] if b0 else 0), ends[b1 - 1]
            if c1 > c0:
                pos = _positions_from_blocks(counts[b0:b1], offsets[c0:c1], c1 - c0, b0)
                flat.index_copy_(0, pos, values[c0:c1])
    else:
        data = payload.to(flat.device)
        nwords = pad8((n + 7) // 8) // 8
        words = _section(data, 0, nwords, torch.int64)
        if n % 64 and bool(bits.unpack_bits(words[-1:].view(torch.uint8), 64)[n % 64:].any()):
            raise ValueError(f"{name}: the delta's bitmap has bits set past the tensor's {n} elements")
        values = _section(data, pad8((n + 7) // 8), k, ints)
        done = 0
        for w0 in range(0, nwords, _APPLY_WORDS):
            pos = bits.set_positions(words[w0: w0 + _APPLY_WORDS]).add_(w0 * 64)
            if done + pos.numel() > k:
                raise ValueError(f"{name}: the delta's bitmap marks more than the {k} elements it carries")
            flat.index_copy_(0, pos, values[done: done + pos.numel()])
            done += pos.numel()
        if done != k:
            raise ValueError(f"{name}: the delta's bitmap marks {done} elements, its header says {k}")
    if target is not dest:
        dest.copy_(target)


def advance(baseline: torch.Tensor, header: DeltaHeader, payload: torch.Tensor, *, name: str = "tensor") -> None:
    """Move a sender's baseline to the new version after a committed sync: only the changes are written."""
    apply_into(baseline, header, payload, name=name)


def apply_to_copy(base: torch.Tensor, header: DeltaHeader, payload: torch.Tensor, *,
                  name: str = "tensor") -> torch.Tensor:
    """A new tensor: `base` with the delta applied (`base` is left as it is)."""
    ints = _check(base, header, payload, name)
    if header.code == DENSE:
        out = torch.empty(base.shape, dtype=base.dtype, device=base.device)
        out.view(-1).view(ints).copy_(_section(payload, 0, header.numel, ints))
        return out
    out = base.clone(memory_format=torch.contiguous_format)
    apply_into(out, header, payload, name=name)
    return out


def verify(tensor: torch.Tensor, header: DeltaHeader) -> bool:
    """Whether `tensor` (a destination after applying) has the digest the sender computed for it."""
    return dg.tensor_digest(tensor) == header.digest
