"""Ask the engine's own `load_weights`, without changing a weight, whether it takes a manifest.

The checkpoint's headers (checkpoint.py) say which names, shapes and dtypes the engine loaded at
start-up; what its `load_weights` refuses or ignores depends on the model's code (name mappers,
stacking rules, skip lists, the tied-embedding guard). So, before any weight changes, the
announced manifest is fed to the model's real `load_weights` as meta tensors while every
parameter's and buffer's `weight_loader` is a recorder: the model's own rules run, nothing can be
written (the recorders copy nothing; a direct copy from a meta tensor raises instead of
writing). What it raises, `load_weights` would raise mid-load; an announced tensor no recorder
saw is one it would silently skip.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from hwsync.errors import ManifestError
from hwsync.integrations.vllm.checkpoint import check_manifest
from hwsync.sync.spec import TensorSpec, dtype_from_name, dtype_name

_MISSING = object()


@dataclass(frozen=True)
class LoaderVerdict:
    """What the engine's load_weights made of a manifest: its error, if any, the names it skips, the dtype of
    the parameter each other name is loaded into (what the engine holds it in: a sender sends it so), and the
    engine module whose parameter each is loaded into (vLLM's reload processes a module once all of it arrived)."""

    error: str | None
    skipped: frozenset[str] = field(default_factory=frozenset)
    dtypes: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)


def _own_loader(tensor: Any) -> Any:
    """The weight_loader `tensor` holds, or _MISSING: in its __dict__ (a Parameter given one), or behind a property
    of its class (vLLM's parameters, whose deleter drops the loader: restored by setting it again, never deleted)."""
    if isinstance(inspect.getattr_static(type(tensor), "weight_loader", None), property):
        try:
            return tensor.weight_loader
        except AttributeError:  # deleted before (vLLM's getter raises then): deleted again after
            return _MISSING
    return tensor.__dict__.get("weight_loader", _MISSING)


@contextmanager
def recording_loaders(model: torch.nn.Module) -> Iterator[dict[int, Any]]:
    """Swap every parameter's and buffer's weight_loader for a recorder of the tensors handed to it: id of each
    tensor handed over -> the parameter (or buffer) it was handed to."""
    seen: dict[int, Any] = {}
    saved: list[tuple[Any, Any]] = []
    done: set[int] = set()

    def record(*args: Any, **kwargs: Any) -> Any:
        param = args[0] if args else kwargs.get("param")
        loaded = args[1] if len(args) > 1 else kwargs.get("loaded_weight")
        seen[id(loaded)] = param
        base = getattr(loaded, "_base", None)  # a view of the tensor handed over (an expert's slice, a transpose)
        if base is not None:
            seen.setdefault(id(base), param)
        # expert loaders are asked whether they took the tensor (return_success=True)
        return True if kwargs.get("return_success") else None

    tensors: list[Any] = [t for _, t in model.named_parameters(remove_duplicate=False)]  # given a weight_loader
    tensors += [t for _, t in model.named_buffers(remove_duplicate=False)]
    try:
        for tensor in tensors:
            if id(tensor) in done:
                continue
            done.add(id(tensor))
            saved.append((tensor, _own_loader(tensor)))
            tensor.weight_loader = record
        yield seen
    finally:
        for tensor, loader in saved:
            if loader is _MISSING:
                del tensor.weight_loader
            else:
                tensor.weight_loader = loader


