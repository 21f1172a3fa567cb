"""The compiled host kernels of 2-byte elements (bf16, fp16: what engines hold) and the fp32-to-bf16 cast;
imported only where numba is installed (native.py says which). Module-level functions, not closures, so numba's
on-disk cache serves them in every process (kernels.py).

A delta of 2-byte elements is a step code (steps.py) unless it is very sparse or full of escapes, so the scan makes
the step code and nothing else: the block and bitmap codes, when smaller, are rebuilt from it (`unsteps`). The scan
reads the trainer's tensor (fp32 masters cast to bf16 as they are read, or 2-byte values) and the baseline once,
128 elements at a time: a vectorised pass makes two 64-bit masks of the elements that differ, then a loop over
exactly the set bits emits each change's unit and digest terms. It picks the next bit from the two masks without a
branch: a loop per 64-bit mask ended at an unpredictable place every 64 elements, and those mispredictions were
half the scan at RL densities (368M elements at 2% changed, one thread: 0.200 s with the earlier scan, 0.116 s with
this one, against a 0.109 s read floor). The digest's row key is constant over a run of RUN elements, so each
change costs one column key and the row key multiplies the run's sums once.

The scatter applies a step code in one pass: it checks the payload as it writes and, when anything is
wrong (a malformed unit, or values at the changes whose digest terms are not the base's), puts back what
it wrote (a difference's old value is the new one less the difference; an escape's is kept): nothing is
left changed. It asks the cache for lines ahead of its writes: changes a few dozen elements apart defeat
the hardware's prefetcher (368M elements at 1/2/4% changed: 0.072/0.092/0.066 s without,
0.026/0.031/0.039 s with).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

try:
    from numba.cpython.unsafe.numbers import trailing_zeros
except ImportError:  # numba's own intrinsic moved: a de Bruijn sequence finds the lowest set bit instead
    trailing_zeros = None

#: elements per run of the scan: the digest's row key is the same over a run (a row is 131072 elements)
RUN = 8192
#: elements ahead of a dense step code's write that the scatter asks the cache for (8 KiB; 2-8 KiB measured alike)
PREFETCH_AHEAD = 4096
#: units ahead of a sparse step code's write whose change's line the scatter asks the cache for (32-128 alike)
UNITS_AHEAD = 64


@intrinsic
def _prefetch(typingctx: Any, array: Any, i: Any) -> Any:
    """LLVM's prefetch of the cache line of array[i], for writing."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        made = context.make_array(signature.args[0])(context, builder, args[0])
        at = cgutils.get_item_pointer(context, builder, signature.args[0], made, [args[1]], wraparound=False)
        byte_ptr, i32 = ir.PointerType(ir.IntType(8)), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(at, byte_ptr), i32(1), i32(3), i32(1)])  # write, keep in cache, data
        return context.get_dummy_value()

    return types.void(array, i), codegen


@numba.njit(nogil=True, cache=True)
def _probe(array: Any) -> None:
    _prefetch(array, 0)


@numba.njit(nogil=True, cache=True, inline="always")
def _no_prefetch(array: Any, i: int) -> None:
    pass


try:  # compiled now (or loaded from the cache): a numba that cannot make the hint fails here, not in the scatter
    _probe(np.zeros(1, dtype=np.int16))
    prefetch = _prefetch
except Exception:  # noqa: BLE001 - the hint is an optimisation: without it the scatter is slower, never wrong
    prefetch = _no_prefetch


_DEBRUIJN = np.array([0, 1, 2, 53, 3, 7, 54, 27, 4, 38, 41, 8, 34, 55, 48, 28, 62, 5, 39, 46, 44, 42, 22, 9, 24,
                  35, 59, 56, 49, 18, 29, 11, 63, 52, 6, 26, 37, 40, 33, 47, 61, 45, 43, 21, 23, 58, 17, 10, 51,
                  25, 36, 32, 60, 20, 57, 16, 50, 31, 19, 15, 30, 14, 13, 12], dtype=np.int64)

