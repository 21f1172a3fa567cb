"""What hwsync's colocated mode needs of verl's private code, checked before anything is replaced.

verl (0.9.x) has no setting that selects the sender of its colocated (hybrid) mode: the vLLM
`ServerAdapter` is looked up in a private registry and drives its own sender. hwsync replaces
that class, so it depends on names verl does not promise to keep. `check_verl()` reads verl's
own source files (parsed, never executed) and raises `VerlMismatchError` naming every name that
moved, with the verl version, before hwsync changes anything: a verl that moved them fails
loudly instead of silently running verl's own sender. `VERL_TESTED` is the range tested;
outside it the check still runs and refuses unless HWSYNC_VERL_UNTESTED=1 says to try anyway.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hwsync.errors import HwsyncError

#: the verl releases hwsync's colocated mode was tested against
VERL_TESTED = SpecifierSet(">=0.9.1,<0.10")
#: set to 1 to run an untested verl whose private names all check out
UNTESTED_ENV = "HWSYNC_VERL_UNTESTED"


class VerlMismatchError(HwsyncError, RuntimeError):
    """verl's private code is not what hwsync's colocated mode replaces: nothing was replaced."""


@dataclass(frozen=True)
class Need:
    """One private name: `what` in `module` (a class, `Class.method`, or a module-level name), and why."""

    module: str
    what: str
    why: str
    #: parameters the function must take (names), or keywords a call inside it must pass (see `calls`)
    params: tuple[str, ...] = ()
    #: for a function: the attribute call (e.g. "self.rollout.update_weights") that must pass `params`
    calls: str | None = None


NEEDS: tuple[Need, ...] = (
    Need("verl.workers.rollout.base", "_ROLLOUT_REGISTRY",
         "the registry get_rollout_class reads; hwsync points its ('vllm', 'async') entry at its adapter"),
    Need("verl.workers.rollout.base", "get_rollout_class", "how the trainer worker finds the rollout class"),
    Need("verl.workers.config.model", "HFModelConfig.__post_init__",
         "imports actor_rollout_ref.model.external_lib (this module) in each worker", calls="import_external_libs"),
    Need("verl.workers.engine_workers", "ActorRolloutRefWorker.update_weights",
         "verl's colocated update: it calls the rollout's update_weights with these keywords",
         ("peft_config", "base_sync_done", "global_steps"), calls="self.rollout.update_weights"),
    Need("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter", "the class hwsync's adapter subclasses"),
    Need("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter.__init__",
         "sets the attributes the adapter reads", ("config", "model_config", "device_mesh", "replica_rank")),
    Need("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter._ensure_server_handle",
         "finds the vLLM server actor of this replica (only the replica's first rank has one)", ("self",)),
    Need("verl.workers.rollout.vllm_rollout.vllm_rollout", "ServerAdapter.update_weights",
         "the call hwsync's adapter replaces", ("weights", "global_steps", "wire_format")),
    Need("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.collective_rpc",
         "drives vLLM's weight-transfer lifecycle (init, start, update, finish) on every worker",
         ("method", "timeout", "args", "kwargs")),
    Need("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.clear_kv_cache",
         "called after an update, as verl's adapter does", ("self",)),
    Need("verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.set_global_steps",
         "called after an update, as verl's adapter does", ("global_steps",)),
    Need("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension.update_weights_from_ipc",
         "verl's own receiver, which hwsync's worker extension guards", ("peft_config", "base_sync_done", "use_shm")),
    Need("verl.workers.rollout.vllm_rollout.utils", "vLLMColocateWorkerExtension._get_zmq_handle",
         "where verl's sender binds; the guard drains verl's update from there", ("self",)),
    Need("verl.workers.rollout.vllm_rollout.bucketed_weight_transfer", "BucketedWeightReceiver.receive_weights",
         "verl's receiver, which the guard drains verl's update with", ("on_bucket_received",)),
    Need("verl.workers.rollout.vllm_rollout.utils", "VLLM_LORA_INT_ID", "the adapter id verl's generate requests"),
    Need("verl.workers.rollout.vllm_rollout.utils", "VLLM_LORA_NAME", "the adapter name verl's generate requests"),
)


def verl_version() -> str:
    """The installed verl's version."""
    return importlib.metadata.version("verl")


def _tree(module: str, cache: dict[str, ast.Module]) -> ast.Module | None:
    if module not in cache:
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            return None
        with open(spec.origin, encoding="utf-8") as f:
            cache[module] = ast.parse(f.read(), spec.origin)
    return cache[module]


def _find(body: list[ast.stmt], name: str) -> ast.AST | None:
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
    return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fn.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}


def _call_keywords(fn: ast.AST, callee: str) -> set[str] | None:
    """Keywords passed by calls to `callee` (dotted) inside fn, or None if it makes no such call."""
    found: set[str] | None = None
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == callee:
            found = (found or set()) | {k.arg for k in node.keywords if k.arg}
    return found


def problem(need: Need, cache: dict[str, ast.Module]) -> str | None:
    """Why `need` is not met by the installed verl, or None."""
    tree = _tree(need.module, cache)
    if tree is None:
        return f"module {need.module} is missing"
    node: ast.AST | None = None
    body = tree.body
    for part in need.what.split("."):
        node = _find(body, part)
        if node is None:
            return f"{need.module}.{need.what} is missing"
        body = getattr(node, "body", [])
    assert node is not None  # the loop above returned otherwise
    if need.calls is not None:
        keywords = _call_keywords(node, need.calls)
        if keywords is None:
            return f"{need.module}.{need.what} no longer calls {need.calls}"
        lacking = [p for p in need.params if p not in keywords]
        return f"{need.module}.{need.what} calls {need.calls} without {lacking}" if lacking else None
    if need.params:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{need.module}.{need.what} is no longer a function"
        lacking = [p for p in need.params if p not in _params(node)]
        return f"{need.module}.{need.what} takes no {lacking}" if lacking else None
    return None


def check_verl() -> str:
    """Raise VerlMismatchError unless the installed verl has every name in NEEDS (and is tested); its version."""
    try:
        version = verl_version()
    except importlib.metadata.PackageNotFoundError:
        raise VerlMismatchError("hwsync.integrations.verl.colocated needs verl: pip install 'hwsync[verl]'") from None
    cache: dict[str, ast.Module] = {}
    problems = [f"{p} ({n.why})" for n in NEEDS if (p := problem(n, cache)) is not None]
    if problems:
        raise VerlMismatchError(
            f"verl {version} does not have what hwsync's colocated adapter replaces: " + "; ".join(problems)
            + f". Nothing was replaced. Use verl {VERL_TESTED} (tested), or drop actor_rollout_ref.model."
            "external_lib=hwsync.integrations.verl.colocated and its engine_kwargs to run verl's own sender")
    if Version(version) not in VERL_TESTED and os.environ.get(UNTESTED_ENV) != "1":
        raise VerlMismatchError(
            f"verl {version} is outside the range hwsync's colocated adapter was tested with ({VERL_TESTED}); its "
            f"private names all check out, so set {UNTESTED_ENV}=1 to try it, or use a tested verl")
    return version
