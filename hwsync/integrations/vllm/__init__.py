"""hwsync for vLLM (and vllm-ascend, a vLLM platform plugin): trainer helpers and the worker extension.

    llm = LLM(model=path, worker_extension_cls=EXTENSION)      # engine side: every worker receives
    sync = VllmWeightSync(llm)                                  # trainer side, kept across steps
    stats = sync.sync(model, version=step)

Files: trainer.py (VllmWeightSync, AsyncVllmWeightSync, HttpVllmWeightSync: drive both sides
of a sync), worker.py (HwsyncWorkerExtension: receive into the running model with vLLM's
layerwise reload), checkpoint.py (what the engine's loader accepts, checked before any weight
changes). Importing this package imports no vLLM: it is imported where it is used.
"""

from __future__ import annotations

from hwsync.integrations.vllm.trainer import (
    EXTENSION,
    AsyncVllmWeightSync,
    HttpVllmWeightSync,
    VllmWeightSync,
    auto_bucket_bytes,
    settle,
    weights_and_manifest,
)
from hwsync.integrations.vllm.worker import HwsyncWorkerExtension

__all__ = ["EXTENSION", "AsyncVllmWeightSync", "HttpVllmWeightSync", "HwsyncWorkerExtension", "VllmWeightSync",
           "auto_bucket_bytes", "settle", "weights_and_manifest"]
