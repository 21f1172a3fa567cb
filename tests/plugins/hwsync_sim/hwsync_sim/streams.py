"""Simulated streams: device work that runs later, in order, on a thread of its own.

A stream is a queue drained by one thread. Work put on it runs `delay_s` after it was queued,
never earlier, unless someone waits for it: synchronizing the stream (or an event on it) makes
everything queued before that point run at once. So correct code (which waits before it reads)
pays nothing, and code that reads without waiting sees the bytes from before the work, as it
would on a GPU whose copy engine is still busy.

An operation that fails makes the stream's error sticky, as a CUDA error is: every later
synchronize raises it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any


class SimStreamError(RuntimeError):
    """Work queued on a simulated stream failed; raised when the stream is next waited for."""


class SimEvent:
    """Marks a point in a stream; done once everything queued before it has run."""

    def __init__(self, stream: "SimStream", seq: int) -> None:
        self.stream = stream
        self.seq = seq
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.value: Any = None

    def query(self) -> bool:
        """Whether the work up to this event has run (never waits, never hurries)."""
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        """Make the stream run up to this event now and wait for it; False on timeout."""
        self.stream.hurry(self.seq)
        return self._done.wait(timeout)

    def _finish(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error
        self._done.set()


class SimStream:
    """One in-order queue of device work on one simulated device, run by a thread."""

    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.delay_s = delay_s
        self._cv = threading.Condition()
        self._queue: collections.deque[tuple[int, float, Callable[[], Any], SimEvent, bool]] = collections.deque()
        self._seq = 0
        self._hurry_to = 0  # every item with seq <= this runs without waiting for its delay
        self.error: BaseException | None = None
        self._deferred = threading.local()  # per thread: work that must wait until it leaves self._cv
        self._thread = threading.Thread(target=self._run, name=f"sim-stream-{name}", daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        """The thread that runs this stream's work."""
        return self._thread

    def enqueue(self, work: Callable[[], Any], sticky: bool = True) -> SimEvent:
        """Queue `work`; the returned event is done once it has run (its result or error kept).

        A failure of `sticky` work (launched and left running) poisons the stream as a CUDA
        error does; work the host waits for (`call`) raises where it was called instead.
        """
        with self._cv:
            self._seq += 1
            event = SimEvent(self, self._seq)
            self._queue.append((self._seq, time.monotonic() + self.delay_s, work, event, sticky))
            self._cv.notify()
        self._run_deferred()
        return event

    def record(self) -> SimEvent:
        """An event marking everything queued so far."""
        return self.enqueue(lambda: None)

    def hurry(self, seq: int) -> None:
        """Run everything up to item `seq` without waiting for its delay."""
        with self._cv:
            if seq > self._hurry_to:
                self._hurry_to = seq
                self._cv.notify()
        self._run_deferred()

    def holds_lock(self) -> bool:
        """Whether this thread is inside the stream's lock: a finalizer that garbage collection ran while this thread
        queued work (an allocation in enqueue). Work that waits for the stream must not run there: the stream's
        thread needs the lock to run anything, so it would wait for good."""
        return self._cv._is_owned()  # type: ignore[attr-defined]

    def after_lock(self, work: Callable[[], Any]) -> None:
        """Run `work` on this thread as soon as it leaves the stream's lock (see holds_lock)."""
        if not hasattr(self._deferred, "items"):
            self._deferred.items = []
        self._deferred.items.append(work)

    def _run_deferred(self) -> None:
        items = getattr(self._deferred, "items", None)
        if items and not self.holds_lock():  # the lock is reentrant: only at the outermost exit
            self._deferred.items = []
            for work in items:
                work()

    def synchronize(self) -> None:
        """Wait until everything queued so far has run; raises the stream's sticky error."""
        if threading.current_thread() is not self._thread:
            self.record().synchronize()
        if self.error is not None:
            raise SimStreamError(f"an earlier operation on stream {self.name} failed: "
                                 f"{type(self.error).__name__}: {self.error}") from self.error

    def call(self, work: Callable[[], Any]) -> Any:
        """Run `work` in stream order and wait for it (what a host read of device memory does)."""
        if threading.current_thread() is self._thread:
            return work()
        event = self.enqueue(work, sticky=False)
        event.synchronize()
        if event.error is not None:
            raise event.error
        return event.value

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._queue:
                        seq, ready_at, work, event, sticky = self._queue[0]
                        wait = ready_at - time.monotonic()
                        if seq <= self._hurry_to or wait <= 0:
                            self._queue.popleft()
                            break
                        self._cv.wait(wait)
                    else:
                        self._cv.wait()
            try:
                value, error = work(), None
            except BaseException as exc:  # noqa: BLE001 - kept, raised where the stream is waited for
                value, error = None, exc
                if sticky:
                    self.error = self.error or exc
            del work  # what it captured (device tensors) must not outlive it
            event._finish(value, error)