if trailing_zeros is not None:
    @numba.njit(nogil=True, cache=True, inline="always")
    def lowest(m: Any) -> Any:
        """The index of the lowest set bit of a non-zero uint64."""
        return np.int64(trailing_zeros(m))
else:
    @numba.njit(nogil=True, cache=True, inline="always")
    def lowest(m: Any) -> Any:
        """The index of the lowest set bit of a non-zero uint64."""
        return _DEBRUIJN[((m & (~m + np.uint64(1))) * np.uint64(0x022FDD63CC95386D)) >> np.uint64(58)]


@numba.njit(nogil=True, cache=True, inline="always")
def ones(x: Any) -> Any:
    """Set bits of a uint64."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))


@numba.njit(nogil=True, cache=True, inline="always")
def bf16(v: Any) -> Any:
    """fp32 bits (uint32) to bfloat16's (uint16), rounded to nearest even (NaNs are the caller's: see scan)."""
    return np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(nogil=True, cache=True)
def cast_bf16(src: Any, out: Any) -> bool:
    """fp32 bit patterns (uint32) to bfloat16's (uint16), rounded to nearest even: whether any was a NaN (then the
    caller casts with torch, whose NaN bits differ between builds). One vectorised pass; the scan's fused cast is
    the same `bf16`, so the check that this gives torch's bits (native.cast_bf16) vouches for both."""
    top = np.uint32(0)
    for i in range(src.size):
        u = src[i]
        top = max(top, u & np.uint32(0x7FFFFFFF))  # a max, not a flag: it keeps the loop vectorised
        out[i] = bf16(u)
    return top > np.uint32(0x7F800000)  # type: ignore[return-value]  # numba returns a bool


@numba.njit(nogil=True, cache=True, inline="always")
def value(src: Any, i: int, cast: bool) -> Any:
    return bf16(src[i]) if cast else src[i]


@numba.njit(nogil=True, cache=True, inline="always")
def mask64(src: Any, b: Any, at: int, top: Any, cast: bool) -> tuple[Any, Any]:
    """Bit j set where element at + j of the slices `src` and `b` differs (vectorised: slices, whose indices
    numba knows are not negative); `top` keeps the largest fp32 magnitude seen."""
    m = np.uint64(0)
    for j in range(64):
        v = src[at + j]
        if cast:
            top = max(top, v & np.uint32(0x7FFFFFFF))  # a max, not a flag: the loop stays vectorised
        m |= np.uint64(value(src, at + j, cast) != b[at + j]) << np.uint64(j)
    return m, top


@numba.njit(nogil=True, cache=True, inline="always")
def mask_tail(src: Any, b: Any, top: Any, cast: bool) -> tuple[Any, Any, Any]:
    """The two masks of the last block, shorter than 128 elements, one element at a time."""
    m0 = m1 = np.uint64(0)
    for j in range(b.size):
        v = src[j]
        if cast:
            top = max(top, v & np.uint32(0x7FFFFFFF))
        bit = np.uint64(value(src, j, cast) != b[j])
        if j < 64:
            m0 |= bit << np.uint64(j)
        else:
            m1 |= bit << np.uint64(j - 64)
    return m0, m1, top


