"""The planner, onload and bucket sizing, driven through a real WeightSender -> WeightReceiver sync."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from hwsync import WeightSender
from hwsync.sync.planner import EngineState, SyncMode, TrainerModel
from hwsync.sync.options import SenderOptions

import transfer_procs as procs

CTX = mp.get_context("spawn")


def _lora_model() -> tuple[TrainerModel, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    base = {f"layers.{i}.q_proj.weight": torch.randn(128, 128) for i in range(4)}
    adapters = {f"layers.{i}.q_proj.lora_{ab}.weight": torch.randn(8, 128) for i in range(4) for ab in "AB"}
    model = TrainerModel(SyncMode.LORA_UNMERGED, base=lambda: iter(base.items()), adapters=lambda: iter(adapters.items()))
    return model, base, adapters


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_lora_sends_adapters_only_while_the_engine_keeps_its_base(backend):
    model, base, adapters = _lora_model()
    kept = EngineState(sleep_level=1, weights_freed=False, has_base=True, version=1).to_dict()
    freed = EngineState(sleep_level=2, weights_freed=True, has_base=True, version=2).to_dict()
    never = EngineState(sleep_level=0, weights_freed=False, has_base=False).to_dict()
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        q = CTX.Queue()
        p = CTX.Process(target=procs.receive_with_states, args=(sender.endpoint, [never, kept, freed], q))
        p.start()
        first = sender.send(model, version=1)
        assert q.get(timeout=60)["names"] == [*base, *adapters]
        assert first.plan.send == "base_then_adapters"

        second = sender.send(model, version=2)
        got = q.get(timeout=60)
        # what crossed the transport: adapters and nothing else
        assert got["names"] == list(adapters)
        assert second.bytes == got["transport_bytes"] == _nbytes(adapters)
        assert "only the adapters are sent" in second.plan.reason

        third = sender.send(model, version=3)
        got = q.get(timeout=60)
        assert got["names"] == [*base, *adapters]
        assert third.bytes == _nbytes(base) + _nbytes(adapters)
        assert "level-2 sleep" in third.plan.reason
        p.join(30)


def test_a_planned_sync_announces_exactly_what_its_plan_sends(backend):
    from hwsync.sync.spec import manifest_from_tensors

    model, base, adapters = _lora_model()
    model.base_manifest = manifest_from_tensors(list(base.items()))
    model.adapters_manifest = manifest_from_tensors(list(adapters.items()))
    never = EngineState(sleep_level=0, weights_freed=False, has_base=False).to_dict()
    checked = EngineState(sleep_level=0, weights_freed=False, has_base=True, base_intact=True).to_dict()
    changed = dict(checked, base_intact=False)
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        q = CTX.Queue()
        p = CTX.Process(target=procs.receive_with_states, args=(sender.endpoint, [never, checked, changed], q))
        p.start()
        for want in ([*base, *adapters], list(adapters), [*base, *adapters]):
            stats = sender.send(model, version=1)
            got = q.get(timeout=60)
            assert got["announced"] == got["names"] == want, stats.plan.reason
        assert "own check" in stats.plan.reason
        p.join(30)


def test_auto_bucket_and_onload_with_nothing_offloaded(backend):
    module = torch.nn.Linear(64, 32)
    device = backend.device().torch_device()
    module.to(device)
    before = {n: t.data_ptr() for n, t in module.state_dict().items()}
    with WeightSender(options=SenderOptions(bucket_bytes="auto", timeout_s=30)) as sender:
        q = CTX.Queue()
        p = CTX.Process(target=procs.receive_with_states, args=(sender.endpoint, [{}], q))
        p.start()
        stats = sender.send(module.state_dict().items(), version=1, onload=module)
        assert q.get(timeout=60)["names"] == ["weight", "bias"]
        p.join(30)
    assert stats.onload_s == 0.0 and stats.offload_s == 0.0
    assert {n: t.data_ptr() for n, t in module.state_dict().items()} == before
    assert "least free memory" in stats.bucket_reason and stats.bucket_bytes >= 16 << 20
