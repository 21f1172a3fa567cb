"""What one colocated update sends, made from what verl hands its rollout, and the settings it reads.

verl's trainer worker calls its rollout's `update_weights` with a generator of (name, tensor):
- full weights (no LoRA, or merged LoRA): hwsync must announce a manifest before the first byte
  moves, and verl's generator announces none, so the first update keeps a host copy of each
  tensor as the generator yields it (once per run) and learns the manifest from it
  (`FullWeights`); every later update streams the generator against that manifest, and a step
  whose tensors differ fails naming the tensor and learns again;
- unmerged LoRA: verl calls twice, the frozen base first only when its `base_sync_done` flag
  says the engine lacks it, then the adapter. Both are already gathered tensors on the host
  (verl's `collect_lora_params`). hwsync keeps the base part and sends one planned
  `LoraTrainerModel`: the planner sends the base when the engine's own report says it lacks it,
  whatever verl's flag says; when verl did not hand a base over, it comes from the checkpoint
  the engine was started on (the frozen base verl trains on), read only if the plan sends it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hwsync.integrations.lora import LoraAdapter, LoraTrainerModel, plain_config
from hwsync.integrations.verl.worker_extension import EXTENSION_CLS
from hwsync.integrations.vllm.checkpoint import checkpoint_manifest, resolve_checkpoint_dir, safetensors_files
from hwsync.sizes import MiB
from hwsync.sync.planner import SyncMode
from hwsync.sync.spec import TensorSpec
from hwsync.timing import DEFAULT_TIMEOUT_S

Pairs = list[tuple[str, torch.Tensor]]
#: hwsync's vLLM weight-transfer backend, as the engine must name it
BACKEND = "hwsync"
#: the hwsync bucket when none is set: at most this, and with every buffer within verl's own bucket setting
MAX_DEFAULT_BUCKET_BYTES = 64 * MiB


@dataclass(frozen=True)
class ColocatedOptions:
    """hwsync's settings for the colocated adapter (`checkpoint_engine.engine_kwargs.hwsync`), all optional."""

    timeout_s: float
    bucket_bytes: int
    num_buffers: int

    @classmethod
    def of(cls, rollout_config: Any) -> ColocatedOptions:
        """Read them from verl's rollout config; the default bucket keeps every buffer within verl's own bucket."""
        ce = rollout_config.checkpoint_engine
        kwargs = dict((ce.engine_kwargs or {}).get(BACKEND, {}) or {})
        unknown = sorted(set(kwargs) - {"timeout_s", "bucket_megabytes", "num_buffers"})
        if unknown:
            raise ValueError(f"checkpoint_engine.engine_kwargs.hwsync has unknown keys {unknown}; the colocated "
                             "adapter takes timeout_s, bucket_megabytes and num_buffers")
        timeout_s = float(kwargs.get("timeout_s", 2 * DEFAULT_TIMEOUT_S))
        num_buffers = int(kwargs.get("num_buffers", 2))
        mb = kwargs.get("bucket_megabytes")
        if mb is not None:
            bucket = int(float(mb) * MiB)
        else:  # verl's update_weights_bucket_megabytes bounds the memory its own sender takes: so does hwsync's
            bucket = min(MAX_DEFAULT_BUCKET_BYTES, (int(ce.update_weights_bucket_megabytes) << 20) // num_buffers)
        if timeout_s <= 0 or num_buffers < 2 or bucket < MiB // 4:
            raise ValueError(f"checkpoint_engine.engine_kwargs.hwsync: timeout_s={timeout_s} must be positive, "
                             f"num_buffers={num_buffers} at least 2, the bucket ({bucket} bytes) at least 256 KiB")
        return cls(timeout_s, bucket, num_buffers)


def _engine_arg(vllm_kwargs: Mapping[str, Any], key: str) -> Any:
    value = vllm_kwargs.get(key)
    if isinstance(value, str) and value.lstrip().startswith("{"):  # vLLM's CLI form of a config: JSON
        value = json.loads(value)
    return value


def check_engine_config(rollout_config: Any) -> None:
    """Raise ValueError, naming the key to set, unless verl starts vLLM for hwsync's colocated mode."""
    vllm_kwargs = (rollout_config.engine_kwargs or {}).get("vllm", {}) or {}
    transfer = _engine_arg(vllm_kwargs, "weight_transfer_config") or {}
    backend = transfer.get("backend") if isinstance(transfer, Mapping) else getattr(transfer, "backend", None)
    fixes = []
    if backend != BACKEND:
        fixes.append(f"actor_rollout_ref.rollout.engine_kwargs.vllm.weight_transfer_config.backend={BACKEND} (now "
                     f"{backend!r}): the engine's side of hwsync")
    if _engine_arg(vllm_kwargs, "worker_extension_cls") != EXTENSION_CLS:
        fixes.append(f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={EXTENSION_CLS} (verl's "
                     "extension, guarded against verl's own sender)")
    if rollout_config.checkpoint_engine.backend != "naive":
        fixes.append("actor_rollout_ref.rollout.checkpoint_engine.backend=naive (hwsync's adapter serves verl's "
                     "colocated mode; disaggregated rollouts take checkpoint_engine.backend=hwsync instead)")
    if fixes:
        raise ValueError("hwsync's colocated adapter was selected (actor_rollout_ref.model.external_lib="
                         "hwsync.integrations.verl.colocated) but verl's rollout config lacks: " + "; ".join(fixes))


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of a tensor on a device; a host tensor as it is."""
    tensor = tensor.detach()
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")


class FullWeights:
    """verl's full-weights generator as hwsync sends it: a manifest learned once, then streamed against."""

    def __init__(self) -> None:
        #: the tensors of the last complete update, in verl's order (None: learn at the next update)
        self.manifest: list[TensorSpec] | None = None

    def source(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[Iterable[tuple[str, torch.Tensor]],
                                                                           list[TensorSpec]]:
        """The (name, tensor) source and its manifest: host copies at the first update, verl's generator after."""
        if self.manifest is not None:
            return weights, self.manifest
        staged = [(name, on_host(tensor)) for name, tensor in weights]
        return staged, [TensorSpec.of(name, tensor) for name, tensor in staged]

    def learned(self, manifest: list[TensorSpec]) -> None:
        """The update went through: later ones stream against its manifest."""
        self.manifest = manifest

    def forget(self) -> None:
        """An update failed: the next one learns the manifest again."""
        self.manifest = None


def base_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Pairs:
    """verl's LoRA base under the checkpoint's names: verl names targeted layers `<layer>.base_layer.weight`."""
    return [(name.replace(".base_layer.", "."), tensor) for name, tensor in weights]


def checkpoint_base(model_path: str) -> tuple[Callable[[], Iterator[tuple[str, torch.Tensor]]], list[TensorSpec]]:
    """The frozen base as the checkpoint the engine was started on holds it: a source read only when called."""
    manifest = checkpoint_manifest(model_path)

    def read() -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for path in safetensors_files(resolve_checkpoint_dir(model_path)):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return read, manifest


def lora_trainer_model(adapter: Pairs, peft_config: Any, base: Pairs | None, model_path: str, *, name: str,
                       lora_id: int) -> LoraTrainerModel:
    """One planned LoRA update: the adapter `name`/`lora_id`, the base verl handed over or else the checkpoint's."""
    config = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)
    if base is not None:
        base_source: Any = base
        base_manifest = [TensorSpec.of(n, t) for n, t in base]
    else:
        base_source, base_manifest = checkpoint_base(model_path)
    return LoraTrainerModel(
        mode=SyncMode.LORA_UNMERGED, base=base_source, adapters=adapter, base_manifest=base_manifest,
        adapters_manifest=[TensorSpec.of(n, t) for n, t in adapter],
        adapter=LoraAdapter(name, int(lora_id), plain_config(config)))
