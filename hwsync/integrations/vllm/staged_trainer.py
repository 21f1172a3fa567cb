"""The trainer side of a staged sync into an AsyncLLM: stage while it generates, pause only to apply.

1. stage: every worker starts staging (`hwsync_stage`, which returns at once) and the sender stages the version
   (`WeightSender.stage`): the engine keeps generating throughout, and no weight it reads changes;
2. commit: vLLM's own `pause_generation(mode=...)`, the sender's commit and every worker's `hwsync_apply` (the
   staged tensors into the model, through its loader), the engine's `weight_version` set to the version, then
   `resume_generation()`: the pause holds the apply alone.

A failure before the commit (a worker that failed to stage or verify, died, or refused the manifest) applies
nothing anywhere: the engine never pauses and keeps serving the previous version; the sync raises with the
engine's message. Prefix and KV caches follow vLLM's contract for the mode: "keep" keeps them (requests in flight
go on with the KV their tokens were computed with, as PipelineRL does); "wait" and "abort" clear them.

Across engines (one AsyncVllmWeightSync each), `rolling_commit` stages the version on every engine first and
commits only once all staged it, then engine by engine: the fleet never pauses at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from hwsync.colocated import WeightSender
from hwsync.sync.spec import TensorSpec
from hwsync.sync.staging import HOST_HEADROOM, free_memory
from hwsync.sync.stats import StageStats, SyncStats
from hwsync.timing import RPC_GRACE_S

log = logging.getLogger("hwsync")

#: vLLM's pause modes: "keep" freezes requests in flight and resumes them, "wait" lets them finish first, "abort"
#: ends them
PauseMode = Literal["keep", "wait", "abort"]
PAUSE_MODES = ("keep", "wait", "abort")


def stage_choice(specs: list[TensorSpec], num_workers: int) -> tuple[bool, str]:
    """Whether the host has the memory to stage a sync of `specs` on each of `num_workers` workers, and why."""
    need = sum(spec.nbytes for spec in specs) * num_workers
    free, total = free_memory()
    room = free - int(total * HOST_HEADROOM)
    gib = 1 << 30
    if need <= room:
        return True, (f"staging syncs: {need / gib:.2f} GiB of host memory for {num_workers} worker(s), "
                      f"{room / gib:.2f} GiB free; the engine pauses only to apply each version")
    return False, (f"streaming syncs (the engine pauses for the whole transfer): staging would need "
                   f"{need / gib:.2f} GiB of host memory for {num_workers} worker(s), {max(room, 0) / gib:.2f} GiB "
                   "is free")


@dataclass
class Outcome:
    """Both sides of one sync so far: the sender's stats or error, the workers' results or the RPC's error."""

    version: int
    stats: SyncStats | None = None
    send_exc: BaseException | None = None
    results: Any = None
    rpc_exc: BaseException | None = None

    @property
    def staged(self) -> bool:
        """Every worker staged the version (the sender says so) and none failed yet."""
        return self.send_exc is None and self.rpc_exc is None


async def stage(engine: Any, sender: WeightSender, source: Any, manifest: list[TensorSpec] | None, version: int,
                args: tuple[Any, ...]) -> Outcome:
    """Stage `version` on every worker of `engine` while it generates; a failure is kept for `finish`."""
    outcome = Outcome(version)
    await engine.collective_rpc("hwsync_stage", args=args)
    try:
        outcome.stats = await asyncio.to_thread(sender.stage, source, version=version, manifest=manifest)
    except Exception as exc:  # noqa: BLE001 - every worker's thread ended too: its error is collected by finish
        outcome.send_exc = exc
    return outcome


async def commit(engine: Any, sender: WeightSender, outcome: Outcome, mode: PauseMode, timeout_s: float) -> None:
    """Commit a staged version inside vLLM's pause, or, after a failure, collect the workers' errors unpaused."""
    paused_at = None
    try:
        if outcome.staged:  # every worker staged the version: pause only to apply it
            await engine.pause_generation(mode=mode, clear_cache=mode != "keep")
            paused_at = time.perf_counter()
        apply = asyncio.ensure_future(engine.collective_rpc("hwsync_apply", args=(timeout_s,)))
        if outcome.staged:
            try:
                outcome.stats = await asyncio.to_thread(sender.commit)
            except Exception as exc:  # noqa: BLE001 - settled with the workers' outcome
                outcome.send_exc = exc
        try:
            outcome.results = await asyncio.wait_for(apply, timeout_s + RPC_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - settled with the sender's outcome
            outcome.rpc_exc = exc
        if paused_at is not None and outcome.staged:
            await engine.update_weight_version(str(outcome.version))
    finally:
        if paused_at is not None:
            await engine.resume_generation()
            if outcome.stats is not None:
                outcome.stats.stage = outcome.stats.stage or StageStats()
                outcome.stats.stage.pause_s = time.perf_counter() - paused_at


async def abandon(engine: Any, sender: WeightSender, outcome: Outcome, timeout_s: float) -> None:
    """Drop a staged version without applying it anywhere (another engine failed to stage it)."""
    if sender.staged_version is not None:
        await asyncio.to_thread(sender.abandon, "another engine failed to stage it")
    try:
        await asyncio.wait_for(engine.collective_rpc("hwsync_apply", args=(timeout_s,)), timeout_s + RPC_GRACE_S)
    except Exception as exc:  # noqa: BLE001 - expected: the workers' threads end with the abort
        log.debug("hwsync: a dropped stage ended on the workers with %s", exc)