@numba.njit(nogil=True, cache=True, inline="always")
def scan(src: Any, b: Any, start: int, keys: Any, rows: Any, units: Any, raws: Any, last: int, final: bool,
         cast: bool) -> tuple[bool, int, int, int, int, int, int]:
    """The changes of `src` (uint16 values, or fp32 bits cast here when `cast`) against `b` (uint16), at element
    `start` (a multiple of RUN) of the tensor, after the change at `last` (-1: none yet): (a NaN was cast,
    changes, the digest's gain, the old values' terms, units, raw values, the last change's position).

    With a NaN among fp32 values nothing is returned but the flag: the caller casts with torch (whose NaN bits
    differ between builds) and scans the result. Fillers for the chunk's unchanged end are added unless it is
    the `final` one, so a chunk's units stay bounded. The loop over the changes is written out here, not
    called: as a function returning its four results it ran 4x slower.
    """
    n = b.size
    k = u = r = 0
    gain = olds = np.int64(0)
    top = np.uint32(0)
    one = np.uint64(1)
    was = last
    for r0 in range(0, n, RUN):
        row = rows[((start + r0) >> 1) >> 16]
        news = olds_here = np.int64(0)  # this run's sums under the column keys
        for blk in range(r0, min(n, r0 + RUN), 128):
            sb, bb = src[blk: blk + 128], b[blk: blk + 128]
            if bb.size == 128:
                m0, top = mask64(sb, bb, 0, top, cast)
                m1, top = mask64(sb, bb, 64, top, cast)
            else:
                m0, m1, top = mask_tail(sb, bb, top, cast)
            count = ones(m0) + ones(m1)
            for _ in range(count):
                low = np.uint64(m0 != np.uint64(0))  # from the first mask until it is spent: no branch
                j = lowest(m0) if low else 64 + lowest(m1)
                m0 &= m0 - low
                m1 &= m1 - (one - low)
                g = start + blk + j
                nv, ov = np.int64(value(sb, j, cast)), np.int64(bb[j])
                sn, so = (nv ^ 0x8000) - 0x8000, (ov ^ 0x8000) - 0x8000  # the signed 16-bit values
                # a lane's low element counts zero-extended, its high one sign-extended (digest.element_delta)
                key = keys[(g >> 1) & 0xFFFF]
                if g & 1:
                    tn, to = sn << 16, so << 16
                else:
                    tn, to = nv, ov
                news += tn * key
                olds_here += to * key
                step = g - last
                while step > 255:  # rare at RL densities: a filler per 255 unchanged elements
                    units[u] = 0
                    u += 1
                    step -= 255
                diff = sn - so
                if diff < -127 or diff > 127:  # rare: an escape, the value raw
                    units[u] = step | (0x80 << 8)
                    raws[r] = nv
                    r += 1
                else:
                    units[u] = step | ((diff & 0xFF) << 8)
                u += 1
                last = g
            k += count
        gain += (news - olds_here) * row
        olds += olds_here * row
    if cast and top > np.uint32(0x7F800000):
        return True, 0, 0, 0, 0, 0, was
    if not final:
        while start + n - 1 - last >= 255:
            units[u] = 0
            u += 1
            last += 255
    return False, k, gain, olds, u, r, last  # type: ignore[return-value]  # numba's int64


@numba.njit(nogil=True, cache=True)
def scan_cast(src: Any, b: Any, start: int, keys: Any, rows: Any, units: Any, raws: Any, last: int,
              final: bool) -> tuple[bool, int, int, int, int, int, int]:
    return scan(src, b, start, keys, rows, units, raws, last, final, True)


@numba.njit(nogil=True, cache=True)
def scan_direct(src: Any, b: Any, start: int, keys: Any, rows: Any, units: Any, raws: Any, last: int,
                final: bool) -> tuple[bool, int, int, int, int, int, int]:
    return scan(src, b, start, keys, rows, units, raws, last, final, False)


@numba.njit(nogil=True, cache=True)
def undo(units: Any, kept: Any, upto: int, dest: Any) -> None:
    """Put back the values the first `upto` units overwrote: a difference's old value is the new one less the
    difference; an escape's was kept (`kept`, in order)."""
    p = np.int64(-1)
    e = 0
    for i in range(upto):
        unit = np.int64(units[i]) & 0xFFFF
        gap, byte = unit & 0xFF, unit >> 8
        p += gap if gap else 255
        if gap == 0:
            continue
        if byte == 0x80:
            dest[p] = kept[e]
            e += 1
        else:
            dest[p] = np.int16(np.int64(dest[p]) - ((byte ^ 0x80) - 0x80))


