"""The compiled loop of host_copy.py: a batch of memmoves on addresses in one call, without the GIL; imported only
where numba is installed (host_copy.py loads it). A module of module-level functions, so that numba caches them on
disk (a closure would be compiled again in every process)."""

from __future__ import annotations

from typing import Any

import numba
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _memmove(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:
    """memmove(dst, src, nbytes) on addresses held as int64 (LLVM's memmove: no call into Python or libc's PLT)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        to, frm, count = args
        cgutils.raw_memmove(builder, builder.inttoptr(to, cgutils.voidptr_t), builder.inttoptr(frm, cgutils.voidptr_t),
                            count, 1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@numba.njit(nogil=True, cache=True)
def move_in(moves: Any, base: int) -> None:
    """Each row (address, offset, bytes) of `moves` (int64, n x 3): from the address to base + offset."""
    for i in range(moves.shape[0]):
        _memmove(base + moves[i, 1], moves[i, 0], moves[i, 2])


@numba.njit(nogil=True, cache=True)
def move_out(moves: Any, base: int) -> None:
    """Each row (address, offset, bytes) of `moves` (int64, n x 3): from base + offset to the address."""
    for i in range(moves.shape[0]):
        _memmove(moves[i, 0], base + moves[i, 1], moves[i, 2])
