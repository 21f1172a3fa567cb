"""Encode what changed in one tensor since its baseline: exact on bit patterns, read once, in cached chunks.

The diff runs where the baseline lives, chunk by chunk (a few MiB, in cache); a trainer's fp32 chunk is
cast to the engine's dtype first, by the loader's own op, in the same pass. On the host, where numba is
installed, one compiled loop per chunk (native.py) emits each change's position and value, counts it in
its block, sets its bit and adds its digest term. Elsewhere (GPU, NPU, or no numba) torch ops do the
same: XOR as integers, pack the change mask to bits, and per span of chunks turn the set bits into sorted
positions and gather the values. Both give the same bytes. Scanning stops as soon as dense has won.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from hwsync.delta import bits, digest as dg, native, steps
from hwsync.delta.header import (
    BLOCKS,
    DENSE,
    SAME,
    STEPS,
    DeltaHeader,
    blocks,
    dense_from,
    int_view,
    pad8,
    payload_bytes,
    smallest_code,
)
from hwsync.delta.host import concat_host, concat_into, keep
from hwsync.delta.room import PayloadRoom
from hwsync.delta.scan import Scan, block_code_from_steps, join, trim_fillers
from hwsync.delta.scratch import Scratch
from hwsync.sync.spec import dtype_name

#: elements per chunk of the diff (a multiple of 65536): 2 Mi bf16 elements, 4 MiB per operand, stay in cache
CHUNK_ELEMS = 1 << 21
#: elements per span: its changes are listed in one go (fewer, larger ops), its values gathered while warm
SPAN_ELEMS = 1 << 24
#: a host tensor of this many elements or more is scanned on two threads (hwsync.delta.scan): a sync's last large
#: tensor (an LM head) would otherwise leave the other encode thread idle
SPLIT_ELEMS = 1 << 23
#: elements per piece of a tensor scanned on two threads (a multiple of the chunk): the helper takes pieces from
#: the end, the encode thread from the start, and when they meet neither waits longer than a piece for the other
#: (with two halves the encode thread once waited 10 ms for a helper that got its core late)
PIECE_ELEMS = 1 << 22


def to_engine_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` in `dtype` as the engine's loader stores it (`param.data.copy_(loaded)`): the same op."""
    if tensor.dtype == dtype:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
    out.copy_(tensor)
    return out


@dataclass(frozen=True)
class Delta:
    """One encoded tensor: header and payload (flat uint8; for dense, possibly a view of the new tensor).

    `changed` is how many elements changed, or None when the scan stopped early because dense had won.
    """

    header: DeltaHeader
    payload: torch.Tensor
    changed: int | None


