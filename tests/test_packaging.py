"""The library a trainer imports ships only itself: the test bed, the benchmarks and the verl shim are the
hwsync-tools distribution (tools/), which adds `hwsync bench` through the `hwsync.commands` entry points."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import hwsync.cli as cli

ROOT = Path(__file__).resolve().parent.parent

#: what a trainer or an engine imports: the package, the vLLM integration, and the `hwsync` command's module
PUBLIC = ("hwsync", "hwsync.integrations.vllm", "hwsync.cli")

#: imports PUBLIC, then lists every loaded module that is tooling, and whether the core still holds the tooling
PROBE = """
import importlib.util, json, sys
for name in sys.argv[1:]:
    __import__(name)
def tooling(name):
    parts = name.split(".")
    return parts[0] in ("hwsync_tools", "verl") or "bed" in parts or "bench" in parts or "verl_bare" in parts
print(json.dumps({"loaded": sorted(m for m in sys.modules if tooling(m)),
                  "in_core": [m for m in ("hwsync.bed", "hwsync.cli.bench") if importlib.util.find_spec(m)]}))
"""


def test_importing_hwsync_imports_no_bed_bench_or_verl_code():
    done = subprocess.run([sys.executable, "-c", PROBE, *PUBLIC], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"loaded": [], "in_core": []}, got


def test_the_core_distribution_packages_no_tooling():
    """What setuptools puts in the hwsync distribution (pyproject.toml's package discovery): the core alone."""
    from setuptools import find_packages

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=found.get("include", ["*"]), exclude=found.get("exclude", ()))
    assert "hwsync" in packages and "hwsync.cli" in packages
    tooling = [p for p in packages if p.split(".")[0] != "hwsync" or {"bed", "bench"} & set(p.split("."))]
    assert not tooling, tooling


def test_the_tools_distribution_adds_bench_through_its_entry_point():
    """Installed (ci/setup.sh: pip install -e tools), hwsync-tools registers `bench`; each bench parses."""
    assert "bench" in cli.plugin_commands(), "pip install -e tools"
    for name in ("transfer", "vllm", "broadcast", "delta", "delta-codec"):
        args = cli._parser(["bench", name]).parse_args(["bench", name])
        module, run = args._run
        assert module.startswith("hwsync_tools.bench.") and run.startswith("run_bench_"), (name, args._run)


def test_bench_without_the_tools_says_in_one_line_how_to_install_them(monkeypatch, capsys):
    monkeypatch.setattr(cli, "plugin_commands", lambda: {})
    assert cli.main(["bench", "transfer", "--gb", "4"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install -e tools" in err, err
    assert "bench" in cli._parser([]).format_help()  # still listed, with how to get it


def test_a_broken_commands_entry_point_names_itself(monkeypatch, capsys):
    """A distribution whose `hwsync.commands` entry point fails to load is named, with the error; hwsync runs on."""
    broken = EntryPoint("bench", "hwsync_tools_missing.nothing:add", cli.COMMANDS_GROUP)
    monkeypatch.setattr(cli, "plugin_commands", lambda: {"bench": broken})
    assert cli.main(["bench", "transfer"]) != 0
    err = capsys.readouterr().err
    assert "hwsync_tools_missing" in err and "bench" in err, err

