"""Cross-node ranks recover from timed-out gathers, over gloo on 127.0.0.1, with real processes.

Sender 0 (the hub) runs in the test process; the other ranks are spawned. Whichever side timed out
or called again first, the next sync completes bit-exact with every live rank: a rank's call that
timed out before sender 0's first send() is simply called again (sender 0 takes its newest ready,
or starts it again in the sync that its stale ready joined), and a rank that is ready hears from
sender 0 while it gathers the others, with the name of the one it still waits for. The same on a
bed of hosts: tests/test_cross_node_bed.py.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time

import pytest
import torch

from hwsync.disaggregated import CrossNodeReceiver, CrossNodeSender
from hwsync.errors import SyncTimeoutError
from hwsync.sync.options import CrossNodeOptions

HOST = "127.0.0.1"
CTX = mp.get_context("spawn")


def _tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("embed", torch.randn(3000, 17, generator=g)), ("w", torch.randn(64, 33, generator=g).bfloat16()),
            ("i8", torch.randint(-128, 127, (77,), generator=g, dtype=torch.int8))]


def _exact(got: dict[str, torch.Tensor], version: int) -> bool:
    want = dict(_tensors(version))
    return set(got) == set(want) and all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in want.items())


def _retrying(call, retries: int, pause_s: float) -> tuple[object, list[str]]:
    """call() again after each SyncTimeoutError (a user's retry loop): its result (None if every call failed) and the
    messages of the calls that timed out."""
    failed: list[str] = []
    while True:
        try:
            return call(), failed
        except SyncTimeoutError as exc:
            failed.append(str(exc))
            if len(failed) > retries:
                return None, failed
            time.sleep(pause_s)


def _receiver(endpoint: str, out, rank: int, timeout_s: float, versions: list[int], retries: int, pause_s: float,
              start=None) -> None:
    rx = CrossNodeReceiver(endpoint, rank=rank, timeout_s=timeout_s)
    out.put(("up", rank))
    if start is not None:
        start.wait(60)
    for v in versions:
        got: dict[str, torch.Tensor] = {}
        stats, failed = _retrying(lambda: rx.receive(lambda ts: got.update({n: t.clone() for n, t in ts})),
                                  retries, pause_s)
        out.put({"who": f"r{rank}", "version": v, "ok": stats is not None, "exact": _exact(got, v), "failed": failed,
                 "waits_for": getattr(rx._link, "hub_waits_for", None), "epoch": rx.group_epoch})
    rx.close()


def _follower(endpoint: str, out, rank: int, senders: int, receivers: int, timeout_s: float, versions: list[int],
              retries: int, pause_s: float) -> None:
    tx = CrossNodeSender(endpoint, rank=rank, num_senders=senders, num_receivers=receivers, group_host=HOST, options=CrossNodeOptions(timeout_s=timeout_s))
    out.put(("up", -rank))
    for v in versions:
        stats, failed = _retrying(lambda: tx.send(_tensors(v), version=v), retries, pause_s)
        out.put({"who": f"s{rank}", "version": v, "ok": stats is not None, "failed": failed, "epoch": tx.group_epoch})
    tx.close()


class Ranks:
    """Sender 0 here; the other ranks spawned; their reports collected."""

    def __init__(self, senders: int, receivers: int, timeout_s: float) -> None:
        self.tx = CrossNodeSender(f"tcp://{HOST}:0", num_senders=senders, num_receivers=receivers, group_host=HOST, options=CrossNodeOptions(bucket_bytes=64 << 10, timeout_s=timeout_s))
        self.out = CTX.Queue()
        self.procs: list = []

    def spawn(self, target, *args) -> None:
        proc = CTX.Process(target=target, args=(self.tx.endpoint, self.out, *args), daemon=True)
        proc.start()
        self.procs.append(proc)

    def wait_up(self, n: int) -> None:
        for _ in range(n):
            assert self.out.get(timeout=60)[0] == "up"

    def reports(self, n: int, timeout: float = 30) -> dict[tuple[str, int], dict]:
        got = [self.out.get(timeout=timeout) for _ in range(n)]
        return {(r["who"], r["version"]): r for r in got}

    def close(self) -> None:
        self.tx.close()
        for proc in self.procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.mark.parametrize("pause_s", [0.0, 2.0], ids=["called-again-at-once", "called-again-after-the-trainer"])
def test_ranks_whose_calls_timed_out_before_the_trainers_first_send_get_it_exact(pause_s, caplog):
    """A follower sender and two receivers call with timeout_s=1.5 and time out before sender 0's first send(), 2 s
    later; each calls again, at once or 2 s later (when sender 0 has taken its stale ready and must start it again
    in the running sync). The trainer's first sync is exact everywhere, the next one on the same groups."""
    caplog.set_level(logging.INFO, logger="hwsync")
    ranks = Ranks(2, 2, timeout_s=6.0)
    try:
        for r in range(2):
            ranks.spawn(_receiver, r, 1.5, [0, 1], 4, pause_s)
        ranks.spawn(_follower, 1, 2, 2, 1.5, [0, 1], 4, pause_s)
        ranks.wait_up(3)
        time.sleep(2.0)  # every rank's first call times out meanwhile
        ranks.tx.send(_tensors(0), version=0)
        epoch = ranks.tx.group_epoch
        ranks.tx.send(_tensors(1), version=1)
        reports = ranks.reports(6)
        for (who, v), r in reports.items():
            assert r["ok"] and r.get("exact", True), (who, v, r)
            assert r["epoch"] == epoch, f"{who} rebuilt its groups at version {v}"
        for who in ("r0", "r1", "s1"):
            assert reports[(who, 0)]["failed"], f"{who}'s first call did not time out: the test timed nothing"
        if pause_s:  # sender 0 took each stale ready, then started the rank again when it called again
            assert caplog.text.count("readied again") == 3, caplog.text
    finally:
        ranks.close()


def test_a_ready_rank_hears_the_hub_name_the_missing_one_while_it_gathers_and_the_next_sync_is_exact():
    """Receiver 0 (timeout_s=2) waits in receive() through sender 0's whole gather (timeout_s=5) for receiver 1,
    which has not called receive(): the gather times out naming receiver 1; receiver 0, kept alive meanwhile, was
    told whom it waits for. Receiver 1 then calls, sender 0 sends again: exact on both, in receiver 0's same call."""
    ranks = Ranks(1, 2, timeout_s=5.0)
    start = CTX.Event()
    try:
        ranks.spawn(_receiver, 0, 2.0, [0], 0, 0.0)
        ranks.spawn(_receiver, 1, 2.0, [0], 0, 0.0, start)
        ranks.wait_up(2)
        t0 = time.monotonic()
        with pytest.raises(SyncTimeoutError, match="waiting for receiver 1") as gather:
            ranks.tx.send(_tensors(0), version=0)
        assert time.monotonic() - t0 > 4.5
        start.set()
        ranks.tx.send(_tensors(0), version=0)
        reports = ranks.reports(2)
        for who in ("r0", "r1"):
            assert reports[(who, 0)]["ok"] and reports[(who, 0)]["exact"], reports[(who, 0)]
        assert not reports[("r0", 0)]["failed"], "receiver 0 timed out while sender 0 gathered"
        assert "receiver 1 (not heard of yet) to call send()/receive()" in str(gather.value)
        assert "receiver 1 (not heard of yet)" in (reports[("r0", 0)]["waits_for"] or ""), reports[("r0", 0)]
    finally:
        ranks.close()
