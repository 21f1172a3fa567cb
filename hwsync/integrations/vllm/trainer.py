"""The trainer side for vLLM: push a trainer's weights into a running engine, every step.

Engine side: start vLLM with
`worker_extension_cls="hwsync.integrations.vllm.HwsyncWorkerExtension"` (see worker.py).
Trainer side, one object per engine, kept across steps (its sender's buffers are reused):

    sync = VllmWeightSync(llm)                    # vllm.LLM; AsyncVllmWeightSync for AsyncLLM,
    stats = sync.sync(model, version=step)        # HttpVllmWeightSync for `vllm serve`

What `sync()` takes is normalised by sources.py (an HF module goes under its checkpoint's
names, a vLLM WeightSource as it says). A planner `TrainerModel` is planned by the sender
against each worker's reported state (the base only when the engine lacks it; the plan and its
reason in `stats.plan`); an unmerged LoRA one (`LoraTrainerModel`, e.g. from
hwsync.integrations.peft) delivers its adapter from memory, served to `lora_request(adapter)`.
`sync()` starts `hwsync_receive` on every worker through `collective_rpc` (on a thread, since it
blocks), drives the WeightSender meanwhile, resets the engine's prefix cache (cached KV blocks were
computed with the old weights) and returns the sender's SyncStats. A refused or failed sync raises
with the engine's own message. Nothing here is specific to a device. vLLM's own weight-transfer API
is native.py's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Self

import torch

from hwsync.backend.devices import start_on_this_device
from hwsync.colocated import WeightSender
from hwsync.errors import HwsyncError, ManifestError, ProtocolError, RemoteError, SyncError, SyncTimeoutError
from hwsync.integrations.lora import LoraAdapter
from hwsync.integrations.vllm import staged_trainer as staged
from hwsync.integrations.vllm.clients import prefix_cache_kept
from hwsync.integrations.vllm.sources import SyncParts, Weights, sync_parts
from hwsync.integrations.vllm.staged_trainer import PAUSE_MODES, PauseMode, stage_choice
from hwsync.sizes import DEFAULT_BUCKET_BYTES, MiB
from hwsync.sync.options import SenderOptions
from hwsync.sync.planner import TrainerModel
from hwsync.sync.spec import TensorSpec
from hwsync.sync.stats import SyncStats
from hwsync.timing import DEFAULT_TIMEOUT_S, RPC_GRACE_S

log = logging.getLogger("hwsync")

#: the value for vLLM's `worker_extension_cls`
EXTENSION = "hwsync.integrations.vllm.HwsyncWorkerExtension"
#: bigger tensors than DEFAULT_BUCKET_BYTES raise the bucket up to this cap (two buffers are kept)
MAX_AUTO_BUCKET_BYTES = 512 * MiB


def auto_bucket_bytes(manifest: list[TensorSpec], default: int = DEFAULT_BUCKET_BYTES,
                      cap: int = MAX_AUTO_BUCKET_BYTES) -> int:
    """A bucket that holds the largest tensor whole (up to `cap`): whole tensors reach load_weights
    as zero-copy views, while a split one is reassembled into a fresh tensor first (an extra copy)."""
    largest = max((spec.nbytes for spec in manifest), default=0)
    if largest <= default:
        return default
    return min(-(-largest // MiB) * MiB, cap)


def settle(stats: SyncStats | None, send_exc: BaseException | None, results: Any,
           rpc_exc: BaseException | None) -> SyncStats:
    """Combine the sender's and the engine's outcome: stats, or one error with the engine's message."""
    if send_exc is None and rpc_exc is None:
        assert stats is not None
        return stats
    if send_exc is not None and not isinstance(send_exc, RemoteError | ProtocolError):
        raise send_exc  # the trainer's side failed first (its source, its manifest, a timeout)
    message = str(send_exc) if send_exc is not None else f"{type(rpc_exc).__name__}: {rpc_exc}"
    if rpc_exc is not None and send_exc is not None and str(rpc_exc) not in message:
        message += f" (engine RPC: {type(rpc_exc).__name__}: {rpc_exc})"
    cls = ManifestError if "ManifestError" in message else SyncError
    raise cls(f"the vLLM engine did not take the sync: {message}") from (rpc_exc or send_exc)


@dataclass
class Outcome:
    """Both sides of one sync: the sender's stats or error, the engine RPC's results or error."""

    stats: SyncStats | None
    send_exc: BaseException | None
    results: Any
    rpc_exc: BaseException | None

    def result(self) -> SyncStats:
        """The sender's stats, or one error carrying the engine's message."""
        return settle(self.stats, self.send_exc, self.results, self.rpc_exc)


