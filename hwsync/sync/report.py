"""What a receiver reports when it is ready for a sync, typed: what its engine holds, in which dtypes, which delta
baseline it holds complete, its device's memory, and the caller's own values.

A receiver's caller says what its engine holds with a `ReceiverState` (`receive(..., state=...)`; a plain dict
is the caller's own values alone). The receiver adds what hwsync knows (the delta baseline it holds, its device's
memory) and sends a `ReceiverReport` in its Ready; the sender parses it once, on arrival, and plans from it: a
TrainerModel from `engine`, the cast from `dtypes`, a delta from `held`, "auto" buckets from `memory`, a callable
source from the whole report (`extra` is the caller's). No key of a dict is reserved.

The cast (`EngineDtypes`): a trainer's fp32 masters travel as the bf16/fp16 the engine holds. Where every
receiver of a sync names the same floating dtype for a tensor and it is no wider than the trainer's, the
sender casts while packing, with torch's own cast (round to nearest even, the `copy_` an engine's loader does
into its parameter), so the bytes on the wire, the delta computed from them and what the engine stores are
bit for bit what its loader would have stored from the trainer's tensor. Nothing is cast where a receiver
says nothing or receivers disagree: it goes as the trainer holds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hwsync.backend.memory import RankMemory
from hwsync.errors import PlanError
from hwsync.sync.planner import EngineState
from hwsync.sync.spec import WIRE_DTYPES, TensorSpec, dtype_name


@dataclass(frozen=True)
class DtypeReport:
    """The dtypes an engine holds its floating tensors in: the one most hold, and the names that differ."""

    default: str | None
    names: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.default is not None and self.default not in WIRE_DTYPES:
            raise ValueError(f"dtype {self.default!r} is not one the wire names ({', '.join(sorted(WIRE_DTYPES))})")
        bad = [(k, v) for k, v in self.names.items() if not isinstance(k, str) or v not in WIRE_DTYPES][:1]
        if bad:
            raise ValueError(f"tensor {bad[0][0]!r} is said to be held as {bad[0][1]!r}, not a dtype the wire names")

    def to_wire(self) -> dict[str, Any]:
        """As msgpack values."""
        return {"default": self.default, "names": dict(self.names)}

    @classmethod
    def from_wire(cls, raw: Any) -> DtypeReport:
        """From a peer's values (ValueError unless well-formed)."""
        if not isinstance(raw, Mapping) or not isinstance(raw.get("names", {}), Mapping):
            raise ValueError(f"a dtype report is a map of default and names, got {type(raw).__name__}")
        return cls(raw.get("default"), dict(raw.get("names", {})))


def engine_dtypes(tensors: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> DtypeReport:
    """What an engine holds: the floating dtype most of its tensors hold, and the others (ReceiverState.dtypes).

    Pass the module the engine loads into (its parameters and buffers), or (name, tensor) pairs under the names
    the trainer sends."""
    from collections import Counter

    pairs = list(tensors.state_dict().items()) if isinstance(tensors, torch.nn.Module) else list(tensors)
    floats = {name: dtype_name(t.dtype) for name, t in pairs if t.dtype.is_floating_point}
    if not floats:
        return DtypeReport(None)
    default = Counter(floats.values()).most_common(1)[0][0]
    return DtypeReport(default, {name: d for name, d in floats.items() if d != default})


@dataclass(frozen=True)
class ReceiverState:
    """What the engine behind a receiver says about itself, for the sender to plan from (`receive(state=...)`)."""

    #: what the engine holds (sleep level, whether its base weights are intact, version): a TrainerModel plans from it
    engine: EngineState | None = None
    #: the dtypes the engine holds its tensors in (engine_dtypes(model)): tensors travel cast to them
    dtypes: DtypeReport | None = None
    #: the caller's own values (msgpack-safe), for a callable source: `send(lambda report: ...)`
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, state: ReceiverState | Mapping[str, Any] | None) -> ReceiverState:
        """A ReceiverState from what a caller passed: itself, or a dict of its own values."""
        if state is None:
            return cls()
        if isinstance(state, ReceiverState):
            return state
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a ReceiverState or a dict of your own values, got {type(state).__name__}")
        return cls(extra=dict(state))


@dataclass(frozen=True)
class ReceiverReport:
    """What one receiver reported when it said it was ready, parsed once on arrival: what the sender plans from."""

    #: what its engine holds, where it says
    engine: EngineState | None = None
    #: the dtypes its engine holds, where it says
    dtypes: DtypeReport | None = None
    #: the id of the sender's delta baseline it holds complete (hwsync.sync.delta_receiver), or None
    held: str | None = None
    #: its device's memory (for "auto" buckets), where it could read it
    memory: RankMemory | None = None
    #: its caller's own values
    extra: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """As msgpack values."""
        return {"engine": None if self.engine is None else self.engine.to_dict(),
                "dtypes": None if self.dtypes is None else self.dtypes.to_wire(), "held": self.held,
                "memory": None if self.memory is None else self.memory.__dict__.copy(), "extra": dict(self.extra)}

    @classmethod
    def from_wire(cls, raw: Any) -> ReceiverReport:
        """From a peer's values; ValueError (the protocol's BadFrame, where it decodes one) unless well-formed."""
        if not isinstance(raw, Mapping) or set(raw) != {"engine", "dtypes", "held", "memory", "extra"}:
            raise ValueError("a receiver's report is a map of engine, dtypes, held, memory and extra")
        engine, dtypes, held, memory, extra = (raw[k] for k in ("engine", "dtypes", "held", "memory", "extra"))
        if held is not None and (not isinstance(held, str) or not 0 < len(held) <= 64):
            raise ValueError("a report's held baseline is an id of at most 64 characters")
        if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
            raise ValueError("a report's extra values are a map with str keys")
        try:
            parsed_engine = None if engine is None else EngineState.from_dict(engine)
        except (PlanError, TypeError, AttributeError) as exc:
            raise ValueError(f"a report's engine state: {exc}") from None
        parsed_memory = None if memory is None else _memory(memory)
        return cls(parsed_engine, None if dtypes is None else DtypeReport.from_wire(dtypes), held, parsed_memory,
                   dict(extra))


def _memory(raw: Any) -> RankMemory:
    """A report's memory row: non-negative ints, each below 2**63."""
    fields = ("rank", "free", "total", "allocated", "reserved")
    if not isinstance(raw, Mapping) or any(type(raw.get(k)) is not int or not 0 <= raw[k] < 1 << 63 for k in fields):
        raise ValueError(f"a report's memory is a map of {', '.join(fields)} as non-negative ints")
    return RankMemory(*(raw[k] for k in fields))


# -- the cast: each tensor in the dtype every engine holds it in --------------------------------------------------
class EngineDtypes:
    """The engine dtype of each tensor, as every receiver of a sync reports it (None where unknown or disputed)."""

    def __init__(self, reports: Sequence[ReceiverReport]) -> None:
        said = [(r.dtypes.default, r.dtypes.names) if r.dtypes is not None else None for r in reports]
        # every receiver must say, or nothing is known
        self._reports = [r for r in said if r is not None] if said and None not in said else []

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
        if not self._reports:  # no engine said its dtypes: nothing is cast (no per-tensor step)
            return iter(source)
        return self._cast_each(source)

    def _cast_each(self, source: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
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
