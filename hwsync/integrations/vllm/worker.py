"""The engine side for vLLM through `worker_extension_cls`: RPC methods that receive hwsync syncs.

Start the engine with `worker_extension_cls="hwsync.integrations.vllm.HwsyncWorkerExtension"`;
vLLM mixes the class into every worker, so `self` is the worker (`self.model_runner.model`,
`self.vllm_config`). Each worker's RPC connects its own WeightReceiver to the sender's
endpoint; with tensor parallelism every worker receives the full tensors and its own
`load_weights` keeps its shard, so the sender is made with `num_receivers` = the worker count.

The loading itself (manifest check before anything changes, MoE kernel reset, layerwise
reload, finalize on every exit path) is loading.py's, shared with the native `hwsync` backend
(engine.py). Around it, what a worker's own weight-update door does and this one must do too
(vllm-ascend's NPUWorker does all three): the reload's allocations land on the model's device
(`DeviceTarget`), the device is synchronized once after the finalize (through the backend's
Device), and on Ascend a worker whose weights may be in FRACTAL_NZ refuses the sync (ascend.py; the
extension turns NZ off before the model loads). This is the door that works on vllm-ascend
0.26.0rc1 unpatched: vLLM mixes the extension into NPUWorker as into any worker class.
vLLM is imported lazily: importing this module never needs vLLM.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from hwsync.errors import HwsyncError
from hwsync.integrations.vllm.adapters import AdapterSpec
from hwsync.integrations.vllm.ascend import default_nz_off, nz_refusal
from hwsync.integrations.vllm.loading import Target, WorkerSync, receiver_state
from hwsync.integrations.vllm.staged import StagedReceive, no_staged_sync
from hwsync.sync.spec import TensorSpec
from hwsync.timing import DEFAULT_TIMEOUT_S

log = logging.getLogger("hwsync")

#: how much longer than a sync's timeout a staged sync's apply waits for the engine's pause
STAGED_PAUSE_WAIT_S = 600.0


def model_device(model: torch.nn.Module) -> torch.device | None:
    """The device the model's weights live on (its first tensor not on meta), or None."""
    for tensor in (*model.parameters(), *model.buffers()):
        if not tensor.is_meta:
            return tensor.device
    return None


@dataclass
class DeviceTarget(Target):
    """A Target whose reload runs under its model's device, as a worker's own weight update does (vLLM's reload and
    weight loaders allocate on the default device: on an NPU worker that must be the NPU)."""

    device: torch.device | None = None

    def context(self) -> Any:
        """vLLM's current config, and the model's device as the default device."""
        stack = ExitStack()
        stack.enter_context(super().context())
        if self.device is not None:
            stack.enter_context(torch.device(self.device))
        return stack


def target_of(model: torch.nn.Module, model_config: Any, vllm_config: Any) -> DeviceTarget:
    """The DeviceTarget for a worker's model."""
    return DeviceTarget(model, model_config, vllm_config, model_device(model))


def refuse(worker: WorkerSync, endpoint: str, timeout_s: float, reason: str) -> None:
    """Refuse the sender's sync through the protocol (it is told `reason` at once, no weight is touched); raises."""

    class Refuse:  # a Loader that refuses the sync as it is announced
        def load(self, tensors: list[tuple[str, Any]]) -> None:
            raise HwsyncError(reason)

        def accept(self, version: int, manifest: list[TensorSpec] | None) -> None:
            raise HwsyncError(reason)

    worker.connect(endpoint, timeout_s).receive(Refuse(), state=receiver_state(worker.state()))
    raise HwsyncError(reason)  # receive raised already; a sender that announced nothing and sent nothing ends here


def synchronize_after(worker: WorkerSync) -> None:
    """Wait once for the device work the finalize queued, through the backend's Device (every peer does)."""
    if worker.receiver is not None:
        worker.receiver.backend.device().synchronize()


def _flag(value: bool | str) -> bool:
    return value in (True, "1", "true", "True")


