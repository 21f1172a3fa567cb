"""Host memmoves in batches: many copies on recorded addresses at one call a batch.

A replayed sync copies each of its tensors with a memmove on addresses recorded when it was planned (replay.py).
From Python each memmove is a ctypes call, about a microsecond and the GIL taken back after each: 20,000 tensors
cost 20 ms a side beyond their bytes, and copy threads contend for the GIL instead of copying side by side. Where
numba is installed (vLLM depends on it), one compiled loop runs a whole batch without the GIL (copy_kernel.py).

numba compiles that loop once per machine (about a second, then cached on disk) and each process loads it (numba
itself is most of that: 3-4 s of Python). `warm()` loads it on a thread of its own when a process first keeps a plan
of at least COMPILED_FROM copies, so no sync waits for it; until it is loaded, batches run as ctypes calls, with the
same bytes. HWSYNC_NUMBA_COPIES=0 keeps the ctypes calls.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import threading
import time
from types import ModuleType
from typing import Any

log = logging.getLogger("hwsync")

#: a plan of fewer copies than this keeps the ctypes calls: they cost it under 2 ms a sync, less than loading numba
#: costs the process once (3-4 s of its Python)
COMPILED_FROM = 2048
#: at exit, how long to wait for a load still running (numba's compiler must not be inside a call when the
#: interpreter ends)
EXIT_WAIT_S = 30.0

_kernel: ModuleType | None = None
_loader: threading.Thread | None = None
_lock = threading.Lock()


class Moves:
    """Copies on addresses as rows (address, offset, bytes): from the address to base + offset (`move_in`), or back
    (`move_out`). The memory at both ends must stay alive and in place while it is used (the plan's checks)."""

    __slots__ = ("rows", "_array")

    def __init__(self, rows: list[tuple[int, int, int]]) -> None:
        self.rows = rows
        self._array: Any = None  # the rows as numpy's int64 (n, 3), made at the first compiled run

    def __len__(self) -> int:
        return len(self.rows)

    def move_in(self, base: int) -> None:
        """memmove each row: from the address to base + offset."""
        kernel = _kernel
        if kernel is not None:
            kernel.move_in(self._rows_array(), base)
            return
        memmove = ctypes.memmove
        for address, offset, nbytes in self.rows:
            memmove(base + offset, address, nbytes)

    def move_out(self, base: int = 0) -> None:
        """memmove each row: from base + offset to the address (base 0: rows of (destination, source, bytes))."""
        kernel = _kernel
        if kernel is not None:
            kernel.move_out(self._rows_array(), base)
            return
        memmove = ctypes.memmove
        for address, offset, nbytes in self.rows:
            memmove(address, base + offset, nbytes)

    def _rows_array(self) -> Any:
        if self._array is None:
            import numpy as np

            self._array = np.array(self.rows, dtype=np.int64).reshape(-1, 3)
        return self._array


def compiled() -> bool:
    """Whether batches run as the compiled loop in this process now."""
    return _kernel is not None


def warm(copies: int = COMPILED_FROM) -> None:
    """Load the compiled loop on a thread of its own, once per process, for a plan of `copies` copies (nothing for a
    small one, without numba, or with HWSYNC_NUMBA_COPIES=0)."""
    global _loader
    with _lock:
        if _loader is not None or copies < COMPILED_FROM or os.environ.get("HWSYNC_NUMBA_COPIES", "1") == "0":
            return
        _loader = threading.Thread(target=_load, name="hwsync-copy-kernel", daemon=True)
        atexit.register(_at_exit)
        _loader.start()


def wait(timeout: float | None = None) -> bool:
    """warm(), then wait for the load; whether the compiled loop runs now."""
    warm()
    loader = _loader
    if loader is not None:
        loader.join(timeout)
    return compiled()


def _load() -> None:
    global _kernel
    t0 = time.perf_counter()
    try:
        import numpy as np

        from hwsync.sync import copy_kernel
    except ImportError:  # no numba: the ctypes calls stay
        return
    except Exception as exc:  # noqa: BLE001  # a numba that does not import here (e.g. against this numpy)
        log.warning("hwsync: numba did not import (%s: %s); host copies run as ctypes calls", type(exc).__name__, exc)
        return
    try:  # each kernel once on a real buffer (this compiles it, or loads it from numba's cache), checked
        buf = np.zeros(16, dtype=np.uint8)
        buf[:4] = (1, 2, 3, 4)
        at = buf.ctypes.data
        copy_kernel.move_in(np.array([[at, 4, 4]], dtype=np.int64), at)
        copy_kernel.move_out(np.array([[at + 12, 4, 4]], dtype=np.int64), at)
        if buf.tolist() != [1, 2, 3, 4, 1, 2, 3, 4, 0, 0, 0, 0, 1, 2, 3, 4]:
            raise RuntimeError(f"the compiled copy loop copied wrong: {buf.tolist()}")
    except Exception as exc:  # noqa: BLE001  # a loop that does not load or copy wrong is never used
        log.warning("hwsync: the compiled host copy loop did not load (%s: %s); copies run as ctypes calls",
                    type(exc).__name__, exc)
        return
    _kernel = copy_kernel
    log.debug("hwsync: the compiled host copy loop is loaded (%.2f s)", time.perf_counter() - t0)


def _at_exit() -> None:
    loader = _loader
    if loader is not None and loader.is_alive():
        loader.join(EXIT_WAIT_S)
