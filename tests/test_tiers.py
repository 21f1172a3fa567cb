"""The unit tier (tests/tiers.py): its list names real tests, and its guard stops a process before it starts."""

from __future__ import annotations

import ast
import multiprocessing
import multiprocessing.process
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tiers import UNIT, SpawnInUnitTest, guarded, mark_unit, spawns_refused

ROOT = Path(__file__).resolve().parent.parent


def test_every_entry_names_a_module_or_a_test_that_exists():
    missing = []
    for entry in UNIT:
        module, _, name = entry.partition("::")
        path = ROOT / module
        if not path.is_file():
            missing.append(entry)
        elif name and name not in {n.name for n in ast.parse(path.read_text()).body
                                   if isinstance(n, ast.FunctionDef)}:
            missing.append(entry)
    assert not missing, f"tests/tiers.py UNIT names tests that do not exist (renamed? update UNIT): {missing}"
    assert len(set(UNIT)) == len(UNIT)


def _spawns() -> list:
    return [
        lambda: subprocess.run(["true"], check=True),
        lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        lambda: multiprocessing.get_context("fork").Process(target=print).start(),
        os.fork,
        lambda: os.system("true"),
    ]


@pytest.mark.parametrize("index", range(5), ids=["subprocess", "mp-spawn", "mp-fork", "os.fork", "os.system"])
def test_every_way_of_starting_a_process_is_refused_before_it_starts(index):
    before = (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork, os.system)
    with spawns_refused("this test") as attempts:
        with pytest.raises(SpawnInUnitTest, match="take it out of UNIT"):
            _spawns()[index]()
    assert len(attempts) == 1
    assert (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start, os.fork, os.system) == before


def _item(unit: bool) -> SimpleNamespace:
    return SimpleNamespace(nodeid="tests/test_x.py::test_y", get_closest_marker=lambda name: unit or None)


def test_a_unit_test_that_catches_the_refusal_still_fails():
    with pytest.raises(pytest.fail.Exception, match="test_y started a process"):
        with guarded(_item(unit=True)):
            try:
                subprocess.run(["true"])
            except SpawnInUnitTest:
                pass


def test_the_probe_records_without_refusing(tmp_path, monkeypatch):
    log = tmp_path / "spawns.txt"
    monkeypatch.setenv("HWSYNC_TIER_PROBE", str(log))
    with spawns_refused("outer"):  # this test is a unit test: the probe's process must not really start
        with guarded(_item(unit=False)):
            with pytest.raises(SpawnInUnitTest):
                subprocess.run(["true"])
    assert log.read_text() == "tests/test_x.py::test_y\tPopen._execute_child\n"


def test_listed_modules_keep_their_slow_tests_out_and_a_listed_slow_test_is_an_error():
    def item(nodeid: str, *marks: str) -> SimpleNamespace:
        added = []
        return SimpleNamespace(nodeid=nodeid, added=added, add_marker=added.append,
                               get_closest_marker=lambda name: name if name in marks else None)

    fast, slow = item("tests/test_planner.py::test_a[x]"), item("tests/test_planner.py::test_b", "slow")
    other = item("tests/test_transfer.py::test_round_trip_is_bit_exact[cpu]")
    mark_unit([fast, slow, other])
    assert [m.name for m in fast.added] == ["unit"] and not slow.added and not other.added
    with pytest.raises(pytest.UsageError, match="marked vllm"):
        mark_unit([item("tests/test_transfer.py::test_bad_arguments_name_the_fix", "vllm")])
