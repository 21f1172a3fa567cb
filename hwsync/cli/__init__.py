"""The `hwsync` command: info, roundtrip, demo (with its toy model) and the benchmarks in bench/."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> (module, function adding its arguments or None, function running it, help)
_COMMANDS = {
    "demo": ("hwsync.cli.demo", "add_demo_arguments", "run_demo", "a small RL loop: trainer -> hwsync -> real vLLM"),
}
_BENCHES = {
    "transfer": ("hwsync.cli.bench.transfer", "add_bench_transfer_arguments", "run_bench_transfer",
                 "process to process: hwsync vs stop-and-wait vs memory copy (--peer verl: vs verl's sender)"),
    "vllm": ("hwsync.cli.bench.vllm", "add_bench_vllm_arguments", "run_bench_vllm",
             "into a vLLM engine: hwsync vs safetensors reload vs in-process load_weights"),
    "broadcast": ("hwsync.cli.bench.broadcast", "add_bench_broadcast_arguments", "run_bench_broadcast",
                  "collective: 1 or striped senders to N receivers"),
    "delta": ("hwsync.cli.bench.delta", "add_bench_delta_arguments", "run_bench_delta",
              "full against delta syncs of a ~300M model trained for real, between two hosts of the bed"),
    "delta-codec": ("hwsync.cli.bench.delta_codec", "add_bench_delta_codec_arguments", "run_bench_delta_codec",
                    "the delta codec alone: diff, apply and digest against one read of the tensors"),
}


def _add_lazy(sub: argparse._SubParsersAction, name: str, spec: tuple[str, str, str, str], chosen: bool) -> None:
    module, add, run, help_text = spec
    parser = sub.add_parser(name, help=help_text)
    parser.set_defaults(_run=(module, run))
    # only the chosen command's module is imported: some pull in vLLM, which takes seconds
    if chosen:
        getattr(importlib.import_module(module), add)(parser)


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hwsync", description="Weight sync from trainers into inference engines.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="selected backend and why; installed backends; devices; transports")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    roundtrip = sub.add_parser("roundtrip", help="send tensors to another process and verify them")
    roundtrip.add_argument("--megabytes", type=float, default=64.0, help="size of the tensors sent")
    roundtrip.add_argument("--json", action="store_true", help="machine-readable output")
    for name, spec in _COMMANDS.items():
        _add_lazy(sub, name, spec, argv[:1] == [name])
    bench = sub.add_parser("bench", help="benchmarks that print a table (or --json)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, spec in _BENCHES.items():
        _add_lazy(bench_sub, name, spec, argv[:2] == ["bench", name])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(argv).parse_args(argv)
    if args.command == "info":
        from hwsync.cli.info import run_info

        return run_info(args.json)
    if args.command == "roundtrip":
        from hwsync.cli.roundtrip import run_roundtrip

        return run_roundtrip(args.megabytes, args.json)
    # Select the backend once, before any child process starts: the resolved name is written to
    # HWSYNC_BACKEND, so engines and workers agree and a cpu fallback is reported only here.
    from hwsync.backend.registry import get_backend
    from hwsync.errors import BackendError

    try:
        get_backend()
    except BackendError as exc:
        print(f"hwsync: {exc}", file=sys.stderr)
        return 1
    module, run = args._run
    return int(getattr(importlib.import_module(module), run)(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
