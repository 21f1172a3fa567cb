"""verl workers for test_verl_engine.py: Ray actors built from verl's own classes (importable, so Ray
pickles them by reference; this module is on the workers' PYTHONPATH).

- TrainerWorker: a verl `Worker` that builds its checkpoint engine exactly as verl's
  ActorRolloutRefWorker does (engine_workers.py: CheckpointEngineRegistry.new with is_master and
  bucket_size) and runs verl's own `ActorRolloutRefWorker.update_weights` and
  `execute_checkpoint_engine`. Its training engine is `ShardedWeightsStandIn` (verl's FSDP engine
  needs a model checkpoint and GPUs): every rank holds a shard of each tensor and yields the
  full tensor from a collective all_gather over the trainer ranks, as FSDP's full_tensor() does.
- RolloutWorker: verl's `CheckpointEngineWorker` itself, with `CopyingAdapterStandIn` in place
  of verl's vLLM server adapter (which needs vLLM): it reads receive_weights() and copies each
  tensor before advancing, as verl's adapter does.
- Replica: verl's RolloutReplica with no servers (abort / release / resume are no-ops), as
  verl's own checkpoint-engine tests do.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import OmegaConf

import hwsync.integrations.verl.cpu_platform  # noqa: F401 - verl's "cpu" platform, selected by VERL_PLATFORM
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout import RolloutReplica

LAYERS = [(f"model.layers.{i}.{part}", shape) for i in range(3)
          for part, shape in (("self_attn.q_proj.weight", (256, 256)), ("mlp.up_proj.weight", (512, 256)),
                              ("input_layernorm.weight", (256,)))]
#: (name, shape) of the test model: a 445 MiB bf16 embedding (Qwen2.5-1.5B's) between small layers, so
#: a rollout worker killed after its first tensors dies while the embedding's buckets are on the wire
SHAPES = LAYERS[:3] + [("model.embed_tokens.weight", (151936, 1536))] + LAYERS[3:] + [("model.norm.weight", (256,))]
TRAINER_RANKS = 2


def shard(name: str, shape: tuple[int, ...], step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s half (first dimension) of tensor `name` at `step`: random bits, bf16."""
    rows = shape[0] // TRAINER_RANKS
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{step}:{rank}".encode()))  # same in every process
    bits = torch.randint(-(1 << 15), 1 << 15, (rows, *shape[1:]), dtype=torch.int16, generator=g)
    return bits.view(torch.bfloat16)


def expected(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    """The full tensor every trainer rank yields at `step`."""
    return torch.cat([shard(name, shape, step, r) for r in range(TRAINER_RANKS)])


class ShardedWeightsStandIn:
    """Stands in for verl's FSDP engine: get_per_tensor_param yields full tensors, each from a collective."""

    def __init__(self) -> None:
        self.step = 0
        self.yielded = 0

    def get_per_tensor_param(self, **kwargs: Any) -> tuple[Any, None]:
        """verl's signature: (generator of (name, full tensor), peft_config)."""
        def gather():
            self.yielded = 0
            rank = torch.distributed.get_rank()
            for name, shape in SHAPES:
                mine = shard(name, shape, self.step, rank)
                parts = [torch.empty_like(mine) for _ in range(TRAINER_RANKS)]
                torch.distributed.all_gather(parts, mine)  # collective, like DTensor.full_tensor()
                self.yielded += 1
                yield name, torch.cat(parts)
        return gather(), None


class TrainerWorker(Worker):
    """A verl trainer worker: the engine built as ActorRolloutRefWorker builds it, verl's update_weights."""

    def __init__(self, ce_config: dict) -> None:
        super().__init__()
        torch.distributed.init_process_group("gloo")
        cfg = CheckpointEngineConfig(**ce_config)
        # what verl/workers/engine_workers.py does for the actor role (verl 0.9.1)
        import_external_libs(cfg.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            cfg.backend, is_master=(torch.distributed.get_rank() == 0),
            bucket_size=cfg.update_weights_bucket_megabytes << 20, **cfg.engine_kwargs.get(cfg.backend, {}))
        self.config = OmegaConf.create({"rollout": {"checkpoint_engine": ce_config}})
        self.actor = SimpleNamespace(engine=ShardedWeightsStandIn())
        self.outcomes: dict[int, tuple] = {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        """verl's ActorRolloutRefWorker.update_weights, its outcome kept for the test to read."""
        self.actor.engine.step = global_steps
        t0 = time.monotonic()
        try:
            metrics = await ActorRolloutRefWorker.update_weights(self, global_steps=global_steps, mode=mode)
        except Exception as exc:
            self.outcomes[global_steps] = ("error", time.monotonic() - t0, f"{type(exc).__name__}: {exc}",
                                           self.actor.engine.yielded)
            raise
        self.outcomes[global_steps] = ("ok", time.monotonic() - t0, metrics, self.actor.engine.yielded)
        return metrics

    execute_checkpoint_engine = ActorRolloutRefWorker.execute_checkpoint_engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def outcome(self, step: int) -> tuple | None:
        """How update_weights of `step` ended on this rank: (kind, seconds, metrics or error, tensors yielded)."""
        return self.outcomes.get(step)


class CopyingAdapterStandIn:
    """Stands in for verl's vLLM server adapter: reads receive_weights(), copying each tensor before advancing."""

    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}
        self.kill_after: int | None = None
        self.outcomes: dict[int, tuple] = {}

    async def update_weights(self, weights: Any, global_steps: int | None = None, **kwargs: Any) -> None:
        """Consume one step's weights."""
        self.received = {}
        t0 = time.monotonic()
        try:
            async for name, tensor in weights:
                self.received[name] = tensor.clone()
                if self.kill_after is not None and len(self.received) >= self.kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # a rollout worker dying mid-step
        except Exception as exc:
            self.outcomes[global_steps] = ("error", time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
            raise
        self.outcomes[global_steps] = ("ok", time.monotonic() - t0, None)


class RolloutWorker(CheckpointEngineWorker):
    """verl's CheckpointEngineWorker with the copying adapter."""

    def __init__(self, rollout_config: Any) -> None:
        super().__init__(rollout_config, model_config=None, server_adapter=CopyingAdapterStandIn())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def check(self, step: int) -> list[str]:
        """Names received wrongly at `step` (empty when all are bit-exact)."""
        got = self.server_adapter.received
        bad = sorted(set(n for n, _ in SHAPES) ^ set(got))
        for name, shape in SHAPES:
            if name in got and not torch.equal(got[name].view(torch.int16), expected(name, shape, step).view(torch.int16)):
                bad.append(name)
        return bad

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die_after(self, tensors: int) -> None:
        """SIGKILL this worker after it has received `tensors` tensors of the next step."""
        self.server_adapter.kill_after = tensors

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def outcome(self, step: int) -> tuple | None:
        """How the adapter's update of `step` ended here."""
        return self.server_adapter.outcomes.get(step)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        """This worker's process id."""
        return os.getpid()


class Replica(RolloutReplica):
    """A rollout replica with one worker and no inference servers."""

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        """Not used: the test makes the workers itself."""
        raise NotImplementedError

    async def launch_servers(self) -> None:
        """Not used: no servers."""
        raise NotImplementedError
