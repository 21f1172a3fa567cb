"""A small random Llama and a vLLM engine on it: what the demo, the benchmark and the tests share.

Nothing is downloaded: the model is built from a `transformers.LlamaConfig` with random weights
and saved as safetensors. Outputs are compared as greedy tokens plus the prompt logprobs of a
fixed token sequence (`prompt_logprobs=0` gives exactly the logprob of each given token).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

#: the fixed sequence whose prompt logprobs are compared (ids < every toy vocab size)
PROMPT_TOKENS = [1, 17, 42, 99, 123, 256, 311, 7, 64, 500, 33, 8]


@dataclass(frozen=True)
class ToyModel:
    """Sizes of a Llama built from a config; the defaults start in seconds on a laptop CPU."""

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 1024
    max_positions: int = 256
    # larger than HF's 0.02 so that logits are peaked and greedy tokens say something
    init_range: float = 0.1

    def config(self) -> Any:
        """The transformers LlamaConfig (head_dim = hidden / heads)."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           num_hidden_layers=self.layers, vocab_size=self.vocab,
                           max_position_embeddings=self.max_positions, initializer_range=self.init_range,
                           tie_word_embeddings=False, torch_dtype="float32")

    def build(self, seed: int) -> torch.nn.Module:
        """A LlamaForCausalLM with random float32 weights drawn from `seed`."""
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        model = LlamaForCausalLM(self.config()).float().eval()
        return model

    def save(self, path: str, seed: int) -> torch.nn.Module:
        """Build with `seed`, save as safetensors under `path`, return the model."""
        model: Any = self.build(seed)  # a transformers LlamaForCausalLM
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        return model


def param_count(model: torch.nn.Module) -> int:
    """Number of parameters (tied ones once)."""
    return sum(p.numel() for p in model.parameters())


@dataclass
class EngineOutputs:
    """Greedy continuation and the logprob of each prompt token after the first."""

    tokens: list[int]
    prompt_logprobs: list[float] = field(default_factory=list)

    def max_logprob_diff(self, other: "EngineOutputs | list[float]") -> float:
        """Largest absolute difference of prompt logprobs."""
        theirs = other.prompt_logprobs if isinstance(other, EngineOutputs) else other
        return max(abs(a - b) for a, b in zip(self.prompt_logprobs, theirs, strict=True))


def engine_kwargs(model_dir: str, *, extension: bool = True, max_model_len: int = 256) -> dict[str, Any]:
    """LLM(...) arguments for a tokenizer-less float32 engine with hwsync's worker extension."""
    from hwsync.integrations.vllm import EXTENSION

    kwargs: dict[str, Any] = dict(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                                  max_model_len=max_model_len, enforce_eager=True, max_num_seqs=8)
    if extension:
        kwargs["worker_extension_cls"] = EXTENSION
    return kwargs


def engine_outputs(llm: Any, max_tokens: int = 8, prompt: list[int] | None = None,
                   lora_request: Any = None) -> EngineOutputs:
    """Greedy tokens and prompt logprobs of the fixed prompt from a vllm.LLM (under a LoRA adapter if given)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = prompt or PROMPT_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, prompt_logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False, lora_request=lora_request)[0]
    logprobs = [entry[token].logprob for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True)]
    return EngineOutputs(list(out.outputs[0].token_ids), logprobs)


@torch.no_grad()
def model_prompt_logprobs(model: torch.nn.Module, prompt: list[int] | None = None) -> list[float]:
    """The trainer model's own logprob of each prompt token after the first (float32)."""
    prompt = prompt or PROMPT_TOKENS
    ids = torch.tensor([prompt])
    logits = model(input_ids=ids).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()


#: how long an engine's shutdown lets its core exit by itself before killing it. vLLM's default (5 s) is as long as
#: the core waits for its worker's exit, and on a loaded machine the worker takes that long: the core is then killed
#: before it unlinks its message queue's shared memory (a psm_* segment left in /dev/shm)
ENGINE_EXIT_S = 60.0


def shutdown_engine(llm: Any) -> None:
    """Stop an engine so that another can start in this process (vLLM keeps global state)."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown(timeout=ENGINE_EXIT_S)  # returns once the core has exited
    del llm, engine, core
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001 - best effort: a later engine start reports what is really wrong
        pass


def cpu_engine_env() -> None:
    """Settings a vLLM engine needs on a CPU-only machine (no effect elsewhere), and a private directory for its
    ipc files (`private_ipc_dir`); keeps existing ones."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    private_ipc_dir()


#: a vLLM ipc socket's name: a uuid4 (36 characters)
UUID_CHARS = "u" * 36


def private_ipc_dir() -> str:
    """Point vLLM's ZeroMQ ipc files (VLLM_RPC_BASE_PATH) at a directory that goes when this process exits.

    vLLM makes them in the temporary directory and an engine that stops leaves some behind (7 sockets per
    `hwsync demo`, from its three engines). A path the user set is kept, and left to them; so is vLLM's default
    where the directory's name would make a socket's path longer than a socket address holds (107 bytes).
    """
    path = os.environ.get("VLLM_RPC_BASE_PATH")
    if path is None and len(os.path.join(tempfile.gettempdir(), "hwsync-ipc-12345678", UUID_CHARS)) <= 107:
        path = tempfile.mkdtemp(prefix="hwsync-ipc-")
        os.environ["VLLM_RPC_BASE_PATH"] = path  # the engine's own processes inherit it
        atexit.register(shutil.rmtree, path, True)
    return path or tempfile.gettempdir()
