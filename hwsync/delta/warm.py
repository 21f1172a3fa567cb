"""Load the host kernels before a delta uses them, off every sync's clock.

numba compiles each kernel once per machine and caches it on disk (kernels.py, kernels16.py), and every
process still loads it from there at its first call with those argument types. Here, for every width:
32 s to compile in a fresh environment, 2.6 s to load from the cache. Either would land inside a sync and
could outlast its timeout, so no sync waits for it: `start()` loads them on a thread of its own (a sender or
receiver calls it when it enters delta mode), by encoding and applying a small tensor of each width in
every code (the kernels then see the argument types of real syncs), and the codec runs torch ops, which give
the same bytes, until they are loaded (native.ready). The log says when they are, and whether numba compiled
them or took them from its cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import torch

from hwsync.delta import native
from hwsync.delta.diff import encode
from hwsync.delta.digest import tensor_digest
from hwsync.delta.header import INT_VIEW
from hwsync.delta.patch import apply_into

log = logging.getLogger("hwsync")

#: one dtype of each width the kernels see, and bfloat16 for the cast of fp32 masters
EVERY_WIDTH = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.bool)

_warm: set[torch.dtype] = set()
_lock = threading.Lock()
_loader: threading.Thread | None = None


def start() -> None:
    """Load the compiled kernels on a thread of their own, once a process (nothing to do without numba)."""
    global _loader
    with _lock:
        if _loader is not None or native.kernel() is None:
            return
        _loader = threading.Thread(target=_load, name="hwsync-delta-kernels", daemon=True)
        _loader.start()


def wait(timeout: float | None = None) -> bool:
    """start(), then wait until the kernels are loaded; False without numba or on timeout."""
    start()
    return native.wait_loaded(timeout)


def _load() -> None:
    t0 = time.perf_counter()
    try:
        with native.loading():
            warm_up(EVERY_WIDTH)
    except Exception as exc:  # noqa: BLE001 - a thread's failure must not go unseen; torch ops serve meanwhile
        log.warning("hwsync: loading the delta codec's compiled kernels failed (%s: %s); deltas use torch ops, "
                    "which give the same bytes, more slowly", type(exc).__name__, exc)
        return
    native.mark_loaded()
    compiled = native.cache_misses()
    log.info("hwsync: the delta codec's compiled kernels are loaded in %.1f s (%s); deltas before that ran torch "
             "ops", time.perf_counter() - t0,
             f"numba compiled {compiled} signatures and cached them for later processes" if compiled
             else "from numba's disk cache")


def warm_up(dtypes: Iterable[torch.dtype]) -> None:
    """Load the kernels that deltas of `dtypes` (the engine's) run, from an fp32 trainer tensor where they are
    floating; at once where numba is missing or they are loaded already."""
    if native.kernel() is None:
        return
    with _lock:
        todo = [d for d in dict.fromkeys(dtypes) if d not in _warm and d.itemsize in INT_VIEW]
        _warm.update(todo)
    for dtype in todo:
        base = torch.zeros(1 << 16, dtype=dtype)
        ints = base.view(INT_VIEW[dtype.itemsize])
        for every, far in ((50, False), (1000, True), (3, True)):  # the step, block and bitmap codes
            new = base.clone()
            bits = new.view(ints.dtype)
            bits[::every] = 0x5A if far and dtype.itemsize > 1 else 1  # 1-byte: 1 keeps a bool a bool
            trainers = [new]
            if dtype.is_floating_point and dtype.itemsize < 4:
                trainers.append(new.float())  # the cast of fp32 masters
            for trainer in trainers:
                delta = encode(trainer, base, base_digest=tensor_digest(base))
                apply_into(base.clone(), delta.header, delta.payload, gain=True)
