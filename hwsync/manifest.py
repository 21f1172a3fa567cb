"""What a sync carries, announced up front: names, dtypes and shapes of the tensors.

A receiver checks the manifest against its model before the first byte is loaded, so a bad
name, shape or dtype is refused while the engine still serves its previous weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: every torch dtype with a fixed element size, by the name that travels on the wire
WIRE_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
        getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None),
        getattr(torch, "float8_e8m0fnu", None),
        getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
    )
    if d is not None
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype ("float32"); an error names the supported ones."""
    name = str(dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise TypeError(f"dtype {dtype} cannot be sent: hwsync sends {', '.join(sorted(WIRE_DTYPES))}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; an error names the supported ones."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise TypeError(f"unknown dtype {name!r}: hwsync sends {', '.join(sorted(WIRE_DTYPES))}") from None


@dataclass(frozen=True)
class TensorSpec:
    """One announced tensor: name, wire dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size in bytes (0 for an empty tensor)."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * dtype_from_name(self.dtype).itemsize

    def to_wire(self) -> list[Any]:
        """[name, dtype, shape] for a msgpack frame."""
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, item: Any) -> "TensorSpec":
        """Inverse of to_wire; ValueError names what is wrong with a malformed item."""
        if not isinstance(item, list) or len(item) != 3:
            raise ValueError(f"a manifest item must be [name, dtype, shape], got {type(item).__name__}")
        name, dtype, shape = item
        if not isinstance(name, str) or dtype not in WIRE_DTYPES:
            raise ValueError(f"manifest item {name!r}: a str name and a known dtype are needed, got dtype {dtype!r}")
        if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"manifest item {name!r}: the shape must be a list of non-negative ints")
        return cls(name, dtype, tuple(shape))

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        """The spec of a tensor (its global shape, for a DTensor, without gathering it)."""
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def manifest_from_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """Specs of (name, tensor) pairs; only metadata is read."""
    return [TensorSpec.of(name, t) for name, t in named_tensors]


def manifest_from_module(module: torch.nn.Module) -> list[TensorSpec]:
    """Specs of a module's state dict: shapes are known without materialising or gathering."""
    return manifest_from_tensors(module.state_dict(keep_vars=True).items())
