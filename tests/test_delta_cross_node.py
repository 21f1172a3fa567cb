"""Delta syncs on the cross-node path (CrossNodeSender / CrossNodeReceiver over gloo on 127.0.0.1), real processes.

Two striped sender ranks (rank 0 here, rank 1 spawned) and two spawned receivers that hold the model in
bf16 (they say so) and receive into it; the trainer keeps fp32 masters. Every sync after the first is a
delta that sender 0 sends alone; the receivers stay bit-exact with the engine loader's own cast; a
receiver whose copy changed behind hwsync's back fails the check and the next sync is full again. A
receiver killed while a delta's groups stream leaves the other one incomplete; the next sync is full and exact.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from hwsync import CrossNodeReceiver, CrossNodeSender
from hwsync.sync.report import ReceiverState, engine_dtypes
from hwsync.disaggregated.plan import DELTA_GROUP_BUCKETS
from hwsync.errors import SyncError
from hwsync.sync.options import CrossNodeOptions
from placement import need_devices, place

import delta_procs
import transfer_procs as procs

HOST = "127.0.0.1"
TIMEOUT = 30.0
STEPS = 4


def _source(step: int) -> dict[str, torch.Tensor]:
    """delta_procs.stepped, and a tensor that changes whole at every step, its payload twice a bucket."""
    return {**delta_procs.stepped(step), "big": torch.randn(256, 64, generator=torch.Generator().manual_seed(step))}


def _engine(step: int) -> dict[str, torch.Tensor]:
    return {n: torch.empty(t.shape, dtype=torch.bfloat16).copy_(t) for n, t in _source(step).items()}


def _receiver(endpoint: str, out, where: tuple[str, int], rank: int, flip_before: int | None) -> None:
    place(*where)
    from hwsync.backend.registry import get_backend

    device = get_backend().device().torch_device()
    held = {n: torch.empty(t.shape, dtype=torch.bfloat16, device=device) for n, t in _source(1).items()}
    state = ReceiverState(dtypes=engine_dtypes(held.items()))
    with CrossNodeReceiver(endpoint, rank=rank, timeout_s=TIMEOUT) as rx:
        out.put(("up", rank))
        for step in range(1, STEPS + 1):
            if step == flip_before:
                held["w2"].view(-1).view(torch.uint8)[5] ^= 0x04  # w2 does not change at this step
            try:
                rx.receive(into=lambda name, dtype, shape: held[name], state=state)
                out.put((rank, step, procs.digests({n: t.cpu() for n, t in held.items()})))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out.put((rank, step, f"{type(exc).__name__}: {exc}"))


def _follower(endpoint: str, out, where: tuple[str, int]) -> None:
    place(*where)
    with CrossNodeSender(endpoint, rank=1, num_senders=2, num_receivers=2, group_host=HOST, options=CrossNodeOptions(timeout_s=TIMEOUT, bucket_bytes=1 << 14)) as tx:
        out.put(("up", "sender"))
        for step in range(1, STEPS + 1):
            try:
                tx.send(list(_source(step).items()), version=step)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out.put(("sender", step, f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("flip", [None, 3], ids=["clean", "a byte flipped before step 3"])
def test_cross_node_deltas_stay_exact_and_a_bad_copy_is_caught(backend, flip, monkeypatch):
    # w2 is flipped where no delta writes: only a whole-tensor check sees it, here at every delta (default: 8th)
    monkeypatch.setenv("HWSYNC_DELTA_FULL_CHECK_EVERY", "1")
    need_devices(backend, 4)
    if backend.name != "cpu":
        backend.device().set_index(0)  # sender 0, here
    devices = [(backend.name, index) for index in range(4)]  # sender 0, receivers 0 and 1, sender 1
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with CrossNodeSender(f"tcp://{HOST}:0", num_senders=2, num_receivers=2, group_host=HOST, options=CrossNodeOptions(timeout_s=TIMEOUT, bucket_bytes=1 << 14, delta=True)) as tx:
        procs_ = [ctx.Process(target=_receiver, args=(tx.endpoint, out, devices[1 + r], r, flip if r == 1 else None))
                  for r in range(2)]
        procs_.append(ctx.Process(target=_follower, args=(tx.endpoint, out, devices[3])))
        for p in procs_:
            p.start()
        assert {out.get(timeout=120)[:2] for _ in procs_} == {("up", 0), ("up", 1), ("up", "sender")}
        modes = []
        for step in range(1, STEPS + 1):
            if flip is None and step == STEPS:  # the baseline dropped to free its memory: the next sync is full
                assert tx.drop_delta_baseline() > 0 and tx.delta_baseline_bytes == 0
            try:
                stats = tx.send(list(_source(step).items()), version=step)
                modes.append(stats.delta.mode)
                if flip is None and step == STEPS:
                    assert "drop_delta_baseline" in stats.delta.reason, stats.delta
                if modes[-1] == "delta":  # streamed by sender 0 alone, in groups of DELTA_GROUP_BUCKETS buckets of
                    # targets: here six tensors of a bucket each, then `big` (two buckets) in a group of its own
                    assert stats.notes["groups"] == stats.buckets == 6 // DELTA_GROUP_BUCKETS + 1, stats.notes
            except SyncError as exc:
                modes.append(f"failed: {exc}")
            results: dict = {}
            while len(results) < 2:  # the follower reports only its failures: those are not the receivers'
                rank, at, got = out.get(timeout=120)
                if rank != "sender":
                    assert at == step, (rank, at, got)
                    results[rank] = got
            if flip is not None and step == flip:
                assert "does not have the sender's digest" in modes[-1], modes
                assert any("DeltaCheckError" in str(r) for r in results.values()), results
                continue
            for got in results.values():
                assert got == procs.digests(_engine(step)), f"step {step}: {got}"
        expected = ["full"] + ["delta"] * (STEPS - 1)
        if flip is None:
            expected[-1] = "full"
        else:
            expected[flip - 1] = modes[flip - 1]
            expected[flip] = "full"  # after the failed check: what the receivers hold is unknown
        assert modes == expected, modes
        for p in procs_:
            p.join(60)


def _dying_receiver(endpoint: str, out, rank: int, die_at: int | None, steps: list[int]) -> None:
    """Receives the syncs of `steps` into bf16 tensors; at step `die_at` it dies while the delta's groups stream."""
    import os

    held = {n: torch.empty(t.shape, dtype=torch.bfloat16) for n, t in _source(1).items()}
    state = ReceiverState(dtypes=engine_dtypes(held.items()))

    def into(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if step == die_at and name == "w3":  # groups before it were applied, the rest not yet sent
            os._exit(3)
        return held[name]

    with CrossNodeReceiver(endpoint, rank=rank, timeout_s=TIMEOUT) as rx:
        out.put(("up", rank))
        for step in steps:
            try:
                stats = rx.receive(into=into, state=state)
                out.put((rank, step, procs.digests({n: t.clone() for n, t in held.items()}), stats.notes))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out.put((rank, step, f"{type(exc).__name__}: {exc}", rx.incomplete))


@pytest.mark.cpu_is_enough("a killed peer mid-sync is process and socket logic")
def test_a_receiver_killed_mid_streamed_delta_and_the_next_sync_is_full_and_exact(backend):
    need_devices(backend, 3)  # sender 0 and two receivers, a device each (NCCL refuses two ranks on one GPU)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with CrossNodeSender(f"tcp://{HOST}:0", num_receivers=2, group_host=HOST, options=CrossNodeOptions(timeout_s=TIMEOUT, bucket_bytes=1 << 14, delta=True)) as tx:
        alive = ctx.Process(target=_dying_receiver, args=(tx.endpoint, out, 0, None, [1, 2, 3, 4, 5]))
        dying = ctx.Process(target=_dying_receiver, args=(tx.endpoint, out, 1, 3, [1, 2, 3]))
        for p in (alive, dying):
            p.start()
        assert {out.get(timeout=120)[:2] for _ in range(2)} == {("up", 0), ("up", 1)}
        for step in (1, 2):
            stats = tx.send(list(_source(step).items()), version=step)
            assert [out.get(timeout=60)[2] for _ in range(2)] == [procs.digests(_engine(step))] * 2
        assert stats.delta.mode == "delta"
        with pytest.raises(SyncError):
            tx.send(list(_source(3).items()), version=3)
        dying.join(30)
        assert dying.exitcode == 3, "it died where it was meant to, mid-delta"
        rank, at, error, incomplete = out.get(timeout=60)
        assert (rank, at) == (0, 3) and incomplete, "the survivor applied some groups: it is marked incomplete"
        reborn = ctx.Process(target=_dying_receiver, args=(tx.endpoint, out, 1, None, [4, 5]))
        reborn.start()
        assert out.get(timeout=120)[:2] == ("up", 1)
        for step in (4, 5):
            stats = tx.send(list(_source(step).items()), version=step)
            got = [out.get(timeout=60) for _ in range(2)]
            assert [g[2] for g in got] == [procs.digests(_engine(step))] * 2, f"step {step}: exact on both"
            assert stats.delta.mode == ("full" if step == 4 else "delta"), stats.delta
        for p in (alive, reborn):
            p.join(30)