def lora_request(adapter: LoraAdapter) -> Any:
    """vLLM's LoRARequest for an adapter hwsync delivered (its path is never read)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(adapter.name, adapter.lora_id, adapter.path)


class _EngineCall:
    """The engine's receiving RPC, run on a thread of its own: it blocks until the sync is loaded."""

    def __init__(self, rpc: Callable[[], Any]) -> None:
        self.rpc = rpc
        self.results: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        """Call the RPC; keep its results, or its error, for the sending thread."""
        try:
            self.results = self.rpc()
        except BaseException as exc:  # noqa: BLE001 - handed to the sending thread, which raises it
            self.error = exc


def send_while(rpc: Callable[[], Any], sender: WeightSender, source: Iterable[tuple[str, torch.Tensor]] | TrainerModel,
               *, version: int, manifest: list[TensorSpec] | None, timeout_s: float) -> Outcome:
    """Run the engine's receiving RPC on a thread (it blocks until the sync is loaded) while this thread sends."""
    return call_while(rpc, partial(sender.send, source, version=version, manifest=manifest), sender,
                      timeout_s=timeout_s)


def call_while(rpc: Callable[[], Any], work: Callable[[], SyncStats], sender: WeightSender, *,
               timeout_s: float) -> Outcome:
    """Run the engine's RPC on a thread while this thread runs the sender's `work` (a send, or a staged commit)."""
    call = _EngineCall(rpc)
    # an in-process engine's worker may run the RPC on this thread: it must be on the sender's device
    thread = start_on_this_device(call.run, "hwsync-vllm-rpc", sender.backend.device())
    stats = send_exc = None
    try:
        stats = work()
    except Exception as exc:  # noqa: BLE001 - the trainer's source too: the engine's side must still be waited for
        send_exc = exc
    thread.join(timeout_s + RPC_GRACE_S)
    if thread.is_alive():
        raise SyncTimeoutError(f"the engine's receiving RPC has not returned {RPC_GRACE_S:.0f}s after the sender "
                               f"finished ({send_exc or 'successfully'}); the engine may be stuck in a load")
    return Outcome(stats, send_exc, call.results, call.error)


class _EngineSync:
    """What every engine flavour shares: the sender, the worker count, the receive arguments."""

    def __init__(self, num_workers: int, sender: WeightSender | None, timeout_s: float, bucket_bytes: int | None,
                 allow_partial: bool, delta: bool = False) -> None:
        if sender is not None and sender.num_receivers != num_workers:
            raise ValueError(f"the engine has {num_workers} workers but the sender expects {sender.num_receivers} "
                             f"receivers; make it with WeightSender(num_receivers={num_workers})")
        self.num_workers = num_workers
        #: made at the first sync when not given, with buckets sized from that sync's tensors
        self.sender: WeightSender | None = sender
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.allow_partial = allow_partial
        #: the sender made at the first sync sends only what changed (a given sender keeps its own setting)
        self.delta = delta
        #: each worker's own stats of the last sync (rank, load_s, version, ...)
        self.engine_stats: list[dict[str, Any]] = []

    def _session(self, manifest: list[TensorSpec]) -> WeightSender:
        if self.sender is None:
            self.sender = WeightSender(
                num_receivers=self.num_workers,
                options=SenderOptions(bucket_bytes=self.bucket_bytes or auto_bucket_bytes(manifest),
                                      timeout_s=self.timeout_s, delta=self.delta))
        return self.sender

    def _receive_args(self, parts: SyncParts) -> tuple[Any, ...]:
        assert self.sender is not None
        return (self.sender.endpoint, self.timeout_s, self.allow_partial, parts.adapter, parts.plans)

    def close(self) -> None:
        """Close the sender (buffers, socket); the engine's receivers reconnect to the next one."""
        if self.sender is not None:
            self.sender.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _BlockingEngineSync(_EngineSync):
    """An engine whose RPCs block the calling thread (`vllm.LLM`, the HTTP server): each flavour says how
    it calls the workers' hwsync_receive and resets the prefix cache; one sync is the same for both."""

    def _drive(self, parts: SyncParts, version: int) -> SyncStats:
        """Run the engine's receive RPC on a thread (it blocks) while this thread sends."""
        sender = self._session(parts.specs)
        rpc = partial(self._receive_rpc, self._receive_args(parts))
        outcome = send_while(rpc, sender, parts.source, version=version, manifest=parts.manifest,
                             timeout_s=self.timeout_s)
        self._reset_prefix_cache()  # also after a failure: a sync that broke midway changed some layers
        self.engine_stats = outcome.results or []
        return outcome.result()

    def _receive_rpc(self, args: tuple[Any, ...]) -> Any:
        """Every worker's hwsync_receive(*args); blocks until each has loaded the sync; one result per worker."""
        raise NotImplementedError

    def _reset_prefix_cache(self) -> None:
        """Drop the engine's cached KV blocks: they were computed with the old weights."""
        raise NotImplementedError


