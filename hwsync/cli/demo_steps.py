"""What both demo loops (`hwsync demo`, `hwsync demo --lora`) run each step: sampling rollouts from the
engine, REINFORCE on the toy reward in the trainer, and the progress bar.

Its own module so that demo.py and demo_lora.py both import it and neither imports the other.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from hwsync.cli.toy_model import PROMPT_TOKENS


def progress_bar(total: int, desc: str = "hwsync demo") -> Any:
    """A tqdm bar on stderr, or None without tqdm."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, leave=False)
    except ImportError:  # tqdm comes with vLLM; without it the table alone says where we are
        return None


def rollouts(llm: Any, step: int, samples: int, lora_request: Any = None) -> list[list[int]]:
    """`samples` sampled completions of the fixed prompt (under a LoRA adapter if given)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=samples, temperature=1.0, max_tokens=8, seed=step, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT_TOKENS)], params, use_tqdm=False,
                       lora_request=lora_request)[0]
    return [list(c.token_ids) for c in out.outputs]


def reinforce(model: torch.nn.Module, optimizer: torch.optim.Optimizer, completions: list[list[int]],
               vocab: int, inner_steps: int) -> float:
    """A few policy-gradient steps on the toy reward; returns the mean reward of the rollouts."""
    rewards = torch.tensor([sum(t < vocab // 2 for t in c) / max(len(c), 1) for c in completions])
    advantages = rewards - rewards.mean()
    width = max(len(c) for c in completions)
    ids = torch.tensor([PROMPT_TOKENS + c + [0] * (width - len(c)) for c in completions])
    mask = torch.tensor([[1.0] * len(c) + [0.0] * (width - len(c)) for c in completions])
    start = len(PROMPT_TOKENS)
    model.train()
    for _ in range(inner_steps):
        logits = model(input_ids=ids[:, :-1]).logits[:, start - 1:]
        logprobs = torch.log_softmax(logits.float(), -1).gather(2, ids[:, start:, None])[..., 0]
        loss = -(advantages[:, None] * logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(rewards.mean())
