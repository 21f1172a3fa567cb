"""hwsync as vLLM's own weight-transfer backend, worker side: `WeightTransferConfig(backend="hwsync")`.

vLLM creates one `HwsyncWeightTransferEngine` per worker when the engine starts (registered by
plugin.py) and drives it through its weight-transfer API, whichever entry the trainer uses
(`LLM`, `AsyncLLM`, the HTTP routes):

    init_weight_transfer_engine {endpoint, timeout_s, allow_partial}   the trainer's WeightSender
    start_weight_update                                                (nothing changes yet)
    update_weights {weight_version, adapter}   one whole hwsync sync: receive, check, load, finalize
                                           (adapter: the LoRA adapter the sync ends with, adapters.py)
    update_weights {..., phase: "stage"}   or, staged: start receiving into staging memory on a thread and
                                           return at once (the engine keeps generating, its weights untouched)
    update_weights {phase: "apply"}        then, with generation paused: apply what was staged (once the
                                           trainer's sender commits it), or raise why nothing was applied
    finish_weight_update(weight_version)   vLLM stamps the version on the engine's outputs

Every value is a str, float, bool or None: msgpack and JSON carry them natively, so no pickle
and no VLLM_ALLOW_INSECURE_SERIALIZATION. The loading is loading.py's: the manifest is checked
before the layerwise reload starts, and the reload is finalized inside `update_weights` on every
exit path — vLLM's worker never calls `finish_weight_update` after a failed `update_weights`,
and a reload left open breaks the next forward pass. The worker never sees the weight version
given to `finish_weight_update`, so the trainer also puts it in the update info, for the
worker's reported state.

vllm-ascend's NPUWorker up to 0.26.0rc1 drives its engine by an older contract: it opens vLLM's
layerwise reload itself in its `start_weight_update` (every layer's weights become meta tensors),
calls `receive_weights(info, load_weights=model.load_weights)` and finalizes in its own
`finish_weight_update`. Given `load_weights`, hwsync first closes the reload the worker opened,
untouched (no layer received anything, so every layer gets its own tensors back), then runs its
own sync as on vLLM: the manifest is checked and the fingerprint read on the real weights, and
the model is whole on every exit path; the worker's later finalize finds no open reload and does
nothing. vllm-ascend's main branch delegates to the engine as vLLM does (start / update /
finish), which needs nothing of this. This module imports vLLM: only vLLM's factory imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from hwsync.errors import HwsyncError
from hwsync.integrations.vllm.adapters import AdapterSpec
from hwsync.integrations.vllm.loading import Target, WorkerSync
from hwsync.integrations.vllm.staged import StagedReceive
from hwsync.integrations.vllm.worker import STAGED_PAUSE_WAIT_S, target_of
from hwsync.timing import DEFAULT_TIMEOUT_S

BACKEND = "hwsync"
#: the vLLM logger that warns "Failed to load weights" for each layer a finalize restores unloaded
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
#: what an update does: "whole" receives and applies inside the call; "stage" starts receiving into staging memory
#: and returns at once; "apply" applies the staged version (call it with generation paused)
PHASES = ("whole", "stage", "apply")


def open_reload_layers(model: torch.nn.Module) -> int:
    """How many of the model's layers are in an open layerwise reload (someone initialized it, nobody finalized)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return sum(1 for layer in model.modules() if layer in LAYERWISE_INFO and LAYERWISE_INFO[layer].can_load())


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def close_untouched_reload(target: Target) -> int:
    """Finalize a layerwise reload the worker opened and nothing loaded into: every layer gets its own tensors back
    (vLLM's finalize places a layer's kept tensors back when it received nothing). Returns the layers it closed."""
    layers = open_reload_layers(target.model)
    if not layers:
        return 0
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    quiet = _DropRecords()  # vLLM would warn "Failed to load weights" for each layer: none was meant to load
    logger = logging.getLogger(_RELOAD_LOGGER)
    logger.addFilter(quiet)
    try:
        with target.context(), torch.no_grad():
            finalize_layerwise_reload(target.model, target.model_config)
    finally:
        logger.removeFilter(quiet)
    return layers


@dataclass
class HwsyncInitInfo(WeightTransferInitInfo):
    """Where the trainer's WeightSender listens, and how each sync is received."""

    endpoint: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    allow_partial: bool = False