def _missing_extension(exc: BaseException) -> HwsyncError:
    return HwsyncError(f"the vLLM engine does not answer hwsync's RPC ({type(exc).__name__}: {exc}); start it with "
                       f"worker_extension_cls={EXTENSION!r}")


class VllmWeightSync(_BlockingEngineSync):
    """Trainer side for an in-process `vllm.LLM`."""

    def __init__(self, llm: Any, *, sender: WeightSender | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 bucket_bytes: int | None = None, allow_partial: bool = False, delta: bool = False) -> None:
        self.llm = llm
        try:
            workers = llm.collective_rpc("hwsync_status")
        except Exception as exc:
            raise _missing_extension(exc) from exc
        super().__init__(len(workers), sender, timeout_s, bucket_bytes, allow_partial, delta)

    def status(self) -> list[dict[str, Any]]:
        """What each worker holds (checked): versions, EngineState (`"engine"`), LoRA adapters (`"lora"`)."""
        return self.llm.collective_rpc("hwsync_status")

    def sync(self, weights: Weights | TrainerModel, *, version: int,
             manifest: list[TensorSpec] | None = None) -> SyncStats:
        """Push `weights` (module, state dict, pairs, vLLM WeightSource, or a TrainerModel to plan) as `version`."""
        return self._drive(sync_parts(weights, manifest), version)

    def _receive_rpc(self, args: tuple[Any, ...]) -> Any:
        return self.llm.collective_rpc("hwsync_receive", args=args)

    def _reset_prefix_cache(self) -> None:
        prefix_cache_kept(self.llm.reset_prefix_cache())


