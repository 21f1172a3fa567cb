"""The diff's host kernel, compiled with numba when numba is installed: one pass that emits every change.

The torch path (diff.py) needs some thirty whole-array ops per span, and on the host each costs about a
nanosecond per item: at 1% changed that is 3-4x one read of the tensors. One compiled loop reads the two
chunks a 64-bit word at a time, and only for a word that differs looks at its elements: it writes each
change's position and value, counts it in its block and adds its term to the digest, in the same pass.
numba is optional (vLLM depends on it); without it the torch path runs, with the same output. Elements of 2
bytes, what engines hold, have kernels of their own that make the step code directly (native16.py).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from hwsync.delta.cast_probe import matches_torch

_kernels: tuple[Callable[..., Any], ...] | None = None
_tried = False
_cast_checked: bool | None = None
#: 64-bit words per run of the scan's first pass (its list of differing words stays in cache): the size of the
#: `dirty` buffer a caller passes the scan
DIRTY_RUN = 8192


def _build() -> tuple[Callable[..., Any], ...] | None:
    try:
        import numba  # noqa: F401  # the kernels' module needs it: without it, the torch path
    except ImportError:
        return None
    from hwsync.delta import kernels, kernels16

    return (kernels.scan_any, kernels.scatter_bits, kernels.digest_lanes, kernels.scatter_blocks, kernels.mark_bits,
            kernels16.cast_bf16)


def _get() -> tuple[Callable[..., Any], ...] | None:
    global _kernels, _tried
    if not _tried:
        _tried = True
        if os.environ.get("HWSYNC_DELTA_NUMBA", "1") != "0":
            _kernels = _build()
    return _kernels


def kernel() -> Callable[..., tuple[int, int]] | None:
    """The compiled scan of 1-, 4- and 8-byte elements (2-byte: native16.py), or None without numba (or with
    HWSYNC_DELTA_NUMBA=0)."""
    got = _get()
    return got[0] if got else None


def scatter_bits() -> Callable[..., tuple[int, int]] | None:
    """The compiled bitmap scatter, or None without numba (or with HWSYNC_DELTA_NUMBA=0)."""
    got = _get()
    return got[1] if got else None


def scatter_blocks() -> Callable[..., int] | None:
    """The compiled block-code scatter, or None without numba (or with HWSYNC_DELTA_NUMBA=0)."""
    got = _get()
    return got[3] if got else None


def mark_bits() -> Callable[..., None] | None:
    """The compiled bitmap of a block code's positions, or None without numba."""
    got = _get()
    return got[4] if got else None


def cast_bf16() -> Callable[..., bool] | None:
    """The compiled fp32-to-bfloat16 cast, or None without numba or where it does not match torch's (checked
    once on values of every kind)."""
    global _cast_checked
    got = _get()
    if got is None:
        return None
    if _cast_checked is None:
        _cast_checked = matches_torch(got[5])
    return got[5] if _cast_checked else None


def digest_lanes() -> Callable[..., int] | None:
    """The compiled lane sum of a host tensor's digest, or None without numba."""
    got = _get()
    return got[2] if got else None


def words(x: Any) -> Any:
    """The whole 64-bit words at the start of a numpy chunk (its tail is scanned element by element)."""
    whole = x.size * x.itemsize // 8
    return x[: whole * 8 // x.itemsize].view("int64")
