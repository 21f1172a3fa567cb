"""The engine-side manifest check and the trainer helper's error handling, without an engine."""

from __future__ import annotations

import pytest
import torch

from hwsync import HwsyncError, ManifestError, TensorSpec
from hwsync.errors import RemoteError
from hwsync.integrations.vllm.checkpoint import check_manifest, checkpoint_manifest
from hwsync.integrations.vllm import EXTENSION, VllmWeightSync, settle, weights_and_manifest

EXPECTED = [
    TensorSpec("model.embed_tokens.weight", "float32", (16, 4)),
    TensorSpec("model.layers.0.self_attn.q_proj.weight", "float32", (4, 4)),
    TensorSpec("model.norm.weight", "float32", (4,)),
]


def test_matching_manifest_passes_and_floats_may_be_cast():
    check_manifest(EXPECTED, EXPECTED)
    check_manifest(EXPECTED, [TensorSpec(s.name, "bfloat16", s.shape) for s in EXPECTED])


@pytest.mark.parametrize("bad, words", [
    (TensorSpec("model.layers.9.mlp.up_proj.weight", "float32", (4, 4)), "is not a weight"),
    (TensorSpec("model.norm.weight", "float32", (5,)), "has shape [5]"),
    (TensorSpec("model.norm.weight", "int32", (4,)), "has dtype int32"),
    (TensorSpec("model.norm.weight", "bfloat17", (4,)), "unknown dtype 'bfloat17'"),
])
def test_bad_tensor_is_named(bad, words):
    announced = [s for s in EXPECTED if s.name != bad.name] + [bad]
    with pytest.raises(ManifestError) as info:
        check_manifest(EXPECTED, announced, allow_partial=True)
    assert repr(bad.name) in str(info.value) and words in str(info.value)


def test_missing_tensors_refused_unless_partial():
    with pytest.raises(ManifestError, match="not in the sync"):
        check_manifest(EXPECTED, EXPECTED[:1])
    check_manifest(EXPECTED, EXPECTED[:1], allow_partial=True)


def test_tied_head_accepted_only_when_tied():
    head = TensorSpec("lm_head.weight", "float32", (16, 4))
    check_manifest(EXPECTED, EXPECTED + [head], tied_embeddings=True)
    with pytest.raises(ManifestError, match="lm_head.weight"):
        check_manifest(EXPECTED, EXPECTED + [head])


def test_checkpoint_manifest_reads_safetensors_headers(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    safetensors.save_file({"a.weight": torch.zeros(3, 2, dtype=torch.bfloat16), "b": torch.zeros(5)},
                          str(tmp_path / "model.safetensors"))
    specs = sorted(checkpoint_manifest(str(tmp_path)), key=lambda s: s.name)
    assert specs == [TensorSpec("a.weight", "bfloat16", (3, 2)), TensorSpec("b", "float32", (5,))]


def test_checkpoint_without_safetensors_names_the_fix(tmp_path):
    with pytest.raises(ManifestError, match="save the initial checkpoint with safetensors"):
        checkpoint_manifest(str(tmp_path))


def test_lazy_source_needs_a_manifest():
    with pytest.raises(ValueError, match="needs manifest="):
        weights_and_manifest(((n, torch.zeros(1)) for n in "ab"), None)
    source, manifest = weights_and_manifest({"a": torch.zeros(2)}, None)
    assert manifest == [TensorSpec("a", "float32", (2,))]


def test_engine_refusal_raises_with_engine_message():
    refusal = RemoteError("receiver failed: ManifestError: tensor 'x' has shape [1]")
    with pytest.raises(ManifestError, match="tensor 'x' has shape"):
        settle(None, refusal, None, RuntimeError("worker failed"))
    with pytest.raises(HwsyncError, match="engine RPC: RuntimeError: boom"):
        settle(None, RemoteError("receiver failed: OSError: disk"), None, RuntimeError("boom"))


def test_engine_without_extension_names_the_fix():
    class NoExtension:
        def collective_rpc(self, method, *args, **kwargs):
            raise AttributeError(f"'Worker' object has no attribute {method!r}")

    with pytest.raises(HwsyncError, match=EXTENSION.replace(".", r"\.")):
        VllmWeightSync(NoExtension())