class AsyncVllmWeightSync(_EngineSync):
    """Trainer side for a `vllm.v1.engine.async_llm.AsyncLLM`; make it with `await create(engine)`."""

    def __init__(self, engine: Any, num_workers: int, **kwargs: Any) -> None:
        self.engine = engine
        stage, mode = kwargs.pop("stage", "auto"), kwargs.pop("pause_mode", "keep")
        if stage not in (True, False, "auto"):
            raise ValueError(f"stage={stage!r}: True (stage every sync), False (stream into the model, the engine "
                             "held for the whole transfer) or 'auto' (stage when the host has the memory)")
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode={mode!r}: one of {PAUSE_MODES} (vLLM's pause_generation modes)")
        #: stage each sync while the engine generates and pause only to apply it (True, False or "auto")
        self.staging: bool | str = stage
        #: vLLM's pause mode around a staged sync's apply: "keep" (default), "wait" or "abort"
        self.pause_mode: PauseMode = mode
        self._staged: staged.Outcome | None = None
        super().__init__(num_workers, kwargs.pop("sender", None), kwargs.pop("timeout_s", DEFAULT_TIMEOUT_S),
                         kwargs.pop("bucket_bytes", None), kwargs.pop("allow_partial", False),
                         kwargs.pop("delta", False))

    @classmethod
    async def create(cls, engine: Any, *, sender: WeightSender | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                     bucket_bytes: int | None = None, allow_partial: bool = False, delta: bool = False,
                     stage: bool | str = "auto", pause_mode: PauseMode = "keep") -> "AsyncVllmWeightSync":
        """Ask the engine for its workers (checks the extension is installed) and make the sender. `stage`: stage
        each sync while the engine generates and pause it (vLLM's `pause_generation(mode=pause_mode)`) only to
        apply; "auto" stages when the host has the memory and says which once in the log."""
        try:
            workers = await engine.collective_rpc("hwsync_status")
        except Exception as exc:
            raise _missing_extension(exc) from exc
        return cls(engine, len(workers), sender=sender, timeout_s=timeout_s, bucket_bytes=bucket_bytes,
                   allow_partial=allow_partial, delta=delta, stage=stage, pause_mode=pause_mode)

    def stage_always(self) -> None:
        """Stage every sync from now on (stage() and rolling_commit() stage whatever `stage` said)."""
        self.staging = True

    def stages(self, specs: list[TensorSpec]) -> bool:
        """Whether a sync of `specs` stages (`stage="auto"` decides at the first sync, and says why in the log)."""
        if self.staging == "auto":
            chosen, why = stage_choice(specs, self.num_workers)
            log.info("hwsync: %s", why)
            self.staging = chosen  # decided once, at the first sync
        return bool(self.staging)

    async def sync(self, weights: Weights | TrainerModel, *, version: int,
                   manifest: list[TensorSpec] | None = None) -> SyncStats:
        """Push `weights` (or a TrainerModel to plan) as `version` while the event loop keeps serving; a staged
        sync pauses generation only to apply it (stats.stage.pause_s)."""
        parts = sync_parts(weights, manifest)
        sender = self._session(parts.specs)
        if self.stages(parts.specs):
            await self._stage(parts, sender, version)
            return await self.commit()
        rpc = asyncio.ensure_future(self.engine.collective_rpc("hwsync_receive", args=self._receive_args(parts)))
        stats = send_exc = rpc_exc = results = None
        try:
            stats = await asyncio.to_thread(sender.send, parts.source, version=version, manifest=parts.manifest)
        except Exception as exc:  # noqa: BLE001 - the trainer's source too: the engine's side is still awaited
            send_exc = exc
        try:
            results = await asyncio.wait_for(rpc, self.timeout_s + RPC_GRACE_S)
        except Exception as exc:  # noqa: BLE001 - settled with the sender's outcome below
            rpc_exc = exc
        prefix_cache_kept(await self.engine.reset_prefix_cache())  # also after a failure: it changed some layers
        self.engine_stats = results or []
        return settle(stats, send_exc, results, rpc_exc)


    async def stage(self, weights: Weights | TrainerModel, *, version: int,
                    manifest: list[TensorSpec] | None = None) -> None:
        """Stage `version` on every worker while the engine generates (nothing it reads changes); `commit()`
        applies it. A failure is raised by commit(), which then applies nothing and never pauses."""
        parts = sync_parts(weights, manifest)
        await self._stage(parts, self._session(parts.specs), version)

    async def _stage(self, parts: SyncParts, sender: WeightSender, version: int) -> None:
        if self._staged is not None:
            raise HwsyncError(f"version {self._staged.version} is staged and not committed: commit() or abandon() "
                              "it first")
        self._staged = await staged.stage(self.engine, sender, parts.source, parts.manifest, version,
                                          self._receive_args(parts))

    @property
    def staged_ok(self) -> bool:
        """Whether a version is staged on every worker and nothing failed (commit() will apply it)."""
        return self._staged is not None and self._staged.staged

    async def commit(self) -> SyncStats:
        """Apply the staged version inside vLLM's pause (`pause_mode`), set the engine's weight_version, resume;
        raises with the engine's message (nothing applied, no pause) if staging failed."""
        outcome, self._staged = self._staged, None
        if outcome is None:
            raise HwsyncError("commit() without a staged version: call stage() first")
        assert self.sender is not None
        await staged.commit(self.engine, self.sender, outcome, self.pause_mode, self.timeout_s)
        self.engine_stats = outcome.results or []
        return settle(outcome.stats, outcome.send_exc, outcome.results, outcome.rpc_exc)

    async def abandon(self) -> None:
        """Drop the staged version: no worker applies it, the engine keeps serving what it serves."""
        outcome, self._staged = self._staged, None
        if outcome is not None and self.sender is not None:
            await staged.abandon(self.engine, self.sender, outcome, self.timeout_s)


async def rolling_commit(syncs: list[AsyncVllmWeightSync], weights: Weights | TrainerModel, *, version: int,
                         manifest: list[TensorSpec] | None = None) -> list[SyncStats]:
    """`version` to every engine, committed everywhere or nowhere and paused one engine at a time: staged on each
    engine first (all generating); if any failed to stage, every engine drops it and the first failure is raised;
    else each engine commits in turn while the others serve (each one's `get_weight_version()` says which it
    serves at any moment). A commit that fails after earlier engines committed is raised with theirs applied."""
    for sync in syncs:
        sync.stage_always()
    await asyncio.gather(*(sync.stage(weights, version=version, manifest=manifest) for sync in syncs))
    if not all(sync.staged_ok for sync in syncs):
        failed = next(sync for sync in syncs if not sync.staged_ok)
        await asyncio.gather(*(sync.abandon() for sync in syncs if sync is not failed))
        await failed.commit()  # raises the failure with the engine's message (it applies nothing)
        raise HwsyncError(f"version {version} failed to stage on an engine, but its commit did not say why")
    return [await sync.commit() for sync in syncs]
