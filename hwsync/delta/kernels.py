"""The compiled host kernels of the delta codec for 1-, 4- and 8-byte elements, the block and bitmap scatters
and the digest's lane sum (the fp32-to-bf16 cast is with the 2-byte kernels, kernels16.py); imported only where
numba is installed (native.py says which).

Module-level functions, not closures: numba keys its on-disk cache of a closure by the objects it closes over,
which differ in every process, so a closure was compiled again in each process that used it (0.1-0.8 s a
kernel) and wrote one more cache file each time. These load from the cache.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def term(g: int, x: Any, y: Any, size: int, keys: Any, rows: Any) -> int:
    """The digest term of element `g` going from `y` to `x` (see digest.element_delta); 0 if equal.

    int64 throughout: products wrap mod 2**64 like torch's (mixing uint64 in would go through float).
    """
    if size == 8:
        xl, xh, yl, yh = (np.int64(x) << 32) >> 32, np.int64(x) >> 32, (np.int64(y) << 32) >> 32, np.int64(y) >> 32
        lane = 2 * g
        return ((xl - yl) * (keys[lane & 0xFFFF] * rows[lane >> 16])
                + (xh - yh) * (keys[(lane + 1) & 0xFFFF] * rows[(lane + 1) >> 16]))
    shift = 2 if size == 1 else (1 if size == 2 else 0)  # log2 of elements per lane: no division
    per = 1 << shift
    sub = g & (per - 1)
    xn, yn = np.int64(x), np.int64(y)
    if size == 1 and sub == per - 1:  # the lane's top byte counts sign-extended (a uint8 view is not)
        xn, yn = xn - ((xn >> 7) << 8), yn - ((yn >> 7) << 8)
    elif size > 1 and sub != per - 1:  # lower elements count zero-extended
        xn, yn = xn & ((1 << (8 * size)) - 1), yn & ((1 << (8 * size)) - 1)
    lane = g >> shift
    return ((xn - yn) << (sub * 8 * size)) * (keys[lane & 0xFFFF] * rows[lane >> 16])

@numba.njit(nogil=True, cache=True, inline="always")
def scan(a: Any, b: Any, wa: Any, wb: Any, start: int, offsets: Any, val: Any, counts: Any, dirty: Any,
         keys: Any, rows: Any, digest: bool, size: int, per_word: int, width: int, mask: int) -> tuple[int, int]:
    """Changes of chunk `a` against `b` (starting at element `start`, a multiple of 65536): (how many, the
    digest's gain). Writes each change's offset in its block of 65536 to `offsets` and its value to `val`, and
    counts it in `counts` (per block of the tensor). 1-, 4- and 8-byte elements (2-byte ones: kernels16.py).

    Two passes per run of `dirty.size` words (native.DIRTY_RUN), all in one block: the first lists the words
    that differ without a branch (`dirty`, in cache), the second takes those apart. A branch per word
    mispredicts at every changed one, and at the densities of RL updates that was the larger part of the scan
    (measured 27% faster). A 64-bit word that differs is two lanes of the digest whatever the dtype, and its
    elements are taken from it by shifts, branch-free. The element width is a constant of each caller below
    (inlined): unrolled, the loop is 25% faster.
    """
    lane0 = (start * size) >> 2  # the chunk's first 32-bit lane in the tensor
    run = dirty.size  # divides a block's words for every width: a run never straddles two blocks
    k = 0
    gain = np.int64(0)
    for w0 in range(0, wa.size, run):
        w1 = min(wa.size, w0 + run)
        m = 0
        for w in range(w0, w1):
            dirty[m] = w
            m += wa[w] != wb[w]
        before = k
        for i in range(m):
            w = dirty[i]
            x, y = wa[w], wb[w]
            d = x ^ y
            if digest:
                low, high = lane0 + 2 * w, lane0 + 2 * w + 1
                gain += ((((x << 32) >> 32) - ((y << 32) >> 32)) * (keys[low & 0xFFFF] * rows[low >> 16])
                         + ((x >> 32) - (y >> 32)) * (keys[high & 0xFFFF] * rows[high >> 16]))
            g0 = start + w * per_word
            for j in range(per_word):
                offsets[k] = (g0 + j) & 0xFFFF  # stored as int16: the uint16 offset's bits
                val[k] = (x >> (j * width)) & mask  # stored truncated to the element's width
                k += ((d >> (j * width)) & mask) != 0
        counts[(start + w0 * per_word) >> 16] += k - before
    tail = wa.size * per_word  # the last elements that do not fill a word: one by one
    for i in range(tail, a.size):
        if a[i] != b[i]:
            g = start + i
            offsets[k] = g & 0xFFFF
            val[k] = a[i]
            k += 1
            counts[g >> 16] += 1
            if digest:
                gain += term(g, a[i], b[i], size, keys, rows)
    return k, gain  # type: ignore[return-value]  # numba's int64

@numba.njit(nogil=True, cache=True)
def scan1(a: Any, b: Any, wa: Any, wb: Any, start: int, offsets: Any, val: Any, counts: Any, dirty: Any,
          keys: Any, rows: Any, digest: bool) -> tuple[int, int]:
    return scan(a, b, wa, wb, start, offsets, val, counts, dirty, keys, rows, digest, 1, 8, 8,
                np.int64(0xFF))

@numba.njit(nogil=True, cache=True)
def scan4(a: Any, b: Any, wa: Any, wb: Any, start: int, offsets: Any, val: Any, counts: Any, dirty: Any,
          keys: Any, rows: Any, digest: bool) -> tuple[int, int]:
    return scan(a, b, wa, wb, start, offsets, val, counts, dirty, keys, rows, digest, 4, 2, 32,
                np.int64(0xFFFFFFFF))

@numba.njit(nogil=True, cache=True)
def scan8(a: Any, b: Any, wa: Any, wb: Any, start: int, offsets: Any, val: Any, counts: Any, dirty: Any,
          keys: Any, rows: Any, digest: bool) -> tuple[int, int]:
    return scan(a, b, wa, wb, start, offsets, val, counts, dirty, keys, rows, digest, 8, 1, 64,
                np.int64(-1))

@numba.njit(nogil=True, cache=True)
def mark_bits(counts: Any, offsets: Any, packed: Any) -> None:
    """Set the bit of every position of a block code (`packed` zeroed by the caller): its bitmap."""
    c = 0
    for block in range(counts.size):
        for _ in range(counts[block]):
            g = (block << 16) + (offsets[c] & 0xFFFF)
            packed[g >> 3] |= 1 << (g & 7)
            c += 1

@numba.njit(nogil=True, cache=True)
def scatter_bits(packed: Any, values: Any, dest: Any, keys: Any, rows: Any, digest: bool) -> tuple[int, int]:
    """Write `values` in order where `packed` has a bit set: (the number of bits set, the digest's gain from
    the values found there to the values written, when `digest`)."""
    c = 0
    gain = np.int64(0)
    n = dest.size
    size = dest.itemsize
    for byte in range(packed.size):
        v = packed[byte]
        if v == 0:
            continue
        at = byte * 8
        for j in range(min(8, n - at)):  # branch-free: a bitmap is chosen when many bits are set
            bit = (v >> j) & 1
            if c < values.size:
                old = dest[at + j]
                new = values[c] if bit else old
                dest[at + j] = new
                if digest and bit:
                    gain += term(at + j, new, old, size, keys, rows)
            c += bit
    return c, gain  # type: ignore[return-value]  # numba's int64

@numba.njit(nogil=True, cache=True)
def scatter_blocks(counts: Any, offsets: Any, values: Any, first_block: int, dest: Any, keys: Any, rows: Any,
                   digest: bool) -> int:
    """Write `values` at the block code's positions (offsets as uint16, checked by the caller to stay inside
    the tensor); the digest's gain from the values found there to the values written, when `digest`."""
    gain = np.int64(0)
    size = dest.itemsize
    c = 0
    for b in range(counts.size):
        start = (first_block + b) << 16
        for _ in range(counts[b]):
            g = start + offsets[c]
            if digest:
                gain += term(g, values[c], dest[g], size, keys, rows)
            dest[g] = values[c]
            c += 1
    return gain  # type: ignore[return-value]  # numba's int64

@numba.njit(nogil=True, cache=True)
def digest_lanes(lanes: Any, keys: Any, rows: Any) -> int:
    """The lane sum of digest.tensor_digest (mod 2**64, as int64): per row the column keys, then its row key.

    A whole row is a slice with a fixed trip count, which LLVM vectorises (measured 14 GB/s here,
    against 4 with the bound in the loop).
    """
    total = np.int64(0)
    whole = lanes.size >> 16
    for r in range(whole):
        row = lanes[r << 16: (r + 1) << 16]
        part = np.int64(0)
        for j in range(0x10000):
            part += row[j] * keys[j]
        total += part * rows[r]
    if lanes.size > whole << 16:
        part = np.int64(0)
        for j in range(lanes.size - (whole << 16)):
            part += lanes[(whole << 16) + j] * keys[j]
        total += part * rows[whole]
    return total  # type: ignore[return-value]  # numba's int64


_SCANS = {1: scan1, 4: scan4, 8: scan8}


def scan_any(a: Any, *rest: Any) -> tuple[int, int]:
    """The scan of the element width of `a` (1, 4 or 8 bytes)."""
    return _SCANS[a.itemsize](a, *rest)