class DeltaEncoder:
    """Diffs new tensors against baselines; holds the chunk buffers, so keep one per sending thread.

    `engine`: "auto" runs the compiled host kernel (native.py) where numba is installed and the baseline
    is on the host, else torch ops; "torch" or "numba" force one (the output is the same). The compiled
    kernel scans a tensor of `split_elems` or more on two threads, in pieces of `piece_elems`, when `encode` is
    given a `helper` (the same output).
    """

    def __init__(self, chunk_elems: int = CHUNK_ELEMS, span_elems: int = SPAN_ELEMS, engine: str = "auto",
                 split_elems: int = SPLIT_ELEMS, piece_elems: int = PIECE_ELEMS) -> None:
        if chunk_elems <= 0 or chunk_elems % (1 << 16) or span_elems % chunk_elems:
            raise ValueError(f"chunk_elems must be a positive multiple of 65536 and span_elems a multiple of it, "
                             f"got {chunk_elems} and {span_elems}")
        if engine not in ("auto", "torch", "numba"):
            raise ValueError(f"engine must be auto, torch or numba, got {engine!r}")
        if engine == "numba" and native.kernel() is None:
            raise RuntimeError("engine='numba' needs numba installed (pip install numba), or HWSYNC_DELTA_NUMBA unset")
        self.chunk_elems, self.span_elems, self.engine, self.split_elems = chunk_elems, span_elems, engine, split_elems
        self.piece_elems = max(1, piece_elems // chunk_elems) * chunk_elems  # whole chunks
        self._scratch: dict[tuple[torch.device, torch.dtype], Scratch] = {}

    def _buffers(self, dtype: torch.dtype, device: torch.device) -> Scratch:
        if (device, dtype) not in self._scratch:
            self._scratch[(device, dtype)] = Scratch(self.chunk_elems, dtype, device)
        return self._scratch[(device, dtype)]

    def uses_native(self, device: torch.device) -> bool:
        """Whether a baseline on `device` is diffed by the compiled kernel ("auto": once loaded, native.ready)."""
        return device.type == "cpu" and self._compiled()

    def _compiled(self) -> bool:
        """Whether this encoder runs compiled kernels now: forced ("numba"), or "auto" once they are loaded."""
        return self.engine == "numba" or (self.engine == "auto" and native.ready())

    def _chunks(self, new_flat: torch.Tensor, base_i: torch.Tensor, ints: torch.dtype, direct: bool,
                s: Scratch, span0: int, span1: int, *, compiled_cast: bool = True
                ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(start, new chunk, baseline chunk) as integers, the new one cast to the engine's dtype in cache.

        On the host an fp32 chunk for a bfloat16 engine is cast by the compiled kernel where it gives torch's
        bits (native.cast_bf16): one thread, as the encode threads are (torch's op would start its own threads
        inside each); a chunk with a NaN is cast by torch, whose NaN bits the kernel does not model
        (`compiled_cast=False`: by torch at once, for a chunk known to hold one).
        """
        fast = None
        if compiled_cast and not direct and new_flat.dtype == torch.float32 and s.dtype == torch.bfloat16 \
                and new_flat.device.type == "cpu" and self._compiled():
            fast = native.cast_bf16()
        for start in range(span0, span1, self.chunk_elems):
            stop = min(span1, start + self.chunk_elems)
            if direct:
                yield start, new_flat[start:stop].view(ints), base_i[start:stop]
                continue
            a = s.cast[: stop - start]
            if fast is None or fast(new_flat[start:stop].detach().view(torch.int32).numpy().view("uint32"),
                                    a.view(torch.int16).numpy().view("uint16")):
                a.copy_(new_flat[start:stop])
            yield start, a.view(ints), base_i[start:stop]

    def _scan_native(self, new_flat: torch.Tensor, base_i: torch.Tensor, ints: torch.dtype, direct: bool,
                     s: Scratch, cap: int, digest: bool, helper: Executor | None) -> Scan | None:
        """The compiled scan; with a `helper`, a tensor of `split_elems` or more on this thread and that one."""
        n = base_i.numel()
        if helper is None or n < self.split_elems or n <= self.chunk_elems:
            out = self._scan_range(new_flat, base_i, ints, direct, s, cap, digest, 0, n)
        else:
            out = self._scan_shared(new_flat, base_i, ints, direct, s, cap, digest, helper)
        if out is not None and out.steps:
            trim_fillers(out.units)
        return out

    def _scan_shared(self, new_flat: torch.Tensor, base_i: torch.Tensor, ints: torch.dtype, direct: bool,
                     s: Scratch, cap: int, digest: bool, helper: Executor) -> Scan | None:
        """The compiled scan in pieces: `helper` runs its jobs in order, so it is given the pieces last first, and
        this thread scans them from the first on, each one the helper has not started, until they meet."""
        n = base_i.numel()
        cuts = list(range(0, n, self.piece_elems)) + [n]
        theirs = {i: helper.submit(_scan_piece, self, new_flat, base_i, ints, direct, s.dtype, cap, digest,
                                   cuts[i], cuts[i + 1])
                  for i in range(len(cuts) - 2, 0, -1)}
        try:
            out = self._scan_range(new_flat, base_i, ints, direct, s, cap, digest, 0, cuts[1])
            for i in range(1, len(cuts) - 1):
                if out is None:  # dense won already
                    return None
                job = theirs.pop(i)
                piece = self._scan_range(new_flat, base_i, ints, direct, s, cap, digest, cuts[i], cuts[i + 1]) \
                    if job.cancel() else job.result()
                out = None if piece is None else join(out, piece, cuts[i])
                if out is not None and out.found >= cap:
                    out = None
            return out
        finally:  # dense won, or a piece failed: the helper's pieces not started are dropped, the others not waited for
            for job in theirs.values():
                job.cancel()

    def _scan_range(self, new_flat: torch.Tensor, base_i: torch.Tensor, ints: torch.dtype, direct: bool,
                    s: Scratch, cap: int, digest: bool, lo: int, hi: int) -> Scan | None:
        """The compiled scan of elements [lo, hi) (lo a multiple of the chunk), as if the last change were at lo - 1."""
        n, size = base_i.numel(), base_i.element_size()
        keys, rows = dg.host_keys(n * size)
        if size == 2:
            return self._scan_steps(new_flat, base_i, ints, direct, s, cap, lo, hi, keys, rows)
        scan = native.kernel()
        assert scan is not None
        offsets, val, dirty = s.offsets.numpy(), s.xor.numpy(), s.dirty.numpy()
        counts = torch.zeros(blocks(n), dtype=torch.int64)
        out = Scan(counts=[counts], packed=None, last=lo - 1)
        for start, a, b in self._chunks(new_flat, base_i, ints, direct, s, lo, hi):
            an, bn = a.numpy(), b.numpy()
            k, gain = scan(an, bn, native.words(an), native.words(bn), start, offsets, val, counts.numpy(), dirty, keys,
                           rows, digest)
            out.found += k
            if out.found >= cap:
                return None
            if k:
                out.gained += int(gain) % (1 << 64)
                out.values.append(keep(val[:k]))
                out.offsets.append(keep(offsets[:k]))
        return out

    def _scan_steps(self, new_flat: torch.Tensor, base_i: torch.Tensor, ints: torch.dtype, direct: bool,
                    s: Scratch, cap: int, lo: int, hi: int, keys: object, rows: object) -> Scan | None:
        """The compiled scan of 2-byte elements (kernels16.py): the step code, the digest's gain, the old values' terms.

        fp32 masters for a bfloat16 engine are cast as they are read, where the compiled cast gives torch's bits
        (native.cast_bf16); a chunk with a NaN, and every other cast, is cast by torch first.
        """
        # the fused cast reads the trainer's tensor as numpy: only a host one (a device tensor is cast chunk by chunk
        # onto the host by torch, below)
        fused = native.scan16_cast() if not direct and new_flat.dtype == torch.float32 \
            and new_flat.device.type == "cpu" and s.dtype == torch.bfloat16 and native.cast_bf16() is not None else None
        plain = native.scan16_direct()
        assert plain is not None
        out, b_all, end = Scan(packed=None, steps=True, last=lo - 1), base_i.numpy().view("uint16"), base_i.numel()
        # numpy views made once per range, sliced per chunk: a chunk's own torch views cost more Python than its scan
        units, raws = s.units.numpy(), s.raws.numpy()
        new_u = new_flat.detach().view(torch.int32).numpy().view("uint32") if fused is not None else None
        for start in range(lo, hi, self.chunk_elems):
            stop, nan = min(hi, start + self.chunk_elems), True
            args = (b_all[start:stop], start, keys, rows, units, raws, out.last, stop == end)
            if fused is not None and new_u is not None:
                nan, k, gain, olds, u, r, out.last = fused(new_u[start:stop], *args)
            if nan:  # a NaN (or no compiled cast): torch casts the chunk first
                a = next(self._chunks(new_flat, base_i, ints, direct, s, start, stop, compiled_cast=False))[1]
                _, k, gain, olds, u, r, out.last = plain(a.numpy().view("uint16"), *args)
            out.found += k
            if out.found >= cap:
                return None
            out.gained = (out.gained + int(gain)) % (1 << 64)
            out.olds = (out.olds + int(olds)) % (1 << 64)
            if u:
                out.units.append(keep(units[:u]))
            if r:
                out.raws.append(keep(raws[:r]))
        return out

    def _scan_torch(self, new_flat: torch.Tensor, base_i: torch.Tensor, ints: torch.dtype, direct: bool,
                    s: Scratch, cap: int, digest: bool) -> Scan | None:
        n = base_i.numel()
        packed = s.bits_for(n)
        out = Scan(packed=packed, steps=base_i.element_size() == 2)
        for span0 in range(0, n, self.span_elems):
            span1 = min(n, span0 + self.span_elems)
            for start, a, b in self._chunks(new_flat, base_i, ints, direct, s, span0, span1):
                self._pack_changes(a, b, packed[start // 8:], s)
            pos = bits.set_positions(packed.view(torch.int64)[span0 // 64: (span1 + 63) // 64]).add_(span0)
            out.found += pos.numel()
            if out.found >= cap:
                return None
            out.counts.append(torch.bincount((pos - span0) >> 16, minlength=blocks(span1 - span0)))
            if pos.numel():
                if direct:
                    vals = new_flat.view(ints).index_select(0, pos)
                else:  # gathered in the trainer's dtype, then cast by the same op as the chunks
                    vals = torch.empty(pos.numel(), dtype=s.dtype, device=base_i.device)
                    vals = vals.copy_(new_flat.index_select(0, pos.to(new_flat.device))).view(ints)
                out.values.append(vals)
                out.offsets.append(pos.to(torch.int16))  # the low 16 bits: the offset in the block
                old = base_i.index_select(0, pos)
                if digest:
                    out.gained += dg.element_delta(pos, old, vals)
                if out.steps:
                    out.olds = (out.olds + steps.old_terms(pos, old)) % (1 << 64)
                    units, raws, out.last = steps.encode_units(pos, vals, old, out.last)
                    out.units.append(units)
                    out.raws.append(raws)
        return out

    @staticmethod
    def _pack_changes(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, s: Scratch) -> None:
        """Bits of where `a` and `b` differ as integers into `out` (the mask padded to whole words)."""
        n = a.numel()
        padded = (n + 63) // 64 * 64
        x = torch.bitwise_xor(a, b, out=s.xor[:n])
        s.mask[:n].copy_(x)  # int -> bool, non-zero where any bit differs: a vectorised cast (`!=` is not)
        if padded > n:
            s.mask[n:padded].zero_()
        bits.pack_mask_into(s.mask[:padded], out, s.words)

    def encode(self, new: torch.Tensor, base: torch.Tensor, *, base_digest: int | None = None,
               name: str = "tensor", helper: Executor | None = None, room: PayloadRoom | None = None) -> Delta:
        """Encode `new` against `base` (the engine's dtype, which `new` is cast to) in the smallest code.

        `base_digest` is `tensor_digest(base)`, kept with the baseline: given, the new digest is updated
        from the changed elements only; without it the new tensor is hashed whole. `helper` (a thread, e.g. a
        one-thread pool): where the compiled scan of a tensor of `split_elems` or more scans pieces from its end.
        `room`: where a host payload is written (a sender's, reused every sync), else fresh memory.
        """
        if new.numel() != base.numel():
            raise ValueError(f"{name}: the new tensor has {new.numel()} elements, its baseline {base.numel()}: "
                             "a changed shape needs a full sync")
        dtype, n = base.dtype, base.numel()
        size, ints, wire = dtype.itemsize, int_view(dtype, name), dtype_name(dtype)
        base_i = base.contiguous().view(-1).view(ints)
        new_flat = new.contiguous().view(-1)
        direct = new.dtype == dtype and new.device == base.device
        s = self._buffers(dtype, base.device)
        cap = dense_from(n, size)
        if self.uses_native(base.device):
            found = self._scan_native(new_flat, base_i, ints, direct, s, cap, base_digest is not None, helper)
        else:
            found = self._scan_torch(new_flat, base_i, ints, direct, s, cap, base_digest is not None)
        if found is None:  # no sparse code can beat dense any more: the scan stopped
            return self._dense(new, dtype, wire, n, None, None)
        k = found.found
        if base_digest is None:
            new_digest = dg.tensor_digest(to_engine_dtype(new, dtype) if k else base)
        else:
            new_digest = (base_digest + found.gained) % (1 << 64)
        units = found.step_units
        code = smallest_code(n, k, size, units)
        if code == SAME:
            return Delta(DeltaHeader(SAME, wire, n, 0, new_digest),
                         torch.empty(0, dtype=torch.uint8, device=base.device), 0)
        if code == DENSE:
            return self._dense(new, dtype, wire, n, new_digest, k)
        if code == STEPS:
            payload = _payload(payload_bytes(STEPS, n, units or 0, 2), base.device, room)
            return Delta(*self._steps(found, units or 0, wire, n, new_digest, payload), k)
        if k and not found.counts:  # the step-code scan (2-byte elements) made no block code: rebuilt from its units
            block_code_from_steps(found, base_i, ints, n)
        payload = _payload(payload_bytes(code, n, k, size), base.device, room)
        counts = torch.cat(found.counts)
        if code == BLOCKS:
            nb = blocks(n)
            payload[: 4 * nb].view(torch.int32).copy_(counts)
            at = pad8(4 * nb)
            payload[4 * nb: at].zero_()
            concat_into(found.offsets, payload[at: at + 2 * k].view(torch.int16))
            payload[at + 2 * k: pad8(at + 2 * k)].zero_()
            at = pad8(at + 2 * k)
        else:
            at = pad8((n + 7) // 8)
            if found.packed is not None:
                payload[:at].copy_(found.packed)  # the bits as the scan packed them, zero past the last element
            else:
                mark = native.mark_bits()
                assert mark is not None
                payload[:at].zero_()
                mark(counts.numpy(), torch.cat(found.offsets).numpy(), payload[:at].numpy())
        concat_into(found.values, payload[at:].view(ints))
        return Delta(DeltaHeader(code, wire, n, k, new_digest), payload, k)

    @staticmethod
    def _steps(found: Scan, count: int, wire: str, n: int, new_digest: int, payload: torch.Tensor
               ) -> tuple[DeltaHeader, torch.Tensor]:
        """The step code's header and `payload` (its room): the escape count, the old values' terms, the `count`
        units and raw values (steps.py)."""
        head = (sum(r.numel() for r in found.raws), _signed64(found.olds))
        if payload.device.type == "cpu":  # numpy views: torch's cost more per tensor than a small tensor's scan
            raw = payload.numpy()
            raw[:16].view(np.int64)[:] = head
            concat_host(found.units + found.raws, raw[16: 16 + 2 * count].view(np.int16))
            raw[16 + 2 * count:] = 0
        else:
            payload[:16].view(torch.int64).copy_(torch.tensor(head, dtype=torch.int64))
            if count:
                concat_into(found.units + found.raws, payload[16: 16 + 2 * count].view(torch.int16))
            payload[16 + 2 * count:].zero_()
        return DeltaHeader(STEPS, wire, n, count, new_digest), payload

    @staticmethod
    def _dense(new: torch.Tensor, dtype: torch.dtype, wire: str, n: int, new_digest: int | None,
               changed: int | None) -> Delta:
        engine = to_engine_dtype(new, dtype).contiguous()
        if new_digest is None:
            new_digest = dg.tensor_digest(engine)
        return Delta(DeltaHeader(DENSE, wire, n, n, new_digest), engine.view(-1).view(torch.uint8), changed)


def _payload(nbytes: int, device: torch.device, room: PayloadRoom | None) -> torch.Tensor:
    """`nbytes` for a payload: from the sender's room on the host, else fresh."""
    return room.take(nbytes) if room is not None and device.type == "cpu" else \
        torch.empty(nbytes, dtype=torch.uint8, device=device)


def _signed64(v: int) -> int:
    """An int in [0, 2**64) as the int64 of the same bits."""
    return v - (1 << 64) if v >= 1 << 63 else v


_local = threading.local()


def _scan_piece(asker: DeltaEncoder, new_flat: torch.Tensor, base_i: torch.Tensor, ints: torch.dtype, direct: bool,
                dtype: torch.dtype, cap: int, digest: bool, lo: int, hi: int) -> Scan | None:
    """Elements [lo, hi) of `asker`'s scan, with this thread's own buffers (the helper thread's job)."""
    encoder = getattr(_local, "helper", None)
    if encoder is None or (encoder.chunk_elems, encoder.engine) != (asker.chunk_elems, asker.engine):
        encoder = _local.helper = DeltaEncoder(asker.chunk_elems, asker.span_elems, asker.engine, asker.split_elems)
    s = encoder._buffers(dtype, base_i.device)
    return encoder._scan_range(new_flat, base_i, ints, direct, s, cap, digest, lo, hi)


def encode(new: torch.Tensor, base: torch.Tensor, *, base_digest: int | None = None, name: str = "tensor",
           helper: Executor | None = None, room: PayloadRoom | None = None) -> Delta:
    """`DeltaEncoder.encode` with this thread's encoder (`helper`: where a large tensor's pieces from its end are
    scanned; `room`: where host payloads are written)."""
    encoder = getattr(_local, "encoder", None)
    if encoder is None:
        encoder = _local.encoder = DeltaEncoder()
    return encoder.encode(new, base, base_digest=base_digest, name=name, helper=helper, room=room)
