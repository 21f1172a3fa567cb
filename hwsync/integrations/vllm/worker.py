"""The engine side for vLLM: a worker extension that receives hwsync syncs into the running model.

Start the engine with `worker_extension_cls="hwsync.integrations.vllm.HwsyncWorkerExtension"`;
vLLM mixes the class into every worker, so `self` is the worker (`self.model_runner.model`,
`self.vllm_config`). Each worker's RPC connects its own WeightReceiver to the sender's
endpoint; with tensor parallelism every worker receives the full tensors and its own
`load_weights` keeps its shard, so the sender is made with `num_receivers` = the worker count.

Loading goes through vLLM's layerwise reload, which also works where vLLM repacks weights
after loading (its CPU backend, quantized kernels): `initialize_layerwise_reload` before the
first bucket, `model.load_weights` per bucket, `finalize_layerwise_reload` at the end. The
announced manifest is checked against the engine's checkpoint before `initialize`, so a
refused sync leaves the model untouched. vLLM is imported lazily: importing this module never
needs vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hwsync.colocated import WeightReceiver
from hwsync.errors import ManifestError
from hwsync.integrations.vllm.checkpoint import check_manifest, checkpoint_manifest
from hwsync.manifest import TensorSpec
from hwsync.timing import DEFAULT_TIMEOUT_S

log = logging.getLogger("hwsync")


def _layerwise_infos() -> list[Any] | None:
    """vLLM's per-layer reload records, or None where this vLLM keeps them elsewhere."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
    except ImportError:
        return None
    if "loaded_weights" not in getattr(LayerReloadingInfo, "__dataclass_fields__", {}):
        return None
    return list(LAYERWISE_INFO.values())


def keep_pending_layers(tensors: list[tuple[str, torch.Tensor]]) -> bool:
    """Copy what layerwise reload still holds of this bucket: its buffer is refilled after load returns.

    vLLM's layerwise reload buffers a layer's weights until the whole layer arrived; a layer that
    straddles two buckets would otherwise be completed from a buffer the sender already reuses.
    Only those few tensors are copied. False where vLLM's records are not found: the caller
    must then hand load_weights copies.
    """
    infos = _layerwise_infos()
    if infos is None:
        return False
    storages = {t.untyped_storage().data_ptr() for _, t in tensors}
    for info in infos:
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                    bound.arguments[key] = value.clone()
    return True


class HwsyncWorkerExtension:
    """Mixed into each vLLM worker: RPC methods `hwsync_receive`, `hwsync_status`, `hwsync_close`."""

    _hwsync_receiver: WeightReceiver | None = None
    _hwsync_endpoint: str | None = None
    _hwsync_expected: list[TensorSpec] | None = None

    def hwsync_status(self) -> dict[str, Any]:
        """This worker's rank, last complete version and whether an update broke midway."""
        receiver = self._hwsync_receiver
        return {
            "rank": int(getattr(self, "rank", 0)),
            "version": None if receiver is None else receiver.version,
            "incomplete": False if receiver is None else receiver.incomplete,
            "model": str(self.model_runner.model_config.model),
        }

    def hwsync_receive(self, endpoint: str, timeout_s: float | str = DEFAULT_TIMEOUT_S, allow_partial: bool | str = False
                       ) -> dict[str, Any]:
        """Receive one sync from `endpoint` into the model; returns this worker's stats as a dict."""
        # strings too: vLLM's HTTP /collective_rpc route passes every argument as a string
        timeout_s = float(timeout_s)
        allow_partial = allow_partial in (True, "1", "true", "True")
        receiver = self._hwsync_connect(endpoint, timeout_s)
        model = self.model_runner.model
        model_config = self.model_runner.model_config
        checked = False
        started = False
        copy_buckets = _layerwise_infos() is None

        def check(announced: list[TensorSpec]) -> None:
            nonlocal checked
            tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
            check_manifest(self._hwsync_expected_manifest(), announced, allow_partial=allow_partial,
                           tied_embeddings=tied)
            checked = True

        def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal started
            if not checked:
                # without a manifest a bad tensor would be found only after earlier layers changed
                raise ManifestError("the sender announced no manifest; pass manifest=manifest_from_module(model) "
                                    "(or manifest_from_tensors(...)) to WeightSender.send")
            if not started:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(model)
                started = True
            if not copy_buckets:
                with self._hwsync_context(), torch.no_grad():
                    model.load_weights(weights=iter(tensors))
                keep_pending_layers(tensors)
                return
            with self._hwsync_context(), torch.no_grad():  # an unknown vLLM: never keep views of a buffer
                model.load_weights(weights=iter([(n, t.clone()) for n, t in tensors]))

        try:
            stats = receiver.receive(load, check_manifest=check, state=self.hwsync_status())
        finally:
            if started:
                # on failure too: restores the layers no bucket reached and unwraps the loaders, so
                # the engine stays runnable (receiver.incomplete says its weights are a mix)
                self._hwsync_finalize()
        out = stats.to_dict()
        out["rank"] = int(getattr(self, "rank", 0))
        return out

    def hwsync_close(self) -> None:
        """Drop the receiver (its socket and buffer mappings); the next receive reconnects."""
        if self._hwsync_receiver is not None:
            self._hwsync_receiver.close()
            self._hwsync_receiver = self._hwsync_endpoint = None

    def _hwsync_connect(self, endpoint: str, timeout_s: float) -> WeightReceiver:
        # one receiver per sender session: its socket and buffer mappings serve every step
        receiver = self._hwsync_receiver
        if receiver is not None and self._hwsync_endpoint == endpoint:
            receiver.timeout_s = timeout_s
            return receiver
        self.hwsync_close()
        receiver = WeightReceiver(endpoint, timeout_s=timeout_s)
        self._hwsync_receiver, self._hwsync_endpoint = receiver, endpoint
        return receiver

    def _hwsync_expected_manifest(self) -> list[TensorSpec]:
        # read once: the checkpoint's headers are what load_weights accepts for the engine's lifetime
        if self._hwsync_expected is None:
            model_config = self.model_runner.model_config
            load_config = getattr(self.vllm_config, "load_config", None)
            self._hwsync_expected = checkpoint_manifest(
                str(model_config.model), getattr(model_config, "revision", None),
                getattr(load_config, "download_dir", None))
        return self._hwsync_expected

    def _hwsync_context(self) -> Any:
        # some weight loaders read the current vLLM config, as vLLM's own reload_weights provides
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def _hwsync_finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self._hwsync_context(), torch.no_grad():
            finalize_layerwise_reload(self.model_runner.model, self.model_runner.model_config)
