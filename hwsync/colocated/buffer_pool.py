"""Which buffer the sender fills next: cycling through a few (cache-hot) or through all of them.

With small buckets a pair of buffers stays in the CPU cache: the receiver reads what the
sender has just written without either touching main memory, and a sync runs near the speed
of one plain copy. That holds while the two processes share a last-level cache. When they do
not (a VM whose two vCPUs the host placed on different dies, say), writing lines the other side
has just read costs a cross-die invalidation per line and the hot pair is several times slower
than going through memory; cycling through the whole pool, whose lines have gone cold by the
time they are reused, is then the faster way. Which case holds can change mid-run, so the pool
measures both as it goes and uses the faster one, trying the other now and then. A try is a
short window (a quarter of a normal one), cut short after any bucket that shows it losing by
half: the wrong mode has been seen to cost 8x while it lasts. The first bucket after a switch
is left out of a try's timing: it pays for the switch (buffers untouched for a while), not for
the mode, and timing it made the whole pool look 8x slower than it was.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

#: windows in the preferred mode before the other one is tried again: doubles from the first
#: figure each time the other loses again, back to the first when a mode is left for being slow
RETRY_FIRST, RETRY_MOST = 4, 32
HOT, COLD = "hot", "cold"
#: a try ends early once its cost per byte exceeds the other mode's by this factor
LOSING = 1.5


class BufferPool:
    """Chooses buffers for consecutive buckets; a buffer's previous bucket must be released first."""

    def __init__(self, num_buffers: int, bucket_bytes: int, hot_buffers: int = 2, window_buckets: int = 16) -> None:
        self.num_buffers = num_buffers
        self.hot_buffers = min(hot_buffers, num_buffers)
        self.adaptive = num_buffers > self.hot_buffers
        self._lru: deque[int] = deque(range(num_buffers))  # least recently used first
        #: the sequence number of the bucket each buffer last held (-1: never used)
        self.holder = [-1] * num_buffers
        self.mode = HOT if self.adaptive else COLD
        #: measured seconds per byte of each mode (None: not measured yet)
        self.cost: dict[str, float | None] = {HOT: None, COLD: None}
        self._window_bytes = window_buckets * bucket_bytes
        self._probe_bytes = max(2, window_buckets // 4) * bucket_bytes
        #: windows scored so far (tries included)
        self.windows = 0
        self._window_start = 0.0
        self._window_filled = 0
        self._windows_in_mode = 0
        self._retry_every = RETRY_FIRST
        self._trying = False
        self._try_buckets = 0

    def begin_sync(self) -> None:
        """Start timing afresh: the gap between syncs is not transfer time."""
        self._window_start = time.perf_counter()
        self._window_filled = 0

    def take(self, seq: int) -> tuple[int, int]:
        """(buffer for bucket `seq`, the bucket it held before, which must be released first; -1: none)."""
        if self.mode == HOT:
            # the least recently used of the `hot_buffers` most recently used
            index = self._lru[self.num_buffers - self.hot_buffers]
        else:
            index = self._lru[0]
        self._lru.remove(index)
        self._lru.append(index)
        previous = self.holder[index]
        self.holder[index] = seq
        return index, previous

    def filled(self, nbytes: int) -> None:
        """Account a posted bucket; at the end of a window, score the mode and maybe switch."""
        if not self.adaptive:
            return
        self._window_filled += nbytes
        if not self._trying:
            if self._window_filled < self._window_bytes:
                return
            now = time.perf_counter()
        else:
            now = time.perf_counter()
            self._try_buckets += 1
            if self._try_buckets == 1:  # the switch's own bucket: time the try from here
                self._window_start, self._window_filled = now, 0
                return
            rival = self.cost[COLD if self.mode == HOT else HOT]
            losing = rival is not None and (now - self._window_start) / self._window_filled > LOSING * rival
            if self._window_filled < self._probe_bytes and not losing:
                return
        cost = (now - self._window_start) / self._window_filled
        self._window_start, self._window_filled = now, 0
        self.windows += 1
        self.cost[self.mode] = cost
        self._windows_in_mode += 1
        other = COLD if self.mode == HOT else HOT
        other_cost = self.cost[other]
        if self._trying:  # this window was a try of this mode: keep it only if it won
            self._trying = False
            if other_cost is not None and other_cost < cost:
                self._retry_every = min(self._retry_every * 2, RETRY_MOST)
                self._switch(other)
            else:
                self._retry_every = RETRY_FIRST
        elif other_cost is None or self._windows_in_mode >= self._retry_every:
            self._switch(other)
            self._trying = True
            self._try_buckets = 0
        elif other_cost < cost:  # this mode got slower: the machine changed, and may change back soon
            self._switch(other)
            self._retry_every = RETRY_FIRST

    def _switch(self, mode: str) -> None:
        self.mode = mode
        self._windows_in_mode = 0

    def to_dict(self) -> dict[str, Any]:
        """The current choice and what each mode measured, in GB/s."""
        rate = {m: (round(1e-9 / c, 2) if c else None) for m, c in self.cost.items()}
        return {"mode": self.mode, "hot_buffers": self.hot_buffers, "buffers": self.num_buffers, "gbps": rate}
