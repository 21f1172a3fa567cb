"""hwsync for vLLM (and vllm-ascend, a vLLM platform plugin): two ways in, one loading path.

vLLM's own weight-transfer API, with hwsync as its `hwsync` backend (registered by the
`vllm.general_plugins` entry point, plugin.py):

    llm = LLM(model=path, weight_transfer_config=WeightTransferConfig(backend="hwsync"))
    trainer = WeightTransferTrainerFactory.trainer_init(HwsyncTrainerInitInfo(rank=0),
                                                        client=LLMClient(llm), source=model)
    trainer.send_weights("step-1")

or hwsync's worker extension and trainer helpers:

    llm = LLM(model=path, worker_extension_cls=EXTENSION)
    sync = VllmWeightSync(llm)
    stats = sync.sync(model, version=step)

An AsyncLLM keeps generating while the next version stages (`AsyncVllmWeightSync`, `stage="auto"`: where the
host has the memory) and pauses (vLLM's `pause_generation`) only to apply it; `rolling_commit` does so across
engines, staged everywhere first, committed one engine at a time. An AsyncLLM on another node than the trainer
receives across nodes and stages just the same (`engine_forwarder`, cross_node.py).

A LoRA trainer passes a planner TrainerModel (hwsync.integrations.peft.peft_trainer_model):
the base goes only when the engine lacks it, the adapter from memory, served to
`lora_request(model.adapter)`.

Files: engine.py (worker side of the backend) and native.py (its trainer side), clients.py
(LLMClient / AsyncLLMClient for vLLM's client protocol), worker.py (the extension), trainer.py
(VllmWeightSync, AsyncVllmWeightSync), http.py (HttpVllmWeightSync, staged over the server's routes too),
loading.py (the one way into the
model: check, MoE kernel reset, layerwise reload, finalize; WorkerSync's reported state),
loader_check.py (the engine's own loader, dry-run), adapters.py (LoRA adapters from memory into
vLLM's LoRA manager), fingerprint.py (what a worker checks its base against before each plan),
kernels.py (MoE and tied-head kernels the reload leaves stale), checkpoint.py (the checkpoint's
manifest), sources.py (what a trainer holds, as checkpoint-named tensors), staged.py and staged_trainer.py (staged
syncs: the worker's staging thread, and stage then commit inside vLLM's pause), cross_node.py (an engine node fed
by a CrossNodeReceiver, staged). Importing this
package imports no vLLM; `HwsyncTrainerInitInfo` / `HwsyncTrainerEngine` import it when first named.
"""

from __future__ import annotations

from typing import Any

from hwsync.integrations.vllm.clients import AsyncLLMClient, LLMClient
from hwsync.integrations.vllm.cross_node import engine_forwarder
from hwsync.integrations.vllm.http import HttpVllmWeightSync
from hwsync.integrations.vllm.plugin import BACKEND, register
from hwsync.integrations.vllm.sources import weights_and_manifest
from hwsync.integrations.vllm.trainer import (
    EXTENSION,
    AsyncVllmWeightSync,
    VllmWeightSync,
    auto_bucket_bytes,
    lora_request,
    rolling_commit,
    settle,
)
from hwsync.integrations.vllm.worker import HwsyncWorkerExtension

_NATIVE = ("HwsyncTrainerInitInfo", "HwsyncTrainerEngine")


def __getattr__(name: str) -> Any:
    # the backend's trainer side subclasses vLLM's classes: import vLLM only when it is asked for
    if name in _NATIVE:
        from hwsync.integrations.vllm import native

        return getattr(native, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKEND", "EXTENSION", "AsyncLLMClient", "AsyncVllmWeightSync", "HttpVllmWeightSync",
           "HwsyncTrainerEngine", "HwsyncTrainerInitInfo", "HwsyncWorkerExtension", "LLMClient", "VllmWeightSync",
           "auto_bucket_bytes", "engine_forwarder", "lora_request", "register", "rolling_commit", "settle",
           "weights_and_manifest"]
