"""The engine side for vLLM through `worker_extension_cls`: RPC methods that receive hwsync syncs.

Start the engine with `worker_extension_cls="hwsync.integrations.vllm.HwsyncWorkerExtension"`;
vLLM mixes the class into every worker, so `self` is the worker (`self.model_runner.model`,
`self.vllm_config`). Each worker's RPC connects its own WeightReceiver to the sender's
endpoint; with tensor parallelism every worker receives the full tensors and its own
`load_weights` keeps its shard, so the sender is made with `num_receivers` = the worker count.

The loading itself (manifest check before anything changes, MoE kernel reset, layerwise
reload, finalize on every exit path) is loading.py's, shared with the native `hwsync` backend
(engine.py). vLLM is imported lazily: importing this module never needs vLLM.
"""

from __future__ import annotations

import json
from typing import Any

from hwsync.integrations.vllm.adapters import AdapterSpec
from hwsync.integrations.vllm.loading import Target, WorkerSync
from hwsync.timing import DEFAULT_TIMEOUT_S


class HwsyncWorkerExtension:
    """Mixed into each vLLM worker: RPC methods `hwsync_receive`, `hwsync_status`, `hwsync_close`."""

    _hwsync: WorkerSync | None = None

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
        return Target(runner.model, runner.model_config, getattr(self, "vllm_config", None))

    def hwsync_status(self) -> dict[str, Any]:
        """What this worker holds (WorkerSync.state): versions, the checked EngineState, LoRA adapters."""
        return self._hwsync_worker().state(self._hwsync_target())

    def hwsync_receive(self, endpoint: str, timeout_s: float | str = DEFAULT_TIMEOUT_S,
                       allow_partial: bool | str = False, adapter: dict[str, Any] | str | None = None,
                       plans: bool | str = True) -> dict[str, Any]:
        """Receive one sync from `endpoint` into the model (its trailing tensors `adapter`'s LoRA, if
        given; `plans`: the sender plans from this worker's state); returns this worker's stats as a dict."""
        # strings too: vLLM's HTTP /collective_rpc route passes every argument as a string (JSON for adapter)
        partial = allow_partial in (True, "1", "true", "True")
        if isinstance(adapter, str):
            adapter = json.loads(adapter) if adapter not in ("", "None", "null") else None
        spec = None if adapter is None else AdapterSpec.parse(adapter)
        return self._hwsync_worker().receive(endpoint, self._hwsync_target(), timeout_s=float(timeout_s),
                                             allow_partial=partial, adapter=spec,
                                             plans=plans in (True, "1", "true", "True"))

    def hwsync_close(self) -> None:
        """Drop the receiver (its socket and buffer mappings); the next receive reconnects."""
        self._hwsync_worker().close()
