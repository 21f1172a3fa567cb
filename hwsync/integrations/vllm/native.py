"""hwsync as vLLM's own weight-transfer backend, trainer side: `HwsyncTrainerInitInfo` selects it.

    from hwsync.integrations.vllm.native import HwsyncTrainerInitInfo   # registers "hwsync" here
    trainer = WeightTransferTrainerFactory.trainer_init(
        HwsyncTrainerInitInfo(rank=0), client=client, source=model)      # client: LLMClient(llm),
    trainer.send_weights("step-3")                                       # AsyncLLMClient, vLLM's HTTP one

The source is what a trainer holds, as VllmWeightSync takes it (sources.py): a vLLM
WeightSource, an HF module (sent under its checkpoint's names), a state dict or pairs, or a
planner TrainerModel: planned against the workers' reported state (base only when they lack it),
an unmerged LoRA one (LoraTrainerModel) delivering its adapter, which outlives vLLM's
`finish_weight_update` dropping every adapter (adapters.py).
`send_weights` is one whole hwsync sync inside vLLM's update: `start_weight_update`, then
`update_weights` on a thread (each worker's WeightReceiver blocks in it) while this thread's
WeightSender sends, then `finish_weight_update(weight_version)`.

With `stage=True` (docs/staged.md) the engine pauses only to apply: `update_weights(phase="stage")` returns at once
and each worker receives into staging memory on a thread while the engine generates and the sender stages; once
every worker staged and verified the version, vLLM's pause (`pause_mode`), `update_weights(phase="apply")` while
the sender commits, `finish_weight_update(weight_version)` and the resume. A failure before the commit applies
nothing anywhere and never pauses. The client must be able to pause its engine (clients.can_pause: hwsync's
AsyncLLMClient, vLLM's HTTP client). Importing this module imports vLLM.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from hwsync.colocated import WeightSender
from hwsync.integrations.vllm.clients import (
    can_pause,
    engine_world_size,
    pause_generation,
    reset_prefix_cache,
    resume_generation,
)
from hwsync.integrations.vllm.engine import HwsyncInitInfo, HwsyncUpdateInfo
from hwsync.integrations.vllm.plugin import BACKEND, register
from hwsync.integrations.vllm.sources import SyncParts, sync_parts
from hwsync.integrations.vllm.staged_trainer import PAUSE_MODES
from hwsync.integrations.vllm.trainer import Outcome, auto_bucket_bytes, call_while, send_while
from hwsync.sync.options import SenderOptions
from hwsync.sync.stats import StageStats, SyncStats
from hwsync.timing import DEFAULT_TIMEOUT_S

log = logging.getLogger("hwsync")


@dataclass
class HwsyncTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the `hwsync` backend; every field is optional."""

    backend: ClassVar[str] = BACKEND

    #: workers that receive (tensor x pipeline x data parallel); None: asked from the client
    num_workers: int | None = None
    #: how long either side waits for a silent peer
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: None: sized at trainer_init so the source's largest tensor fits whole (at least 32 MiB)
    bucket_bytes: int | None = None
    #: let a sync carry only some of the checkpoint's tensors (whole layers only)
    allow_partial: bool = False
    #: where the sender listens; None: a private ipc:// path (trainer and engine on one host)
    endpoint: str | None = None
    #: send only what changed since what every worker holds (docs/vllm.md, "Delta syncs")
    delta: bool = False
    #: stage each sync while the engine generates and pause it only to apply (docs/staged.md); the client must
    #: be able to pause its engine (hwsync's AsyncLLMClient, vLLM's HTTP client)
    stage: bool = False
    #: vLLM's pause mode around a staged sync's apply: "keep", "wait" or "abort"
    pause_mode: str = "keep"


def _version_number(weight_version: str | None, fallback: int) -> int:
    """hwsync's integer version for vLLM's string one: the number it spells, else a count of syncs."""
    if weight_version is not None and weight_version.strip().isdigit():
        return int(weight_version)
    return fallback


