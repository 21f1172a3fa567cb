"""A LoRA adapter as the trainer names it for an engine, and the TrainerModel that carries one.

The planner's `TrainerModel` says what to send; an engine serving several adapters also needs
to know which adapter the tensors become: a name and an integer id, both the trainer's choice
(vLLM's `LoRARequest(name, id, path)`), and the adapter's PEFT config (rank, alpha, target
modules: what `adapter_config.json` holds), which the engine checks against its own LoRA limits
before anything changes. `LoraTrainerModel` is a TrainerModel of unmerged LoRA with that identity;
`hwsync.integrations.peft.peft_trainer_model` makes one from a PEFT model.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hwsync.errors import PlanError
from hwsync.sync.planner import SyncMode, TrainerModel

#: the path of every adapter hwsync delivers (vLLM's LoRARequest needs one; it is never read)
ADAPTER_SCHEME = "hwsync://"


@dataclass(frozen=True)
class LoraAdapter:
    """Which engine adapter the trainer's LoRA becomes: its name, its id and its PEFT config (a plain dict)."""

    name: str
    lora_id: int
    config: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"adapter name must be a non-empty str, got {self.name!r}")
        if isinstance(self.lora_id, bool) or not isinstance(self.lora_id, int) or self.lora_id < 1:
            raise ValueError(f"adapter {self.name!r}: lora_id must be a positive int (vLLM's rule), "
                             f"got {self.lora_id!r}")
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in self.config:
                raise ValueError(f"adapter {self.name!r}: its config lacks {key!r}; pass the PEFT adapter config")

    @property
    def path(self) -> str:
        """The path its requests name: `hwsync://<name>`."""
        return ADAPTER_SCHEME + self.name

    def spec(self, tensors: int) -> dict[str, Any]:
        """What the engine is told: identity, config and how many tensors end the sync (plain values)."""
        return {"name": self.name, "lora_id": self.lora_id, "config": self.config, "tensors": tensors}


@dataclass
class LoraTrainerModel(TrainerModel):
    """An unmerged-LoRA TrainerModel that also names the engine adapter its adapter tensors become."""

    adapter: LoraAdapter | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode is not SyncMode.LORA_UNMERGED:
            raise PlanError(f"LoraTrainerModel is for mode lora_unmerged, got {self.mode.value}")
        if self.adapter is None:
            raise PlanError("LoraTrainerModel needs adapter=LoraAdapter(name, lora_id, config)")
        if self.adapters_manifest is None:
            raise PlanError(f"adapter {self.adapter.name!r}: pass adapters_manifest (the engine checks the "
                            "adapter's names and shapes before anything changes)")

    def adapter_spec(self) -> dict[str, Any]:
        """The adapter's identity for the engine, with the count of its tensors."""
        assert self.adapter is not None and self.adapters_manifest is not None
        return self.adapter.spec(len(self.adapters_manifest))


def plain_config(value: Any) -> Any:
    """JSON-safe values as adapter_config.json holds them (sets as sorted lists, enums as their values)."""
    if isinstance(value, enum.Enum):
        return plain_config(value.value)
    if isinstance(value, Mapping):
        return {str(k): plain_config(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(plain_config(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain_config(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
