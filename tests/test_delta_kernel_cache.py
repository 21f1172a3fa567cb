"""The delta codec's compiled kernels come from numba's on-disk cache in every process after the first.

numba keys its cache of a closure by the objects the closure holds, which differ in every process: such
a kernel is compiled again in each process that uses it (0.1-0.8 s a kernel, here) and adds one more file
to the cache each time, without end. The kernels are module-level functions (hwsync.delta.kernels and
kernels16) so that the cache serves them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hwsync.delta import native

# every kernel a sync can run: each width, the fp32 masters' cast, and the step, block and bitmap codes
WARM_ALL = ("import torch\nfrom hwsync.delta.warm import warm_up\n"
            "warm_up([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.bool])\n")


HERE = Path(__file__).parent


def _info(env: dict[str, str]) -> dict:
    """`hwsync info --json`'s delta codec section, in `env`."""
    shown = subprocess.run([sys.executable, "-m", "hwsync.cli", "info", "--json"], env=env, check=True, timeout=120,
                           stdout=subprocess.PIPE, text=True)
    return json.loads(shown.stdout)["delta_codec"]


def _cache_files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_a_second_process_loads_every_kernel_from_numbas_cache(tmp_path):
    if native.kernel() is None:
        pytest.skip("numba is not installed here: the delta codec runs torch ops, nothing is compiled")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    assert _info(env)["compiled"] is False  # `hwsync info` says so before any process compiled them
    # the first delta syncs of a fresh environment wait for no compile: both sides compile on threads of their own
    # (half a minute here) and the syncs, with a 5 s timeout, run torch ops meanwhile
    cold = subprocess.run([sys.executable, str(HERE / "delta_cold_procs.py"), "5"], env=env, check=True, timeout=900,
                          stdout=subprocess.PIPE, text=True)
    report = json.loads(cold.stdout.strip().splitlines()[-1])
    assert [s["mode"] for s in report["syncs"]] == ["full", "delta", "delta"], report
    assert all(s["exact"] and s["seconds"] < 5 for s in report["syncs"]), report
    assert report["loaded"] and not report["syncs"][1]["kernels_loaded"], report  # the deltas ran while they compiled
    assert _info(env)["compiled"] is True
    for run in range(3):
        subprocess.run([sys.executable, "-c", WARM_ALL], env=env, check=True, timeout=300)
        files = _cache_files(tmp_path)
        if run == 0:
            first = files
            assert any(name.endswith(".nbc") for name in first), "the first process cached no kernel"
        else:  # nothing compiled again: no new cache entry, none rewritten
            assert files == first, f"process {run + 1} wrote {sorted(set(files) - set(first))} and rewrote " \
                                   f"{sorted(k for k in first if files.get(k) != first[k])}"
