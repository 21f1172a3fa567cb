"""The in-tree backends share one shape (docs/backends.md), and importing a package imports nothing.

The shape is what a third party copies: `__init__.py` (lazy names), `backend.py` (the class the
entry point names), `device.py`. A package import must stay free of torch: the npu pre-import
hook loads `hwsync_npu` before torch may be imported, and `hwsync info` lists every backend.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

BACKENDS = Path(__file__).resolve().parents[1] / "backends"
IN_TREE = {"cpu": "CpuBackend", "cuda": "CudaBackend", "npu": "NpuBackend"}
SHAPE = ("__init__.py", "backend.py", "device.py")


@pytest.mark.parametrize("name", sorted(IN_TREE))
def test_package_has_the_shape(name: str) -> None:
    package = BACKENDS / name / f"hwsync_{name}"
    missing = [f for f in SHAPE if not (package / f).is_file()]
    assert not missing, f"{package} lacks {missing} (see docs/backends.md)"


@pytest.mark.parametrize("name", sorted(IN_TREE))
def test_entry_point_names_the_backend_module(name: str) -> None:
    (ep,) = entry_points(group="hwsync.backends", name=name)
    assert ep.value == f"hwsync_{name}.backend:{IN_TREE[name]}", (
        f"{ep.value}: reinstall with `pip install -e backends/{name}`")


@pytest.mark.parametrize("name", sorted(IN_TREE))
def test_every_lazy_name_resolves(name: str) -> None:
    package = importlib.import_module(f"hwsync_{name}")
    assert IN_TREE[name] in package.__all__
    for attr in package.__all__:
        assert getattr(package, attr) is not None
    with pytest.raises(AttributeError, match="no attribute 'Nonexistent'"):
        package.Nonexistent  # noqa: B018


def test_package_imports_pull_in_neither_torch_nor_the_core() -> None:
    code = ("import sys, hwsync_cpu, hwsync_cuda, hwsync_npu\n"
            "print(sorted(m for m in ('torch', 'hwsync', 'torch_npu') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"a backend package imported {done.stdout.strip()} at import"
