"""Jobs on a pool's threads that a receiver waits for together: every one ends, failed or not, before the first
failure is raised (the jobs work on views of a buffer, or on the engine's tensors, that must outlive them).

The first failure is raised without a reference cycle: a failed job's traceback holds the frames it ran in (and
with them the bucket's views or the tensors they wrote), and a cycle through it would keep those alive, and the
mapping under a view, until a garbage collection.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from typing import Any


def wait_all(jobs: list[Future[Any]]) -> None:
    """Wait for every job, then raise the first failure in `jobs`' order; empties `jobs` (the caller's list would
    otherwise hold the futures, and with them the error raised, in the frame the error's traceback holds)."""
    wait(jobs)
    errors = [job.exception() for job in jobs]
    jobs.clear()
    raise_first(errors)


def raise_first(errors: list[BaseException | None]) -> None:
    """Raise the first error in `errors` (None: that job succeeded), with the jobs' tracebacks dropped; empties
    `errors`. Nothing raised when none failed."""
    first = next((error for error in errors if error is not None), None)
    for error in errors:
        if error is not None:
            error.__traceback__ = None
    errors.clear()
    if first is not None:
        try:
            raise first
        finally:
            first = None
