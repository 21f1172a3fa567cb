"""Apply an encoded tensor where the destination lives, with torch ops that exist on every device.

On the host, where numba is installed, one compiled pass (kernels.py) scatters a bitmap's or a block code's
changes, and one (kernels16.py) a step code's, checked against its base's values as it writes; every other device
uses torch ops (repeat_interleave, index_copy_, cumsum), a few Mi elements at a time.
Either can also sum what the destination's digest gains, from the values it found and wrote: a receiver
then checks a delta by reading the changed elements only (receiver.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hwsync.delta import bits, digest as dg, native, steps
from hwsync.delta.header import BLOCK, BLOCKS, DENSE, SAME, STEPS, DeltaHeader, blocks, int_view, pad8
from hwsync.sync.spec import dtype_name

_APPLY_BLOCKS = 64  # blocks (4 Mi elements) per scatter: bounds the index temporaries
_APPLY_WORDS = 1 << 16  # bitmap words (4 Mi elements) per scatter


def _section(payload: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of `dtype` at byte `start` of the payload (copied when not aligned for `dtype`)."""
    raw = payload[start: start + count * dtype.itemsize]
    if raw.data_ptr() % dtype.itemsize == 0 and raw.storage_offset() % dtype.itemsize == 0:
        return raw.view(dtype)
    return raw.clone().view(dtype)


def positions_from_blocks(counts: torch.Tensor, offsets: torch.Tensor, total: int,
                          first_block: int = 0) -> torch.Tensor:
    """Flat positions of the block code: each block's start repeated `count` times plus the uint16 offsets."""
    # built on the host and moved: small, and arange is not implemented on every device (not on the sim)
    starts = ((torch.arange(counts.numel(), dtype=torch.int64) + first_block) * BLOCK).to(counts.device)
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


def _scatter_bits(flat: torch.Tensor, words: torch.Tensor, values: torch.Tensor, k: int, name: str,
                  gain: bool) -> int:
    """Write `values` in order where the bitmap's bits are set, a few Mi elements at a time; the digest's gain."""
    done, total = 0, 0
    for w0 in range(0, words.numel(), _APPLY_WORDS):
        pos = bits.set_positions(words[w0: w0 + _APPLY_WORDS]).add_(w0 * 64)
        if done + pos.numel() > k:
            raise ValueError(f"{name}: the delta's bitmap marks more than the {k} elements it carries")
        total += _write(flat, pos, values[done: done + pos.numel()], gain)
        done += pos.numel()
    if done != k:
        raise ValueError(f"{name}: the delta's bitmap marks {done} elements, its header says {k}")
    return total


def _write(flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, gain: bool) -> int:
    """flat[pos] = values; with `gain`, what the digest gains from the values found there to the values written."""
    old = flat.index_select(0, pos) if gain else None
    flat.index_copy_(0, pos, values)
    return dg.element_delta(pos, old, values) if old is not None else 0


