"""`hwsync roundtrip` with its defaults says what it measures: the receiver's start-up, the first sync and a warm
sync's rate, each apart, every sync verified. (ci/demo.sh runs it too; tests/test_transfer.py runs it on every
backend.) No figure is asserted: speed is for the benchmarks' tables."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def roundtrip(*args: str) -> subprocess.CompletedProcess:
    """`hwsync roundtrip ARGS` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "hwsync.cli", "roundtrip", *args], capture_output=True, text=True,
                          timeout=300)


def test_roundtrip_reports_start_up_first_and_warm_sync_apart():
    done = roundtrip()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert re.match(r"roundtrip over \w+/\w+: 55\.9 MB in 4 tensors, .*both syncs verified bit-exact$", lines[0])
    labels = [re.match(r"\s+(receiver start-up|first sync|warm sync)\s+\d+\.\d{3} s\s", line) for line in lines[1:]]
    assert [m.group(1) if m else line for m, line in zip(labels, lines[1:])] == [
        "receiver start-up", "first sync", "warm sync"], done.stdout
    assert "not part of any sync" in lines[1] and "GB/s" in lines[3] and "as each later step sees it" in lines[3]


def test_roundtrip_json_gives_the_warm_syncs_rate():
    done = roundtrip("--megabytes", "4", "--json")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads(done.stdout)
    first, warm = report["first_sync"], report["warm_sync"]
    assert report["verified"] is True and report["startup_s"] > 0
    assert (first["stats"]["version"], warm["stats"]["version"]) == (1, 2)  # the rate is not the first sync's
    assert report["gbps"] == warm["gbps"] == warm["stats"]["bytes"] / warm["seconds"] / 1e9
    assert report["bytes"] == warm["stats"]["bytes"] > 3e6  # ~4 MiB in three dtypes