class HwsyncWorkerExtension:
    """Mixed into each vLLM worker: RPC methods `hwsync_receive`, `hwsync_stage` and `hwsync_apply` (staged.py),
    `hwsync_status`, `hwsync_close`."""

    _hwsync: WorkerSync | None = None
    _hwsync_staged: StagedReceive | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # vLLM builds the worker with the extension mixed in: this runs before the worker's __init__ reads its
        # config and long before the model loads, so the weights hwsync writes keep the checkpoint's layout
        default_nz_off()
        return super().__new__(cls)

    def _hwsync_worker(self) -> WorkerSync:
        # one WorkerSync per worker: the native backend's when vLLM made one, so both paths report one state
        shared = getattr(getattr(self, "weight_transfer_engine", None), "worker", None)
        if isinstance(shared, WorkerSync):
            return shared
        if self._hwsync is None:
            self._hwsync = WorkerSync(rank=int(getattr(self, "rank", 0)))
        return self._hwsync

    def _hwsync_target(self) -> Target:
        runner = self.model_runner  # type: ignore[attr-defined]
        return target_of(runner.model, runner.model_config, getattr(self, "vllm_config", None))

    def hwsync_status(self) -> dict[str, Any]:
        """What this worker holds (WorkerSync.state): versions, the checked EngineState, LoRA adapters."""
        return self._hwsync_worker().state(self._hwsync_target())

    def _hwsync_begin(self, endpoint: str, timeout_s: float | str, adapter: dict[str, Any] | str | None
                      ) -> tuple[WorkerSync, AdapterSpec | None]:
        """This worker's WorkerSync and the adapter spec, or the sender told why this worker refuses (raises)."""
        # strings too: vLLM's HTTP /collective_rpc route passes every argument as a string (JSON for adapter)
        if isinstance(adapter, str):
            adapter = json.loads(adapter) if adapter not in ("", "None", "null") else None
        spec = None if adapter is None else AdapterSpec.parse(adapter)
        worker = self._hwsync_worker()
        reason = nz_refusal()
        if reason is not None:
            refuse(worker, endpoint, float(timeout_s), reason)
        return worker, spec

    def hwsync_receive(self, endpoint: str, timeout_s: float | str = DEFAULT_TIMEOUT_S,
                       allow_partial: bool | str = False, adapter: dict[str, Any] | str | None = None,
                       plans: bool | str = True) -> dict[str, Any]:
        """Receive one sync from `endpoint` into the model (its trailing tensors `adapter`'s LoRA, if
        given; `plans`: the sender plans from this worker's state); returns this worker's stats as a dict."""
        worker, spec = self._hwsync_begin(endpoint, timeout_s, adapter)
        try:
            stats = worker.receive(endpoint, self._hwsync_target(), timeout_s=float(timeout_s),
                                   allow_partial=_flag(allow_partial), adapter=spec, plans=_flag(plans))
        except BaseException:
            try:  # the reload was finalized on this path too: its queued work is waited for all the same
                synchronize_after(worker)
            except Exception as exc:  # noqa: BLE001 - never hide the sync's own error behind a failed wait
                log.warning("hwsync: the device synchronize after a failed sync failed too: %s", exc)
            raise
        synchronize_after(worker)
        return stats

    def hwsync_stage(self, endpoint: str, timeout_s: float | str = DEFAULT_TIMEOUT_S,
                     allow_partial: bool | str = False, adapter: dict[str, Any] | str | None = None,
                     plans: bool | str = True) -> dict[str, Any]:
        """Start staging one sync from `endpoint` on a thread of this worker and return at once: the engine keeps
        generating; `hwsync_apply`, called once generation is paused, applies it (the arguments: hwsync_receive's)."""
        worker, spec = self._hwsync_begin(endpoint, timeout_s, adapter)
        if self._hwsync_staged is not None and self._hwsync_staged.running:
            raise HwsyncError("hwsync_stage while the last staged sync still runs: call hwsync_apply first")
        target = self._hwsync_target()

        def receive(pause: Any) -> dict[str, Any]:
            return worker.receive(endpoint, target, timeout_s=float(timeout_s), allow_partial=_flag(allow_partial),
                                  adapter=spec, plans=_flag(plans), pause=pause)

        self._hwsync_staged = StagedReceive(receive, wait_s=float(timeout_s) + STAGED_PAUSE_WAIT_S)
        return {"rank": worker.rank, "staging": True}

    def hwsync_apply(self, timeout_s: float | str = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        """With generation paused: apply the staged sync (once the sender commits it) and return this worker's
        stats; raises the sync's error if it failed (nothing applied when it failed before the commit)."""
        staged, self._hwsync_staged = self._hwsync_staged, None
        if staged is None:
            raise no_staged_sync()
        worker = self._hwsync_worker()
        try:
            return staged.apply(float(timeout_s))
        finally:
            synchronize_after(worker)

    def hwsync_close(self) -> None:
        """Drop the receiver (its socket and buffer mappings); the next receive reconnects."""
        if self._hwsync_staged is not None:
            self._hwsync_staged.release()
            self._hwsync_staged = None
        self._hwsync_worker().close()
