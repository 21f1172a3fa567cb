"""Backend selection rules, asserted on what a user sees from `hwsync info`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hwsync.errors import BackendError
from hwsync.backend.registry import installed_names, select_backend

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


def test_auto_picks_cpu_and_says_why(plugin_path):
    out = hwsync_info(plugin_path=plugin_path)
    assert out.returncode == 0, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    if any(n in installed_names() for n in ("npu", "cuda")):
        assert first.startswith("selected backend: cpu  (auto: fell back to cpu because")
        assert "falling back to the cpu backend" in out.stderr  # the log line, with each probe's reason
    else:
        assert first.startswith("selected backend: cpu  (auto:")


def test_strict_forbids_fallback():
    if not any(n in installed_names() for n in ("npu", "cuda")):
        pytest.skip("no accelerator backend installed, so there is no fallback to forbid")
    out = hwsync_info(env={"HWSYNC_STRICT": "1"})
    assert out.returncode == 1
    assert "HWSYNC_STRICT=1 forbids falling back to cpu" in out.stdout


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
