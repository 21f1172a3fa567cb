"""A delta sync's encodes, run on the encode threads ahead of the stream that sends them, in source order.

The stream takes one group of tensors at a time and may wait for the wire meanwhile; the encodes
should not wait with it. Jobs start when this is made (while the plan goes out and the receivers
accept it) and keep going up to AHEAD_BYTES of target tensors ahead of the reader, so on a slow link
the diff runs while earlier groups are on the wire, and one large tensor does not leave the other
threads idle behind it. The results held meanwhile are payloads: for a sparse delta a few percent of
the target's bytes; for a dense one the cast tensor itself, hence a bound in bytes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from hwsync.delta.diff import Delta
from hwsync.delta.header import CODES
from hwsync.errors import ManifestError
from hwsync.sync.spec import TensorSpec
from hwsync.sync.stats import DeltaStats

#: bytes of target tensors whose encodes may run ahead of the reader (4 default buckets)
AHEAD_BYTES = 128 << 20

#: one encode: the tensor as receivers hold it, the work, its arguments
Job = tuple[TensorSpec, Callable[..., Delta], tuple[Any, ...]]


class EncodeAhead:
    """Each job's (target, delta) in order, encoded on `pool` up to `ahead_bytes` of targets (and at least
    `min_jobs` jobs) ahead of the reader.

    Records each result in `deltas` and keeps `note` (the sync's delta stats) current: diff_s counts only the
    time the reader waited. `expected`: how many tensors the manifest announced, checked at the end.
    """

    def __init__(self, jobs: Iterator[Job], pool: ThreadPoolExecutor, deltas: dict[str, Delta],
                 note: DeltaStats, *, expected: int | None, min_jobs: int, ahead_bytes: int = AHEAD_BYTES) -> None:
        self._jobs: Iterator[Job] | None = jobs
        self._pool, self._deltas, self._note = pool, deltas, note
        self._expected, self._min_jobs, self._ahead_bytes = expected, min_jobs, ahead_bytes
        self._window: deque[tuple[TensorSpec, Future[Delta]]] = deque()
        self._ahead = 0
        self._changed = self._total = 0
        note.diff_s, note.density, note.wire_bytes, note.codes = 0.0, 0.0, 0, dict.fromkeys(CODES, 0)
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    def _fill(self) -> None:
        """Start jobs until the window holds `ahead_bytes` of targets and `min_jobs` jobs, or the source ends."""
        while self._jobs is not None and (len(self._window) < self._min_jobs or self._ahead < self._ahead_bytes):
            job = next(self._jobs, None)
            if job is None:
                self._jobs = None
                break
            spec, work, args = job
            self._window.append((spec, self._pool.submit(work, *args)))
            self._ahead += spec.nbytes

    def __iter__(self) -> "EncodeAhead":
        return self

    def __next__(self) -> tuple[TensorSpec, Delta]:
        t0 = time.perf_counter()
        try:
            self._fill()
            if not self._window:
                self._check_count()
                raise StopIteration
            spec, job = self._window.popleft()
            self._ahead -= spec.nbytes
            found = job.result()
            self._fill()  # the freed room goes to the next jobs before the reader works on this result
        except BaseException as error:
            if not isinstance(error, StopIteration):
                self.close()
            raise
        self._deltas[spec.name] = found
        self._changed += found.changed if found.changed is not None else found.header.numel
        self._total += found.header.numel
        note = self._note
        note.codes[found.header.code] += 1
        note.diff_s += time.perf_counter() - t0
        note.density = self._changed / self._total if self._total else 0.0
        note.wire_bytes += found.payload.numel()
        return spec, found

    def _check_count(self) -> None:
        if self._expected is not None and len(self._deltas) != self._expected:
            raise ManifestError(f"the source gave {len(self._deltas)} tensors, the manifest announced "
                                f"{self._expected}; a delta sync sends exactly the announced tensors")

    def close(self) -> None:
        """Stop: jobs not started are cancelled, and those running are waited for (they write their payloads into
        the sender's room, which the next sync takes again)."""
        running = [job for _, job in self._window if not job.cancel()]
        self._window.clear()
        self._jobs = None
        wait(running)
