"""BufferPool: which buffer the sender fills next, and how it picks hot pair or whole pool by measured speed.

Pure unit tests: the pool's clock is replaced by one the test moves by hand.
"""

from __future__ import annotations

import pytest

import hwsync.colocated.stream
from hwsync.colocated.stream import COLD, HOT, RETRY_FIRST, RETRY_MOST, BufferPool

#: one window is 4 buckets of 250 MB: 1 GB, so a window of 1 s is 1 GB/s
BUCKET = 250_000_000
WINDOW = 4


class Clock:
    """perf_counter for the pool: time moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(hwsync.colocated.stream.time, "perf_counter", fake)
    return fake


def new_pool(clock: Clock, num_buffers: int = 8) -> tuple[BufferPool, list[int]]:
    pool = BufferPool(num_buffers, BUCKET, window_buckets=WINDOW)
    pool.begin_sync()
    return pool, [0]  # the pool and the next bucket's sequence number


def run_window(pool: BufferPool, seq: list[int], clock: Clock, seconds: dict[str, float]) -> str:
    """Fill buckets until the pool scores a window, the clock moving by each bucket's cost in the mode
    in use (a normal window of the mode costs `seconds[mode]`); returns that mode."""
    mode, scored = pool.mode, pool.windows
    while pool.windows == scored:
        assert pool.mode == mode, "the mode changes only at the end of a window"
        pool.take(seq[0])
        seq[0] += 1
        clock.now += seconds[mode] / WINDOW
        pool.filled(BUCKET)
    return mode


def takes(pool: BufferPool, first: int, n: int) -> list[tuple[int, int]]:
    return [pool.take(seq) for seq in range(first, first + n)]


def test_two_buffers_alternate_and_never_adapt(clock):
    pool = BufferPool(2, BUCKET, window_buckets=WINDOW)
    pool.begin_sync()
    assert pool.adaptive is False and pool.mode == COLD
    got = []
    for seq in range(6):
        got.append(pool.take(seq))
        clock.now += 5.0
        pool.filled(BUCKET)
    # each buffer is handed out with the bucket it held before, which must be released first
    assert got == [(0, -1), (1, -1), (0, 0), (1, 1), (0, 2), (1, 3)]
    assert pool.mode == COLD and pool.cost == {HOT: None, COLD: None}, "a pair has nothing to choose"
    assert BufferPool(8, BUCKET).adaptive is True


def test_hot_mode_cycles_through_the_two_most_recently_used_buffers(clock):
    pool, _ = new_pool(clock)
    assert pool.mode == HOT
    got = takes(pool, 0, 10)
    buffers = [index for index, _ in got]
    assert len(set(buffers)) == 2 and buffers[0] != buffers[1]
    assert buffers == buffers[:2] * 5, "the hot pair alternates"
    assert [previous for _, previous in got] == [-1, -1] + list(range(8))
    assert sorted(pool.holder) == [-1] * 6 + [8, 9]


def test_cold_mode_cycles_through_every_buffer(clock):
    pool, _ = new_pool(clock)
    pool.mode = COLD
    got = takes(pool, 0, 20)
    buffers = [index for index, _ in got]
    assert sorted(buffers[:8]) == list(range(8)), "all 8 buffers, each once"
    assert buffers[8:16] == buffers[:8] and buffers[16:] == buffers[:4], "then the same round again"
    assert [previous for _, previous in got] == [-1] * 8 + list(range(12))


def test_switching_to_cold_first_reuses_the_least_recently_used(clock):
    pool, _ = new_pool(clock)
    hot = {index for index, _ in takes(pool, 0, 4)}
    pool.mode = COLD
    following = [index for index, _ in takes(pool, 4, 8)]
    assert set(following) == set(range(8)) and set(following[-2:]) == hot, \
        "the buffers just used are the last the whole-pool round comes back to"


@pytest.mark.parametrize("hot_s,cold_s,settled", [(1.0, 3.0, HOT), (3.0, 1.0, COLD)],
                         ids=["hot-cheaper", "cold-cheaper"])
def test_one_window_in_each_mode_then_the_cheaper_one(clock, hot_s, cold_s, settled):
    pool, seq = new_pool(clock)
    cost = {HOT: hot_s, COLD: cold_s}
    assert run_window(pool, seq, clock, cost) == HOT
    assert pool.mode == COLD, "the other mode is measured next"
    assert run_window(pool, seq, clock, cost) == COLD
    assert pool.mode == settled
    assert pool.cost[HOT] == pytest.approx(hot_s / 1e9) and pool.cost[COLD] == pytest.approx(cold_s / 1e9)
    modes = [run_window(pool, seq, clock, cost) for _ in range(RETRY_FIRST - 1)]
    assert modes == [settled] * (RETRY_FIRST - 1), "it stays with the cheaper mode"


def test_a_failed_retry_doubles_the_interval_and_a_won_one_resets_it(clock):
    pool, seq = new_pool(clock)
    cost = {HOT: 1.0, COLD: 3.0}
    modes = [run_window(pool, seq, clock, cost) for _ in range(2 + 8 + 1 + 16 + 1 + 3 * (RETRY_MOST + 1))]
    assert modes[:2] == [HOT, COLD]
    # each cold window is a retry that lost: hot for twice as long before the next one, RETRY_MOST at most
    runs = "".join("h" if m == HOT else "c" for m in modes[2:]).split("c")
    assert RETRY_MOST == 32
    assert [len(r) for r in runs] == [2 * RETRY_FIRST, 16, RETRY_MOST, RETRY_MOST, RETRY_MOST, 0]

    # cold turns cheap while hot stays below the cold figure measured last: only the next retry can tell
    cost = {HOT: 2.5, COLD: 1.0}
    modes = [run_window(pool, seq, clock, cost) for _ in range(RETRY_MOST + RETRY_FIRST + 1 + 8 + 1)]
    assert modes == [HOT] * RETRY_MOST + [COLD] * RETRY_FIRST + [HOT] + [COLD] * 8 + [HOT], \
        "the won retry keeps cold and starts the interval again at 4; hot then loses and it doubles to 8"
    assert pool.mode == COLD


def test_a_mode_slower_than_the_others_last_figure_is_left_at_once(clock):
    pool, seq = new_pool(clock)
    cost = {HOT: 1.0, COLD: 3.0}
    assert [run_window(pool, seq, clock, cost) for _ in range(3)] == [HOT, COLD, HOT]
    cost = {HOT: 4.0, COLD: 2.0}  # hot becomes slower than cold was
    assert run_window(pool, seq, clock, cost) == HOT
    assert pool.mode == COLD, "no waiting for the retry interval"
    # the machine just changed and may change back: hot is tried again after the first interval, not 8
    modes = [run_window(pool, seq, clock, cost) for _ in range(RETRY_FIRST + 1 + 8 + 1)]
    assert modes == [COLD] * RETRY_FIRST + [HOT] + [COLD] * 8 + [HOT] and pool.mode == COLD


def test_to_dict_reports_gigabytes_per_second(clock):
    pool, seq = new_pool(clock)
    assert pool.to_dict() == {"mode": HOT, "hot_buffers": 2, "buffers": 8, "gbps": {HOT: None, COLD: None}}
    run_window(pool, seq, clock, {HOT: 0.5, COLD: 4.0})  # 1 GB in 0.5 s
    run_window(pool, seq, clock, {HOT: 0.5, COLD: 4.0})  # 1 GB in 4 s
    assert pool.to_dict() == {"mode": HOT, "hot_buffers": 2, "buffers": 8, "gbps": {HOT: 2.0, COLD: 0.25}}


def test_begin_sync_leaves_the_gap_between_syncs_out(clock):
    pool, seq = new_pool(clock)
    for _ in range(WINDOW // 2):
        pool.take(seq[0])
        seq[0] += 1
        clock.now += 0.25
        pool.filled(BUCKET)
    clock.now += 100.0  # the trainer computes between syncs
    pool.begin_sync()
    for _ in range(WINDOW):
        pool.take(seq[0])
        seq[0] += 1
        clock.now += 0.25
        pool.filled(BUCKET)
    assert pool.to_dict()["gbps"][HOT] == 1.0, "1 GB in 1 s, the idle 100 s not counted"


def window_lengths(clock: Clock, per_bucket: dict[str, float], windows: int = 3
                   ) -> tuple[list[tuple[int, str]], BufferPool]:
    """(buckets in each scored window, the mode after it) for a pool of 8 with 16-bucket windows, and the pool."""
    pool = BufferPool(8, BUCKET, window_buckets=16)
    pool.begin_sync()
    lengths, seq = [], 0
    for _ in range(windows):
        scored, n = pool.windows, 0
        while pool.windows == scored:
            pool.take(seq)
            clock.now += per_bucket[pool.mode]
            pool.filled(BUCKET)
            n, seq = n + 1, seq + 1
        lengths.append((n, pool.mode))
    return lengths, pool


def test_a_try_of_the_other_mode_is_a_quarter_window(clock):
    # cold is slower, yet not by half: the try runs its course
    lengths, _ = window_lengths(clock, {HOT: 1.0, COLD: 1.2})
    # hot for a full window, then cold tried: its first bucket untimed, then 4 timed (slower: back
    # to hot), then hot again
    assert lengths == [(16, COLD), (1 + 4, HOT), (16, HOT)]


def test_a_losing_try_ends_after_its_first_timed_bucket(clock):
    lengths, pool = window_lengths(clock, {HOT: 1.0, COLD: 8.0})  # cold costs 8x: the try is cut at once
    assert lengths == [(16, COLD), (1 + 1, HOT), (16, HOT)]
    assert pool.cost[COLD] == pytest.approx(8.0 / BUCKET)


def test_the_switch_bucket_is_left_out_of_a_tries_timing(clock):
    pool = BufferPool(8, BUCKET, window_buckets=16)
    pool.begin_sync()
    for n in range(16):  # a full hot window at 1 s per bucket
        pool.take(n)
        clock.now += 1.0
        pool.filled(BUCKET)
    assert pool.mode == COLD
    pool.take(16)
    clock.now += 50.0  # the switch's own bucket is very slow ...
    pool.filled(BUCKET)
    for n in range(17, 21):  # ... the mode itself is faster than hot
        pool.take(n)
        clock.now += 0.5
        pool.filled(BUCKET)
    assert pool.mode == COLD and pool.cost[COLD] == pytest.approx(0.5 / BUCKET)
