"""Striped senders whose source is itself collective (FSDP's full_tensor(): every sender rank takes part).

When such a source is being walked, sender 0 (the hub) can sit in the source's collective waiting
for a follower, so a follower must never wait on the hub while the hub waits on it. The case
here: sender 0 has a buffer for every bucket it owns, sender 1 two; receiver 1 dies in its first
load, so sender 1's broadcasts fail and it waits for a buffer, while sender 0 waits for nothing
and walks on into the source's next collective. The follower must walk on too (its group is dead anyway), so both
reach the end and sender 0 can name the dead receiver to everyone, well within the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

from hwsync.disaggregated import CrossNodeSender
from hwsync.errors import SyncError
from hwsync.backend.registry import get_backend
from hwsync.sync.options import CrossNodeOptions
from test_collective import HOST, TIMEOUT, _receiver

BUCKET = 64 << 10


def _tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """24 tensors of one bucket each: the senders broadcast every other one."""
    g = torch.Generator().manual_seed(version)
    return [(f"w{i}", torch.randn(BUCKET // 4, generator=g)) for i in range(24)]


def _gathered(comm, version: int):
    """Each tensor after an all_reduce over the sender ranks, as a collective source produces it."""
    for name, tensor in _tensors(version):
        probe = torch.zeros(1)
        comm.all_reduce(probe)  # every sender rank must get here for any of them to go on
        yield name, tensor


def _follower(endpoint: str, store: str, out) -> None:
    os.environ["HWSYNC_BACKEND"] = "cpu"
    comm = get_backend().communicator(store, 1, 2, 3 * TIMEOUT)
    tx = CrossNodeSender(endpoint, rank=1, num_senders=2, num_receivers=2, group_host=HOST, options=CrossNodeOptions(timeout_s=TIMEOUT))
    out.put(("up", -1))
    for v in (0, 1):
        source = _gathered(comm, v)
        t0 = time.monotonic()
        try:
            tx.send(source, version=v)
            result = "ok"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = f"{type(exc).__name__}: {exc}"
            for _ in source:  # walk the rest: sender 0's collective steps need this rank
                pass
        out.put(("sender", 1, v, result, time.monotonic() - t0))
    tx.close()
    comm.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.fixture
def cpu_backend(monkeypatch):
    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")


def test_a_follower_whose_broadcast_failed_walks_on_so_sender_0_can_name_the_dead_receiver(cpu_backend):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = f"tcp://{HOST}:{_free_port()}"
    # sender 0 has a buffer for each of its buckets, so it never waits on one and walks straight on
    tx = CrossNodeSender(f"tcp://{HOST}:0", num_senders=2, num_receivers=2, group_host=HOST, options=CrossNodeOptions(bucket_bytes=BUCKET, num_buffers=32, timeout_s=TIMEOUT))
    procs = [ctx.Process(target=_receiver, args=(tx.endpoint, out, ("cpu", 0), r, [0, 1], ("kill", 1, 1) if r else None),
                         daemon=True) for r in (0, 1)]
    procs.append(ctx.Process(target=_follower, args=(tx.endpoint, store, out), daemon=True))
    for proc in procs:
        proc.start()
    comm = None
    try:
        comm = get_backend().communicator(store, 0, 2, 3 * TIMEOUT)
        for _ in procs:
            assert out.get(timeout=30)[0] == "up"
        stats = tx.send(_gathered(comm, 0), version=0, manifest=_manifest())
        assert stats.notes["sent_buckets"] == 12 and stats.buckets == 24  # the layout this test relies on
        source = _gathered(comm, 1)
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="receiver 1 .* exited"):
            try:
                tx.send(source, version=1, manifest=_manifest())
            finally:
                for _ in source:
                    pass
        assert time.monotonic() - t0 < TIMEOUT
        # version 0: both receivers and sender 1; version 1: receiver 0 and sender 1 (receiver 1 was killed)
        reports = [out.get(timeout=3 * TIMEOUT) for _ in range(5)]
        follower = [r for r in reports if r[0] == "sender" and r[2] == 1]
        assert follower and "receiver 1" in follower[0][3] and follower[0][4] < TIMEOUT, reports
    finally:
        tx.close()
        if comm is not None:
            comm.destroy()
        for proc in procs:
            proc.join(3 * TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def _manifest():
    from hwsync.sync.spec import manifest_from_tensors

    return manifest_from_tensors(_tensors(0))
