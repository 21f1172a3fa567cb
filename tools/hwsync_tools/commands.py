"""`hwsync bench ...`, added to the `hwsync` command by the `hwsync.commands` entry point (tools/pyproject.toml)."""

from __future__ import annotations

import argparse
import importlib

#: bench -> (module, function adding its arguments, function running it, help)
BENCHES = {
    "transfer": ("hwsync_tools.bench.transfer", "add_bench_transfer_arguments", "run_bench_transfer",
                 "process to process: hwsync vs stop-and-wait vs memory copy (--peer verl: vs verl's sender)"),
    "tensors": ("hwsync_tools.bench.tensors", "add_bench_tensors_arguments", "run_bench_tensors",
                "per-tensor costs: the same bytes in many tensors against few, synced in turns"),
    "vllm": ("hwsync_tools.bench.vllm", "add_bench_vllm_arguments", "run_bench_vllm",
             "into a vLLM engine: hwsync vs safetensors reload vs in-process load_weights"),
    "broadcast": ("hwsync_tools.bench.broadcast", "add_bench_broadcast_arguments", "run_bench_broadcast",
                  "collective: 1 or striped senders to N receivers"),
    "delta": ("hwsync_tools.bench.delta", "add_bench_delta_arguments", "run_bench_delta",
              "full against delta syncs of a ~300M model trained for real, between two hosts of the bed"),
    "pause": ("hwsync_tools.bench.pause", "add_bench_pause_arguments", "run_bench_pause",
              "how long a sync stops a serving vLLM engine under load: staged against streamed"),
    "delta-codec": ("hwsync_tools.bench.delta_codec", "add_bench_delta_codec_arguments", "run_bench_delta_codec",
                    "the delta codec alone: diff, apply and digest against one read of the tensors"),
}


def add_bench(sub: argparse._SubParsersAction, argv: list[str]) -> None:
    """Add `bench` and its benches to the `hwsync` subcommands `sub`; `argv` (after `hwsync`) names the one to run."""
    bench = sub.add_parser("bench", help="benchmarks that print a table (or --json)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, add, run, help_text) in BENCHES.items():
        parser = bench_sub.add_parser(name, help=help_text)
        parser.set_defaults(_run=(module, run))
        # only the chosen bench's module is imported: some pull in vLLM, which takes seconds
        if argv[:2] == ["bench", name]:
            getattr(importlib.import_module(module), add)(parser)