@dataclass
class HwsyncUpdateInfo(WeightTransferUpdateInfo):
    """One sync: the vLLM weight version it becomes (the worker reports it), optionally a new endpoint,
    the LoRA adapter whose tensors end the sync (AdapterSpec.to_dict()), if any, and whether it plans."""

    weight_version: str | None = None
    endpoint: str | None = None
    adapter: dict[str, Any] | None = None
    #: the trainer plans from the workers' state (a TrainerModel): they check their base's fingerprint
    plans: bool = True
    #: one of PHASES: the whole sync in this call, or staged (stage, then apply inside the engine's pause)
    phase: str = "whole"

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"HwsyncUpdateInfo(phase={self.phase!r}): one of {', '.join(PHASES)}")


class HwsyncWeightTransferEngine(WeightTransferEngine[HwsyncInitInfo, HwsyncUpdateInfo]):
    """Worker side of the `hwsync` backend: a WeightReceiver per worker, loading through loading.py."""

    init_info_cls = HwsyncInitInfo
    update_info_cls = HwsyncUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.worker = WorkerSync(rank=int(getattr(self.parallel_config, "rank", 0)))
        self._init: HwsyncInitInfo | None = None
        #: the sync a "stage" update started, until the "apply" update that ends it
        self._staged: StagedReceive | None = None

    def init_transfer_engine(self, init_info: HwsyncInitInfo) -> None:
        """Remember the trainer's sender; a later init (a new sender) replaces it."""
        self._init = init_info
        self.worker.connect(init_info.endpoint, float(init_info.timeout_s))

    def start_weight_update(self) -> None:
        """Nothing changes yet: the reload starts at the first bucket, once the manifest is accepted."""
        self._require_init()

    def receive_weights(self, update_info: HwsyncUpdateInfo,
                        load_weights: Callable[[Any], Any] | None = None) -> None:
        """Receive one whole sync into the model (checked, loaded layerwise, finalized), or stage it, or apply what
        was staged (`update_info.phase`).

        `load_weights`: given by a worker that opened vLLM's layerwise reload itself (vllm-ascend up to 0.26.0rc1,
        which passes `model.load_weights`): that reload is closed untouched first, and hwsync loads through the
        model's own `load_weights` in a reload of its own, as on vLLM (see the module doc)."""
        init = self._require_init()
        if load_weights is not None:
            close_untouched_reload(self.target())
        if update_info.phase == "apply":
            self._apply(float(init.timeout_s))
            return
        if self._staged is not None and self._staged.running:
            raise HwsyncError(f"update_weights(phase={update_info.phase!r}) while a staged sync still runs on this "
                              "worker: end it with update_weights(phase='apply') first")
        self._staged = None
        adapter = None if update_info.adapter is None else AdapterSpec.parse(update_info.adapter)
        target, timeout_s = self.target(), float(init.timeout_s)

        def receive(pause: Any = None) -> dict[str, Any]:
            return self.worker.receive(update_info.endpoint or init.endpoint, target, timeout_s=timeout_s,
                                       allow_partial=bool(init.allow_partial),
                                       weight_version=update_info.weight_version, adapter=adapter,
                                       plans=bool(update_info.plans), pause=pause)

        if update_info.phase == "stage":  # the engine generates on while the thread receives; nothing is applied
            self._staged = StagedReceive(receive, wait_s=timeout_s + STAGED_PAUSE_WAIT_S)
        else:
            receive()

    def _apply(self, timeout_s: float) -> None:
        """With generation paused: let the staged sync apply and wait for it; raises its error (nothing applied when
        it failed before the sender's commit)."""
        staged, self._staged = self._staged, None
        if staged is None:
            raise HwsyncError("update_weights(phase='apply') without a staged sync: send "
                              "update_weights(phase='stage') first (the hwsync trainer engine does, with stage=True)")
        staged.apply(timeout_s)

    def finish_weight_update(self) -> None:
        """Nothing left to do: update_weights finalized the reload (vLLM sets the version itself).

        vLLM's worker then drops every LoRA adapter (`reset_lora_state`); hwsync's come back at once
        (adapters.py wraps the manager's remove_all_adapters)."""

    def shutdown(self) -> None:
        """Drop the receiver: its socket and buffer mappings (a staged sync waiting for its apply ends unapplied)."""
        if self._staged is not None:
            self._staged.release()
            self._staged = None
        self.worker.close()

    def target(self) -> Target:
        """The model this update writes into (vLLM may point it at a draft model for one session)."""
        return target_of(self.model, self.model_config, self.vllm_config)

    def state(self) -> dict[str, Any]:
        """This worker's reported state (see WorkerSync.state)."""
        return self.worker.state(self.target())

    def _require_init(self) -> HwsyncInitInfo:
        if self._init is None:
            raise HwsyncError("the hwsync weight-transfer engine has no sender yet: call "
                              "init_weight_transfer_engine first (the hwsync trainer engine's trainer_init does)")
        return self._init
