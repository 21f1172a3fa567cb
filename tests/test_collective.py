"""The collective (disaggregated) path over gloo on 127.0.0.1, with real processes.

Sender rank 0 runs in the test process; receivers and striped senders are spawned. Children
report on a queue; each waits for "up" before the first sync so imports, and the seconds a
process's first device op can take (_warm), do not count against the short timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from hwsync.backend.registry import load_backend
from hwsync.disaggregated import CrossNodeReceiver, CrossNodeSender, assign_owners, make_plan, pack_layout
from hwsync.disaggregated.plan import CollectivePlan
from hwsync.protocol import TO_RANK, decode, encode
from hwsync.errors import ManifestError, SyncError
from hwsync.sync.spec import TensorSpec, manifest_from_tensors
from hwsync.sync.options import CrossNodeOptions
from placement import need_devices, place

BUCKET = 64 << 10
TIMEOUT = 6.0
HOST = "127.0.0.1"
#: how long the spawned ranks may take to import and warm up (seconds each under CPU load)
START_S = 90.0


def _tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """Deterministic per version; one tensor spans several buckets, one is strided, one is empty."""
    g = torch.Generator().manual_seed(version)
    return [
        ("embed", torch.randn(3000, 17, generator=g)),  # 204 KB: chunked over 4 buckets
        ("w_bf16", torch.randn(64, 33, generator=g).to(torch.bfloat16)),
        ("w_f16", torch.randn(100, generator=g).to(torch.float16)),
        ("i8", torch.randint(-128, 127, (77,), generator=g, dtype=torch.int8)),
        ("mask", torch.rand(51, generator=g) > 0.5),
        ("empty", torch.empty(0, 4)),
        ("strided", torch.randn(40, 30, generator=g).t()),
        ("scalar", torch.tensor(float(version))),
        ("i64", torch.randint(0, 1 << 40, (9, 9), generator=g)),
    ]


def _exact(got: dict[str, torch.Tensor], version: int) -> bool:
    """Bit-exact against the sent tensors (received ones may live on a device: compared on the host)."""
    want = dict(_tensors(version))
    return set(got) == set(want) and all(
        got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n].cpu(), t) for n, t in want.items())


def _warm(backend: str) -> None:
    """One copy on this process's current device of `backend`, as a trainer or engine made long before its first sync.

    A process's first op on a device costs seconds: on the sim, torch imports torch.distributed.tensor
    (and sympy) when it first dispatches the sim's tensor subclass, 3-8 s with the CPUs loaded; on a GPU
    the context. Paid inside the first sync, it stalls that rank's control loop past the 6 s timeout.
    """
    buffer = torch.zeros(16, dtype=torch.uint8, device=load_backend(backend).device().torch_device())
    buffer[4:12].copy_(torch.arange(8, dtype=torch.uint8))
    assert buffer.cpu()[4:12].tolist() == list(range(8))


def _receiver(endpoint: str, out, where: tuple[str, int], rank: int, versions: list[int],
              fault: tuple | None = None, go=None) -> None:
    """A receiver rank; with `go` (an Event) it reports "up" warmed but joins only once `go` is set."""
    place(*where)
    _warm(where[0])
    if go is not None:
        out.put(("up", rank))
        if not go.wait(START_S):
            return
    rx = CrossNodeReceiver(endpoint, rank=rank, timeout_s=TIMEOUT)
    if go is None:
        out.put(("up", rank))
    for v in versions:
        got: dict[str, torch.Tensor] = {}
        calls = [0]

        def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
            calls[0] += 1
            if fault is not None and (v, calls[0]) == fault[1:]:
                if fault[0] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault[0] == "stall":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if fault[0] == "raise":
                    raise ValueError("bad weights in this engine")
            got.update({n: t.clone() for n, t in tensors})

        t0 = time.monotonic()
        try:
            rx.receive(load)
            result = "ok" if _exact(got, v) else "MISMATCH"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            result = f"{type(exc).__name__}: {exc}"
        out.put(("receiver", rank, v, result, time.monotonic() - t0, rx.group_epoch))
        if fault == ("release",):  # give the receive buffers back between syncs
            rx.release_buffers()
    rx.close()


def _sender(endpoint: str, out, where: tuple[str, int], rank: int, senders: int, receivers: int,
            versions: list[int]) -> None:
    place(*where)
    _warm(where[0])
    tx = CrossNodeSender(endpoint, rank=rank, num_senders=senders, num_receivers=receivers, group_host=HOST, options=CrossNodeOptions(timeout_s=TIMEOUT))
    out.put(("up", -rank))
    for v in versions:
        t0 = time.monotonic()
        try:
            stats = tx.send(_tensors(v), version=v)
            result = f"ok {stats.notes['sent_buckets']}"
        except Exception as exc:  # noqa: BLE001
            result = f"{type(exc).__name__}: {exc}"
        out.put(("sender", rank, v, result, time.monotonic() - t0, tx.group_epoch))
    tx.close()


class Cluster:
    """Sender 0 here, the other ranks spawned, each on a device of its own; collects what they report.

    Sender s runs on device s, receiver r on device senders + r (HWSYNC_BACKEND is the backend's).
    """

    def __init__(self, backend, senders: int, receivers: int) -> None:
        need_devices(backend, senders + receivers)
        self.name = backend.name
        if self.name != "cpu":
            backend.device().set_index(0)  # sender 0, here
        _warm(self.name)
        self.ctx = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs: list = []
        self.senders, self.receivers = senders, receivers
        self.tx = CrossNodeSender(f"tcp://{HOST}:0", num_senders=senders, num_receivers=receivers, group_host=HOST, options=CrossNodeOptions(bucket_bytes=BUCKET, timeout_s=TIMEOUT))

    def receiver_at(self, rank: int) -> tuple[str, int]:
        """(backend, device) of receiver `rank`."""
        return self.name, self.senders + rank

    def spawn(self, target, where: tuple[str, int], *args) -> mp.Process:
        proc = self.ctx.Process(target=target, args=(self.tx.endpoint, self.out, where, *args), daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def start(self, versions: list[int], faults: dict[int, tuple] | None = None) -> None:
        for r in range(self.receivers):
            self.spawn(_receiver, self.receiver_at(r), r, versions, (faults or {}).get(r))
        for s in range(1, self.senders):
            self.spawn(_sender, (self.name, s), s, self.senders, self.receivers, versions)
        self.wait_up(self.receivers + self.senders - 1)

    def wait_up(self, n: int) -> None:
        for _ in range(n):
            assert self.out.get(timeout=START_S)[0] == "up"

    def reports(self, n: int) -> list[tuple]:
        return [self.out.get(timeout=3 * TIMEOUT) for _ in range(n)]

    def close(self) -> None:
        self.tx.close()
        for proc in self.procs:
            proc.join(3 * TIMEOUT)
            if proc.is_alive():  # the test fails below; do not leave it running
                proc.kill()
                proc.join(5)
        assert not [p for p in self.procs if p.exitcode is None], "a child process was left running"


# -- the plan, without processes ---------------------------------------------------------------

def test_plan_chunks_big_tensors_and_keeps_small_ones_whole():
    manifest = manifest_from_tensors(_tensors(0))
    plan = make_plan(manifest, BUCKET, 2)
    for spec, pieces in zip(manifest, plan.pieces()):
        assert sum(e.chunk_bytes for _, e in pieces) == spec.nbytes
        assert [e.chunk_offset for _, e in pieces] == [sum(e.chunk_bytes for _, e in pieces[:i]) for i in range(len(pieces))]
        if spec.nbytes <= BUCKET:
            assert len(pieces) == 1
    assert len(plan.pieces()[0]) == 4  # embed: 204 KB over 64 KiB buckets
    assert all(b.nbytes <= BUCKET for b in plan.buckets)
    frame = plan.frame(pid=1, host="h", epoch=1, version=1, receivers=[])
    assert CollectivePlan.from_frame(decode(encode(frame), TO_RANK)) == plan


def test_owners_are_balanced_and_interleaved():
    assert assign_owners([10, 10, 10, 10, 10], 2) == [0, 1, 0, 1, 0]
    assert assign_owners([100, 10, 10, 10], 2) == [0, 1, 1, 1]
    assert assign_owners([5, 5], 1) == [0, 0]


def test_duplicate_names_are_refused():
    with pytest.raises(ManifestError, match="twice"):
        pack_layout([TensorSpec("a", "float32", (2,)), TensorSpec("a", "float32", (2,))], BUCKET)


def test_follower_needs_the_token():
    with pytest.raises(ValueError, match="endpoint"):
        CrossNodeSender("tcp://127.0.0.1:1", rank=1, num_senders=2, backend=object())  # type: ignore[arg-type]


# -- real processes over gloo -------------------------------------------------------------------

@pytest.mark.parametrize("senders", [
    pytest.param(1, marks=pytest.mark.cpu_is_enough("the striped case runs every rank on its own device there")),
    2], ids=["1-sender", "2-striped-senders"])
def test_senders_to_three_receivers_bit_exact(backend, senders):
    cluster = Cluster(backend, senders, 3)
    try:
        cluster.start([0, 1])
        for v in (0, 1):
            stats = cluster.tx.send(_tensors(v), version=v)
            assert stats.version == v and stats.tensors == len(_tensors(v))
            assert len(stats.peer["receivers"]) == 3
        reports = cluster.reports(2 * (3 + senders - 1))
        assert all(r[3].startswith("ok") for r in reports), reports
        if senders == 2:  # both senders broadcast a share
            assert stats.notes["sent_buckets"] > 0
            assert all(int(r[3].split()[1]) > 0 for r in reports if r[0] == "sender")
    finally:
        cluster.close()


@pytest.mark.cpu_is_enough("reusing one group across syncs is control-plane logic")
def test_twenty_syncs_on_one_group(backend):
    versions = list(range(20))
    cluster = Cluster(backend, 2, 2)
    try:
        cluster.start(versions)
        epochs = set()
        for v in versions:
            cluster.tx.send(_tensors(v), version=v)
            epochs.add(cluster.tx.group_epoch)
        reports = cluster.reports(20 * 3)
        assert all(r[3].startswith("ok") for r in reports), [r for r in reports if not r[3].startswith("ok")]
        assert len(epochs) == 1 and {r[5] for r in reports} == epochs  # built once, reused by every rank
    finally:
        cluster.close()


def test_released_buffers_come_back_at_the_next_sync_on_the_same_group(backend):
    cluster = Cluster(backend, 1, 2)
    try:
        cluster.start([0, 1, 2], faults={0: ("release",)})
        cluster.tx.send(_tensors(0), version=0)
        epoch = cluster.tx.group_epoch
        for v in (1, 2):
            cluster.tx.release_buffers()
            assert not cluster.tx._carrier.group._buffers  # freed until the next send
            cluster.tx.send(_tensors(v), version=v)
        assert cluster.tx.group_epoch == epoch
        reports = cluster.reports(3 * 2)
        assert all(r[3] == "ok" for r in reports), reports
        assert {r[5] for r in reports} == {epoch}  # the receivers kept their groups too
    finally:
        cluster.close()


def test_killed_receiver_fails_every_rank_naming_it_then_a_rebuilt_group_works(backend):
    cluster = Cluster(backend, 2, 3)
    try:
        # receiver 2's replacement engine rank starts with the others and joins once told: after the failure the
        # survivors wait for the hub in their next receive() and time out (rightly) if it stays out of send() for
        # TIMEOUT, less than spawning a process can take with the CPUs loaded
        go = cluster.ctx.Event()
        cluster.spawn(_receiver, cluster.receiver_at(2), 2, [2], None, go)
        cluster.start([0, 1, 2], faults={2: ("kill", 1, 1)})  # receiver 2 dies in its first load of version 1
        cluster.wait_up(1)
        killed = cluster.procs[1 + 2]  # the replacement, then receivers 0, 1, 2
        cluster.tx.send(_tensors(0), version=0)
        epoch = cluster.tx.group_epoch
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="receiver 2 .* exited"):
            cluster.tx.send(_tensors(1), version=1)
        assert time.monotonic() - t0 < TIMEOUT
        reports = cluster.reports(4 + 3)  # version 0: every rank; version 1: all but the killed one
        failed = [r for r in reports if r[2] == 1]
        assert len(failed) == 3 and all("receiver 2" in r[3] and r[4] < TIMEOUT for r in failed), failed
        killed.join(5)
        assert killed.exitcode == -signal.SIGKILL
        go.set()  # the replacement engine rank joins
        cluster.tx.send(_tensors(2), version=2)
        assert cluster.tx.group_epoch != epoch  # rebuilt
        assert all(r[3].startswith("ok") for r in cluster.reports(4)), "sync after the rebuild failed"
    finally:
        cluster.close()


@pytest.mark.cpu_is_enough("a failed rank's abort path runs on the sim with the killed receiver")
def test_stalled_receiver_is_named_within_the_timeout(backend):
    cluster = Cluster(backend, 1, 2)
    try:
        cluster.start([0, 1], faults={1: ("stall", 1, 1)})  # receiver 1 freezes (SIGSTOP) in its first load of v1
        cluster.tx.send(_tensors(0), version=0)  # the groups are built: what follows times the stall alone
        assert all(r[3] == "ok" for r in cluster.reports(2))
        t0 = time.monotonic()
        with pytest.raises(SyncError, match="receiver 1 .* stopped answering"):
            cluster.tx.send(_tensors(1), version=1)
        assert time.monotonic() - t0 < TIMEOUT
        (report,) = cluster.reports(1)
        assert report[1] == 0 and "receiver 1" in report[3]
        os.kill(cluster.procs[1].pid, signal.SIGCONT)  # it wakes, finds the sync aborted, and exits
        (report,) = cluster.reports(1)
        assert report[1] == 1 and "aborted" in report[3], report
    finally:
        cluster.close()


@pytest.mark.cpu_is_enough("control-plane logic only: nothing an accelerator changes")
def test_a_receivers_load_error_reaches_every_rank(backend):
    cluster = Cluster(backend, 1, 2)
    try:
        cluster.start([0, 1], faults={0: ("raise", 0, 1)})
        with pytest.raises(SyncError, match="receiver 0 .*bad weights"):
            cluster.tx.send(_tensors(0), version=0)
        cluster.tx.send(_tensors(1), version=1)
        reports = cluster.reports(4)
        assert all("bad weights" in r[3] for r in reports if r[2] == 0), reports
        assert all(r[3] == "ok" for r in reports if r[2] == 1), reports
    finally:
        cluster.close()


def _stateful_receiver(endpoint: str, out, where: tuple[str, int], rank: int, versions: list[int]) -> None:
    place(*where)
    _warm(where[0])
    rx = CrossNodeReceiver(endpoint, rank=rank, timeout_s=TIMEOUT)
    out.put(("up", rank))
    for v in versions:
        got: dict[str, torch.Tensor] = {}
        rx.receive(lambda tensors: got.update({n: t.clone() for n, t in tensors}), state={"marker": 70 + v})
        out.put(("receiver", rank, v, "ok" if _exact(got, v) else "MISMATCH"))
    rx.close()


def _callable_sender(endpoint: str, out, where: tuple[str, int], rank: int, senders: int, receivers: int,
                     versions: list[int]) -> None:
    place(*where)
    _warm(where[0])
    tx = CrossNodeSender(endpoint, rank=rank, num_senders=senders, num_receivers=receivers, group_host=HOST, options=CrossNodeOptions(timeout_s=TIMEOUT))
    out.put(("up", -rank))
    for v in versions:
        seen: list = []
        tx.send(lambda report: seen.append(report.extra.get("marker")) or _tensors(v), version=v)
        out.put(("sender", rank, v, seen))
    tx.close()


@pytest.mark.cpu_is_enough("control-plane logic only: nothing an accelerator changes")
def test_a_callable_source_gets_the_receivers_state_on_every_sender_rank(backend):
    cluster = Cluster(backend, 2, 1)
    try:
        cluster.spawn(_stateful_receiver, cluster.receiver_at(0), 0, [0, 1])
        cluster.spawn(_callable_sender, (cluster.name, 1), 1, 2, 1, [0, 1])
        cluster.wait_up(2)
        for v in (0, 1):
            seen: list = []
            cluster.tx.send(lambda report: seen.append(report.extra.get("marker")) or _tensors(v), version=v)
            assert seen == [70 + v]
        reports = cluster.reports(4)
        assert sorted(r[3] for r in reports if r[0] == "receiver") == ["ok", "ok"], reports
        assert sorted((r[2], r[3]) for r in reports if r[0] == "sender") == [(0, [70]), (1, [71])], reports
    finally:
        cluster.close()
