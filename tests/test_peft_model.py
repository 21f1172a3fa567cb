"""A PEFT LoRA model as hwsync sends it: base under the checkpoint's names, adapter as PEFT saves it."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("peft", reason="peft is not importable: pip install peft (ci/setup.sh installs it)")

import torch  # noqa: E402

from hwsync.cli.toy_model import ToyModel  # noqa: E402
from hwsync.integrations.hf import checkpoint_tensors  # noqa: E402
from hwsync.integrations.lora import LoraAdapter, LoraTrainerModel  # noqa: E402
from hwsync.errors import PlanError  # noqa: E402
from hwsync.sync.planner import SyncMode, TrainerModel  # noqa: E402

TOY = ToyModel(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=128)


def _peft(targets=("q_proj", "v_proj")):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(TOY.build(0), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    return model


def test_the_base_is_the_plain_models_checkpoint_and_is_not_copied():
    from hwsync.integrations.peft import peft_trainer_model

    peft_model = _peft()
    model = peft_trainer_model(peft_model, name="a", lora_id=1)
    plain = [(n, t.clone()) for n, t in checkpoint_tensors(TOY.build(0))]
    sent = list(model.base())
    assert [n for n, _ in sent] == [n for n, _ in plain] == [s.name for s in model.base_manifest]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(sent, plain, strict=True))
    wrapped = peft_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    q = dict(sent)["model.layers.0.self_attn.q_proj.weight"]
    assert q.data_ptr() == wrapped.data_ptr()  # a view of the trained model's frozen weight


def test_the_adapter_is_what_save_pretrained_writes(tmp_path):
    from safetensors.torch import load_file

    from hwsync.integrations.peft import peft_trainer_model

    peft_model = _peft()
    model = peft_trainer_model(peft_model, name="a", lora_id=3)
    peft_model.save_pretrained(str(tmp_path))
    saved = load_file(os.path.join(tmp_path, "adapter_model.safetensors"))
    sent = dict(model.adapters())
    assert sorted(sent) == sorted(saved) == sorted(s.name for s in model.adapters_manifest)
    assert all(torch.equal(sent[n], saved[n]) for n in saved)
    on_disk = json.loads((tmp_path / "adapter_config.json").read_text())
    on_disk["target_modules"] = sorted(on_disk["target_modules"])  # a set in PEFT: saved in any order
    lora_fields = ("r", "lora_alpha", "target_modules", "bias", "use_rslora", "use_dora", "rank_pattern",
                   "alpha_pattern", "modules_to_save", "lora_bias", "init_lora_weights", "peft_type")
    assert {k: model.adapter.config[k] for k in lora_fields} == {k: on_disk[k] for k in lora_fields}
    assert json.loads(json.dumps(model.adapter.config)) == model.adapter.config  # plain values only
    assert model.adapter_spec() == {"name": "a", "lora_id": 3, "config": model.adapter.config, "tensors": 8}


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode=SyncMode.FULL, base=list), "for mode lora_unmerged"),
    (dict(mode=SyncMode.LORA_UNMERGED, adapters=list, adapters_manifest=[]), "needs adapter="),
    (dict(mode=SyncMode.LORA_UNMERGED, adapters=list, adapter=LoraAdapter("a", 1, {"r": 1, "lora_alpha": 1,
                                                                                 "target_modules": []})),
     "pass adapters_manifest"),
])
def test_lora_trainer_model_misconfiguration(kwargs, match):
    with pytest.raises(PlanError, match=match):
        LoraTrainerModel(**kwargs)


@pytest.mark.parametrize("args,match", [
    (("", 1, {}), "non-empty"), (("a", 0, {}), "positive int"), (("a", True, {}), "positive int"),
    (("a", 1, {"r": 8}), "lacks 'lora_alpha'"),
])
def test_lora_adapter_validation(args, match):
    with pytest.raises(ValueError, match=match):
        LoraAdapter(*args)


def test_an_unmerged_trainer_model_without_an_adapter_identity_is_refused_for_vllm():
    from hwsync.integrations.vllm.sources import sync_parts

    model = TrainerModel(SyncMode.LORA_UNMERGED, adapters=list, adapters_manifest=[])
    with pytest.raises(ValueError, match="LoraTrainerModel"):
        sync_parts(model)
    with pytest.raises(ValueError, match="base_manifest"):
        sync_parts(TrainerModel(SyncMode.FULL, base=list))
