"""Threads for host copies, free to run on every CPU of the host whatever core their creator was bound to.

An engine may bind the thread that calls hwsync to one core: vLLM's CPU worker binds its main thread (an OpenMP
thread) to the cores it was given (VLLM_CPU_OMP_THREADS_BIND) and keeps one for its front end and scheduler. A thread
inherits its creator's binding, so copy threads started there would share that one core, while a host copy needs two
cores to run at memory speed on these hosts (one thread copies 0.5 GB in 86 ms, two in ~46 ms). hwsync copies into
an engine while it is paused (a streamed sync holds it; a staged apply runs inside its pause), when no forward pass
needs those cores, so its copy threads unbind themselves when they start.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

#: threads copying host tensors side by side (more gain nothing on two cores; a larger host sets the pool's size
#: where it is made)
HOST_COPY_THREADS = 2
#: host copies of fewer bytes than this run on the calling thread: queueing them costs more than a second core gives
PARALLEL_FROM_BYTES = 32 << 20
#: a contiguous copy larger than this is cut into pieces of it, so that the threads end together
PIECE_BYTES = 16 << 20

#: set while nothing else of the sync runs on this host beside the copies (a staged apply inside the engine's pause,
#: a one-copy read of the sender's shared memory): only then do large copies take a second core. A streamed packed
#: sync leaves it unset: its sender packs the next bucket meanwhile, and a second copy thread would take its core.
_cores_free: ContextVar[bool] = ContextVar("hwsync_host_cores_free", default=False)

_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_pool_lock = threading.Lock()


def unbind_this_thread() -> None:
    """Let the calling thread run on every CPU this process may use (the kernel keeps it inside its cpuset)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # no affinity calls here (not Linux), or a cpuset that refuses: stay bound
        pass


@contextmanager
def host_cores_free() -> Iterator[None]:
    """Within this block (on this thread) the sync has the host's cores to itself: copy_host_tensors may spread."""
    token = _cores_free.set(True)
    try:
        yield
    finally:
        _cores_free.reset(token)


def copy_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool of `threads` copy threads named `name`, each unbound as it starts."""
    return ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=unbind_this_thread)


def _shared_pool() -> ThreadPoolExecutor:
    """This process's copy threads (a forked child makes its own: its parent's threads are not in it)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool, _pool_pid = copy_pool(HOST_COPY_THREADS, "hwsync-host-copy"), os.getpid()
        return _pool


def _pieces(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(dest, src, bytes) for each copy, a contiguous one larger than PIECE_BYTES cut into pieces of about that."""
    out = []
    for dest, src in zip(dests, srcs):
        nbytes = dest.numel() * dest.element_size()
        if (nbytes <= PIECE_BYTES or dest.dtype != src.dtype or dest.shape != src.shape
                or not (dest.is_contiguous() and src.is_contiguous())):
            out.append((dest, src, nbytes))
            continue
        flat_dest, flat_src, step = dest.view(-1), src.view(-1), max(1, PIECE_BYTES // dest.element_size())
        for start in range(0, dest.numel(), step):
            piece = flat_dest[start:start + step]
            out.append((piece, flat_src[start:start + step], piece.numel() * piece.element_size()))
    return out


def copy_host_tensors(dests: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dest.copy_(src)` for each pair of host tensors, on HOST_COPY_THREADS copy threads when they are large and
    the cores are free (`host_cores_free`; each thread a run of about equal bytes, in order), else here; returns
    once every copy ran, raising the first error."""
    total = sum(d.numel() * d.element_size() for d in dests)
    if total < PARALLEL_FROM_BYTES or HOST_COPY_THREADS < 2 or not _cores_free.get():
        torch._foreach_copy_(dests, srcs)
        return
    runs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(HOST_COPY_THREADS)]
    share, done = total / HOST_COPY_THREADS, 0
    for dest, src, nbytes in _pieces(dests, srcs):
        run = runs[min(int(done // share), HOST_COPY_THREADS - 1)]
        run[0].append(dest)
        run[1].append(src)
        done += nbytes
    pool = _shared_pool()
    futures = [pool.submit(torch._foreach_copy_, d, s) for d, s in runs if d]
    errors = [exc for exc in (f.exception() for f in futures) if exc is not None]
    if errors:
        raise errors[0]
