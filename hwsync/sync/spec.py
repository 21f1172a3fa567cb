"""What a sync carries, announced up front: names, dtypes and shapes of the tensors.

A receiver checks the manifest against its model before the first byte is loaded, so a bad
name, shape or dtype is refused while the engine still serves its previous weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Union, runtime_checkable

import torch

from hwsync.errors import ManifestError, SourceError

if TYPE_CHECKING:  # the report is made of specs: it imports this module
    from hwsync.sync.report import ReceiverReport

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


# -- sources: (name, tensor) pairs, the checks every item passes, and their manifests ------------------------
NamedTensors = Iterable[tuple[str, torch.Tensor]]


@runtime_checkable
class Source(Protocol):
    """What a sync sends, described before a tensor is read: send() asks it afresh every sync (a TrainerModel is one,
    planned against the receivers' reports first)."""

    def manifest(self) -> list[TensorSpec] | None:
        """The tensors the next iteration yields (name, dtype, shape, in order), from metadata only; None: unknown."""
        ...

    def tensors(self) -> NamedTensors:
        """A fresh iteration over this sync's (name, tensor) pairs."""
        ...


#: what a sender's send() accepts: a Source, the tensors, or a function of the receivers' reported state giving them
TensorSource = Union[Source, NamedTensors, Callable[["ReceiverReport"], NamedTensors]]


#: the torch dtypes the wire has a name for (a set: this check runs once per tensor of every sync)
_SENDABLE = frozenset(WIRE_DTYPES.values())


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def named_tensor(position: int, item: Any, where: str = "the source",
                 error: type[Exception] = SourceError) -> tuple[str, torch.Tensor]:
    """The (name, tensor) pair at `position` of `where`, or `error` naming the item and the fix.

    Refused: anything but a 2-item tuple or list; a name that is not a str; a value that is not
    a tensor; tensors without plain bytes to copy (meta, sparse and other non-strided layouts,
    nested, quantized or other dtypes the wire has no name for); lazy conjugate or negative views
    (their memory holds the values before the view: the bytes sent would be those).
    """
    # a sync asks this of every tensor: every check at once first; what fails one is checked again below, one at
    # a time, to say which (that path accepts all this one does)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        name, tensor = item
        if (type(name) is str and isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided
                and tensor.dtype in _SENDABLE and not tensor.is_meta and not tensor.is_nested
                and not tensor.is_conj() and not tensor.is_neg()):
            return name, tensor
    return _checked_named_tensor(position, item, where, error)


def _checked_named_tensor(position: int, item: Any, where: str, error: type[Exception]) -> tuple[str, torch.Tensor]:
    """named_tensor one check at a time: `error` names the first that fails."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        kind = f"a {type(item).__name__} of {len(item)} items" if isinstance(item, (tuple, list)) else \
            f"of type {type(item).__name__}"
        raise error(f"item #{position} of {where} is {kind} ({_short(item)}), not a (name, tensor) pair; yield "
                    "(str, torch.Tensor) pairs, e.g. model.state_dict().items()")
    name, tensor = item
    if not isinstance(name, str):
        raise error(f"item #{position} of {where} is named {_short(name)}, of type {type(name).__name__}: names must "
                    "be str; name it with a str (f\"layer.{i}\" for a number, name.decode() for bytes)")
    label = f"item #{position} ({name!r}) of {where}"
    if not isinstance(tensor, torch.Tensor):
        raise error(f"{label} is of type {type(tensor).__name__}, not a torch.Tensor; yield (name, tensor) pairs "
                    "(torch.as_tensor(x) turns an array into one)")
    if tensor.is_meta:
        raise error(f"{label} is a meta tensor: it has a shape but no data; materialise it before sending (load "
                    "its weights, e.g. after model.to_empty(device=...))")
    if tensor.is_nested:
        raise error(f"{label} is a nested tensor, which has no single shape to announce; send its components "
                    "(tensor.unbind()) as tensors of their own")
    if tensor.layout is not torch.strided:
        raise error(f"{label} has layout {tensor.layout}, which has no plain bytes to send; send tensor.to_dense() "
                    "instead, or its parts (indices, values) as tensors of their own")
    if tensor.is_conj() or tensor.is_neg():
        fix = "tensor.resolve_conj()" if tensor.is_conj() else "tensor.resolve_neg()"
        raise error(f"{label} is a lazy {'conjugate' if tensor.is_conj() else 'negative'} view: its memory holds the "
                    f"values before the {'conj()' if tensor.is_conj() else 'negation'}, which would be sent as they "
                    f"are; send {fix} instead")
    if tensor.dtype not in _SENDABLE:
        raise error(f"{label} has dtype {tensor.dtype}, which hwsync cannot send (it sends "
                    f"{', '.join(sorted(WIRE_DTYPES))}); convert it first, e.g. tensor.dequantize() or "
                    "tensor.to(torch.float32)")
    return name, tensor


def checked_items(source: NamedTensors, manifest: list[TensorSpec] | None
                  ) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(position, name, tensor) of each item; ManifestError for a repeated name or a stray from `manifest`.

    When `manifest` is given, the source must yield exactly its tensors, in its order: the
    receivers were told to expect them (and checked them) before the first byte moved.
    """
    seen: set[str] = set()
    count = 0
    for position, item in enumerate(source):
        name, tensor = named_tensor(position, item)
        if name in seen:
            raise ManifestError(f"tensor {name!r} (item #{position}) was yielded twice in one sync; each name must "
                                "be sent once: drop the repeat or rename it")
        seen.add(name)
        if manifest is not None:
            if position >= len(manifest):
                raise ManifestError(f"tensor {name!r} (item #{position}) is beyond the {len(manifest)} tensors the "
                                    "manifest announced; announce every tensor the source yields")
            spec, actual = manifest[position], TensorSpec.of(name, tensor)
            if spec != actual:
                raise ManifestError(f"tensor #{position} strays from the announced manifest: announced {spec}, "
                                    f"got {actual}; yield the tensors in the manifest's order and shapes")
        count += 1
        yield position, name, tensor
    if manifest is not None and count != len(manifest):
        raise ManifestError(f"the manifest announced {len(manifest)} tensors but the source yielded {count}; "
                            f"the next expected was {manifest[count].name!r}")


def with_manifest(source: NamedTensors, manifest: list[TensorSpec] | None, why: str
                  ) -> tuple[NamedTensors, list[TensorSpec]]:
    """The source and its manifest; a lazy source must come with one (`why` says who needs it first)."""
    if manifest is not None:
        return source, manifest
    if not isinstance(source, Sequence):
        raise SourceError(f"a lazy (name, tensor) source needs manifest=...: {why}; pass "
                          "manifest_from_module(model), or the pairs as a list")
    return source, [TensorSpec.of(*named_tensor(position, item)) for position, item in enumerate(source)]
