"""Send in the engine's dtype: a trainer's fp32 masters travel as the bf16/fp16 the engine holds.

A receiver reports the dtypes its engine holds in its state (`state["dtypes"]`, made by
`engine_dtypes`): a default for floating tensors and the names that differ. Where every receiver
of a sync names the same floating dtype for a tensor and it is no wider than the trainer's, the
sender casts while packing, with torch's own cast (round to nearest even, the `copy_` an engine's
loader does into its parameter), so the bytes on the wire, the delta computed from them and what
the engine stores are bit for bit what its loader would have stored from the trainer's tensor.
Nothing is cast where a receiver says nothing or receivers disagree: it goes as the trainer holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hwsync.sync.spec import WIRE_DTYPES, TensorSpec, dtype_name

#: the key of a receiver's state under which it reports its engine's dtypes
STATE_KEY = "dtypes"


def engine_dtypes(tensors: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What a receiver reports as `state["dtypes"]`: the floating dtype most of its tensors hold, and the others.

    Pass the module the engine loads into (its parameters and buffers), or (name, tensor) pairs under the
    names the trainer sends.
    """
    pairs = list(tensors.state_dict().items()) if isinstance(tensors, torch.nn.Module) else list(tensors)
    floats = {name: dtype_name(t.dtype) for name, t in pairs if t.dtype.is_floating_point}
    if not floats:
        return {"default": None, "names": {}}
    default = Counter(floats.values()).most_common(1)[0][0]
    return {"default": default, "names": {name: d for name, d in floats.items() if d != default}}


class EngineDtypes:
    """The engine dtype of each tensor, as every receiver of a sync reports it (None where unknown or disputed)."""

    def __init__(self, states: Sequence[Mapping[str, Any]]) -> None:
        reports = [_parse(state.get(STATE_KEY)) for state in states]
        # every receiver must say, or nothing is known
        self._reports = [r for r in reports if r is not None] if reports and None not in reports else []

    def __bool__(self) -> bool:
        return bool(self._reports)

    def of(self, name: str) -> torch.dtype | None:
        """The dtype every receiver holds `name` in, or None when one does not say or they differ."""
        if not self._reports:
            return None
        found = {names.get(name, default) for default, names in self._reports}
        if len(found) != 1:
            return None
        value = found.pop()
        return None if value is None else WIRE_DTYPES[value]

    def target(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a trainer tensor of `dtype` named `name` travels in: the engine's, where casting is exact."""
        wanted = self.of(name)
        if wanted is None or wanted == dtype or not (dtype.is_floating_point and wanted.is_floating_point):
            return dtype
        return wanted if wanted.itemsize <= dtype.itemsize else dtype  # never widen: the engine's loader does that

    def cast(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the dtype it travels in (itself when nothing changes)."""
        wanted = self.target(name, tensor.dtype)
        if wanted == tensor.dtype:
            return tensor
        out = torch.empty(tensor.shape, dtype=wanted, device=tensor.device)
        out.copy_(tensor)  # the engine loader's own cast
        return out

    def pairs(self, source: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The source, each tensor cast as it is taken (lazily: one cast copy alive at a time)."""
        for item in source:
            if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor):
                yield item[0], self.cast(item[0], item[1])
            else:
                yield item  # the stream's checks name what is wrong with it

    def manifest(self, manifest: list[TensorSpec] | None) -> list[TensorSpec] | None:
        """The manifest as the tensors travel."""
        if manifest is None or not self:
            return manifest
        return [TensorSpec(s.name, dtype_name(self.target(s.name, WIRE_DTYPES[s.dtype])), s.shape) for s in manifest]


def _parse(report: Any) -> tuple[str | None, dict[str, str]] | None:
    """(default, {name: dtype}) from a receiver's report, or None when it is missing or malformed."""
    if not isinstance(report, Mapping):
        return None
    default, names = report.get("default"), report.get("names", {})
    if (default is not None and default not in WIRE_DTYPES) or not isinstance(names, Mapping):
        return None
    if not all(isinstance(k, str) and v in WIRE_DTYPES for k, v in names.items()):
        return None
    return default, dict(names)
