"""`hwsync bench tensors`: the same bytes in many tensors against few, synced in turns in one run.

A sync of many small tensors (a mixture-of-experts model has ~18,000) is set by per-tensor costs, not by bytes.
This bench puts a figure on them that a shared, noisy machine does not move: two sender-and-receiver pairs stay up
side by side, one syncing the state dict as `--many` equal tensors, the other the same bytes as `--few`, and their
syncs take turns (which pair goes first swaps every round), on the packed path and then from hwsync's shared memory
(one-copy, by reference). A load that comes and goes weighs on both alike, and the figure is the median of each
round's own ratio many/few. Each pair's first sync on a path records the plan and is not timed; the later ones
replay it (docs/architecture.md, "Plan once, replay after"). Before every sync the sender writes new values into
its tensors in place, and each receiver checks, at the end, that it holds the last sync's values, so a replay that
skipped a tensor fails the run.

`--fresh`: each pair sends two copies of its tensors in turn, so no sync matches the last one's plan and every sync
is planned afresh, as the first sync of a model is and every sync of a trainer that gathers new tensors each step.
`--gc-baseline`: a third pair, as many tensors, whose two processes leave Python's collector alone
(HWSYNC_GC_HOLD=0: hwsync/sync/collector.py), syncing in turns with the others; the table adds its seconds and the
median of each round's ratio to the many-tensor pair's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import torch

from hwsync.sync.options import SenderOptions
from hwsync_tools.bench import tiny_defaults
from hwsync_tools.bench.transfer import model_spec
from hwsync_tools.bench.transfer_parts import Spec, build, load_copy_loop

if TYPE_CHECKING:  # for the annotations only: the methods import them where they use them
    from hwsync.colocated.sender import WeightSender
    from hwsync.sync.shared_params import SharedTensors

PATHS = ("packed", "one-copy")


def _fill(named: list[tuple[str, torch.Tensor]], sync: int) -> None:
    """Tensor i holds (i + sync) % 128 (exact in every dtype): every sync changes every tensor."""
    for i, (_, t) in enumerate(named):
        t.fill_(float((i + sync) % 128))


@contextmanager
def _collector_left_alone(yes: bool) -> Iterator[None]:
    """Within the block, with `yes`, hwsync leaves Python's collector alone in this process (HWSYNC_GC_HOLD=0)."""
    if not yes:
        yield
        return
    before = os.environ.get("HWSYNC_GC_HOLD")
    os.environ["HWSYNC_GC_HOLD"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HWSYNC_GC_HOLD"]
        else:
            os.environ["HWSYNC_GC_HOLD"] = before


def _receiver_main(endpoint: str, spec_json: str, syncs: int, threads: int, timeout_s: float,
                   conn: Connection, no_gc_hold: bool = False) -> None:
    """The spawned engine stand-in: `syncs` syncs straight `into` its tensors, then whether they hold the last one."""
    if no_gc_hold:
        os.environ["HWSYNC_GC_HOLD"] = "0"
    torch.set_num_threads(threads)
    from hwsync.colocated.receiver import WeightReceiver

    spec: Spec = json.loads(spec_json)
    load_copy_loop(len(spec), timeout_s)
    dest = {name: t.fill_(-1) for name, t in build(spec)}  # resident, like an engine's parameters
    error = None
    with WeightReceiver(endpoint, timeout_s=timeout_s) as rx:
        for _ in range(syncs):
            rx.receive(into=lambda name, dtype, shape: dest[name])
    for i, (name, _, _) in enumerate(spec):
        flat, want = dest[name].reshape(-1), float((i + syncs - 1) % 128)
        if flat.numel() and (float(flat[0]) != want or float(flat[-1]) != want):
            error = f"tensor {name} holds {float(flat[0])} after the last sync, expected {want}"
            break
    conn.send_bytes(json.dumps({"error": error}).encode())
    conn.close()


class _Pair:
    """One sender, its spawned receiver and its tensors (plain ones for packed syncs, shared ones for one-copy)."""

    def __init__(self, spec: Spec, args: argparse.Namespace, no_gc_hold: bool = False) -> None:
        self.spec, self.args, self.no_gc_hold = spec, args, no_gc_hold
        #: the tensors, sent in turn: two copies with --fresh (no sync is the last one's plan), else one
        self.sets = [build(spec) for _ in range(2 if args.fresh else 1)]
        self.named = self.sets[0]
        #: per path: each timed sync's seconds, and how many of them replayed the path's first sync's plan
        self.seconds: dict[str, list[float]] = {path: [] for path in PATHS}
        self.replayed = dict.fromkeys(PATHS, 0)
        self.syncs = 0
        self.shared: list[SharedTensors] = []
        self.sender: WeightSender | None = None
        self.conn: Connection | None = None
        self.proc: BaseProcess | None = None

    def start(self) -> None:
        """Start the sender and the receiver process."""
        from hwsync.colocated.sender import WeightSender

        self.sender = WeightSender(options=SenderOptions(timeout_s=self.args.timeout))
        self.conn, child = mp.Pipe(duplex=False)
        self.proc = mp.get_context("spawn").Process(
            target=_receiver_main, daemon=True,
            args=(self.sender.endpoint, json.dumps(self.spec), 2 * self.args.syncs, self.args.threads,
                  self.args.timeout, child, self.no_gc_hold))
        self.proc.start()
        child.close()

    def sync(self, path: str, first: bool) -> None:
        """One sync on `path`, with new values; timed unless it is the path's `first`."""
        if path == "one-copy" and not self.shared:
            from hwsync.backend.registry import get_backend
            from hwsync.sync.shared_params import SharedTensors

            self.shared = [SharedTensors(named, device=get_backend().device()) for named in self.sets]
        assert self.sender is not None, "start() first"
        which = self.syncs % len(self.sets)
        items = list(self.shared[which].items()) if path == "one-copy" else self.sets[which]
        _fill(items, self.syncs)
        with _collector_left_alone(self.no_gc_hold):
            stats = self.sender.send(items, version=self.syncs)
        self.syncs += 1
        if not first:
            self.seconds[path].append(stats.total_s)
            self.replayed[path] += "replay" in stats.notes

    def finish(self) -> str | None:
        """Close the sender; the receiver's verdict on the last sync."""
        assert self.sender is not None and self.conn is not None, "start() first"
        self.sender.close()
        if not self.conn.poll(self.args.timeout):
            return "the receiver said nothing after its last sync"
        error: str | None = json.loads(self.conn.recv_bytes())["error"]
        return error

    def close(self) -> None:
        """Release the shared segments, the sender, the pipe and the process, whatever state they are in."""
        for shared in self.shared:
            shared.close()
        if self.sender is not None:
            self.sender.close()
        if self.conn is not None:
            self.conn.close()
        if self.proc is not None:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run both pairs' syncs in turns; a dict of the figures."""
    torch.set_num_threads(args.threads)
    load_copy_loop(args.many, args.timeout)
    total = int(args.gb * 1e9)
    few = _Pair(model_spec(total, args.dtype, args.few), args)
    many = _Pair(model_spec(total, args.dtype, args.many), args)
    baseline = _Pair(model_spec(total, args.dtype, args.many), args, no_gc_hold=True) if args.gc_baseline else None
    pairs = (few, many) if baseline is None else (few, many, baseline)
    rounds: dict[str, list[float]] = {path: [] for path in PATHS}
    gc_rounds: dict[str, list[float]] = {path: [] for path in PATHS}
    try:
        for pair in pairs:
            pair.start()
        for path in PATHS:
            for r in range(args.syncs):
                for pair in pairs if r % 2 == 0 else pairs[::-1]:
                    pair.sync(path, first=r == 0)
                if r:
                    rounds[path].append(many.seconds[path][-1] / few.seconds[path][-1])
                    if baseline is not None:
                        gc_rounds[path].append(baseline.seconds[path][-1] / many.seconds[path][-1])
                    if args.verbose:
                        print(f"{path} round {r + 1}/{args.syncs}: {few.seconds[path][-1]:.4f} s, "
                              f"{many.seconds[path][-1]:.4f} s", file=sys.stderr, flush=True)
        errors = [e for e in (pair.finish() for pair in pairs) if e]
    finally:
        for pair in pairs:
            pair.close()
    if errors:
        raise RuntimeError(f"received weights are wrong: {errors}")
    bytes_ = [sum(t.numel() * t.element_size() for _, t in pair.named) for pair in (few, many)]
    out: dict[str, Any] = {
        "bytes": bytes_, "tensors": [len(few.spec), len(many.spec)], "dtype": args.dtype, "syncs": args.syncs,
        "threads": args.threads, "fresh": args.fresh,
        "paths": {path: {
            "few_s": statistics.median(few.seconds[path]), "many_s": statistics.median(many.seconds[path]),
            "many_vs_few": statistics.median(rounds[path]), "round_ratios": rounds[path],
            "few_seconds": few.seconds[path], "many_seconds": many.seconds[path],
            "replayed": [few.replayed[path], many.replayed[path]], "timed": len(few.seconds[path]),
        } for path in PATHS},
    }
    if baseline is not None:
        for path in PATHS:
            out["paths"][path].update({
                "no_gc_hold_s": statistics.median(baseline.seconds[path]),
                "no_gc_hold_vs_many": statistics.median(gc_rounds[path]), "no_gc_hold_round_ratios": gc_rounds[path],
                "no_gc_hold_seconds": baseline.seconds[path]})
            out["paths"][path]["replayed"].append(baseline.replayed[path])
    return out


def add_bench_tensors_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hwsync bench tensors`."""
    parser.add_argument("--gb", type=float, default=0.5, help="the state dict's size in GB (1e9 bytes), both ways")
    parser.add_argument("--many", type=int, default=20000, help="tensors of the many-tensor state dict")
    parser.add_argument("--few", type=int, default=16, help="tensors of the same bytes' few-tensor state dict")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="the tensors' dtype")
    parser.add_argument("--syncs", type=int, default=9,
                        help="syncs per pair and path; the first records the plan and is not timed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--timeout", type=float, default=120.0, help="timeout_s of every wait")
    parser.add_argument("--fresh", action="store_true",
                        help="send two copies of the tensors in turn: every sync is planned afresh (none replays)")
    parser.add_argument("--gc-baseline", action="store_true",
                        help="a third pair of as many tensors whose processes leave Python's collector alone "
                             "(HWSYNC_GC_HOLD=0), in turns with the others")
    parser.add_argument("--verbose", action="store_true", help="print each round's seconds on stderr")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    tiny_defaults(parser, gb=0.01, many=512, few=4, syncs=3)


def run_bench_tensors(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON); 0 on success."""
    if args.syncs < 2 or args.few < 1 or args.many <= args.few or args.threads < 1:
        raise SystemExit("--syncs must be at least 2 (the first is not timed), --few at least 1, --many more than "
                         "--few, --threads at least 1")
    try:
        r = measure(args)
    except KeyboardInterrupt:
        print("hwsync bench tensors: interrupted (segments, sockets and the receiver processes cleaned up)",
              file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    few, many = r["tensors"]
    gc = "no_gc_hold_s" in r["paths"][PATHS[0]]
    print(f"hwsync bench tensors: {r['bytes'][0] / 1e9:.2f} GB as {many} tensors against {few} ({r['dtype']}), "
          f"{r['threads']} thread(s) per process; syncs 2-{r['syncs']} of each, in turns; medians"
          + ("; every sync planned afresh (--fresh)" if r["fresh"] else ""))
    head = f"{'path':10} {f'{few} tensors s':>14} {f'{many} tensors s':>16} {'many / few':>11}"
    if gc:
        head += f" {'no GC hold s':>13} {'no hold / hold':>15}"
    print(head + f" {'replayed':>14}")
    for path, p in r["paths"].items():
        replayed = f"{'+'.join(str(n) for n in p['replayed'])} of {len(p['replayed']) * p['timed']}"
        row = f"{path:10} {p['few_s']:>14.4f} {p['many_s']:>16.4f} {p['many_vs_few']:>10.2f}x"
        if gc:
            row += f" {p['no_gc_hold_s']:>13.4f} {p['no_gc_hold_vs_many']:>14.2f}x"
        print(row + f" {replayed:>14}")
    print("many / few: the median of each round's own ratio (the syncs of a round run one after the other)")
    if gc:
        print(f"no hold / hold: {many} tensors with Python's collector left alone (HWSYNC_GC_HOLD=0) against held")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hwsync_tools.bench.tensors`."""
    parser = argparse.ArgumentParser(prog="hwsync bench tensors", description=__doc__.splitlines()[0])
    add_bench_tensors_arguments(parser)
    return run_bench_tensors(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
