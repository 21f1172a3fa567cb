"""The sync planner: decide what to send from the engine's real state, not from habit.

Rules (tests/test_planner.py checks them over every combination of the state's fields):
- full fine-tuning and merged LoRA send every weight, every sync: the trainer changed them all;
- unmerged LoRA always sends the adapters, and sends the base first only when the engine does
  not hold the current base: it never received one, a level-2 sleep really freed it, its own check
  found the base changed since its last complete sync, or it holds a different base than the
  trainer names;
- no tensor name is ever yielded twice; a duplicate is an error that names it.

Sources are consumed lazily: a base that is not sent is never called or iterated, so a trainer
that materialises weights on demand (FSDP2 `full_tensor()`) pays nothing for it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from hwsync.errors import DuplicateTensorError, PlanError
from hwsync.sync.spec import NamedTensors, TensorSpec, named_tensor

log = logging.getLogger("hwsync")

#: A weight version or a base's identity: what the trainer counts or names it by.
Version = Union[int, str]
#: a part of a TrainerModel: (name, tensor) pairs, or a callable that returns them (re-callable every step)
PartSource = Union[NamedTensors, Callable[[], NamedTensors]]


class SyncMode(str, enum.Enum):
    """How the trainer trains: every weight, or LoRA adapters on a frozen base."""

    FULL = "full"
    LORA_MERGED = "lora_merged"
    LORA_UNMERGED = "lora_unmerged"


class SendSet(str, enum.Enum):
    """Which tensors one sync sends."""

    ALL = "all"
    ADAPTERS_ONLY = "adapters_only"
    BASE_THEN_ADAPTERS = "base_then_adapters"


_SLEEP_LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class EngineState:
    """What the inference engine holds, as its receiver reports it before a sync.

    sleep_level describes the weight memory the sync writes into: 0 the engine has not slept
    since its last sync; 1 it slept at level 1 (weights kept in host memory and restored on
    wake-up); 2 it slept at level 2. The receiver reports the level of the sleep it went
    through even when it has been woken for this sync, because waking from level 2 re-allocates
    weight memory without restoring its contents.
    weights_freed says whether that sleep really released the weights (an engine without sleep
    mode, or configured to keep its weights, keeps them at any level).
    base_intact is what the engine observed rather than assumed: True when a check of its weights
    (e.g. a fingerprint taken after its last complete sync) finds them unchanged, False when the
    check finds them changed or a sync broke midway, None when the engine does not check.
    """

    sleep_level: int
    weights_freed: bool
    has_base: bool
    version: Version | None = None
    base_version: Version | None = None
    base_intact: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.sleep_level, bool) or self.sleep_level not in _SLEEP_LEVELS:
            raise PlanError(f"sleep_level must be 0, 1 or 2, got {self.sleep_level!r}")
        for name in ("weights_freed", "has_base"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.base_intact is not None and not isinstance(self.base_intact, bool):
            raise PlanError(f"base_intact must be a bool or None, got {self.base_intact!r}")
        for name in ("version", "base_version"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
                raise PlanError(f"{name} must be an int, a str or None, got {value!r}")
        if self.sleep_level == 0 and self.weights_freed:
            # Weights cannot be freed without a sleep; this is a receiver that reset its sleep
            # level on wake-up but not weights_freed, and guessing either way could lose weights.
            raise PlanError(
                "engine state says weights_freed=True at sleep_level=0; the receiver must report "
                "the level of the sleep that freed the weights (2) until it has received them again"
            )

    @property
    def base_discarded(self) -> bool:
        """Whether a level-2 sleep really released the weights."""
        return self.sleep_level == 2 and self.weights_freed

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack/JSON-safe values."""
        return {"sleep_level": self.sleep_level, "weights_freed": self.weights_freed,
                "has_base": self.has_base, "version": self.version, "base_version": self.base_version,
                "base_intact": self.base_intact}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineState:
        """Build from a receiver's report; unknown keys are ignored so newer receivers still work."""
        missing = [k for k in ("sleep_level", "weights_freed", "has_base") if k not in data]
        if missing:
            raise PlanError(f"engine state {dict(data)!r} lacks {', '.join(missing)}; the receiver must report them")
        return cls(sleep_level=data["sleep_level"], weights_freed=data["weights_freed"], has_base=data["has_base"],
                   version=data.get("version"), base_version=data.get("base_version"),
                   base_intact=data.get("base_intact"))


