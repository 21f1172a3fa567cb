"""The diff's host kernels, compiled with numba when numba is installed (kernels.py, kernels16.py): which exist.

The torch path (diff.py) needs some thirty whole-array ops per span, and on the host each costs about a
nanosecond per item: at 1% changed that is 3-4x one read of the tensors. One compiled loop reads the two
chunks a 64-bit word at a time, and only for a word that differs looks at its elements: it writes each
change's position and value, counts it in its block and adds its term to the digest, in the same pass.
numba is optional (vLLM depends on it); without it the torch path runs, with the same output. Elements of 2
bytes, what engines hold, have kernels of their own that make the step code directly (kernels16.py). The
kernels' modules are imported at the first use, never when hwsync is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from hwsync.delta.cast_probe import matches_torch

_kernels: dict[str, Callable[..., Any]] | None = None
#: set once the kernels are loaded for every width (hwsync.delta.warm.start); the codec uses them only then
_loaded = threading.Event()
#: the thread that loads them uses them while it does
_loading = threading.local()
_tried = False
_cast_checked: bool | None = None
#: 64-bit words per run of the scan's first pass (its list of differing words stays in cache): the size of the
#: `dirty` buffer a caller passes the scan
DIRTY_RUN = 8192


def _build() -> dict[str, Callable[..., Any]] | None:
    try:
        import numba  # noqa: F401  # the kernels' modules need it: without it, the torch path
    except ImportError:
        return None
    from hwsync.delta import kernels, kernels16

    return {"scan": kernels.scan_any, "scatter_bits": kernels.scatter_bits, "digest_lanes": kernels.digest_lanes,
            "scatter_blocks": kernels.scatter_blocks, "mark_bits": kernels.mark_bits, "cast_bf16": kernels16.cast_bf16,
            "scan16_cast": kernels16.scan_cast, "scan16_direct": kernels16.scan_direct,
            "scatter_steps": kernels16.scatter, "unsteps": kernels16.unsteps}


def _get(name: str) -> Callable[..., Any] | None:
    """The compiled kernel `name`, or None without numba (or with HWSYNC_DELTA_NUMBA=0)."""
    global _kernels, _tried
    if not _tried:
        _tried = True
        if os.environ.get("HWSYNC_DELTA_NUMBA", "1") != "0":
            _kernels = _build()
    return None if _kernels is None else _kernels[name]


def ready() -> bool:
    """Whether a sync's codec runs the compiled kernels now: numba is installed and they are loaded (warm.start: a
    thread of its own, started when a sender or receiver enters delta mode), or this is the thread loading them.

    Until then the codec runs torch ops, which give the same bytes: no sync waits for numba, whose first compile
    on a machine takes half a minute (then it loads them from its disk cache in a few seconds)."""
    return kernel() is not None and (_loaded.is_set() or getattr(_loading, "active", False))


@contextmanager
def loading() -> Iterator[None]:
    """This thread loads the kernels: ready() is true for it meanwhile."""
    _loading.active = True
    try:
        yield
    finally:
        _loading.active = False


def mark_loaded() -> None:
    """The kernels are loaded: every thread's codec may use them from now on."""
    _loaded.set()


def wait_loaded(timeout: float | None = None) -> bool:
    """Wait until the kernels are loaded (warm.start must have been called); False on timeout or without numba."""
    return kernel() is not None and _loaded.wait(timeout)


def cache_misses() -> int:
    """How many kernel signatures this process compiled rather than loading from numba's disk cache."""
    if _kernels is None:
        return 0
    return sum(sum(k.stats.cache_misses.values()) for k in _kernels.values() if hasattr(k, "stats"))


def cached_on_disk() -> tuple[bool, str] | None:
    """(whether numba's disk cache holds every kernel, the cache's folder), or None without numba or where its
    cache cannot be read (no compile happens: numba's own index files are looked for)."""
    if kernel() is None or _kernels is None:
        return None
    try:
        files = [k._cache._cache_file._index_path for k in _kernels.values() if hasattr(k, "_cache")]
    except AttributeError:  # another numba's internals: say nothing rather than guess
        return None
    return (bool(files) and all(os.path.exists(f) for f in files)), os.path.dirname(files[0]) if files else ""


def kernel() -> Callable[..., tuple[int, int]] | None:
    """The compiled scan of 1-, 4- and 8-byte elements (2-byte: `scan16_cast`, `scan16_direct`), or None."""
    return _get("scan")


def scatter_bits() -> Callable[..., tuple[int, int]] | None:
    """The compiled bitmap scatter, or None."""
    return _get("scatter_bits")


def scatter_blocks() -> Callable[..., int] | None:
    """The compiled block-code scatter, or None."""
    return _get("scatter_blocks")


def mark_bits() -> Callable[..., None] | None:
    """The compiled bitmap of a block code's positions, or None."""
    return _get("mark_bits")


def cast_bf16() -> Callable[..., bool] | None:
    """The compiled fp32-to-bfloat16 cast, or None without numba or where it does not match torch's (checked
    once on values of every kind; the fused cast of `scan16_cast` is the same formula)."""
    global _cast_checked
    cast = _get("cast_bf16")
    if cast is None:
        return None
    if _cast_checked is None:
        _cast_checked = matches_torch(cast)
    return cast if _cast_checked else None


def digest_lanes() -> Callable[..., int] | None:
    """The compiled lane sum of a host tensor's digest, or None."""
    return _get("digest_lanes")


def scan16_cast() -> Callable[..., tuple[bool, int, int, int, int, int, int]] | None:
    """The compiled scan of fp32 values cast to bf16 as they are read, against a 2-byte baseline, or None."""
    return _get("scan16_cast")


def scan16_direct() -> Callable[..., tuple[bool, int, int, int, int, int, int]] | None:
    """The compiled scan of 2-byte values against a 2-byte baseline, or None."""
    return _get("scan16_direct")


def scatter_steps() -> Callable[..., tuple[int, int]] | None:
    """The compiled one-pass step-code scatter, or None."""
    return _get("scatter_steps")


def unsteps() -> Callable[..., None] | None:
    """The compiled conversion of a step code to the block code's offsets, values and counts, or None."""
    return _get("unsteps")


def words(x: Any) -> Any:
    """The whole 64-bit words at the start of a numpy chunk (its tail is scanned element by element)."""
    whole = x.size * x.itemsize // 8
    return x[: whole * 8 // x.itemsize].view("int64")
