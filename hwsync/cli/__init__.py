"""The `hwsync` command: info, roundtrip, demo (with its toy model), and what other installed distributions add
through the `hwsync.commands` entry points (hwsync-tools, in tools/ of this repository: `hwsync bench ...`)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from importlib.metadata import EntryPoint, entry_points

# subcommand -> (module, function adding its arguments or None, function running it, help)
_COMMANDS = {
    "demo": ("hwsync.cli.demo", "add_demo_arguments", "run_demo", "a small RL loop: trainer -> hwsync -> real vLLM"),
}
#: the entry point group through which another distribution adds a subcommand: each names a function
#: (subparsers of `hwsync`, the command line after `hwsync`) -> None that adds its parser, whose default `_run` is
#: (module, function running it), and imports only what the command line chose
COMMANDS_GROUP = "hwsync.commands"
#: the commands of this distribution
_CORE = ("info", "roundtrip", *_COMMANDS)
#: the commands of this repository's other distributions: (help, distribution, how to install it where it is missing)
_ELSEWHERE = {"bench": ("benchmarks that print a table (or --json)", "hwsync-tools", "pip install -e tools")}


def plugin_commands() -> dict[str, EntryPoint]:
    """The commands that installed distributions add (entry points in COMMANDS_GROUP), by name."""
    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


def _add_unavailable(sub: argparse._SubParsersAction, name: str, help_text: str, why: str) -> None:
    """A parser for command `name` that cannot run here: choosing it prints `why` (one line) and fails."""
    sub.add_parser(name, help=help_text, description=why).set_defaults(_unavailable=why)


def _add_plugins(sub: argparse._SubParsersAction, argv: list[str]) -> None:
    plugins = {name: ep for name, ep in plugin_commands().items() if name not in _CORE}
    for name, ep in plugins.items():
        try:
            add = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin is reported when it is asked for, never a crash
            _add_unavailable(sub, name, f"[does not load: {type(exc).__name__}]",
                             f"hwsync {name}: its entry point {ep.name} = {ep.value} ({COMMANDS_GROUP}) does not "
                             f"load: {type(exc).__name__}: {exc}")
            continue
        add(sub, argv)  # what the chosen command imports fails loudly, as a core command's would
    for name, (help_text, dist, install) in _ELSEWHERE.items():
        if name not in plugins:
            _add_unavailable(sub, name, f"{help_text} [not installed: {install}]",
                             f"hwsync {name}: the {dist} distribution is not installed here; from the root of a "
                             f"hwsync checkout: {install}")


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
    if argv[:1] not in ([c] for c in _CORE):  # a core command needs no other distribution's code
        _add_plugins(sub, argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(argv)
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 1
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
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
