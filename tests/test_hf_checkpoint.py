"""What a trainer holds, as the checkpoint's tensors: HF modules, plain modules, vLLM WeightSources (no engine)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (vLLM brings it)")

from hwsync import TensorSpec  # noqa: E402
from hwsync.integrations.hf import checkpoint_manifest_of, checkpoint_tensors, is_hf_model  # noqa: E402
from hwsync.integrations.vllm.sources import weights_and_manifest, without_aliases  # noqa: E402
from vllm_families import FAMILIES, build  # noqa: E402


@pytest.mark.parametrize("family", list(FAMILIES))
def test_module_is_sent_as_save_pretrained_writes_it(family: str, tmp_path):
    from safetensors.torch import load_file

    model = build(family, 0)
    model.save_pretrained(str(tmp_path))
    written = load_file(os.path.join(tmp_path, "model.safetensors"))
    sent = list(checkpoint_tensors(model))
    assert sorted(n for n, _ in sent) == sorted(written)
    assert all(torch.equal(written[n], t) for n, t in sent)
    # the manifest comes from meta tensors, in the stream's order
    assert checkpoint_manifest_of(model) == [TensorSpec.of(n, t) for n, t in sent]
    assert all(t.device.type == "meta" for _, t in checkpoint_tensors(model, meta=True))


def test_fused_experts_go_under_the_checkpoints_names():
    qwen = dict(checkpoint_tensors(build("qwen3_moe", 0)))
    assert not [n for n in qwen if "gate_up_proj" in n]
    assert qwen["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (128, 256)
    mixtral = dict(checkpoint_tensors(build("mixtral", 0)))
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in mixtral
    assert not [n for n in mixtral if ".mlp." in n]


@pytest.mark.parametrize("family", ["qwen2_tied", "gemma2"])
def test_tied_head_is_sent_once_and_not_copied(family: str):
    model = build(family, 0)
    sent = dict(checkpoint_tensors(model))
    assert "lm_head.weight" not in sent
    embedding = model.get_input_embeddings().weight
    assert sent["model.embed_tokens.weight"].data_ptr() == embedding.data_ptr()  # a view, not a copy


def test_plain_module_sends_a_shared_parameter_once_and_listed_pairs_as_listed():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    assert not is_hf_model(model)
    source, manifest = weights_and_manifest(model, None)
    assert [n for n, _ in source] == [s.name for s in manifest] == ["embed.weight"]
    pairs = list(model.state_dict().items())
    assert [n for n, _ in weights_and_manifest(pairs, None)[0]] == ["embed.weight", "head.weight"]
    # a view of the same bytes under another shape is not an alias: it is sent
    flat = torch.zeros(16)
    assert len(without_aliases([("a", flat), ("b", flat.view(4, 4)), ("c", flat)])) == 2


def test_vllm_weight_sources_are_taken_as_they_are():
    base = pytest.importorskip("vllm.distributed.weight_transfer.base")

    hf = build("qwen3_moe", 0)
    source, manifest = weights_and_manifest(base.ModuleSource(hf), None)  # module names are fused: converted
    assert manifest == checkpoint_manifest_of(hf)
    assert [n for n, _ in source] == [s.name for s in manifest]

    class Two(base.WeightSource):
        def metadata(self):
            return [base.ParamMeta("a", torch.float32, (2,)), base.ParamMeta("b", torch.bfloat16, (1, 3))]

        def __iter__(self):
            yield "a", torch.zeros(2)
            yield "b", torch.zeros(1, 3, dtype=torch.bfloat16)

    source, manifest = weights_and_manifest(Two(), None)
    assert manifest == [TensorSpec("a", "float32", (2,)), TensorSpec("b", "bfloat16", (1, 3))]
    assert [n for n, _ in source] == ["a", "b"]
