"""What a trainer holds, as the (name, tensor) stream and manifest an engine's checkpoint expects.

Every trainer-side entry (VllmWeightSync.sync, the native `hwsync` trainer engine) goes through
`weights_and_manifest`, so a module, a state dict, (name, tensor) pairs and a vLLM WeightSource
are all taken as they are:
- an HF transformers module goes under its checkpoint's names (hwsync.integrations.hf), lazily,
  with its manifest computed on meta tensors;
- vLLM's `ModuleSource` of an HF module likewise (its named_parameters are the module's fused
  names, which the checkpoint does not have); any other WeightSource as it says, its
  `metadata()` being the manifest;
- any other module is sent once per storage: a parameter that is an exact alias of one already
  in the stream (a tied head) is dropped, since the engine ties it itself and would otherwise
  receive the same bytes twice; state dicts and lists of pairs go as the caller lists them.
A planner `TrainerModel` goes to the sender as it is (`sync_parts`): the sender plans it against
the engine's reported state and announces what the plan sends; an unmerged LoRA one must name
its engine adapter (LoraTrainerModel), whose tensors then end the sync.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hwsync.integrations.hf import checkpoint_manifest_of, checkpoint_tensors, is_hf_model
from hwsync.integrations.lora import LoraTrainerModel
from hwsync.sync.planner import SyncMode, TrainerModel
from hwsync.sync.spec import TensorSpec, dtype_name, with_manifest

log = logging.getLogger("hwsync")

#: what a trainer may hand to a sync (a vLLM WeightSource included: anything with metadata() and iteration)
Weights = torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Source = Iterable[tuple[str, torch.Tensor]]


def is_weight_source(obj: Any) -> bool:
    """True for a vLLM WeightSource, or anything shaped like one (metadata() plus iteration)."""
    return (callable(getattr(obj, "metadata", None)) and hasattr(obj, "__iter__")
            and not isinstance(obj, torch.nn.Module | Mapping))


def _module_of(source: Any) -> torch.nn.Module | None:
    """The module inside vLLM's ModuleSource (its one private attribute), else None."""
    if type(source).__name__ != "ModuleSource":
        return None
    module = getattr(source, "_module", None)
    return module if isinstance(module, torch.nn.Module) else None


def _materialized(source: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A WeightSource's pairs with each FSDP2 DTensor gathered whole when its turn comes."""
    for name, tensor in source:
        full_tensor = getattr(tensor, "full_tensor", None)
        yield name, (full_tensor() if callable(full_tensor) else tensor)


def manifest_of_source(source: Any) -> list[TensorSpec]:
    """A WeightSource's metadata() as hwsync's manifest."""
    return [TensorSpec(m.name, dtype_name(m.dtype), tuple(int(d) for d in m.shape)) for m in source.metadata()]


def _alias_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    if tensor.device.type == "meta":
        return None  # no storage to share
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype)


def without_aliases(pairs: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The pairs minus every tensor that is an exact view of one earlier in the list (same bytes, same shape)."""
    seen: dict[tuple[Any, ...], str] = {}
    kept = []
    for name, tensor in pairs:
        key = _alias_key(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is not None and key in seen:
            log.debug("hwsync: %r is %r under another name; sent once", name, seen[key])
            continue
        if key is not None:
            seen[key] = name
        kept.append((name, tensor))
    return kept


def weights_and_manifest(weights: Any, manifest: list[TensorSpec] | None) -> tuple[Source, list[TensorSpec]]:
    """The (name, tensor) source to send and its manifest; a lazy source must come with its manifest."""
    module = weights if isinstance(weights, torch.nn.Module) else _module_of(weights)
    if module is not None and is_hf_model(module):
        return checkpoint_tensors(module), manifest or checkpoint_manifest_of(module)
    if is_weight_source(weights):
        return _materialized(weights), manifest or manifest_of_source(weights)
    if isinstance(weights, torch.nn.Module):  # its tied parameters once; pairs a caller lists go as listed
        weights = without_aliases(list(weights.state_dict().items()))
    if isinstance(weights, Mapping):
        weights = list(weights.items())
    return with_manifest(weights, manifest, "the engine checks names, shapes and dtypes before loading")


@dataclass
class SyncParts:
    """What one sync sends: a source (or a TrainerModel the sender plans), its manifest, the adapter it ends with."""

    source: Any
    #: None for a TrainerModel: the sender announces what its plan sends
    manifest: list[TensorSpec] | None
    #: every tensor the sync may carry (sizes the buckets)
    specs: list[TensorSpec]
    #: the LoRA adapter's spec for the engine (AdapterSpec.to_dict()), or None
    adapter: dict[str, Any] | None = None

    @property
    def plans(self) -> bool:
        """Whether the sender reads the engines' reported state (a TrainerModel it plans, a callable source):
        only then do the workers check their base against its fingerprint, and keep one after loading."""
        return isinstance(self.source, TrainerModel) or callable(self.source)


def sync_parts(weights: Any, manifest: list[TensorSpec] | None = None) -> SyncParts:
    """Normalise what a trainer passes: weights as weights_and_manifest takes them, or a TrainerModel."""
    if not isinstance(weights, TrainerModel):
        source, manifest = weights_and_manifest(weights, manifest)
        return SyncParts(source, manifest, manifest)
    if manifest is not None:
        raise ValueError("a TrainerModel announces its own tensors: set base_manifest / adapters_manifest on it "
                         "instead of passing manifest=")
    model = weights
    if model.base is not None and model.base_manifest is None:
        raise ValueError("the engine checks names, shapes and dtypes before loading: give the TrainerModel "
                         "base_manifest (e.g. hwsync.integrations.hf.checkpoint_manifest_of(model))")
    adapter = None
    if model.mode is SyncMode.LORA_UNMERGED:
        if not isinstance(model, LoraTrainerModel):
            raise ValueError("unmerged LoRA into vLLM needs the adapter's name, id and config: use LoraTrainerModel("
                             "..., adapter=LoraAdapter(name, lora_id, config)) or hwsync.integrations.peft."
                             "peft_trainer_model(peft_model, name=..., lora_id=...)")
        adapter = model.adapter_spec()
    return SyncParts(model, None, (model.base_manifest or []) + (model.adapters_manifest or []), adapter)
