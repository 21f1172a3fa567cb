"""Tiny float32 models of the families the vLLM tests sync, built from transformers configs.

Each is small enough for a vLLM engine to start in seconds on a CPU (hidden 256, 2 layers,
vocab 1024, 4 experts where there are experts), with weights drawn from a seed and an
initializer range large enough for peaked logits (greedy tokens that say something).
"""

from __future__ import annotations

import os
from typing import Any

import torch

COMMON: dict[str, Any] = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=1024, max_position_embeddings=256, initializer_range=0.1)

#: family -> (transformers model class, config class, family-specific config)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(intermediate_size=512, tie_word_embeddings=False)),
    "qwen2_tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(intermediate_size=512, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(intermediate_size=512, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                       head_dim=64, norm_topk_prob=True, tie_word_embeddings=False)),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(intermediate_size=512, head_dim=64, tie_word_embeddings=True)),
}


def build(family: str, seed: int) -> torch.nn.Module:
    """The family's model with random float32 weights drawn from `seed`."""
    import transformers

    model_cls, config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    model.config.torch_dtype = "float32"  # the engine then loads float32, as the tests compare
    return model


def save(family: str, seed: int, path: str) -> torch.nn.Module:
    """Build with `seed` and save as safetensors under `path`; returns the model."""
    model = build(family, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return model


def with_wrong_shape(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The model with its last layer's last 2-D-or-more parameter one row longer; returns it and that name."""
    name, param = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and ".layers." in n][-1]
    shape = list(param.shape)
    shape[-2] += 1
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(torch.zeros(shape)))
    return model, name
