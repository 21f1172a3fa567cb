"""An AsyncLLM on another node than the trainer: syncs received across nodes, staged while the engine generates.

On the engine's node, the process that runs the AsyncLLM (its front end) receives each sync over the cross-node
path (a CrossNodeReceiver) and forwards it, bucket by bucket, into its workers through the same-host path (an
AsyncVllmWeightSync). `engine_forwarder` makes the Loader that does so:

    sync = await AsyncVllmWeightSync.create(engine, stage=True)
    receiver = CrossNodeReceiver(trainer_endpoint, rank=r)
    forward = engine_forwarder(sync)                      # in the event loop's thread
    while training:
        stats = await asyncio.to_thread(receiver.receive, forward)

A sync that stages (`stage=True`, or "auto" where the host has the memory) is staged on every worker while the
engine generates; this node reports it staged to the trainer only then, and the engine pauses (vLLM's
`pause_generation`, the sync's `pause_mode`) to apply it only once sender 0 commits it, every engine node having
staged it. A sync that fails anywhere before the commit is dropped here: the engine never pauses and keeps serving
what it served. A sync that streams (`stage=False`, or "auto" short of memory) is applied as its bytes arrive,
the engine held for the whole transfer, as on the same host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import torch

from hwsync.disaggregated.forwarder import StagedForwarder
from hwsync.integrations.vllm.trainer import AsyncVllmWeightSync
from hwsync.sync.spec import TensorSpec
from hwsync.sync.stats import SyncStats

T = TypeVar("T")


def engine_forwarder(sync: AsyncVllmWeightSync) -> StagedForwarder:
    """The Loader a CrossNodeReceiver on the engine's node receives into, feeding `sync`'s engine; make it in the
    event loop's thread and call `receive` on another (`asyncio.to_thread`)."""
    loop = asyncio.get_running_loop()

    def run(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def stage(source: Iterator[tuple[str, torch.Tensor]], version: int,
              manifest: list[TensorSpec] | None) -> SyncStats | None:
        if manifest is None or not sync.stages(manifest):  # streamed: applied as it arrives (stage=False, or
            # "auto" where the host is short of memory)
            return run(sync.sync(source, version=version, manifest=manifest))
        run(sync.stage(source, version=version, manifest=manifest))
        if not sync.staged_ok:  # a worker failed to stage or verify: commit() raises its error, applying nothing
            run(sync.commit())
        return None

    def commit() -> SyncStats | None:  # nothing to apply after a streamed sync
        return run(sync.commit()) if sync.staged_ok else None

    def abandon() -> None:
        run(sync.abandon())

    return StagedForwarder(stage, commit=commit, abandon=abandon, timeout_s=sync.timeout_s)
