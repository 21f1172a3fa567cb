"""`hwsync bench delta`'s summary of one pair of hosts: floors, ratios and each delta's CPU on both hosts.

The bench itself needs the bed (root, network namespaces) and minutes; its arithmetic is checked here on a
made-up run: the engine reports a CPU figure per sync in the trainer's order, full syncs included.
"""

from __future__ import annotations

import pytest

from hwsync_tools.bench.delta import _summary, cpu_s


def _sync(step: int, mode: str, seconds: float, nbytes: int, cpu: float) -> dict:
    density = 0.03 if mode == "delta" else None
    return {"step": step, "mode": mode, "seconds": seconds, "bytes": nbytes, "density": density, "diff_s": 0.1,
            "apply_s": 0.01, "wait_s": 0.0, "pack_s": 0.0, "baseline_bytes": 1000, "reason": "", "check": None,
            "cpu_s": cpu}


def test_each_delta_carries_its_floors_and_both_hosts_cpu():
    syncs = [_sync(0, "full", 1.0, 1000, 0.5), _sync(1, "delta", 0.4, 30, 0.2), _sync(2, "delta", 0.2, 20, 0.1),
             _sync(2, "full", 0.8, 1000, 0.4), _sync(2, "full", 1.0, 1000, 0.4)]
    run = {"params": 250, "copy_gbps": 1e-8, "new_bytes": 1000, "syncs": syncs, "colocated": [],
           "engine": {"cpu_s": [0.3, 0.07, 0.05, 0.2, 0.2]}}
    got = _summary(run, rate_bps=8 * 100.0)  # 100 B/s: the wire floor of 30 B is 0.3 s
    first, second = got["deltas"]
    assert first["engine_cpu_s"] == 0.07 and second["engine_cpu_s"] == 0.05  # the syncs' own, not the full ones'
    assert first["cpu_s"] == 0.2
    assert first["read_floor_s"] == pytest.approx(2000 / 10.0)  # new bytes and the baseline at 10 B/s
    assert first["vs_floor"] == pytest.approx(0.4 / 200.0)
    assert got["full_s"] == pytest.approx(0.9) and got["speedup"] == pytest.approx(0.9 / 0.3)


def test_an_engine_without_cpu_figures_leaves_them_empty():
    run = {"params": 1, "copy_gbps": 1.0, "new_bytes": 10, "syncs": [_sync(1, "delta", 0.1, 5, 0.1)],
           "colocated": [], "engine": {"receive_s": [0.1]}}
    assert _summary(run, rate_bps=8e6)["deltas"][0]["engine_cpu_s"] is None


def test_cpu_seconds_grow_with_work():
    before = cpu_s()
    sum(i * i for i in range(300_000))
    assert cpu_s() > before