@numba.njit(nogil=True, cache=True)
def scatter(units: Any, raws: Any, olds: int, dest: Any, keys: Any, rows: Any, digest: bool) -> tuple[int, int]:
    """Apply a step code to int16 `dest`: (0 and the digest's gain when `digest`, or a negative error: -1 a
    filler with a difference, -2 past the end, -3 escapes and raw values disagree, -4 the values at the changes
    are not the base's: their digest terms are not `olds`). On an error every value written is put back."""
    n, nr = dest.size, raws.size
    kept = np.empty(nr, np.int16)  # the values escapes overwrote (a difference's old value follows from it)
    found = gain = olds_here = news = np.int64(0)
    row = np.int64(-1)
    p = np.int64(-1)
    e = status = done = 0
    # changes a few dozen elements apart defeat the hardware's prefetcher, and each waited for its line. Sparse
    # codes (under ~1 change in 40) ask for the line of the change UNITS_AHEAD units on; denser ones, whose
    # changes touch most lines, for the line PREFETCH_AHEAD elements on (368M elements at 1/2/4/20% changed:
    # 0.072/0.092/0.066/0.169 s without either, 0.026/0.031/0.039/0.174 s with them)
    sparse = units.size * 40 < n
    q = np.int64(-1)  # the position of the change UNITS_AHEAD units on
    for i in range(min(units.size, UNITS_AHEAD) if sparse else 0):
        ahead = np.int64(units[i]) & 0xFF
        q += ahead if ahead else 255
    for i in range(units.size):
        if sparse and i + UNITS_AHEAD < units.size:
            ahead = np.int64(units[i + UNITS_AHEAD]) & 0xFF
            q += ahead if ahead else 255
            prefetch(dest, max(0, min(q, n - 1)))
        unit = np.int64(units[i]) & 0xFFFF
        gap, byte = unit & 0xFF, unit >> 8
        done = i
        if gap == 0:
            if byte != 0:
                status = -1
                break
            p += 255
            continue
        p += gap
        if p >= n:
            status = -2
            break
        here = p >> 17  # the digest's row (65536 lanes of two elements)
        if here != row:
            if row >= 0:
                found += olds_here * rows[row]
                gain += (news - olds_here) * rows[row]
            olds_here = news = np.int64(0)
            row = here
        if not sparse:
            prefetch(dest, min(p + PREFETCH_AHEAD, n - 1))
        old = dest[p]
        if byte == 0x80:
            if e == nr:
                status = -3
                break
            kept[e] = old
            new = raws[e]
            e += 1
        else:
            new = np.int16(np.int64(old) + ((byte ^ 0x80) - 0x80))
        dest[p] = new
        key = keys[(p >> 1) & 0xFFFF]
        on, nn = np.int64(old), np.int64(new)
        if p & 1:  # a lane's high element counts sign-extended, its low one zero-extended (digest.element_delta)
            on, nn = on << 16, nn << 16
        else:
            on, nn = on & 0xFFFF, nn & 0xFFFF
        olds_here += on * key
        news += nn * key
    else:
        done = units.size
    if row >= 0:
        found += olds_here * rows[row]
        gain += (news - olds_here) * rows[row]
    if status == 0 and e != nr:
        status = -3
    if status == 0 and found != olds:
        status = -4
    if status:
        undo(units, kept, done, dest)
        return status, 0
    return 0, (gain if digest else np.int64(0))  # type: ignore[return-value]  # numba's int64


@numba.njit(nogil=True, cache=True)
def unsteps(units: Any, raws: Any, base: Any, offsets: Any, values: Any, counts: Any) -> None:
    """The block code of a step code made against `base` (int16): each change's offset in its block of 65536,
    its new value, and the changes per block (`counts`, zeroed by the caller)."""
    p = np.int64(-1)
    c = e = 0
    for i in range(units.size):
        unit = np.int64(units[i]) & 0xFFFF
        gap, byte = unit & 0xFF, unit >> 8
        if gap == 0:
            p += 255
            continue
        p += gap
        if byte == 0x80:
            values[c] = raws[e]
            e += 1
        else:
            values[c] = np.int16(np.int64(base[p]) + ((byte ^ 0x80) - 0x80))
        offsets[c] = p & 0xFFFF
        counts[p >> 16] += 1
        c += 1