class HwsyncTrainerEngine(TrainerWeightTransferEngine[HwsyncTrainerInitInfo]):
    """Trainer side of the `hwsync` backend: one WeightSender kept across rounds."""

    init_info_cls = HwsyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 init_info: HwsyncTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info or HwsyncTrainerInitInfo(rank=0 if is_sender else 1)
        self.sender: WeightSender | None = None
        #: the sender's stats of the last round (None before the first, and on non-sender ranks)
        self.last_stats: SyncStats | None = None
        self._rounds = 0

    @classmethod
    def trainer_init(cls, init_info: HwsyncTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "HwsyncTrainerEngine":
        """Open the sender and tell every worker where it listens (rank 0 only)."""
        if init_info.pause_mode not in PAUSE_MODES:
            raise ValueError(f"HwsyncTrainerInitInfo(pause_mode={init_info.pause_mode!r}): one of {PAUSE_MODES} "
                             "(vLLM's pause modes)")
        if init_info.stage and init_info.is_sender and not can_pause(client):
            raise TypeError(f"HwsyncTrainerInitInfo(stage=True) pauses the engine to apply each sync, and "
                            f"{type(client).__name__} cannot pause it: use hwsync's AsyncLLMClient (an AsyncLLM) or "
                            "vLLM's HTTP client, or stage=False (an offline LLM generates nothing during a sync)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if engine.is_sender:
            engine.sender = engine._open_sender()
            init = HwsyncInitInfo(endpoint=engine.sender.endpoint, timeout_s=float(init_info.timeout_s),
                                  allow_partial=bool(init_info.allow_partial))
            try:
                client.init_weight_transfer_engine(asdict(init))
            except BaseException:
                engine.shutdown()
                raise
        return engine

    def _open_sender(self) -> WeightSender:
        info = self.init_info
        workers = engine_world_size(self.client)
        if info.num_workers is not None and workers is not None and workers != info.num_workers:
            raise ValueError(f"HwsyncTrainerInitInfo(num_workers={info.num_workers}) but the engine has {workers} "
                             "workers; leave num_workers out to take the engine's")
        bucket = info.bucket_bytes
        if bucket is None:  # the largest tensor whole: it then reaches load_weights as a zero-copy view
            bucket = auto_bucket_bytes(sync_parts(self.source).specs if self.source is not None else [])
        return WeightSender(
            info.endpoint, num_receivers=info.num_workers or workers or 1,
            options=SenderOptions(bucket_bytes=bucket, timeout_s=float(info.timeout_s), delta=bool(info.delta)))

    def send_weights(self, weight_version: str | None = None, *, source: Any = None,
                     version: int | None = None) -> SyncStats | None:
        """One round: every worker receives the source (or `source`) and vLLM's version becomes `weight_version`.

        `version` is hwsync's integer version (default: the number `weight_version` spells, else
        the round count). Raises ManifestError (nothing changed) or SyncError with the engine's message.
        """
        source = self.source if source is None else source
        if source is None:
            raise ValueError("the hwsync trainer engine has no source: pass source= to trainer_init or send_weights")
        parts = sync_parts(source)
        if not self.is_sender:
            if parts.manifest is not None:  # a TrainerModel is planned on rank 0 only
                for _ in parts.source:  # take part in the collectives materialising each tensor (FSDP full_tensor)
                    pass
            return None
        assert self.sender is not None, "trainer_init opens the sender"
        self._rounds += 1
        number = version if version is not None else _version_number(weight_version, self._rounds)
        self.client.start_weight_update()
        if self.init_info.stage:
            outcome = self._send_staged(parts, number, weight_version)
        else:
            update = asdict(HwsyncUpdateInfo(weight_version=weight_version, adapter=parts.adapter,
                                             plans=parts.plans))
            outcome = send_while(partial(self.client.update_weights, update), self.sender, parts.source,
                                 version=number, manifest=parts.manifest, timeout_s=float(self.init_info.timeout_s))
            self._finish(weight_version if outcome.send_exc is None and outcome.rpc_exc is None else None,
                         failed=outcome.rpc_exc is not None)
            reset_prefix_cache(self.client)  # also after a failure: a sync that broke midway changed some layers
        self.last_stats = outcome.result()
        return self.last_stats

    def _send_staged(self, parts: SyncParts, number: int, weight_version: str | None) -> Outcome:
        """Stage on every worker while the engine generates; then pause, commit and apply, finish, resume. A failure
        before the commit applies nothing anywhere and never pauses."""
        sender, info = self.sender, self.init_info
        assert sender is not None
        phase = partial(HwsyncUpdateInfo, weight_version=weight_version, adapter=parts.adapter, plans=parts.plans)
        apply = partial(self.client.update_weights, asdict(phase(phase="apply")))
        try:
            self.client.update_weights(asdict(phase(phase="stage")))  # returns at once: the workers' threads receive
        except BaseException:
            self._finish(None, failed=True)
            raise
        try:
            sender.stage(parts.source, version=number, manifest=parts.manifest)
            pause_generation(self.client, info.pause_mode)
        except Exception as exc:  # noqa: BLE001 - nothing applied; the workers' threads end: collect why, unpaused
            if sender.staged_version is not None:  # staged everywhere, but the engine could not pause
                sender.abandon(f"the engine did not pause: {exc}")
            outcome = Outcome(None, exc, None, None)
            try:
                apply()
            except Exception as rpc_exc:  # noqa: BLE001 - expected: the workers' error, settled with the sender's
                outcome.rpc_exc = rpc_exc
            self._finish(None, failed=True)
            return outcome
        paused_at = time.perf_counter()
        try:
            outcome = call_while(apply, sender.commit, sender, timeout_s=float(info.timeout_s))
            self._finish(weight_version if outcome.send_exc is None and outcome.rpc_exc is None else None,
                         failed=outcome.rpc_exc is not None)
        finally:
            resume_generation(self.client)
        if outcome.stats is not None:
            outcome.stats.stage = outcome.stats.stage or StageStats()
            outcome.stats.stage.pause_s = time.perf_counter() - paused_at
        return outcome

    def _finish(self, weight_version: str | None, *, failed: bool) -> None:
        """End the update on every worker, after a failed one too.

        vLLM's worker (and vllm-ascend's main branch) closed the update itself when `update_weights` failed and
        refuses a finish then; vllm-ascend's NPUWorker up to 0.26.0rc1 did not, and only its finish puts back the
        tensors its own reload moved to meta and lets a next update start. So the finish always goes, and after a
        failed update its refusal is expected."""
        try:
            self.client.finish_weight_update(weight_version)
        except Exception as exc:
            if not failed:
                raise
            # vLLM's words: "... without a matching start_weight_update", "start_weight_update must be called ..."
            expected = "start_weight_update" in str(exc)
            log.log(logging.DEBUG if expected else logging.WARNING, "hwsync: finish_weight_update after a failed "
                    "update: %s: %s", type(exc).__name__, exc)

    def shutdown(self) -> None:
        """Close the sender (buffers, socket); the workers' receivers reconnect to the next one."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None


register()  # the trainer process may never start an engine, so vLLM's plugin loader may never run here
