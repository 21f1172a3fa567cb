"""An HF transformers module as the tensors of its checkpoint: the names an engine's loader knows.

transformers 5 holds some weights differently from how its checkpoints store them (MoE experts
fused into `mlp.experts.gate_up_proj` / `down_proj`, Mixtral's `block_sparse_moe` renamed), and a
tied output head is the embedding under a second name. An engine started on the checkpoint
accepts the checkpoint's names only, and a tied head at most once. So what a trainer holds is
sent the way `save_pretrained` writes it, with transformers' own machinery rather than a table of
ours: `remove_tied_weights_from_state_dict` drops the aliases (a tensor that shares storage with
one already kept is sent once) and `revert_weight_conversion` applies the reverse of the model's
conversion mapping. Both run one decoder layer at a time, so only one layer's converted tensors
exist at once, and on meta tensors they give the manifest without touching data.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from hwsync.sync.spec import TensorSpec, dtype_name


def is_hf_model(module: Any) -> bool:
    """True for a transformers PreTrainedModel (checked without importing transformers)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(module, torch.nn.Module):
        return False  # a transformers model cannot exist unless transformers was imported
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel)


def _layer_key(name: str) -> str | None:
    """The outermost `<prefix>.<index>` of a name: one decoder layer (a MoE layer's experts included)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 DTensor is gathered (a collective), anything else returned as is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _saved_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The module's state dict (or `state`, under the module's names) as save_pretrained keeps it:
    ignored keys and tied aliases dropped."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = {name: t.detach() for name, t in (model.state_dict() if state is None else state).items()}
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    return remove_tied_weights_from_state_dict(state, model)


def checkpoint_tensors(model: torch.nn.Module, *, meta: bool = False, state: dict[str, torch.Tensor] | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of an HF module, one decoder layer at a time, as save_pretrained names them.

    `meta=True` yields meta tensors of the same names, dtypes and shapes (the manifest, for free).
    Yielded tensors are views of the module's own where the conversion allows (dense layers),
    fresh tensors where it splits fused ones (MoE experts). `state` replaces the module's own
    state dict (e.g. a PEFT-wrapped model's base weights under their plain names).
    """
    from transformers.core_model_loading import revert_weight_conversion

    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _saved_state(model, state).items():
        # names outside the layers go before them (embeddings) or after them (final norm, head)
        key = _layer_key(name) or ("post" if groups.keys() - {"pre"} else "pre")
        groups.setdefault(key, {})[name] = tensor
    for group in groups.values():
        if meta:
            part = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in group.items()}
        else:
            part = {n: full_tensor(t) for n, t in group.items()}
        yield from revert_weight_conversion(model, part).items()


def checkpoint_manifest_of(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> list[TensorSpec]:
    """The manifest of `checkpoint_tensors(model)`, computed on meta tensors (no data is read)."""
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape))
            for n, t in checkpoint_tensors(model, meta=True, state=state)]
