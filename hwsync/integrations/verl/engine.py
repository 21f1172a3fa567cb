"""HwsyncCheckpointEngine: verl's CheckpointEngine interface over hwsync's disaggregated path.

verl builds one engine per trainer rank (with `is_master`) and one per rollout worker (without),
keeps them for the whole run, and drives every weight update through its
CheckpointEngineManager: prepare() everywhere -> build_topology() on the driver ->
init_process_group(**kwargs) everywhere -> send_weights() on every trainer rank while every
rollout worker's adapter reads receive_weights() -> finalize() everywhere. The mapping:

- prepare: the rank's address; trainer rank 0 also its hub's endpoint, and a fresh one;
- build_topology: trainer ranks on rank 0's node are striped senders, rollout workers receivers;
- init_process_group: keep this rank's hwsync sender/receiver (and groups) if nothing changed;
- send_weights / receive_weights: one step, bucketed by the trainer's geometry; every wait
  bounded by timeout_s; a dead or stalled rank named on every rank;
- finalize: the bucket buffers go back (the groups stay for the next step).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from hwsync.integrations.verl import topology
from hwsync.integrations.verl.rollout import RolloutSide
from hwsync.integrations.verl.trainer import Options, TrainerSide, metrics

#: the name verl's config selects this engine by: checkpoint_engine.backend
BACKEND = "hwsync"


@CheckpointEngineRegistry.register(BACKEND)
class HwsyncCheckpointEngine(CheckpointEngine):
    """hwsync as a verl checkpoint engine: the trainer ranks broadcast to the rollout workers over NCCL/HCCL/gloo.

    bucket_size is verl's update_weights_bucket_megabytes in bytes: the rollout's value is not
    used (the trainer's rank 0 plans every bucket). Options (engine_kwargs.hwsync): timeout_s
    bounds every wait; bucket_megabytes sets hwsync's bucket (default: at most 64 MiB, with the
    buffers of all senders within the trainer's bucket_size); max_senders caps the striped
    senders; num_buffers is the pipeline depth; host is the address peers reach this worker at; delta sends,
    after a first full sync, only what changed since what every rollout worker holds (docs/verl.md).
    """

    def __init__(self, bucket_size: int, is_master: bool | None = None, *, timeout_s: float = 120.0,
                 bucket_megabytes: float | None = None, max_senders: int = 8, num_buffers: int = 2,
                 host: str | None = None, delta: bool = False) -> None:
        if timeout_s <= 0 or max_senders < 1 or num_buffers < 2 or (bucket_megabytes or 1) <= 0:
            raise ValueError(f"engine_kwargs.hwsync: timeout_s={timeout_s} must be positive, max_senders={max_senders} "
                             f"at least 1, num_buffers={num_buffers} at least 2, bucket_megabytes={bucket_megabytes} "
                             "positive or unset")
        self.options = Options(int(bucket_size), float(timeout_s), bucket_megabytes, int(max_senders), int(num_buffers),
                               topology.node_ip(host), bool(delta))
        # verl's trainer workers always pass is_master; its rollout workers never do
        self.is_master = bool(is_master)
        self._trainer = TrainerSide(self.options) if is_master is not None else None
        self._rollout = RolloutSide(self.options) if is_master is None else None
        self._steps = 0

    @property
    def role(self) -> str:
        """The side this engine is on: trainer or rollout."""
        return "trainer" if self._trainer is not None else "rollout"

    @property
    def group_epoch(self) -> int | None:
        """Id of the collective group(s) this worker holds (changes only when they are rebuilt), or None."""
        if self._trainer is not None:
            return self._trainer.sender.group_epoch if self._trainer.sender is not None else None
        assert self._rollout is not None
        return self._rollout.receiver.group_epoch if self._rollout.receiver is not None else None

    def prepare(self) -> dict[str, Any]:
        """Metadata for build_topology (plain values; nothing is allocated before the send)."""
        if self._trainer is not None:
            return self._trainer.metadata(self.is_master)
        assert self._rollout is not None
        return self._rollout.metadata()

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
                       ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Per-worker init_process_group kwargs, computed on verl's driver from every worker's prepare()."""
        return topology.build_topology(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, *, endpoint: str, rank: int, num_senders: int | None = None,
                           num_receivers: int | None = None) -> None:
        """Join this step's topology; the hwsync objects and their groups are kept while it is unchanged."""
        if self._trainer is not None:
            if num_senders is None or num_receivers is None:
                raise ValueError("a trainer engine needs num_senders and num_receivers from build_topology; "
                                 "set backend='hwsync' on both sides so verl calls hwsync's build_topology")
            self._trainer.join(topology.TrainerPlace(endpoint, rank, num_senders, num_receivers))
        else:
            assert self._rollout is not None
            self._rollout.join(topology.RolloutPlace(endpoint, rank))

    def finalize(self) -> None:
        """After a step: free the bucket buffers (the device memory goes back to verl; the groups stay)."""
        side = self._trainer or self._rollout
        assert side is not None
        side.release_buffers()

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
                           ) -> dict[str, float] | None:
        """Send one step from this trainer rank; rank 0 returns hwsync's figures for verl's logger."""
        if self._trainer is None:
            raise RuntimeError("send_weights was called on a rollout engine (built without is_master); only "
                           "verl's trainer workers send")
        version = self._version(global_steps)
        # on the actor's event loop, as verl's generator expects: its FSDP gathers run on this thread's device
        stats, walk = self._trainer.send(weights, version)
        sender, place = self._trainer.sender, self._trainer.place
        if not self.is_master or sender is None or place is None:
            return None  # verl merges every rank's dict: only rank 0 reports, so nothing overwrites its figures
        return metrics(stats, walk, sender, place)

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every tensor of one step; each is valid until the consumer asks for the next bucket's first."""
        if self._rollout is None:
            raise RuntimeError("receive_weights was called on a trainer engine (built with is_master); only "
                               "verl's rollout workers receive")
        self._version(global_steps)
        async for item in self._rollout.receive():
            yield item

    def _version(self, global_steps: int | None) -> int:
        self._steps += 1
        return int(global_steps) if global_steps is not None else self._steps

    def close(self) -> None:
        """Close hwsync's sender or receiver, its groups and sockets; safe to call twice."""
        for side in (self._trainer, self._rollout):
            if side is not None:
                side.close()
