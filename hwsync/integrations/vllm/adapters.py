"""LoRA adapters delivered from memory into a running vLLM engine's LoRA manager: no file is written.

A sync that carries an adapter names it (`AdapterSpec`: name and id chosen by the trainer, its
PEFT config, how many of the announced tensors are its own: the last ones). In order:
1. `check`, before any byte of the sync is loaded: the engine has LoRA on, the config passes
   vLLM's own `PEFTHelper.validate_legal` (rank <= max_lora_rank, no bias, no DoRA, ...), every
   tensor lands in a module the engine wrapped for LoRA, shapes fit those modules, and the CPU
   cache has room. vLLM's disk path would silently drop modules outside `lora_target_modules`,
   and an adapter it refuses while scheduling stops an in-process engine, so a misfit is refused
   here, with the fix, while the engine still serves what it had;
2. `install`, once every tensor arrived: `LoRAModel.from_lora_tensors`, then the adapter replaces
   any earlier version under the same id and is pinned in the CPU cache (an evicted adapter would
   be re-read from its path, and there is none). The next batch activates it; the caller resets
   the prefix cache, whose blocks are keyed by the adapter's name, not its contents.
vLLM drops every adapter whenever it replaces base weights (its weight-transfer `finish` and
`reload_weights` call `reset_lora_state`): the manager's `remove_all_adapters` is wrapped so that
the adapters held here are registered again right after, from memory.
Requests use `LoRARequest(name, id, "hwsync://<name>")`; vLLM never reads that path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch

from hwsync.errors import HwsyncError
from hwsync.sync.spec import TensorSpec

log = logging.getLogger("hwsync")

#: the path of every LoRARequest of an adapter delivered by hwsync (vLLM requires one; it is never read)
ADAPTER_SCHEME = "hwsync://"


class LoraError(HwsyncError, ValueError):
    """The adapter does not fit the engine's LoRA config; nothing was changed."""


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter one sync delivers: name and id (the trainer's choice), PEFT config, count of its tensors."""

    name: str
    lora_id: int
    config: dict[str, Any]
    tensors: int

    @classmethod
    def parse(cls, data: Any) -> AdapterSpec:
        """Validate what the trainer sent (a dict, e.g. decoded from JSON)."""
        if not isinstance(data, dict):
            raise LoraError(f"the adapter spec must be a dict, got {type(data).__name__}")
        name, lora_id, config, tensors = (data.get(k) for k in ("name", "lora_id", "config", "tensors"))
        if not isinstance(name, str) or not name:
            raise LoraError(f"adapter name must be a non-empty str, got {name!r}")
        for key, value in (("lora_id", lora_id), ("tensors", tensors)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoraError(f"adapter {name!r}: {key} must be a positive int, got {value!r}")
        if not isinstance(config, dict):
            raise LoraError(f"adapter {name!r}: config must be the PEFT adapter config as a dict")
        return cls(name, cast(int, lora_id), config, cast(int, tensors))  # checked above

    def to_dict(self) -> dict[str, Any]:
        """Plain values (msgpack/JSON)."""
        return {"name": self.name, "lora_id": self.lora_id, "config": self.config, "tensors": self.tensors}


@dataclass
class _Held:
    spec: AdapterSpec
    lora: Any  # vLLM's LoRAModel
    version: int | None


def lora_manager(model: torch.nn.Module) -> Any:
    """The engine's LoRA model manager (vLLM sets `model.lora_manager`), or None when LoRA is off."""
    return getattr(model, "lora_manager", None)


def _peft_helper(spec: AdapterSpec, vllm_config: Any) -> Any:
    from vllm.lora.peft_helper import PEFTHelper

    text = vllm_config.model_config.hf_config.get_text_config()
    config = dict(spec.config, vllm_max_position_embeddings=getattr(text, "max_position_embeddings", None))
    try:
        helper = PEFTHelper.from_dict(config)
        helper.validate_legal(vllm_config.lora_config)  # vLLM's own rules and messages
    except (ValueError, TypeError) as exc:
        raise LoraError(f"adapter {spec.name!r} does not fit the engine's LoRA config: {exc}") from None
    return helper


def _weights_mapper(model: torch.nn.Module) -> Any:
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return None if mapper is None else mapper.get_rename_mapper()


def _full_dims(wrapper: torch.nn.Module, index: int | None) -> tuple[int, int] | None:
    """(input, output) of a LoRA-wrapped linear layer, unsharded, or of its packed slice `index`; None if not linear."""
    from vllm.model_executor.layers.linear import LinearBase

    base = getattr(wrapper, "base_layer", None)
    if not isinstance(base, LinearBase):
        return None
    sizes = [int(s) for s in (getattr(base, "output_sizes", None) or [base.output_size])]
    if hasattr(base, "total_num_kv_heads") and len(sizes) == 3:  # kv heads replicated across ranks count once
        head = int(base.head_size)
        sizes = [int(base.total_num_heads) * head, int(base.total_num_kv_heads) * head,
                 int(base.total_num_kv_heads) * int(getattr(base, "v_head_size", head))]
    if index is None:
        return int(base.input_size), sum(sizes)
    return (int(base.input_size), sizes[index]) if index < len(sizes) else None


class EngineAdapters:
    """One worker's adapters delivered by hwsync: checked, registered, kept across vLLM's resets."""

    def __init__(self) -> None:
        self.held: dict[str, _Held] = {}

    def check(self, model: torch.nn.Module, vllm_config: Any, spec: AdapterSpec, announced: list[TensorSpec]) -> None:
        """Refuse, with the fix, an adapter that does not fit; changes nothing."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        am = lora_manager(model)
        if am is None or getattr(vllm_config, "lora_config", None) is None:
            raise LoraError(f"adapter {spec.name!r}: the engine runs without LoRA; start it with enable_lora=True "
                            f"and max_lora_rank >= {spec.config.get('r')}")
        if len(announced) != spec.tensors:
            raise LoraError(f"adapter {spec.name!r} announces {spec.tensors} tensors but the sync carries "
                            f"{len(announced)} after the base")
        for other in self.held.values():
            if other.spec.lora_id == spec.lora_id and other.spec.name != spec.name:
                raise LoraError(f"adapter {spec.name!r}: id {spec.lora_id} already serves adapter "
                                f"{other.spec.name!r}; give each adapter its own id")
        if len({n for n in self.held if n != spec.name}) + 1 > am.capacity:
            raise LoraError(f"adapter {spec.name!r} would be adapter {len(self.held) + 1} held in memory, but the "
                            f"engine's CPU cache holds {am.capacity}; start it with max_cpu_loras >= "
                            f"{len(self.held) + 1}")
        _peft_helper(spec, vllm_config)
        mapper, packed = _weights_mapper(model), am.packed_modules_mapping
        wrapped: dict[str, tuple[torch.nn.Module, int | None]] = {}  # module name -> (LoRA wrapper, packed slice)
        for name, module in am.modules.items():
            parent, _, leaf = name.rpartition(".")
            wrapped[name] = (module, None)
            for index, sub in enumerate(packed.get(leaf, [])):
                wrapped[f"{parent}.{sub}" if parent else sub] = (module, index)
        shapes: dict[str, dict[bool, tuple[int, ...]]] = {}
        for item in announced:
            try:
                module, is_a = parse_fine_tuned_lora_name(item.name, mapper)
            except ValueError as exc:
                raise LoraError(f"adapter {spec.name!r}: {item.name!r} is not a LoRA tensor name ({exc})") from None
            if len(item.shape) != 2:
                raise LoraError(f"adapter {spec.name!r}: {item.name!r} has shape {item.shape}; LoRA A/B are matrices")
            shapes.setdefault(module, {})[is_a] = item.shape
        outside = sorted(m for m in shapes if m not in wrapped)
        if outside:
            targets = vllm_config.lora_config.target_modules
            raise LoraError(f"adapter {spec.name!r} has LoRA weights for {len(outside)} modules the engine does not "
                            f"apply LoRA to (e.g. {outside[0]!r}; engine lora_target_modules={targets}); vLLM would "
                            "drop them silently: start the engine with lora_target_modules covering them, or train "
                            "the adapter without them")
        max_rank = vllm_config.lora_config.max_lora_rank
        for module, pair in sorted(shapes.items()):
            if set(pair) != {True, False}:
                raise LoraError(f"adapter {spec.name!r}: module {module!r} has lora_{'A' if True in pair else 'B'} "
                                "but not its other half")
            (rank, fan_in), (fan_out, rank_b) = pair[True], pair[False]
            if rank != rank_b or rank > max_rank:
                raise LoraError(f"adapter {spec.name!r}: module {module!r} has rank {rank} (A) / {rank_b} (B); "
                                f"both must be equal and <= the engine's max_lora_rank {max_rank}")
            dims = _full_dims(*wrapped[module])
            if dims is not None and dims != (fan_in, fan_out):
                raise LoraError(f"adapter {spec.name!r}: module {module!r} maps {fan_in} -> {fan_out} but the "
                                f"engine's layer maps {dims[0]} -> {dims[1]}; was it trained on this model?")

    def install(self, model: torch.nn.Module, vllm_config: Any, spec: AdapterSpec,
                tensors: dict[str, torch.Tensor], version: int | None) -> None:
        """Build the adapter from `tensors` (checked before) and make it replace any earlier version."""
        from vllm.lora.lora_model import LoRAModel

        am = lora_manager(model)
        lora = LoRAModel.from_lora_tensors(
            spec.lora_id, tensors, _peft_helper(spec, vllm_config), device="cpu",
            dtype=vllm_config.lora_config.lora_dtype, model_vocab_size=vllm_config.model_config.get_vocab_size(),
            weights_mapper=_weights_mapper(model), skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        for validate in ("_validate_moe_lora_format", "_validate_modules_to_save"):
            if hasattr(am, validate):  # vLLM's own checks of what from_lora_tensors built
                getattr(am, validate)(lora)
        previous = self.held.get(spec.name)
        if previous is not None and previous.spec.lora_id != spec.lora_id:
            am.remove_adapter(previous.spec.lora_id)  # the same adapter under a new id: free the old one
        self.held[spec.name] = _Held(spec, lora, version)
        self._keep_across_resets(am)
        am.remove_adapter(spec.lora_id)  # deactivates its slot too: the next batch activates the new version
        self._register(am, self.held[spec.name])

    @staticmethod
    def _register(am: Any, held: _Held) -> None:
        am.add_adapter(held.lora)
        am._registered_adapters.pin(held.spec.lora_id)  # in the CPU cache only; GPU slots stay vLLM's to rotate

    def _keep_across_resets(self, am: Any) -> None:
        """Wrap the manager's remove_all_adapters once: the adapters held here come back right after it."""
        if getattr(am, "_hwsync_adapters", None) is self:
            return
        remove_all = am.remove_all_adapters

        def remove_all_then_restore() -> None:
            remove_all()
            for held in self.held.values():
                self._register(am, held)
            if self.held:
                log.info("hwsync: registered %d LoRA adapters again after vLLM dropped all", len(self.held))

        am.remove_all_adapters = remove_all_then_restore
        am._hwsync_adapters = self

    def report(self, model: torch.nn.Module, vllm_config: Any) -> dict[str, Any]:
        """Whether LoRA is on, its limits, the ids vLLM has registered, and hwsync's adapters by name."""
        am = lora_manager(model)
        config = getattr(vllm_config, "lora_config", None)
        if am is None or config is None:
            return {"enabled": False, "loaded": [], "adapters": {}}
        loaded = sorted(int(i) for i in am.list_adapters())
        targets = config.target_modules
        return {
            "enabled": True, "max_rank": int(config.max_lora_rank), "max_loras": int(config.max_loras),
            "max_cpu_loras": int(am.capacity), "target_modules": None if targets is None else sorted(targets),
            "loaded": loaded,
            "adapters": {name: {"id": h.spec.lora_id, "version": h.version, "rank": int(h.spec.config.get("r", 0)),
                                "loaded": h.spec.lora_id in loaded} for name, h in self.held.items()},
        }


class AdapterDelivery:
    """One sync's adapter part: checked with the manifest, copied out as it arrives, installed once complete."""

    def __init__(self, adapters: EngineAdapters, model: torch.nn.Module, vllm_config: Any, spec: AdapterSpec) -> None:
        self.adapters, self.model, self.vllm_config, self.spec = adapters, model, vllm_config, spec
        self.names: frozenset[str] = frozenset()
        self.tensors: dict[str, torch.Tensor] = {}

    def accept(self, announced: list[TensorSpec]) -> list[TensorSpec]:
        """Check the adapter (the manifest's last `spec.tensors` entries); return the base part before it."""
        count = self.spec.tensors
        if count > len(announced):
            raise LoraError(f"adapter {self.spec.name!r} announces {count} tensors but the sync carries "
                            f"{len(announced)} in all")
        base, own = announced[:len(announced) - count], announced[len(announced) - count:]
        self.adapters.check(self.model, self.vllm_config, self.spec, own)
        self.names = frozenset(s.name for s in own)
        return base

    def take(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Keep copies of this bucket's adapter tensors (the bucket is reused); return the base tensors."""
        base = []
        for name, tensor in tensors:
            if name in self.names:
                self.tensors[name] = tensor.clone()
            else:
                base.append((name, tensor))
        return base

    def install(self) -> None:
        """Register the adapter (every tensor has arrived)."""
        missing = sorted(self.names - self.tensors.keys())
        if missing:
            raise LoraError(f"adapter {self.spec.name!r}: the sync ended without {missing[:3]}")
        self.adapters.install(self.model, self.vllm_config, self.spec, self.tensors, None)
