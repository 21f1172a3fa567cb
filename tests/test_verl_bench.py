"""`hwsync bench transfer --peer verl` runs verl's own sender and receiver and reports a refused bucket.

No figure is asserted (speed is for the benchmark's table, not for tests): this checks that the
comparison runs end to end on verl 0.9.1, that verl's receiver got the weights right (the
bench raises otherwise), and that verl's shared-memory path refusing a tensor larger than its
bucket (verl issue #5952) is reported instead of crashing the run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed in this environment: ci/test.sh runs these tests in "
                                   ".venv-verl, which ci/setup-verl.sh makes")

from hwsync_tools.bench.transfer import model_spec  # noqa: E402
from hwsync_tools.bench.verl_peer import sweep
from hwsync.sizes import MiB  # noqa: E402
from hwsync.sync.spec import dtype_from_name  # noqa: E402


def test_the_sweep_spans_verls_default_down_to_below_the_largest_tensor():
    embedding = 151936 * 1536 * 2  # Qwen2.5-1.5B's, 445.1 MiB
    assert sweep(embedding, 2048) == [2048, 1024, 512, 446, 256]
    assert sweep(3 * MiB, 2048) == [2048, 1024, 512, 3, 2]


def test_bench_transfer_peer_verl_runs_verls_code_and_reports_the_refused_bucket():
    spec = model_spec(int(0.03e9), "bf16")
    largest = max(math.prod(shape) * dtype_from_name(dtype).itemsize for _, shape, dtype in spec)
    fits, refused = math.ceil(largest / MiB), math.ceil(largest / MiB) // 2
    done = subprocess.run(
        [sys.executable, "-m", "hwsync.cli", "bench", "transfer", "--peer", "verl", "--gb", "0.03", "--syncs", "2",
         "--verl-syncs", "2", "--verl-bucket-mb", str(fits), str(refused), "--copy-mib", "64", "--json"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HWSYNC_BACKEND": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    verl = json.loads(done.stdout)["verl"]
    ok, failed = verl["runs"]
    assert ok["bucket_mb"] == fits and ok["error"] is None and len(ok["seconds"]) == 2 and ok["gbps"] > 0
    assert failed["bucket_mb"] == refused and "too large to fit in the bucket" in failed["error"]
    assert verl["failed_bucket_mb"] == [refused] and verl["best_bucket_mb"] == fits and verl["use_shm"]
    assert verl["hwsync_vs_verl_best"] > 0


# A GPU machine with no package registry gets verl as a wheel installed without its dependencies; there
# `import verl` fails (its __init__ imports ray). This process hides them the same way.
_HIDE_VERLS_DEPENDENCIES = '''
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"ray", "omegaconf", "fastapi", "uvicorn", "tensordict"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
'''


def test_verls_transfer_code_loads_unmodified_where_verl_is_installed_without_its_dependencies():
    code = _HIDE_VERLS_DEPENDENCIES + '''
import asyncio, json, os
try:
    import verl
    whole = True
except ImportError:
    whole = False
from hwsync_tools.bench.verl_bare import default_bucket_mb, import_verl
from hwsync_tools.bench.verl_peer import load_verl_transfer
verl = import_verl()
transfer = load_verl_transfer("cuda", 10)  # the GPU's case: verl's own CUDA platform, no CPU stand-in
from verl.workers.rollout import utils
async def walk():
    return [x async for x in utils.ensure_async_iterator(iter([1, 2, 3]))]
root = os.path.dirname(verl.__file__)
print(json.dumps({"whole": whole, "version": verl.__version__, "bare": verl.bare_because,
                  "default_mb": default_bucket_mb(), "walk": asyncio.run(walk()),
                  "utils_names": sorted(n for n in vars(utils) if not n.startswith("__")),
                  "transfer_is_verls_file": transfer.__file__ == os.path.join(
                      root, "workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py"),
                  "classes": [hasattr(transfer, c) for c in ("BucketedWeightSender", "BucketedWeightReceiver")]}))
'''
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["whole"] is False  # what the bench met on the GPU machine before verl_bare
    assert got["version"] == "0.9.1" and "ray" in got["bare"]
    assert got["default_mb"] == 2048 and got["walk"] == [1, 2, 3]
    assert got["utils_names"] == ["ensure_async_iterator"]  # verl's helper alone, nothing of ours
    assert got["transfer_is_verls_file"] and got["classes"] == [True, True]
