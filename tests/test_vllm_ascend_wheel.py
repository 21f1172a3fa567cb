"""Does `weight_transfer_config={"backend": "hwsync"}` reach hwsync on vllm-ascend? Read from the real wheel.

vllm-ascend cannot run here (no NPU, no CANN), so its sources are read statically: the wheel is a
zip, its worker and weight-transfer modules are parsed with ast, nothing is imported. hwsync's
own vLLM engine is parsed too (importing it needs vLLM). docs/ascend.md states what this found.
The wheel is fetched by ci/fetch-vllm-ascend.sh into .cache/vllm-ascend/ (25 MB), vllm-ascend main's
worker.py as tests/npu_vllm_ascend.py says; without them, and no way to download them, these tests
skip with that reason. tests/test_vllm_ascend_worker.py runs the worker's weight-update methods.
"""

from __future__ import annotations

import ast
import os
import zipfile

import npu_vllm_ascend
import pytest

from hwsync.integrations.vllm import ascend
from hwsync.integrations.vllm.worker import HwsyncWorkerExtension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = npu_vllm_ascend.CACHE
VERSION = npu_vllm_ascend.RELEASE  # the release docs/ascend.md was checked against (pairs with vLLM 0.26.0)
WORKER = npu_vllm_ascend.WORKER


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    found = npu_vllm_ascend.release_wheel()
    if found is None:
        pytest.skip(f"vllm-ascend {VERSION} wheel not in {CACHE} and could not be fetched (ci/fetch-vllm-ascend.sh)")
    with zipfile.ZipFile(found) as zf:
        yield zf


def _tree(zf: zipfile.ZipFile, path: str) -> ast.Module:
    return ast.parse(zf.read(path).decode("utf-8"), filename=path)


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(fn: ast.AST, callee: str) -> list[ast.Call]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func) == callee]


def test_the_npu_platform_runs_vllm_ascends_own_worker(wheel):
    platform = ast.unparse(_tree(wheel, "vllm_ascend/platform.py"))
    assert "parallel_config.worker_cls = 'vllm_ascend.worker.worker.NPUWorker'" in platform  # ast.unparse quotes


def test_the_npu_worker_builds_the_engine_through_vllms_factory_with_hwsyncs_arguments(wheel):
    load_model = _method(_tree(wheel, WORKER), "NPUWorker", "load_model")
    (call,) = _calls(load_model, "WeightTransferEngineFactory.create_engine")
    assert [ast.unparse(a) for a in call.args] == ["self.vllm_config.weight_transfer_config", "self.vllm_config",
                                                   "self.device", "self.model_runner.get_model()"]
    # what hwsync's engine takes (vLLM's WeightTransferEngine contract since 0.26): the same four
    with open(os.path.join(ROOT, "hwsync", "integrations", "vllm", "engine.py"), encoding="utf-8") as f:
        engine = ast.parse(f.read())
    init = _method(engine, "HwsyncWeightTransferEngine", "__init__")
    assert [a.arg for a in init.args.args] == ["self", "config", "vllm_config", "device", "model"]


def test_vllm_ascends_factory_patch_replaces_only_nccl_and_ipc(wheel):
    # so the "hwsync" entry hwsync's vllm.general_plugins entry point registers stays hwsync's
    patch = _tree(wheel, "vllm_ascend/patch/platform/patch_weight_transfer_engine.py")
    replaced = [ast.unparse(t.slice) for n in patch.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "WeightTransferEngineFactory._registry"]
    assert replaced == ["'nccl'", "'ipc'"]
    register = _tree(wheel, "vllm_ascend/distributed/weight_transfer/__init__.py")
    added = [ast.literal_eval(c.args[0]) for c in _calls(register, "WeightTransferEngineFactory.register_engine")]
    assert added == ["hccl", "npu_ipc"]