def apply_into(dest: torch.Tensor, header: DeltaHeader, payload: torch.Tensor, *, name: str = "tensor",
               gain: bool = False) -> int | None:
    """Write the changed elements into `dest` (the delta's base) in place, on whatever device it lives.

    With `gain`, returns what the destination's digest gained: the terms of the values found at the changed
    positions and of the values written (digest.element_delta), so `held digest + gain` is the new digest
    without reading the rest of the tensor; None for a dense delta (the whole tensor: digest it).
    """
    ints = _check(dest, header, payload, name)
    if header.code == SAME:
        return 0
    target = dest if dest.is_contiguous() else dest.contiguous()
    flat = target.view(-1).view(ints)
    n, k = header.numel, header.count
    found: int | None = 0
    if header.code == DENSE:
        flat.copy_(_section(payload, 0, n, ints))
        found = None
    elif header.code == STEPS:
        found = _apply_steps(flat, header, payload, name, gain)
    elif header.code == BLOCKS:
        nb = blocks(n)
        counts_host = _section(payload, 0, nb, torch.int32).cpu()  # small: one int per 65536 elements
        ends = counts_host.to(torch.int64).cumsum(0).tolist()
        if ends[-1] != k or int(counts_host.min()) < 0:
            raise ValueError(f"{name}: the block counts of the delta add up to {ends[-1]}, its header says {k}")
        data = payload.to(flat.device)
        counts = _section(data, 0, nb, torch.int32)
        offsets = _section(data, pad8(4 * nb), k, torch.int16)
        values = _section(data, pad8(4 * nb) + pad8(2 * k), k, ints)
        last = n - (nb - 1) * BLOCK
        tail = offsets[(ends[-2] if nb > 1 else 0):].to(torch.int64).bitwise_and_(0xFFFF)
        if tail.numel() and int(tail.max()) >= last:  # checked here: on a GPU a bad index is a device assert
            raise ValueError(f"{name}: the delta's last block has an offset past the tensor's {n} elements")
        scatter = native.scatter_blocks() if flat.device.type == "cpu" and native.ready() else None
        if scatter is not None:  # on the host, one compiled pass over the changes
            keys, rows = dg.host_keys(flat.numel() * flat.element_size())
            found = scatter(counts.numpy(), offsets.numpy().view("uint16"), values.numpy(), 0, flat.numpy(), keys,
                            rows, gain)
        else:
            acc = 0
            for b0 in range(0, nb, _APPLY_BLOCKS):
                b1 = min(nb, b0 + _APPLY_BLOCKS)
                c0, c1 = (ends[b0 - 1] if b0 else 0), ends[b1 - 1]
                if c1 > c0:
                    pos = positions_from_blocks(counts[b0:b1], offsets[c0:c1], c1 - c0, b0)
                    acc += _write(flat, pos, values[c0:c1], gain)
            found = acc
    else:
        data = payload.to(flat.device)
        nwords = pad8((n + 7) // 8) // 8
        words = _section(data, 0, nwords, torch.int64)
        if n % 64 and bool(bits.unpack_bits(words[-1:].view(torch.uint8), 64)[n % 64:].any()):
            raise ValueError(f"{name}: the delta's bitmap has bits set past the tensor's {n} elements")
        values = _section(data, pad8((n + 7) // 8), k, ints)
        scatter_bits = native.scatter_bits() if flat.device.type == "cpu" and native.ready() else None
        if scatter_bits is not None:  # on the host, one compiled pass over the bits
            keys, rows = dg.host_keys(flat.numel() * flat.element_size())
            done, found = scatter_bits(words.view(torch.uint8).numpy(), values.numpy(), flat.numpy(), keys, rows, gain)
            if done != k:
                raise ValueError(f"{name}: the delta's bitmap marks {done} elements, its header says {k}")
        else:
            found = _scatter_bits(flat, words, values, k, name, gain)
    if target is not dest:
        dest.copy_(target)
    return None if found is None else found % (1 << 64)


_STEP_ERRORS = {-1: "a filler of its step code carries a difference", -2: "its steps run past the tensor's end",
                -3: "its step code's escapes and raw values disagree"}


class BaseMismatch(ValueError):
    """A step code's changes found other values than the ones its differences were taken from: not its base."""


def _apply_steps(flat: torch.Tensor, header: DeltaHeader, payload: torch.Tensor, name: str, gain: bool) -> int:
    """Write a step code's changes into `flat` (int16), all checked first (the base's values at the changes
    included); the digest's gain."""
    scatter = native.scatter_steps() if flat.device.type == "cpu" and native.ready() else None
    if scatter is not None:  # on the host, compiled passes: check the payload, check the base, write
        return _scatter_steps_host(scatter, flat, header, payload.to(flat.device).numpy(), name, gain)
    count = header.count
    escapes, olds = (int(v) for v in _section(payload, 0, 2, torch.int64).cpu())
    if not 0 <= escapes <= count:
        raise ValueError(f"{name}: the delta's step code says {escapes} escapes in {count} units")
    olds %= 1 << 64
    data = payload.to(flat.device)
    units = _section(data, 16, count - escapes, torch.int16)
    raws = _section(data, 16 + 2 * (count - escapes), escapes, torch.int16)
    pos, byte, escaped = steps.decode_units(units, raws, header.numel, name)
    if pos.numel() == 0:
        return 0
    old = flat.index_select(0, pos)
    if steps.old_terms(pos, old) != olds:
        raise BaseMismatch(f"{name}: the values at the delta's changes are not the ones it was taken from: this "
                           "copy is not the delta's base")
    return _write(flat, pos, steps.new_values(old, byte, escaped, raws), gain)


def _scatter_steps_host(scatter: Callable[..., tuple[int, int]], flat: torch.Tensor, header: DeltaHeader,
                        raw: np.ndarray, name: str, gain: bool) -> int:
    """The compiled scatter of a host payload (`raw`, uint8), its sections read as numpy views: a torch view per
    section cost more Python than the scatter of a small tensor."""
    count = header.count
    escapes, olds = (int(v) for v in _np_section(raw, 0, 2, np.int64))
    if not 0 <= escapes <= count:
        raise ValueError(f"{name}: the delta's step code says {escapes} escapes in {count} units")
    units = _np_section(raw, 16, count - escapes, np.int16)
    raws = _np_section(raw, 16 + 2 * (count - escapes), escapes, np.int16)
    keys, rows = dg.host_keys(flat.numel() * flat.element_size())
    status, found = scatter(units, raws, olds, flat.numpy(), keys, rows, gain)
    if status == -4:
        raise BaseMismatch(f"{name}: the values at the delta's changes are not the ones it was taken from: "
                           "this copy is not the delta's base")
    if status:
        raise ValueError(f"{name}: the delta is malformed: {_STEP_ERRORS.get(status, status)}")
    return int(found)


def _np_section(raw: np.ndarray, start: int, count: int, dtype: type[np.generic]) -> np.ndarray:
    """`count` elements of `dtype` at byte `start` of `raw` (copied when not aligned for `dtype`)."""
    piece = raw[start: start + count * np.dtype(dtype).itemsize].view(dtype)
    return piece if piece.flags.aligned else piece.copy()


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
