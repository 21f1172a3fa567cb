"""Bug 11: ci/setup.sh picks its torch by the machine: the pinned CPU build without an NVIDIA GPU (this
machine: nothing changes), the machine's own CUDA torch where a GPU and one are there, else a CUDA
build. The choice is ci/torch-plan.sh, run here against a stand-in nvidia-smi and Python."""

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
    assert _plan(tmp_path, gpu=True, python=sys.executable) == "cuda-install"


def test_with_a_gpu_the_machines_cuda_torch_is_kept(tmp_path):
    fake = _script(tmp_path / "python", "echo 2.13.0+cu128")  # what `print(torch.__version__ ...)` gives there
    assert _plan(tmp_path, gpu=True, python=str(fake)) == "cuda-keep 2.13.0+cu128"


def test_setup_script_parses():
    done = subprocess.run(["bash", "-n", str(ROOT / "ci" / "setup.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
