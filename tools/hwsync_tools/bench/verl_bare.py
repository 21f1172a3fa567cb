"""verl's transfer code where verl is installed without its dependencies (`pip install --no-deps verl`).

A GPU machine with no package registry takes wheels carried along, and verl's own dependencies
(ray's wheel alone is larger than all that may travel) stay behind. verl's package __init__ and
its rollout utils import ray, omegaconf and fastapi, but the colocated transfer module needs only
verl's device and platform modules, one helper (`ensure_async_iterator`) and one default (the
checkpoint engine's bucket size). So where `import verl` fails for a missing dependency, verl's
packages are registered bare (their __init__ not run), the helper is compiled from verl's own
source alone, and the default is read from verl's source: verl's code runs unmodified, none of
it replaced. Where verl imports whole (ci/setup-verl.sh's venv), it is used as it is.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import sys
import types

_BARE_PACKAGES = ("verl", "verl.utils", "verl.workers", "verl.workers.rollout", "verl.workers.rollout.vllm_rollout")


def import_verl() -> types.ModuleType:
    """The verl package: imported whole where its dependencies are installed, else registered bare."""
    try:
        import verl

        return verl
    except ImportError as exc:
        missing = exc.name or str(exc)
    for name in [n for n in sys.modules if n == "verl" or n.startswith("verl.")]:
        del sys.modules[name]  # what the failed import left half-made
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("hwsync bench transfer --peer verl needs verl: pip install 'hwsync[verl]'")
    root = list(spec.submodule_search_locations)[0]
    for name in _BARE_PACKAGES:
        module = types.ModuleType(name, f"verl's package {name}, registered without running its __init__")
        module.__path__ = [os.path.join(root, *name.split(".")[1:])]
        module.__package__ = name
        sys.modules[name] = module
    verl = sys.modules["verl"]
    verl.__file__ = os.path.join(root, "__init__.py")
    verl.__version__ = importlib.metadata.version("verl")  # type: ignore[attr-defined]
    verl.bare_because = f"verl's dependencies are not installed ({missing})"  # type: ignore[attr-defined]
    _rollout_utils(os.path.join(root, "workers", "rollout", "utils.py"))
    return verl


def _function_source(path: str, name: str) -> ast.Module:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    if not found:
        raise SystemExit(f"verl's {path} has no {name}(); this verl differs from 0.9.1: install its dependencies")
    return ast.Module(body=list[ast.stmt](found), type_ignores=[])


def _rollout_utils(path: str) -> None:
    # the transfer module imports ensure_async_iterator from here; the rest of the file needs ray and fastapi
    module = types.ModuleType("verl.workers.rollout.utils", "ensure_async_iterator alone, compiled from verl's source")
    module.__file__ = path
    exec(compile(_function_source(path, "ensure_async_iterator"), path, "exec"), module.__dict__)
    sys.modules[module.__name__] = module


def default_bucket_mb() -> int:
    """verl's default update_weights_bucket_megabytes (CheckpointEngineConfig), from its class or its source."""
    verl = import_verl()
    if not hasattr(verl, "bare_because"):
        from verl.workers.config import CheckpointEngineConfig

        return int(CheckpointEngineConfig().update_weights_bucket_megabytes)
    path = os.path.join(os.path.dirname(str(verl.__file__)), "workers", "config", "rollout.py")
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "CheckpointEngineConfig":
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and item.target.id == "update_weights_bucket_megabytes"
                        and isinstance(item.value, ast.Constant) and isinstance(item.value.value, int)):
                    return int(item.value.value)
    raise SystemExit(f"verl's {path} has no CheckpointEngineConfig.update_weights_bucket_megabytes default")
