"""The diff's host kernel, compiled with numba when numba is installed: one pass that emits every change.

The torch path (diff.py) needs some thirty whole-array ops per span, and on the host each costs about a
nanosecond per item: at 1% changed that is 3-4x one read of the tensors. One compiled loop reads the two
chunks a 64-bit word at a time, and only for a word that differs looks at its elements: it writes each
change's position and value, counts it in its block and adds its term to the digest, in the same pass.
numba is optional (vLLM depends on it); without it the torch path runs, with the same output.
"""

from __future__ import annotations

import os
from typing import Any, Callable

_kernels: tuple[Callable[..., Any], Callable[..., Any]] | None = None
_tried = False


def _build() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    try:
        import numba
        import numpy as np
    except ImportError:
        return None

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

    @numba.njit(nogil=True, cache=True)
    def scan(a: Any, b: Any, wa: Any, wb: Any, start: int, pos: Any, val: Any, counts: Any, packed: Any,
             keys: Any, rows: Any, digest: bool) -> tuple[int, int]:
        size = a.itemsize
        per_word = 8 if size == 1 else (4 if size == 2 else (2 if size == 4 else 1))
        nw = wa.size
        lane0 = (start * size) >> 2  # the chunk's first 32-bit lane in the tensor (chunks start word-aligned)
        k = 0
        gain = 0
        for w in range(nw + 1):
            if w < nw:
                if wa[w] == wb[w]:
                    continue
                lo, hi = w * per_word, w * per_word + per_word
                if digest:  # the word is two lanes of the digest, whatever the dtype
                    x, y = wa[w], wb[w]
                    low, high = lane0 + 2 * w, lane0 + 2 * w + 1
                    gain += ((((x << 32) >> 32) - ((y << 32) >> 32)) * (keys[low & 0xFFFF] * rows[low >> 16])
                             + ((x >> 32) - (y >> 32)) * (keys[high & 0xFFFF] * rows[high >> 16]))
            else:
                lo, hi = nw * per_word, a.size
                if digest:  # the tail: element by element
                    for i in range(lo, hi):
                        gain += term(start + i, a[i], b[i], size, keys, rows)
            # inside a word that differs, branch-free: every element is written, a changed one kept; the
            # word's elements share a block and a byte of the bitmap, so those are updated once per word
            flags, here = 0, 0
            for i in range(lo, hi):
                changed = a[i] != b[i]
                pos[k] = start + i
                val[k] = a[i]
                k += changed
                here += changed
                flags |= changed << ((start + i) & 7)
            counts[(start + lo) >> 16] += here
            packed[(start + lo) >> 3] |= flags
        return k, gain

    @numba.njit(nogil=True, cache=True)
    def scatter_bits(packed: Any, values: Any, dest: Any) -> int:
        """Write `values` in order where `packed` has a bit set; the number of bits set."""
        c = 0
        n = dest.size
        for byte in range(packed.size):
            v = packed[byte]
            if v == 0:
                continue
            at = byte * 8
            for j in range(min(8, n - at)):  # branch-free: a bitmap is chosen when many bits are set
                bit = (v >> j) & 1
                if c < values.size:
                    dest[at + j] = values[c] if bit else dest[at + j]
                c += bit
        return c

    return scan, scatter_bits


def _get() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    global _kernels, _tried
    if not _tried:
        _tried = True
        if os.environ.get("HWSYNC_DELTA_NUMBA", "1") != "0":
            _kernels = _build()
    return _kernels


def kernel() -> Callable[..., tuple[int, int]] | None:
    """The compiled scan, or None without numba (or with HWSYNC_DELTA_NUMBA=0)."""
    got = _get()
    return got[0] if got else None


def scatter_bits() -> Callable[..., int] | None:
    """The compiled bitmap scatter, or None without numba (or with HWSYNC_DELTA_NUMBA=0)."""
    got = _get()
    return got[1] if got else None


def words(x: Any) -> Any:
    """The whole 64-bit words at the start of a numpy chunk (its tail is scanned element by element)."""
    whole = x.size * x.itemsize // 8
    return x[: whole * 8 // x.itemsize].view("int64")
