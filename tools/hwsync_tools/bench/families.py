"""Float32 models of each family the vLLM tests cover, at a benchmark's sizes, built from transformers configs.

`hwsync bench vllm --family NAME` syncs one of these instead of the default Llama: the families differ in what the
engine's loader does with each tensor (tied heads, fused MoE experts, Gemma's norms), and issue 50 asks for the
sync against vLLM's own `reload_weights` on each. Experts take a quarter of `--intermediate` each, eight a layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

#: family -> (transformers model class, config class); the suite's tests sync the same ones (tests/vllm_families.py)
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "qwen2_tied": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config"),
}
#: experts a layer, for the MoE families
EXPERTS = 8


@dataclass(frozen=True)
class FamilyModel:
    """One family's model at these sizes (head_dim = hidden / heads)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int = 512
    # larger than HF's 0.02 so that logits are peaked and greedy tokens say something
    init_range: float = 0.1

    def config(self) -> Any:
        """The family's transformers config."""
        import transformers

        if self.family not in FAMILIES:
            raise ValueError(f"--family {self.family!r}: one of {', '.join(FAMILIES)}")
        common: dict[str, Any] = dict(hidden_size=self.hidden, num_hidden_layers=self.layers,
                                      num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                      vocab_size=self.vocab, max_position_embeddings=self.max_positions,
                                      initializer_range=self.init_range, torch_dtype="float32")
        head_dim = self.hidden // self.heads
        extra: dict[str, Any] = {
            "llama": dict(intermediate_size=self.intermediate, tie_word_embeddings=False),
            "qwen2_tied": dict(intermediate_size=self.intermediate, tie_word_embeddings=True),
            "qwen3_moe": dict(intermediate_size=self.intermediate, moe_intermediate_size=self.intermediate // 4,
                              num_experts=EXPERTS, num_experts_per_tok=2, head_dim=head_dim, norm_topk_prob=True,
                              tie_word_embeddings=False),
            "mixtral": dict(intermediate_size=self.intermediate // 4, num_local_experts=EXPERTS,
                            num_experts_per_tok=2, tie_word_embeddings=False),
            "gemma2": dict(intermediate_size=self.intermediate, head_dim=head_dim, tie_word_embeddings=True),
        }[self.family]
        _, config_cls = FAMILIES[self.family]
        return getattr(transformers, config_cls)(**common, **extra)

    def build(self, seed: int) -> torch.nn.Module:
        """The model with random float32 weights drawn from `seed`."""
        import transformers

        model_cls, _ = FAMILIES[self.family]
        torch.manual_seed(seed)
        model: torch.nn.Module = getattr(transformers, model_cls)(self.config()).float().eval()
        return model

    def save(self, path: str, seed: int) -> torch.nn.Module:
        """Build with `seed`, save as safetensors under `path`, return the model."""
        model: Any = self.build(seed)
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        return model