@dataclass
class TrainerModel:
    """What the trainer has to send: its mode and two lazily consumed sources of named tensors.

    FULL: `base` yields every weight. LORA_MERGED: `base` yields the merged full weights (base
    plus adapter delta, under the base's names); there are no separate adapters. LORA_UNMERGED:
    `base` yields the frozen base, `adapters` the adapter tensors. base_version names the base
    (e.g. a checkpoint path) so an engine holding another base is sent the right one.
    base_manifest / adapters_manifest announce each source's tensors (name, dtype, shape, in
    order); with both known, a plan has a manifest of exactly what it sends (`SyncPlan.manifest`).
    """

    mode: SyncMode
    base: PartSource | None = None
    adapters: PartSource | None = None
    base_version: Version | None = None
    base_manifest: list[TensorSpec] | None = None
    adapters_manifest: list[TensorSpec] | None = None
    #: one-shot iterators already consumed by a plan of this model (every send() plans anew)
    consumed: set[int] = field(default_factory=set, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            self.mode = SyncMode(self.mode)
        except ValueError:
            raise PlanError(f"mode {self.mode!r} is not one of {[m.value for m in SyncMode]}") from None
        if self.mode in (SyncMode.FULL, SyncMode.LORA_MERGED):
            if self.base is None:
                raise PlanError(f"mode {self.mode.value} sends every weight; pass them as `base`")
            if self.adapters is not None:
                raise PlanError(
                    f"mode {self.mode.value} sends full weights only; merge the adapters into `base`, "
                    "or use mode lora_unmerged to send them separately"
                )
        elif self.adapters is None:
            raise PlanError("mode lora_unmerged always sends the adapters; pass them as `adapters`")

    def manifest(self) -> list[TensorSpec] | None:
        """What a sync to an engine of unknown state sends (a sender plans against its receivers' reports instead)."""
        return plan_sync(None, self).manifest()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors a sync to an engine of unknown state sends: every part (a sender plans against reports)."""
        return plan_sync(None, self).tensors()


def engine_holds_base(engine: EngineState | None, base_version: Version | None = None) -> tuple[bool, str]:
    """Whether the engine holds the current base, and why, as a sentence fragment."""
    if engine is None:
        return False, "the engine's state is unknown"
    if not engine.has_base:
        return False, "the engine has never received base weights"
    if engine.base_discarded:
        return False, "the engine discarded its base weights in a level-2 sleep"
    if engine.base_intact is False:
        return False, "the engine's own check found its base weights changed since its last complete sync"
    # Compared only when both sides name a base: an engine that does not track which base it
    # loaded would otherwise be re-sent the base every step (the field bug this module fixes).
    if base_version is not None and engine.base_version is not None and engine.base_version != base_version:
        return False, f"the engine holds base {engine.base_version!r} but the trainer's base is {base_version!r}"
    where = {0: "awake, weights untouched", 1: "a level-1 sleep keeps them in host memory",
             2: "its level-2 sleep did not free them"}[engine.sleep_level]
    if engine.base_intact:
        where += "; its own check confirms them"
    return True, f"the engine still holds the base weights ({where})"


def plan_sync(engine: EngineState | Mapping[str, Any] | None, model: TrainerModel) -> SyncPlan:
    """Decide what this sync sends; `engine` may be the receiver's reported dict, or None if unknown."""
    if engine is not None and not isinstance(engine, EngineState):
        engine = EngineState.from_dict(engine)
    if model.mode is not SyncMode.LORA_UNMERGED:
        what = "full fine-tuning" if model.mode is SyncMode.FULL else "LoRA merged into the base"
        reason = f"{what} changes every weight, so all weights are sent"
        return SyncPlan(SendSet.ALL, model.mode, reason, engine, model.base, None, _opened=model.consumed,
                        _manifests=(model.base_manifest, None))
    holds, why = engine_holds_base(engine, model.base_version)
    if holds:
        reason = f"unmerged LoRA: {why}, so only the adapters are sent"
        return SyncPlan(SendSet.ADAPTERS_ONLY, model.mode, reason, engine, None, model.adapters, _opened=model.consumed,
                        _manifests=(None, model.adapters_manifest))
    if model.base is None:
        raise PlanError(
            f"unmerged LoRA: {why}, so the base must be sent, but TrainerModel.base is None; "
            "pass the frozen base's named tensors as `base`"
        )
    reason = f"unmerged LoRA: {why}, so the base is sent first, then the adapters"
    return SyncPlan(SendSet.BASE_THEN_ADAPTERS, model.mode, reason, engine, model.base, model.adapters,
                    _opened=model.consumed, _manifests=(model.base_manifest, model.adapters_manifest))


def plan_for_engines(engines: Sequence[EngineState | Mapping[str, Any] | None], model: TrainerModel) -> SyncPlan:
    """One plan for several engines fed the same bytes: the base goes if any engine lacks it."""
    if not engines:
        raise PlanError("plan_for_engines needs at least one engine state (pass [None] if unknown)")
    plans = [plan_sync(e, model) for e in engines]
    for index, plan in enumerate(plans):
        if plan.send is SendSet.BASE_THEN_ADAPTERS:
            if len(plans) > 1:
                plan.reason = f"engine {index} of {len(plans)}: {plan.reason}"
            return plan
    return plans[0]


@dataclass
class SyncPlan:
    """Which tensors one sync sends and why; `tensors()` yields them, each name once."""

    send: SendSet
    mode: SyncMode
    reason: str
    engine: EngineState | None
    base: PartSource | None = field(default=None, repr=False)
    adapters: PartSource | None = field(default=None, repr=False)
    _opened: set[int] = field(default_factory=set, repr=False)
    _manifests: tuple[list[TensorSpec] | None, list[TensorSpec] | None] = field(default=(None, None), repr=False)

    @property
    def sends_base(self) -> bool:
        """Whether base (or full) weights are part of this sync."""
        return self.send in (SendSet.ALL, SendSet.BASE_THEN_ADAPTERS)

    @property
    def sends_adapters(self) -> bool:
        """Whether adapter tensors are part of this sync."""
        return self.send in (SendSet.ADAPTERS_ONLY, SendSet.BASE_THEN_ADAPTERS)

    def to_dict(self) -> dict[str, Any]:
        """A log-friendly summary (no tensors)."""
        return {"send": self.send.value, "mode": self.mode.value, "reason": self.reason,
                "engine": None if self.engine is None else self.engine.to_dict()}

    def manifest(self) -> list[TensorSpec] | None:
        """The announced tensors of exactly what this plan sends, in order; None if a sent part has no manifest."""
        base, adapters = self._manifests
        parts = ([base] if self.sends_base else []) + ([adapters] if self.sends_adapters else [])
        if any(part is None for part in parts):
            return None
        return [spec for part in parts for spec in part]  # type: ignore[union-attr]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) in send order, lazily; a repeated name raises DuplicateTensorError."""
        parts = []
        if self.sends_base:
            parts.append(("weights" if self.send is SendSet.ALL else "base", self.base))
        if self.sends_adapters:
            parts.append(("adapters", self.adapters))
        seen: dict[str, str] = {}
        for part, source in parts:
            count = 0
            for position, item in enumerate(self._open(part, source)):
                name, tensor = named_tensor(position, item, f"the {part} source", PlanError)
                if name in seen:
                    raise DuplicateTensorError(
                        f"tensor {name!r} was yielded twice in one sync (first in {seen[name]}, again in "
                        f"{part}); each name must be sent once: drop it from one source or rename it"
                    )
                seen[name] = part
                count += 1
                yield name, tensor
            if part == "adapters" and count == 0:
                raise PlanError("unmerged LoRA sync yielded no adapter tensors; check the `adapters` source")

    def _open(self, part: str, source: PartSource | None) -> Iterator[Any]:
        if source is None:
            raise PlanError(f"the plan sends {part} but no {part} source was given")
        if callable(source):
            return iter(source())
        it = iter(source)
        if it is source:
            # A one-shot iterator (a generator) is empty the second time: say so instead of
            # silently sending nothing.
            if id(source) in self._opened:
                raise PlanError(
                    f"the {part} source is a one-shot iterator that was already consumed; pass a "
                    "callable that returns a fresh iterator (e.g. `model.named_parameters`) instead"
                )
            self._opened.add(id(source))
        return it
