"""Backend selection rules, asserted on what a user sees from `hwsync info`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hwsync.errors import BackendError
from hwsync.backend.registry import FALLBACK_LINE, backend_statuses, installed_names, select_backend

PLUGIN_SRC = Path(__file__).parent / "plugins" / "hwsync_toy"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    """The third-party test plugin distribution, pip-installed into a directory of its own."""
    target = tmp_path_factory.mktemp("plugins")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(PLUGIN_SRC)],
        check=True, capture_output=True,
    )
    return str(target)


def hwsync_info(*args: str, env: dict[str, str] | None = None, plugin_path: str | None = None):
    """Run `hwsync info` in a fresh process, as a user would."""
    full = {k: v for k, v in os.environ.items() if k not in ("HWSYNC_BACKEND", "HWSYNC_STRICT")}
    full.update(env or {})
    if plugin_path:
        full["PYTHONPATH"] = plugin_path + os.pathsep + full.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "hwsync.cli", "info", *args], env=full, capture_output=True,
                          text=True, timeout=120)


def test_cpu_by_name_works():
    out = hwsync_info(env={"HWSYNC_BACKEND": "cpu"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "selected backend: cpu  (selected by HWSYNC_BACKEND=cpu)" in out.stdout


def test_unknown_name_lists_installed():
    out = hwsync_info(env={"HWSYNC_BACKEND": "nonexistent"})
    assert out.returncode == 1
    assert "HWSYNC_BACKEND=nonexistent: no such backend is installed" in out.stdout
    assert "Installed backends:" in out.stdout and "cpu      usable" in out.stdout


@pytest.mark.parametrize("name", ["npu", "cuda"])
def test_unusable_accelerator_is_an_error_with_reason(name):
    if name not in installed_names():
        pytest.skip(f"the {name} backend is not installed")
    if select_backend("auto").backend.name == name:
        pytest.skip(f"{name} hardware is usable on this machine")
    out = hwsync_info(env={"HWSYNC_BACKEND": name})
    assert out.returncode == 1
    assert f"backend {name!r} is not usable here:" in out.stdout
    assert "never falls back" in out.stdout and "cpu      usable" in out.stdout


def _accelerator_reasons() -> list[str]:
    """`name: reason` of every installed accelerator backend whose probe fails here (the fallback's reasons)."""
    return [f"{s.name}: {s.reason}" for s in backend_statuses() if s.name in ("npu", "cuda") and not s.usable]


def _fallback_or_skip() -> list[str]:
    reasons = _accelerator_reasons()
    if not reasons or select_backend("auto", quiet=True).backend.name != "cpu":
        pytest.skip("no accelerator backend installed (or one is usable): there is no fallback to cpu here")
    return reasons


def test_auto_picks_cpu_and_says_why(plugin_path):
    out = hwsync_info(plugin_path=plugin_path)
    assert out.returncode == 0, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    if any(n in installed_names() for n in ("npu", "cuda")):
        assert first.startswith("selected backend: cpu  (auto: fell back to cpu because")
        for reason in _accelerator_reasons():  # every probe's reason, in the report's first line
            assert reason in first, first
        assert FALLBACK_LINE not in out.stderr  # the report says it in full; no warning besides
    else:
        assert first.startswith("selected backend: cpu  (auto:")


def test_a_fallback_is_one_short_line_once_per_process_tree():
    """`hwsync roundtrip` spawns a receiver: it inherits HWSYNC_BACKEND=cpu and says nothing."""
    reasons = _fallback_or_skip()
    env = {k: v for k, v in os.environ.items() if k not in ("HWSYNC_BACKEND", "HWSYNC_STRICT")}
    out = subprocess.run([sys.executable, "-m", "hwsync.cli", "roundtrip", "--megabytes", "1"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    said = [line for line in out.stderr.splitlines() if "cpu backend" in line]
    assert said == [FALLBACK_LINE] and len(FALLBACK_LINE) <= 80, out.stderr
    assert not any(reason in out.stderr for reason in reasons), out.stderr  # the details: `hwsync info`, the debug log


def test_the_debug_log_has_every_probes_reason():
    reasons = _fallback_or_skip()
    env = {k: v for k, v in os.environ.items() if k not in ("HWSYNC_BACKEND", "HWSYNC_STRICT")}
    code = ("import logging; logging.basicConfig(level=logging.DEBUG, format='%(message)s'); "
            "from hwsync.backend.registry import get_backend; print(get_backend().name)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr
    logged = [line for line in out.stderr.splitlines() if line.startswith("hwsync: falling back to the cpu backend")]
    assert len(logged) == 1 and all(reason in logged[0] for reason in reasons), out.stderr
    assert out.stderr.count(FALLBACK_LINE) == 1


def test_strict_forbids_fallback():
    if not any(n in installed_names() for n in ("npu", "cuda")):
        pytest.skip("no accelerator backend installed, so there is no fallback to forbid")
    out = hwsync_info(env={"HWSYNC_STRICT": "1"})
    assert out.returncode == 1
    assert "HWSYNC_STRICT=1 forbids falling back to cpu" in out.stdout
    for reason in _accelerator_reasons():  # the error names every probe's reason
        assert reason in out.stdout, out.stdout


def test_resolved_name_is_written_back(monkeypatch):
    monkeypatch.delenv("HWSYNC_BACKEND", raising=False)
    selection = select_backend()
    assert os.environ["HWSYNC_BACKEND"] == selection.backend.name


def test_explicit_never_falls_back_in_process(monkeypatch):
    monkeypatch.setenv("HWSYNC_BACKEND", "nonexistent")
    with pytest.raises(BackendError, match="no such backend is installed"):
        select_backend()


def test_third_party_plugin_found_and_selected(plugin_path):
    out = hwsync_info("--json", env={"HWSYNC_BACKEND": "toy"}, plugin_path=plugin_path)
    assert out.returncode == 0, out.stdout + out.stderr
    info = json.loads(out.stdout)
    assert info["selected"] == "toy"
    assert {"name": "toy", "usable": True, "distribution": "hwsync-toy"}.items() <= next(
        b for b in info["backends"] if b["name"] == "toy").items()


def test_plugin_that_fails_to_import(plugin_path):
    out = hwsync_info(env={"HWSYNC_BACKEND": "broken"}, plugin_path=plugin_path)
    assert out.returncode == 1
    assert "backend 'broken' is not usable here: plugin failed to load: ImportError: libbrokenrt.so" in out.stdout
    # the others are still listed, with their own reasons
    assert "toy      usable" in out.stdout and "absent   not usable: no absent-accelerator card" in out.stdout


def test_plugin_without_hardware(plugin_path):
    out = hwsync_info(env={"HWSYNC_BACKEND": "absent"}, plugin_path=plugin_path)
    assert out.returncode == 1
    assert "backend 'absent' is not usable here: no absent-accelerator card found" in out.stdout


def test_info_json_is_valid_and_names_backend():
    out = hwsync_info("--json", env={"HWSYNC_BACKEND": "cpu"})
    info = json.loads(out.stdout)
    assert info["selected"] == "cpu"
    assert info["device"]["devices"][0]["total_bytes"] > info["device"]["devices"][0]["free_bytes"] > 0
    assert info["transports"]["shm"]["usable"] is True
