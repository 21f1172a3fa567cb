"""Load the host kernels before a delta uses them, off every sync's clock.

numba compiles each kernel once per machine and caches it on disk (kernels.py, kernels16.py), and every
process still loads it from there at its first call with those argument types. Here, for every width:
32 s to compile in a fresh environment, 2.6 s to load from the cache. Either would land inside a sync and
could outlast its timeout, so no sync waits for it: `start()` (a sender or receiver calls it when it enters
delta mode) loads them on a thread of its own, by encoding and applying a small tensor of each width in every
code (the kernels then see the argument types of real syncs), and the codec runs torch ops, which give the
same bytes, until they are loaded (native.ready). Where numba's cache lacks them, a child process compiles
them first (`python -m hwsync.delta.warm`): a compile is half a minute of numba's Python, which in a thread
would hold this process's GIL against the sync (a small full sync took 3-4 s instead of 0.1 s), and the
child takes a lock in the cache folder, so that the processes of one machine compile them once. The log
says when the kernels are loaded, and whether this process waited for a compile. An exit while the
kernels load waits for the load (numba's compiler must not be inside a call when the interpreter ends), and
ends a compile child (the next process compiles again).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import subprocess
import sys
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
#: at exit, how long to wait for a load from the cache still running (it takes a few seconds)
EXIT_WAIT_S = 30.0

_warm: set[torch.dtype] = set()
_lock = threading.Lock()
_loader: threading.Thread | None = None
_compiler: subprocess.Popen | None = None
#: set once the interpreter exits: a compile child ended then is no failure to report
_exiting = threading.Event()


def start() -> None:
    """Load the compiled kernels on a thread of their own, once a process (nothing to do without numba)."""
    global _loader
    with _lock:
        if _loader is not None or native.kernel() is None:
            return
        _loader = threading.Thread(target=_load, name="hwsync-delta-kernels", daemon=True)
        atexit.register(_at_exit)
        _loader.start()


def wait(timeout: float | None = None) -> bool:
    """start(), then wait until the kernels are loaded; False without numba or on timeout."""
    start()
    return native.wait_loaded(timeout)


def _load() -> None:
    t0 = time.perf_counter()
    try:
        compiled = _compile_if_missing()
        if _exiting.is_set():
            return
        warm_up(EVERY_WIDTH)
    except Exception as exc:  # noqa: BLE001 - a thread's failure must not go unseen; torch ops serve meanwhile
        if not _exiting.is_set():
            log.warning("hwsync: loading the delta codec's compiled kernels failed (%s: %s); deltas use torch ops, "
                        "which give the same bytes, more slowly", type(exc).__name__, exc)
        return
    log.info("hwsync: the delta codec's compiled kernels are loaded in %.1f s (%s); deltas before that ran torch "
             "ops", time.perf_counter() - t0,
             "numba compiled them first, in a child process, into its disk cache" if compiled
             else "from numba's disk cache")
    native.mark_loaded()  # the last thing this thread does: an exit waits for its end (_at_exit)


def _compile_if_missing() -> bool:
    """Where numba's cache lacks a kernel, compile them all in a child process and wait for it; whether it did."""
    global _compiler
    cached = native.cached_on_disk()
    if cached is None or cached[0]:
        return False
    child = subprocess.Popen([sys.executable, "-m", "hwsync.delta.warm", cached[1]], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _compiler = child
    _, err = child.communicate()
    _compiler = None
    if child.returncode:
        raise RuntimeError(f"the compile child ended with status {child.returncode}: {err.decode()[-400:]}")
    return True


def _at_exit() -> None:
    """A compile child is ended (numba's cache entries are whole or absent), then the loading thread is waited for:
    a thread that ran numba and is still ending while the interpreter exits can abort the process (its C++
    thread-local state is torn down beside the process's own: "terminate called without an active exception",
    1 exit in about 12 here)."""
    _exiting.set()
    child = _compiler
    if child is not None and child.poll() is None:
        child.terminate()
    if _loader is not None:
        _loader.join(EXIT_WAIT_S)


def compile_all(folder: str) -> None:
    """The compile child's work: under a lock in numba's cache `folder` (one compile per machine at a time),
    compile (or, if another child just did, load) every kernel."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "hwsync-compile.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        warm_up(EVERY_WIDTH)


def warm_up(dtypes: Iterable[torch.dtype]) -> None:
    """Load the kernels that deltas of `dtypes` (the engine's) run, from an fp32 trainer tensor where they are
    floating; at once where numba is missing or they are loaded already."""
    if native.kernel() is None:
        return
    with _lock:
        todo = [d for d in dict.fromkeys(dtypes) if d not in _warm and d.itemsize in INT_VIEW]
        _warm.update(todo)
    with native.loading():  # the codec runs the kernels on this thread, loaded or not
        for dtype in todo:
            _exercise(dtype)


def _exercise(dtype: torch.dtype) -> None:
    """Encode and apply a small tensor of `dtype` in every code (and from fp32 where it is a narrower float)."""
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


if __name__ == "__main__":
    compile_all(sys.argv[1])
