"""vllm-ascend's real sources for the tests, never committed: its release wheel and its main branch's worker.

- The wheel (`RELEASE`, 25 MB) comes from the registry through ci/fetch-vllm-ascend.sh into
  .cache/vllm-ascend/, as tests/test_vllm_ascend_wheel.py has always fetched it.
- vllm-ascend's main branch is on no registry: its worker.py at `MAIN_COMMIT` is read from
  .cache/vllm-ascend/main-<commit>/, filled once from a git clone or mirror of vllm-ascend named by
  HWSYNC_VLLM_ASCEND_GIT (`git --git-dir ... show`), else from GitHub's raw files.
Either missing, the caller skips with the reason. NPUWorker's weight-update methods are taken out of a
worker.py with ast and executed on a stand-in class (`npu_worker_class`): only the names listed in
`STUBBED` (hardware and vllm-ascend's config) are given stand-ins; anything else the methods would read
makes `npu_worker_class` raise, so a new dependency fails loudly instead of being faked.
"""

from __future__ import annotations

import ast
import builtins
import glob
import os
import subprocess
import types
import urllib.request
import zipfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.path.join(ROOT, ".cache", "vllm-ascend")
RELEASE = "0.26.0rc1"  # the newest release on the registry (pairs with vLLM 0.26.0)
#: vllm-ascend main after #12876 (9eabafb0c8, "Align weight transfer lifecycle with vLLM"), as docs/ascend.md read it
MAIN_COMMIT = "182b75ea84"
WORKER = "vllm_ascend/worker/worker.py"
RAW_URL = "https://raw.githubusercontent.com/vllm-project/vllm-ascend/{commit}/{path}"

#: NPUWorker's weight-update door, as vLLM's engine calls it (collective_rpc), and the checks it runs
METHODS = ("_check_weight_transfer_engine", "init_weight_transfer_engine", "_check_nz_disabled",
           "start_weight_update", "update_weights", "finish_weight_update")
#: the only module-level names of worker.py the methods may read, each a stand-in for hardware or config
STUBBED = ("torch", "envs_ascend", "get_ascend_config")


def release_wheel() -> str | None:
    """The cached vllm-ascend release wheel, fetched once (None when it cannot be)."""
    pattern = os.path.join(CACHE, f"vllm_ascend-{RELEASE}-*.whl")
    if not glob.glob(pattern):
        subprocess.run(["bash", os.path.join(ROOT, "ci", "fetch-vllm-ascend.sh"), RELEASE],
                       capture_output=True, timeout=600, check=False)
    found = sorted(glob.glob(pattern))
    return found[0] if found else None


def release_worker() -> str | None:
    """worker.py of the release wheel, or None."""
    wheel = release_wheel()
    if wheel is None:
        return None
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(WORKER).decode("utf-8")


def main_worker(commit: str = MAIN_COMMIT) -> str | None:
    """worker.py of vllm-ascend's main branch at `commit`, cached; None when no copy can be had."""
    path = os.path.join(CACHE, f"main-{commit}", WORKER)
    if not os.path.exists(path):
        text = _from_git(commit) or _from_github(commit)
        if text is None:
            return None
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    with open(path, encoding="utf-8") as f:
        return f.read()


def _from_git(commit: str) -> str | None:
    git_dir = os.environ.get("HWSYNC_VLLM_ASCEND_GIT")
    if not git_dir:
        return None
    done = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{WORKER}"], capture_output=True,
                          text=True, timeout=60, check=False)
    return done.stdout if done.returncode == 0 else None


def _from_github(commit: str) -> str | None:
    try:
        with urllib.request.urlopen(RAW_URL.format(commit=commit, path=WORKER), timeout=30) as response:
            return response.read().decode("utf-8")
    except OSError:
        return None


def worker_methods(source: str) -> list[ast.FunctionDef]:
    """NPUWorker's METHODS as defined in `source` (worker.py)."""
    tree = ast.parse(source, filename=WORKER)
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NPUWorker")
    found = {n.name: n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name in METHODS}
    missing = [m for m in METHODS if m not in found]
    if missing:
        raise LookupError(f"NPUWorker in this worker.py has no {missing}")
    return [found[m] for m in METHODS]


def free_names(functions: list[ast.FunctionDef]) -> set[str]:
    """The module-level names the functions read (not builtins, arguments, locals or their own imports)."""
    names: set[str] = set()
    for fn in functions:
        local: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                local |= {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
                local |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
                if not isinstance(node, ast.Lambda):
                    local.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                local.add(node.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                local |= {(a.asname or a.name).split(".")[0] for a in node.names}
        names |= {node.id for node in ast.walk(fn) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                  and node.id not in local and not hasattr(builtins, node.id)}
    return names


def npu_worker_class(source: str, stubs: dict[str, Any]) -> type:
    """A class holding NPUWorker's real METHODS from `source`, executed against `stubs` (a subset of STUBBED)."""
    functions = worker_methods(source)
    needed = free_names(functions)
    unknown = needed - set(STUBBED)
    if unknown:
        raise LookupError(f"NPUWorker's weight-update methods now read {sorted(unknown)}: give them a faithful "
                          "stand-in (hardware or config only) or run them for real")
    missing = needed - set(stubs)
    if missing:
        raise LookupError(f"no stand-in given for {sorted(missing)}")
    module = ast.parse("class NPUWorker:\n    pass\n")
    module.body[0].body = list(functions)  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {name: stubs[name] for name in needed}
    exec(compile(module, f"{WORKER} (NPUWorker's weight-update methods)", "exec"), namespace)
    return namespace["NPUWorker"]


class TorchWithNpu(types.ModuleType):
    """torch as worker.py sees it on an NPU host: the real torch, plus `torch.npu.synchronize` (recorded)."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("torch")
        self._real = real
        self.synchronized = 0
        self.npu = types.SimpleNamespace(synchronize=self._synchronize)

    def _synchronize(self) -> None:
        self.synchronized += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)
