"""Engine nodes fed across nodes stage, and apply only once every node staged: a StagedForwarder.

Five processes: sender 0 (here), and on each of two engine nodes an agent (a CrossNodeReceiver whose
StagedForwarder stages each sync into a same-node WeightSender) and its engine (a WeightReceiver made with
stage=True, standing in for the vLLM worker extension's staging thread). Each engine reports, after every
sync, which version the tensors it serves are, bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from hwsync import StagedForwarder, SyncError, WeightReceiver
from hwsync.disaggregated import CrossNodeReceiver, CrossNodeSender
from hwsync.sync.loader import Hooks
from hwsync.sync.options import CrossNodeOptions, SenderOptions
from placement import need_devices, place
from test_collective import BUCKET, HOST, _tensors

pytestmark = pytest.mark.timeout(180)

#: versions the sender sends; node 1 fails version 1: its engine refuses the manifest before a byte moves
#: ("refused"), or its agent fails once its engine and node 0's staged it ("after staging")
VERSIONS = [0, 1, 2]
FAILED = (1, 1)  # (rank, version)
#: every wait's limit: a silent peer is named after a quarter of it (roomy: five processes share two cores)
TIMEOUT = 20.0


def _version_of(held: dict[str, torch.Tensor]) -> int | None:
    """Which sent version the served tensors are, bit for bit, or None (a mix, or nothing)."""
    for v in VERSIONS:
        want = dict(_tensors(v))
        if set(held) == set(want) and all(torch.equal(held[n].cpu(), t) for n, t in want.items()):
            return v
    return None


def _engine(endpoint: str, out: Any, where: tuple[str, int], rank: int, fault: str) -> None:
    place(*where)
    held: dict[str, torch.Tensor] = {}

    class Engine:  # a Loader: the staged tensors land in `held` only once the sync is committed
        @staticmethod
        def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
            held.update({n: t.clone() for n, t in tensors})

        @staticmethod
        def accept(version: int, manifest: Any) -> None:
            if (rank, version) == FAILED and fault == "refused":
                raise ValueError(f"engine {rank} refuses version {version}'s manifest")

    with WeightReceiver(endpoint, timeout_s=TIMEOUT, stage=True) as rx:
        for _ in VERSIONS:
            try:
                rx.receive(Engine())
                result = "ok"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result = f"{type(exc).__name__}: {exc}"
            out.put(("engine", rank, result, _version_of(held)))


def _agent(endpoint: str, out: Any, where: tuple[str, int], rank: int, fault: str) -> None:
    place(*where)
    from hwsync.colocated.sender import WeightSender

    with WeightSender(options=SenderOptions(bucket_bytes=BUCKET // 2, timeout_s=TIMEOUT)) as local, \
            CrossNodeReceiver(endpoint, rank=rank, timeout_s=TIMEOUT) as rx:
        engine = mp.get_context("spawn").Process(target=_engine, args=(local.endpoint, out, where, rank, fault))
        engine.start()

        def stage(src: Any, v: int, manifest: Any) -> Any:
            stats = local.stage(src, version=v, manifest=manifest)
            if (rank, v) == FAILED and fault == "after staging":
                time.sleep(1.0)  # node 0 staged it too by now, and waits for the commit
                raise ValueError(f"agent {rank} fails once its engine staged version {v}")
            return stats

        forward = StagedForwarder(stage, commit=local.commit, abandon=lambda: local.abandon("another node failed"),
                                  timeout_s=TIMEOUT)
        out.put(("up", rank))
        for _ in VERSIONS:
            try:
                stats = rx.receive(forward)
                result = f"ok {stats.version} staged {stats.stage is not None and stats.stage.stage_s > 0}"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result = f"{type(exc).__name__}: {exc}"
            out.put(("agent", rank, result, rx.version, rx.staged))
        engine.join(3 * TIMEOUT)


@pytest.mark.cpu_is_enough("the two phases are the control plane's and the forwarder's; the staging engines' copies "
                            "run on the sim in test_staged.py")
@pytest.mark.parametrize("fault", ["refused", "after staging"])
def test_engine_nodes_stage_and_apply_only_once_every_node_staged(backend, fault):
    need_devices(backend, 3)
    if backend.name != "cpu":
        backend.device().set_index(0)  # sender 0, here
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    options = CrossNodeOptions(bucket_bytes=BUCKET, timeout_s=TIMEOUT)
    with CrossNodeSender(f"tcp://{HOST}:0", num_receivers=2, group_host=HOST, options=options) as tx:
        agents = [ctx.Process(target=_agent, args=(tx.endpoint, out, (backend.name, 1 + r), r, fault)) for r in (0, 1)]
        for agent in agents:
            agent.start()
        try:
            assert sorted(out.get(timeout=60) for _ in agents) == [("up", 0), ("up", 1)]
            tx.send(_tensors(0), version=0)
            with pytest.raises(SyncError, match="receiver 1.*(refuses|fails once its engine staged) version 1"):
                tx.send(_tensors(1), version=1)
            tx.send(_tensors(2), version=2)
            reports = [out.get(timeout=3 * TIMEOUT) for _ in range(4 * len(VERSIONS))]
        finally:
            for agent in agents:
                agent.join(3 * TIMEOUT)
                if agent.is_alive():
                    agent.kill()
    engines = {r: [x[2:] for x in reports if x[:2] == ("engine", r)] for r in (0, 1)}
    # version 1 failed on node 1: applied on neither engine, both serve version 0 bit for bit
    assert engines[0][0] == ("ok", 0) and engines[1][0] == ("ok", 0), engines
    assert engines[0][1][1] == 0 and engines[1][1][1] == 0, engines
    if fault == "refused":
        assert "refuses version 1" in engines[1][1][0], engines
    else:  # both engines staged it; the agents dropped it when the sync failed
        assert all("another node failed" in engines[r][1][0] for r in (0, 1)), engines
    assert engines[0][2] == ("ok", 2) and engines[1][2] == ("ok", 2), engines  # the next sync commits exact
    agents_said = {r: [x[2:] for x in reports if x[:2] == ("agent", r)] for r in (0, 1)}
    for r in (0, 1):
        assert agents_said[r][0] == ("ok 0 staged True", 0, None), agents_said
        assert agents_said[r][1][1:] == (0, None), agents_said  # nothing left staged; still version 0
        assert agents_said[r][2] == ("ok 2 staged True", 2, None), agents_said
    assert all(agent.exitcode == 0 for agent in agents)


def test_a_staging_loader_needs_both_halves_and_the_cross_node_receiver():
    class Half:
        def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
            pass

        def commit(self) -> None:
            pass

    with pytest.raises(TypeError, match="has commit\\(\\) but not abandon\\(\\)"):
        Hooks.of(Half(), None)
    forward = StagedForwarder(lambda src, v, m: None, commit=lambda: None, abandon=lambda: None)
    with WeightReceiver("ipc:///nonexistent/hwsync#token", timeout_s=1.0) as rx, \
            pytest.raises(TypeError, match="CrossNodeReceiver drives"):
        rx.receive(forward)  # refused before it connects
    with CrossNodeSender(f"tcp://{HOST}:0", num_receivers=1, group_host=HOST) as tx, \
            CrossNodeReceiver(tx.endpoint, rank=0, timeout_s=1.0, stage=True) as cross, \
            pytest.raises(TypeError, match="pick one"):
        cross.receive(forward)
