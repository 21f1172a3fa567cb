"""A PEFT LoRA model as hwsync sends it: the frozen base under its checkpoint's names, the adapter as PEFT saves it.

    from hwsync.integrations.peft import peft_trainer_model
    model = peft_trainer_model(peft_model, name="policy", lora_id=1)   # a LoraTrainerModel
    stats = sync.sync(model, version=step)                           # base only when the engine lacks it

- base: PEFT wraps each targeted layer and moves its weight to `<layer>.base_layer.weight`; the
  base is that state dict with `base_layer` taken out and the adapter's own weights left out,
  then named as `save_pretrained` names the checkpoint (hf.py, transformers' own conversions),
  one decoder layer at a time. Its manifest is computed on meta tensors.
- adapter: `get_peft_model_state_dict`, the tensors PEFT writes to `adapter_model.safetensors`,
  under the same names, as views of the trained parameters (nothing is copied until sent);
- config: the adapter's PEFT config as `adapter_config.json` holds it.
Both sources are callables, opened afresh at every sync; a base the plan does not send is never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hwsync.integrations.hf import checkpoint_manifest_of, checkpoint_tensors, full_tensor
from hwsync.integrations.lora import LoraAdapter, LoraTrainerModel, plain_config
from hwsync.sync.planner import SyncMode, Version
from hwsync.sync.spec import TensorSpec, dtype_name


def _tuner_layers(model: torch.nn.Module) -> set[str]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)}


def peft_base_state(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights under their own names: `base_layer` taken out, adapter weights left out."""
    base = peft_model.get_base_model()  # type: ignore[operator]
    tuners = _tuner_layers(base)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        parts = name.split(".")
        owner = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in tuners), None)
        if owner is None:
            state[name] = tensor
        elif parts[owner] == "base_layer":  # the wrapped layer's own weight
            state[".".join(parts[:owner] + parts[owner + 1:])] = tensor
        # else: the adapter's weights (lora_A, lora_B, ...): not part of the base
    return state


def peft_adapter_tensors(peft_model: torch.nn.Module, adapter: str = "default") -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors as PEFT saves them (`adapter_model.safetensors` names), as views."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=adapter, save_embedding_layers=False)
    return [(name, full_tensor(tensor)) for name, tensor in state.items()]


def peft_adapter_config(peft_model: torch.nn.Module, adapter: str = "default") -> dict[str, Any]:
    """The adapter's PEFT config as plain values (what adapter_config.json holds)."""
    return plain_config(peft_model.peft_config[adapter].to_dict())  # type: ignore[index, union-attr]


def peft_trainer_model(peft_model: torch.nn.Module, *, name: str, lora_id: int, adapter: str = "default",
                       base_version: Version | None = None) -> LoraTrainerModel:
    """A LoraTrainerModel of `peft_model`'s `adapter`, delivered to engines as adapter `name` / `lora_id`."""
    base = peft_model.get_base_model()  # type: ignore[operator]

    def base_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        return checkpoint_tensors(base, state=peft_base_state(peft_model))

    def adapter_tensors() -> list[tuple[str, torch.Tensor]]:
        return peft_adapter_tensors(peft_model, adapter)

    adapters_manifest = [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in adapter_tensors()]
    return LoraTrainerModel(
        SyncMode.LORA_UNMERGED, base=base_tensors, adapters=adapter_tensors, base_version=base_version,
        base_manifest=checkpoint_manifest_of(base, state=peft_base_state(peft_model)),
        adapters_manifest=adapters_manifest,
        adapter=LoraAdapter(name, lora_id, peft_adapter_config(peft_model, adapter)))
