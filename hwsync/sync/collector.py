"""Python's cyclic garbage collector, run less often while a sync handles its tensors one by one.

A sync that plans its tensors (the first one, and every one whose tensors are new objects: a trainer that gathers
sharded parameters each step) makes a few objects a tensor on each side (references and their frames' entries,
views, the plan it records), and many of them live until the sync ends. Python's collector runs every 700 new
objects and moves whatever is alive then into older generations; once enough has moved it scans every object of the
process. On a planned sync of 20,000 tensors (0.5 GB) that was about one full collection a sync in each process
(0.12-0.19 s each, in processes of 330,000-490,000 objects): held back, such a sync runs 1.39-1.53x faster
(`hwsync bench tensors --fresh --gc-baseline`, docs/performance.md).

So a sync holds the collector back: the first generation is collected every HELD_THRESHOLD new objects instead of
700, and the objects a sync makes for a moment are freed by reference counting before any collection moves them. A
sync of up to ~10,000 tensors then runs no collection at all. Unlike gc.disable(), the collector still runs (every
HELD_THRESHOLD new objects of any thread), so the garbage that waits stays bounded; the thresholds the process had
come back when its last sync ends, unless someone set others meanwhile (theirs stay). HWSYNC_GC_HOLD=0 leaves the
collector alone.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: while a sync runs, the first generation is collected every this many new objects (Python's default: 700)
HELD_THRESHOLD = 100_000

_lock = threading.Lock()
_holders = 0
#: the thresholds before the first hold, restored after the last (None: nothing was raised)
_saved: tuple[int, ...] | None = None


def hold_collector() -> Callable[[], None]:
    """Raise the collector's first threshold to HELD_THRESHOLD; the returned function undoes it (once). Holds on
    several threads share one raise, undone by the last release."""
    global _holders, _saved
    if os.environ.get("HWSYNC_GC_HOLD", "1") == "0":
        return _nothing
    with _lock:
        if _holders == 0:
            current = gc.get_threshold()
            # 0 is a collector turned off by threshold; a higher one is the process's own choice: both stay
            _saved = current if 0 < current[0] < HELD_THRESHOLD else None
            if _saved is not None:
                gc.set_threshold(HELD_THRESHOLD, *current[1:])
        _holders += 1
    released = [False]  # read and set under the lock

    def release() -> None:
        global _holders, _saved
        with _lock:
            if released[0]:
                return
            released[0] = True
            _holders -= 1
            if _holders == 0 and _saved is not None:
                if gc.get_threshold()[0] == HELD_THRESHOLD:  # else the process set its own meanwhile: it stays
                    gc.set_threshold(*_saved)
                _saved = None

    return release


@contextmanager
def collector_held() -> Iterator[None]:
    """hold_collector() for the block."""
    release = hold_collector()
    try:
        yield
    finally:
        release()


def _nothing() -> None:
    pass


def _after_fork_in_child() -> None:
    """A child forked during a hold has no sync running: its thresholds go back, and no hold is counted."""
    global _holders, _saved, _lock
    _lock = threading.Lock()
    if _holders and _saved is not None and gc.get_threshold()[0] == HELD_THRESHOLD:
        gc.set_threshold(*_saved)
    _holders, _saved = 0, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