def dry_run(model: torch.nn.Module, announced: list[TensorSpec], vllm_config: Any = None) -> LoaderVerdict:
    """Feed `announced` as meta tensors to the model's load_weights in one call; no weight changes.

    Must run outside a layerwise reload, which wraps the same weight_loader attributes.
    """
    pairs = [(s.name, torch.empty(s.shape, dtype=dtype_from_name(s.dtype), device="meta")) for s in announced]
    try:
        with _config(vllm_config), recording_loaders(model) as seen, torch.no_grad():
            cast(Any, model).load_weights(weights=iter(pairs))  # a vLLM model's
    except Exception as exc:  # noqa: BLE001 - any refusal counts: the message is the engine's own
        return LoaderVerdict(error=f"{type(exc).__name__}: {exc}")
    dtypes = {name: dtype_name(dtype) for name, t in pairs
              if isinstance(dtype := getattr(seen.get(id(t)), "dtype", None), torch.dtype) and dtype.is_floating_point}
    owners = {id(tensor): path for path, module in model.named_modules(remove_duplicate=False)
              for tensor in (*module._parameters.values(), *module._buffers.values()) if tensor is not None}
    modules = {name: owners[id(seen[id(t)])] for name, t in pairs if id(t) in seen and id(seen[id(t)]) in owners}
    return LoaderVerdict(error=None, skipped=frozenset(name for name, t in pairs if id(t) not in seen), dtypes=dtypes,
                         modules=modules)


def _config(vllm_config: Any) -> Any:
    # some weight loaders read the current vLLM config, as the engine's own loading provides
    from contextlib import nullcontext

    if vllm_config is None:
        return nullcontext()
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def check_announced(model: torch.nn.Module, model_config: Any, vllm_config: Any, expected: list[TensorSpec],
                    announced: list[TensorSpec], *, allow_partial: bool = False) -> LoaderVerdict:
    """Refuse (ManifestError) what the engine would refuse mid-load; the verdict's `skipped`: the names not to
    hand it, its `dtypes`: the dtype each name is held in.

    The header check names a bad name, shape or dtype; the dry run then refuses what the model's
    own loader would (e.g. a tied `lm_head.weight` in a model that has no head). Names the
    checkpoint lacks that the loader accepts but skips (a tied head next to its embedding) are
    returned, not to be handed over: outside a reload the loader refuses such a head in any call
    without the embedding (a bucket split), and inside vLLM's layerwise reload the tie is
    undone, so the head loads as a layer of its own and whichever of head and embedding is
    processed last wins the shared storage.
    """
    text_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    tied = bool(getattr(text_config, "tie_word_embeddings", False))
    check_manifest(expected, announced, allow_partial=allow_partial, tied_embeddings=tied)
    verdict = dry_run(model, announced, vllm_config)
    if verdict.error is not None:
        raise ManifestError(f"sync refused before any weight changed: the engine's load_weights refuses this "
                            f"manifest ({verdict.error[:400]}); send the checkpoint's names only")
    if allow_partial:
        _whole_modules(model, vllm_config, expected, announced, verdict)
    in_checkpoint = {spec.name for spec in expected}
    return LoaderVerdict(None, frozenset(name for name in verdict.skipped if name not in in_checkpoint), verdict.dtypes,
                         verdict.modules)


def _whole_modules(model: torch.nn.Module, vllm_config: Any, expected: list[TensorSpec], announced: list[TensorSpec],
                   verdict: LoaderVerdict) -> None:
    """A partial sync must bring every checkpoint tensor of each engine module it writes (ManifestError if not).

    vLLM's layerwise reload rebuilds a module once all of it arrived, and at the end of the sync builds the rest
    from new memory: a module a sync sends only part of (q and v of a fused qkv_proj, one expert of a fused
    experts layer, a weight without its bias) would serve zeros where the sync did not reach."""
    whole = dry_run(model, expected, vllm_config)
    if whole.error is not None:  # the checkpoint itself is refused: the announced check above already said so
        return
    parts: dict[str, list[str]] = {}
    for name, module in whole.modules.items():
        parts.setdefault(module, []).append(name)
    sent = {spec.name for spec in announced}
    split = [(module, [n for n in parts[module] if n not in sent])
             for module in dict.fromkeys(verdict.modules.values()) if module in parts]
    split = [(module, missing) for module, missing in split if missing]
    if split:
        module, missing = split[0]
        more = f" (and {len(split) - 1} more modules)" if len(split) > 1 else ""
        raise ManifestError(f"sync refused before any weight changed: a partial sync (allow_partial=True) must send "
                            f"every checkpoint tensor of each engine module it updates, and module {module!r} is "
                            f"missing {missing[:4]}{more}; vLLM rebuilds a module whole, so the parts not sent would "
                            "be left as zeros. Send those tensors too")
