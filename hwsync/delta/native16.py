"""The host kernels of 2-byte elements (bf16, fp16: what engines hold), where numba is installed: which exist.

The kernels are in kernels16.py, imported at the first use. A delta of 2-byte elements is a step code
(steps.py) unless it is very sparse or full of escapes, so the scan makes the step code and nothing else:
the block and bitmap codes, when smaller, are rebuilt from it (`unsteps`). The scan reads the trainer's
tensor (fp32 masters cast to bf16 as they are read, or 2-byte values) and the baseline once, 128 elements
at a time: a vectorised pass makes two 64-bit masks of the elements that differ, then a loop over exactly
the set bits emits each change's unit and digest terms. It picks the next bit from the two masks without a
branch: a loop per 64-bit mask ended at an unpredictable place every 64 elements, and those mispredictions
were half the scan at RL densities (368M elements at 2% changed, one thread: 0.200 s with the earlier scan,
0.116 s with this one, against a 0.109 s read floor). The digest's row key is constant over a run of RUN
elements (kernels16.py), so each change costs one column key and the row key multiplies the run's sums once.

The scatter applies a step code in one pass: it checks the payload as it writes and, when anything is
wrong (a malformed unit, or values at the changes whose digest terms are not the base's), puts back what
it wrote (a difference's old value is the new one less the difference; an escape's is kept): nothing is
left changed. It asks the cache for lines ahead of its writes: changes a few dozen elements apart defeat
the hardware's prefetcher (kernels16.py; 368M elements at 1/2/4% changed: 0.072/0.092/0.066 s without,
0.026/0.031/0.039 s with).
"""

from __future__ import annotations

import os
from typing import Any, Callable

_kernels: dict[str, Callable[..., Any]] | None = None
_tried = False


def _build() -> dict[str, Callable[..., Any]] | None:
    try:
        import numba  # noqa: F401  # the kernels' module needs it: without it, the torch path
    except ImportError:
        return None
    from hwsync.delta import kernels16

    return {"scan_cast": kernels16.scan_cast, "scan_direct": kernels16.scan_direct, "scatter": kernels16.scatter,
            "unsteps": kernels16.unsteps}


def _get(name: str) -> Callable[..., Any] | None:
    global _kernels, _tried
    if not _tried:
        _tried = True
        if os.environ.get("HWSYNC_DELTA_NUMBA", "1") != "0":
            _kernels = _build()
    return None if _kernels is None else _kernels[name]


def scan_cast() -> Callable[..., tuple[bool, int, int, int, int, int, int]] | None:
    """The compiled scan of fp32 values cast to bf16 as they are read, or None without numba."""
    return _get("scan_cast")


def scan_direct() -> Callable[..., tuple[bool, int, int, int, int, int, int]] | None:
    """The compiled scan of 2-byte values, or None without numba."""
    return _get("scan_direct")


def scatter_steps() -> Callable[..., tuple[int, int]] | None:
    """The compiled one-pass step-code scatter, or None without numba."""
    return _get("scatter")


def unsteps() -> Callable[..., None] | None:
    """The compiled conversion of a step code to the block code's offsets, values and counts, or None."""
    return _get("unsteps")
