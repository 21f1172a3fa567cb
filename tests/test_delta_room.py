"""The memory a sender's delta payloads are written into (hwsync.delta.room): kept across syncs, made ready after a
full sync, never reused while an encode of the last sync still writes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from hwsync.sync.encode_ahead import EncodeAhead
from hwsync.delta.room import FIRST_SLAB, MIN_RESERVE, RESERVE_SHARE, PayloadRoom
from hwsync.sync.delta_sender import SenderDeltas
from hwsync.sync.report import EngineDtypes, ReceiverReport
from hwsync.sync.stats import DeltaStats
from hwsync.sync.spec import TensorSpec
from hwsync.backend.registry import load_backend
from hwsync.sync.stats import SyncStats


def _within(t: torch.Tensor, slabs: list[torch.Tensor]) -> bool:
    return any(s.data_ptr() <= t.data_ptr() and t.data_ptr() + t.numel() <= s.data_ptr() + s.numel() for s in slabs)


def test_payloads_are_carved_from_slabs_that_the_next_sync_takes_again():
    room = PayloadRoom(slab_bytes=1024)
    a, b = room.take(100), room.take(200)
    assert b.data_ptr() == a.data_ptr() + 128, "the next payload starts on the next cache line"
    big = room.take(3000)  # larger than a slab: a slab of its own
    assert big.numel() == 3000 and room.held_bytes == 1024 + 3000
    room.reset()
    assert room.take(100).data_ptr() == a.data_ptr(), "the next sync writes where the last one did"
    room.reset()  # that sync reached the first slab only: the other goes
    assert room.held_bytes == 1024
    room.reserve(MIN_RESERVE - 1)
    assert room.held_bytes == 1024, "a reserve too small to matter is not made"
    room.reserve(MIN_RESERVE)
    assert room.held_bytes >= MIN_RESERVE
    room.reset()  # a sync that took nothing (a full one) keeps what was made ready for the next
    assert room.held_bytes >= MIN_RESERVE
    room.clear()
    assert room.held_bytes == 0
    assert room.take(10).numel() == 10 and room.held_bytes == 1024
    small = PayloadRoom()
    small.take(10)
    assert small.held_bytes == FIRST_SLAB, "a small model's room stays small"


def test_the_first_delta_after_a_full_sync_writes_into_the_room_made_ready_for_it():
    deltas = SenderDeltas(load_backend("cpu").device())
    g = torch.Generator().manual_seed(5)
    model = {"w": torch.randn(1 << 23, generator=g), "u": torch.randn(1 << 16, generator=g)}  # 4% is over 1 MiB
    manifest = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in model.items()]

    def sync() -> list[torch.Tensor]:
        stats = SyncStats()
        prepared = deltas.prepare(list(model.items()), manifest, EngineDtypes([]), True, [ReceiverReport(held=deltas.base_id)],
                                  stats)
        assert prepared.source is not None
        payloads = [t for _, t in prepared.source]
        deltas.commit()
        return payloads

    sync()  # full: the baseline, and room for the first delta made ready behind it
    deltas.settle()
    assert deltas.room.held_bytes >= int(RESERVE_SHARE * deltas.baseline_bytes) > 0
    slabs, held = list(deltas.room._slabs), deltas.room.held_bytes
    first = None
    for _ in range(4):
        pos = torch.randint(0, model["w"].numel(), (5000,), generator=g)
        model["w"][pos] += 1.0
        payloads = sync()
        assert all(_within(p, slabs) for p in payloads if p.numel()), "no payload in fresh memory"
        assert deltas.room.held_bytes == held
        first = first or payloads[0].data_ptr()
        assert payloads[0].data_ptr() == first, "each delta reuses the last one's memory"
    deltas.settle()
    for name, tensor in model.items():  # the baseline took every delta's changes before the next reused the room
        assert torch.equal(deltas.baseline.tensors[name], tensor), name
    assert deltas.drop() > 0 and deltas.room.held_bytes == 0, "dropping the baseline lets the room go too"
    deltas.close()


def test_an_ended_streamed_encode_waits_for_the_encodes_still_running():
    pool = ThreadPoolExecutor(1)
    started, wrote = threading.Event(), []

    def slow(value: int) -> None:
        started.set()
        time.sleep(0.3)
        wrote.append(value)  # where a payload would be written into the room

    spec = TensorSpec("w", "float32", (1,))
    ahead = EncodeAhead(iter([(spec, slow, (1,)), (spec, slow, (2,))]), pool, {}, DeltaStats("delta"), expected=None, min_jobs=2)
    assert started.wait(5)
    ahead.close()  # the sync failed: the next one may reuse the room only once nothing writes into it
    assert wrote == [1], "close returned while an encode still ran (the second, not started, is cancelled)"
    pool.shutdown()
