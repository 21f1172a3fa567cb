"""An engine node forwards what it receives over the collective group into its local engine.

Three processes: sender 0 (here, on device 0), the engine node's agent (a CrossNodeReceiver
whose load feeds a same-node WeightSender through LocalForwarder, on device 1), and the engine
itself (a plain WeightReceiver, standing in for the vLLM worker extension, sharing the agent's
device).
"""

from __future__ import annotations

import multiprocessing as mp

import torch

from hwsync.disaggregated import CrossNodeSender
from hwsync.sync.options import CrossNodeOptions, SenderOptions
from placement import need_devices, place
from test_collective import BUCKET, HOST, TIMEOUT, _exact, _tensors

VERSIONS = [0, 1]


def _engine(endpoint: str, out, where: tuple[str, int]) -> None:
    place(*where)
    from hwsync.colocated.receiver import WeightReceiver

    with WeightReceiver(endpoint, timeout_s=TIMEOUT) as rx:
        for v in VERSIONS:
            got: dict[str, torch.Tensor] = {}
            rx.receive(lambda tensors: got.update({n: t.clone() for n, t in tensors}))
            out.put(("engine", v, _exact(got, v), rx.version))


def _agent(endpoint: str, out, where: tuple[str, int]) -> None:
    place(*where)
    from hwsync.disaggregated import CrossNodeReceiver, LocalForwarder
    from hwsync.colocated.sender import WeightSender

    with WeightSender(options=SenderOptions(bucket_bytes=BUCKET // 2, timeout_s=TIMEOUT)) as local, \
            CrossNodeReceiver(endpoint, rank=0, timeout_s=TIMEOUT) as rx:
        engine = mp.get_context("spawn").Process(target=_engine, args=(local.endpoint, out, where))
        engine.start()
        forward = LocalForwarder(lambda src, v, manifest: local.send(src, version=v, manifest=manifest),
                                 timeout_s=TIMEOUT)
        out.put(("up",))
        for v in VERSIONS:
            rx.receive(forward)
            out.put(("agent", v, forward.result.tensors, forward.result.bytes))
        engine.join(TIMEOUT)


def test_engine_node_forwards_into_its_local_engine(backend):
    need_devices(backend, 2)
    if backend.name != "cpu":
        backend.device().set_index(0)  # sender 0, here
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with CrossNodeSender(f"tcp://{HOST}:0", num_receivers=1, group_host=HOST, options=CrossNodeOptions(bucket_bytes=BUCKET, timeout_s=TIMEOUT)) as tx:
        agent = ctx.Process(target=_agent, args=(tx.endpoint, out, (backend.name, 1)))
        agent.start()
        try:
            assert out.get(timeout=30) == ("up",)
            for v in VERSIONS:
                tx.send(_tensors(v), version=v)
            reports = [out.get(timeout=3 * TIMEOUT) for _ in range(2 * len(VERSIONS))]
        finally:
            agent.join(3 * TIMEOUT)
            if agent.is_alive():
                agent.kill()
    engine = sorted(r for r in reports if r[0] == "engine")
    assert engine == [("engine", v, True, v) for v in VERSIONS], reports
    nbytes = sum(t.numel() * t.element_size() for _, t in _tensors(0))
    assert ("agent", 0, len(_tensors(0)), nbytes) in reports
    assert agent.exitcode == 0
