"""hwsync's verl checkpoint engine across hosts of a bed (hwsync_tools.bed): 2 trainer ranks on host 0, a rollout
worker on each of hosts 1 and 2, each a process in its host with a host name of its own and no interface
variable, driven through verl's CheckpointEngineManager sequence (tests/verl_bed_procs.py says how).

It needs verl (ci/test.sh runs tests/test_verl_*.py in .venv-verl) and a machine that can hold a bed (root).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed in this environment: ci/test.sh runs these tests in "
                                   ".venv-verl, which ci/setup-verl.sh makes")

from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402

import verl_bed_procs  # noqa: E402
from bed_procs import bed_or_skip  # noqa: E402
from hwsync.integrations.verl.trainer import PREFIX  # noqa: E402

PROCS = os.path.abspath(verl_bed_procs.__file__)
CONFIG = {"backend": "hwsync", "custom_backend_module": "hwsync.integrations.verl",
          "update_weights_bucket_megabytes": 8,  # hwsync's bucket: 8 MiB / (2 senders x 2 buffers) = 2 MiB
          # no host: each worker finds its own address; deltas after the first step (each step's weights all change)
          "engine_kwargs": {"hwsync": {"timeout_s": 30.0, "delta": True}}}
WORKERS = [("t0", "trainer", 0, 0), ("t1", "trainer", 1, 0), ("r0", "rollout", 0, 1), ("r1", "rollout", 1, 2)]


def _why(proc: Any) -> str:
    """A dead worker's error: its target's exception and traceback (the bed's result file), then its output."""
    try:
        proc.result(5.0)
    except Exception as exc:  # noqa: BLE001 - the error is what is reported
        return str(exc)[-6000:]
    return proc.log()


def _read(folder: str, name: str, procs: dict, timeout: float = 120.0):
    path = os.path.join(folder, name)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        dead = {w: _why(p) for w, p in procs.items() if not p.alive() and p.poll() != 0}
        assert not dead and time.monotonic() < deadline, f"no {name}; dead workers: {dead}"
        time.sleep(0.02)
    with open(path) as f:
        return json.load(f)


def _write(folder: str, name: str, value) -> None:
    """Whole or not at all: a worker polls for the file and reads it as soon as it exists."""
    tmp = os.path.join(folder, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(folder, name))


def test_verl_engine_across_hosts_three_steps_bit_exact(tmp_path):
    """verl's update_weights, three steps: both rollout hosts bit-exact each step, the trainer ranks striped,
    the groups kept after the first step, every rank on the address of its own host."""
    steps = [1, 2, 3]
    folder = str(tmp_path)
    engine_cls = CheckpointEngineRegistry.get("hwsync")
    with bed_or_skip(3) as bed:
        procs = {who: bed.start(host, f"{PROCS}:worker", folder, who, role, rank, CONFIG, steps, interface_vars=False)
                 for who, role, rank, host in WORKERS}
        trainers = [w for w, role, _, _ in WORKERS if role == "trainer"]
        rollouts = [w for w, role, _, _ in WORKERS if role == "rollout"]
        metrics = {}
        for step in steps:
            # what CheckpointEngineManager.update_weights does, minus Ray: prepare everywhere, build_topology on the
            # driver, init_process_group everywhere, update_weights everywhere, finalize everywhere
            metadata = [_read(folder, f"meta-{w}-{step}", procs) for w in trainers + rollouts]
            tk, rk = engine_cls.build_topology(len(trainers), len(rollouts), metadata)
            for i, w in enumerate(trainers):
                _write(folder, f"topo-{w}-{step}", {k: v[i] for k, v in tk.items()})
            for i, w in enumerate(rollouts):
                _write(folder, f"topo-{w}-{step}", {k: v[i] for k, v in rk.items()})
            for w in trainers + rollouts:
                _read(folder, f"inited-{w}-{step}", procs)
            _write(folder, f"update-{step}", True)
            results = {w: _read(folder, f"updated-{w}-{step}", procs) for w in trainers + rollouts}
            _write(folder, f"finalize-{step}", True)
            for w in rollouts:
                assert results[w] == {"tensors": len(verl_bed_procs.SHAPES), "wrong": []}, f"step {step}, {w}"
            metrics[step] = results["t0"]
            assert results["t1"] is None  # only rank 0 reports (verl merges every rank's dict)
        got = {w: p.result(60) for w, p in procs.items()}
    for step in steps:
        assert metrics[step][PREFIX + "num_senders"] == 2 and metrics[step][PREFIX + "num_receivers"] == 2
        # one verl update is a sync per window of tensors: every one is a delta but the very first (a window's
        # tensors new to the baseline go whole in it)
        syncs = metrics[step][PREFIX + "syncs"]
        assert metrics[step][PREFIX + "delta_syncs"] == syncs - (step == 1), f"step {step}: {metrics[step]}"
        assert metrics[step][PREFIX + "tensors"] == len(verl_bed_procs.SHAPES)
    assert metrics[1][PREFIX + "syncs"] > 1 and metrics[2][PREFIX + "syncs"] == metrics[3][PREFIX + "syncs"] == 1
    assert len({metrics[s][PREFIX + "group_epoch"] for s in (2, 3)}) == 1, "the groups must be kept across steps"
    for who, role, rank, host in WORKERS:
        lines = got[who]["log"]
        addr = bed.address(host)
        assert lines and all(f"{addr} on hwbed{host}: gloo device bound to {addr}" in line for line in lines), lines