def _delegates(tree: ast.Module) -> None:
    """Assert that NPUWorker's weight-update door leaves the update to its engine, as vLLM's worker does."""
    update = _method(tree, "NPUWorker", "update_weights")
    receives = _calls(update, "self.weight_transfer_engine.receive_weights")
    assert _calls(update, "self.weight_transfer_engine.update_weights") or (
        receives and all(not c.keywords and len(c.args) == 1 for c in receives)), \
        "update_weights hands the update to the engine (engine.update_weights(info), or receive_weights(info) only)"
    for name in ("start_weight_update", "finish_weight_update"):
        method = _method(tree, "NPUWorker", name)
        assert _calls(method, f"self.weight_transfer_engine.{name}"), f"NPUWorker.{name} delegates to the engine"
        assert not [c for c in ast.walk(method) if isinstance(c, ast.Call) and "layerwise_reload" in ast.unparse(c.func)
                    ], f"NPUWorker.{name} runs vLLM's layerwise reload itself"


@pytest.mark.xfail(strict=True, reason="vllm-ascend 0.26.0rc1's NPUWorker drives its engines by an older contract: "
                   "it owns the layerwise reload (start/finish) and calls receive_weights(info, load_weights=...); "
                   "hwsync's engine takes that too (tests/test_vllm_ascend_worker.py). When this passes, a vllm-ascend "
                   "release delegates as vLLM does (its main branch has since #12876): update docs/ascend.md and the "
                   "pinned release, and drop the xfail")
def test_the_npu_worker_drives_the_engine_by_vllms_contract(wheel):
    _delegates(_tree(wheel, WORKER))


def test_vllm_ascend_main_drives_the_engine_by_vllms_contract():
    # the same check against vllm-ascend main: it passes there, so the strict xfail above flips once a release has it
    source = npu_vllm_ascend.main_worker()
    if source is None:
        pytest.skip(f"vllm-ascend main's worker.py at {npu_vllm_ascend.MAIN_COMMIT} is not in {CACHE} and could not be "
                    "fetched (HWSYNC_VLLM_ASCEND_GIT=<a clone's .git>, or GitHub)")
    _delegates(ast.parse(source))


def test_the_nz_settings_hwsync_reads_are_vllm_ascends(wheel):
    # ascend.py reads weight_nz_mode from get_ascend_config(), the variable VLLM_ASCEND_ENABLE_NZ, is_310p(), and
    # quotes the worker's own refusal
    config = _tree(wheel, "vllm_ascend/ascend_config.py")
    assert any(isinstance(n, ast.FunctionDef) and n.name == "get_ascend_config" for n in config.body)
    assert "self.weight_nz_mode" in {ast.unparse(t) for n in ast.walk(config) if isinstance(n, ast.Assign)
                                     for t in n.targets}
    assert f"'{ascend.NZ_ENV}'" in ast.unparse(_tree(wheel, "vllm_ascend/envs.py"))
    utils = _tree(wheel, "vllm_ascend/utils.py")
    assert any(isinstance(n, ast.FunctionDef) and n.name == "is_310p" for n in utils.body)
    worker = wheel.read(WORKER).decode()
    assert " ".join(ascend.NZ_REASON.split()[:4]) in worker and "precision issues in the RL scenarios" in worker
    nz_check = ast.unparse(_method(_tree(wheel, WORKER), "NPUWorker", "_check_nz_disabled"))
    assert f"envs_ascend.{ascend.NZ_ENV}" in nz_check  # the variable the extension defaults to 0


def test_the_extension_mixes_into_npu_worker_without_a_clash(wheel):
    # vLLM refuses an extension one of whose attributes the worker class already has (worker_base.py, init_worker)
    klass = next(n for n in _tree(wheel, WORKER).body if isinstance(n, ast.ClassDef) and n.name == "NPUWorker")
    worker_names = {n.name for n in klass.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    worker_names |= {ast.unparse(t).removeprefix("self.") for n in ast.walk(klass) if isinstance(n, ast.Assign)
                     for t in n.targets}
    ours = {a for a in dir(HwsyncWorkerExtension) if not a.startswith("__")}
    assert ours and not ours & worker_names, ours & worker_names
