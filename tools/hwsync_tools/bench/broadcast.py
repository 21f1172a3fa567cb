"""`hwsync bench broadcast`: GB/s of the collective path, 1 sender or striped senders to N receivers.

Every rank is a process on this host (spawned), on the selected backend's collective library
(gloo on the CPU). For each (senders, receivers, size) the sync is run --repeat times on one
group after a warm-up sync that builds the group; the figure is the median. Alongside it, in
the same run: the same bytes stop-and-wait, the design peers ship (broadcast_stop_and_wait.py: one
buffer per rank, so packing, broadcast and load never overlap), and the host's own copy
bandwidth, because figures from shared machines are only comparable as ratios.

With `--hosts H --link RATE [RATE ...]` the ranks run instead in the hosts of a bed (hwsync_tools.bed: network
namespaces, links limited to RATE; needs root), trainer on host 0 and engines on the others, and each row
is compared with the link's line rate (broadcast_bed.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

from hwsync.sync.options import CrossNodeOptions
from hwsync_tools.bench import tiny_defaults
from hwsync_tools.bench.broadcast_model import end_ranks, state_dict as _model
from hwsync_tools.bench.broadcast_stop_and_wait import measure as measure_stop_and_wait


def _receiver(endpoint: str, rank: int, size: int, buffers: int, runs: int, timeout_s: float, backend: str) -> None:
    os.environ["HWSYNC_BACKEND"] = backend
    from hwsync.disaggregated import CrossNodeReceiver

    sink: dict[str, torch.Tensor] = {}

    def load(tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:  # what an engine does: copy into its own parameter
            if name not in sink:
                sink[name] = torch.empty_like(t)
            sink[name].copy_(t)

    with CrossNodeReceiver(endpoint, rank=rank, num_buffers=buffers, timeout_s=timeout_s) as rx:
        for _ in range(runs):
            rx.receive(load)
    for name, want in _model(size):
        if not torch.equal(sink[name].cpu(), want):
            raise SystemExit(f"receiver {rank}: {name} arrived wrong")


def _sender(endpoint: str, rank: int, senders: int, receivers: int, size: int, bucket: int, buffers: int,
            runs: int, timeout_s: float, backend: str) -> None:
    os.environ["HWSYNC_BACKEND"] = backend
    from hwsync.disaggregated import CrossNodeSender

    model = _model(size)
    with CrossNodeSender(endpoint, rank=rank, num_senders=senders, num_receivers=receivers, group_host="127.0.0.1",
                         options=CrossNodeOptions(bucket_bytes=bucket, num_buffers=buffers, timeout_s=timeout_s)) as tx:
        for v in range(runs):
            tx.send(model, version=v)


def measure(senders: int, receivers: int, size: int, bucket: int, buffers: int, repeat: int,
            timeout_s: float, backend: str) -> dict[str, Any]:
    """Median GB/s over `repeat` syncs (after one warm-up) of one configuration."""
    os.environ["HWSYNC_BACKEND"] = backend
    from hwsync.disaggregated import CrossNodeSender

    runs = repeat + 1
    ctx = mp.get_context("spawn")
    model = _model(size)
    with CrossNodeSender("tcp://127.0.0.1:0", num_senders=senders, num_receivers=receivers, group_host="127.0.0.1",
                         options=CrossNodeOptions(bucket_bytes=bucket, num_buffers=buffers, timeout_s=timeout_s)) as tx:
        procs = [ctx.Process(target=_receiver, args=(tx.endpoint, r, size, buffers, runs, timeout_s, backend))
                 for r in range(receivers)]
        procs += [ctx.Process(target=_sender, args=(tx.endpoint, s, senders, receivers, size, bucket, buffers,
                                                    runs, timeout_s, backend)) for s in range(1, senders)]
        for p in procs:
            p.start()
        try:
            seconds = []
            for v in range(runs):
                stats = tx.send(model, version=v)
                if v > 0:  # the first sync builds the groups
                    seconds.append(stats.total_s)
        finally:
            failed = end_ranks(procs, timeout_s)
    if failed:
        raise RuntimeError(f"a rank failed (exit codes {failed}): see its output above")
    best = statistics.median(seconds)
    return {"senders": senders, "receivers": receivers, "bytes": size, "bucket_bytes": bucket,
            "buffers": buffers, "design": "hwsync", "seconds": best, "gbps": size / best / 1e9}


def copy_gbps(size: int) -> float:
    """The host's own memcpy bandwidth at this size, in GB/s (the yardstick for ratios)."""
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return size / min(times) / 1e9


def add_bench_broadcast_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hwsync bench broadcast`."""
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[256], help="sync sizes in MB (1e6 bytes)")
    parser.add_argument("--receivers", type=int, nargs="+", default=None,
                        help="receiver counts N (default 1 2 3; with --hosts: engine hosts, 1 and H-1)")
    parser.add_argument("--senders", type=int, nargs="+", default=[1, 2], help="sender counts (striping)")
    parser.add_argument("--bucket-mb", type=float, default=32.0, help="bucket size in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="timed syncs per configuration (median)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the stop-and-wait rows (the design peers ship: 1 buffer per rank)")
    parser.add_argument("--timeout", type=float, default=120.0, help="timeout_s of every rank")
    parser.add_argument("--backend", default=None, help="backend (default: HWSYNC_BACKEND or auto)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--hosts", type=int, default=0,
                        help="run on a bed of this many hosts (trainer on host 0, engines on the others; needs root)")
    parser.add_argument("--link", nargs="+", default=["1gbit", "10gbit"],
                        help="with --hosts: the rates of the bed's links (e.g. 1gbit 10gbit; none: unlimited)")
    tiny_defaults(parser, sizes_mb=[4], bucket_mb=1.0, repeat=1, senders=[2], receivers=[2], link=["10gbit"])


def run_bench_broadcast(args: argparse.Namespace) -> int:
    """Run every configuration, print a table (or JSON); 0 on success."""
    from hwsync.backend.registry import get_backend

    if args.hosts:
        from hwsync_tools.bed import unavailable_reason
        from hwsync_tools.bench.broadcast_bed import print_bed_table, run_on_bed

        reason = unavailable_reason()
        if reason:
            print(f"hwsync bench broadcast --hosts needs the multi-host bed: {reason}")
            return 2
        print_bed_table(run_on_bed(args), args)
        return 0
    backend = args.backend or get_backend().name
    args.receivers = args.receivers or [1, 2, 3]
    bucket = int(args.bucket_mb * (1 << 20))
    rows = []
    for size_mb in args.sizes_mb:
        size = size_mb * 1_000_000
        for senders in args.senders:
            for receivers in args.receivers:
                rows.append(measure(senders, receivers, size, bucket, 2, args.repeat, args.timeout, backend))
                if not args.no_baseline:
                    rows.append(measure_stop_and_wait(senders, receivers, size, bucket, args.repeat, args.timeout,
                                                      backend))
        memcpy = copy_gbps(size)
        for row in rows:
            if row["bytes"] == size:
                row["memcpy_gbps"] = memcpy
                row["vs_memcpy"] = row["gbps"] / memcpy
    for row in rows:
        twin = [r for r in rows if r["buffers"] == 1 and all(r[k] == row[k] for k in ("senders", "receivers", "bytes"))]
        row["vs_stop_and_wait"] = row["gbps"] / twin[0]["gbps"] if twin and row["buffers"] != 1 else None
    if args.json:
        print(json.dumps({"backend": backend, "cpus": os.cpu_count(), "rows": rows}, indent=2))
        return 0
    print(f"hwsync bench broadcast: backend {backend}, {os.cpu_count()} CPUs, bucket {args.bucket_mb:g} MiB, "
          f"median of {args.repeat}")
    print(f"{'MB':>6} {'senders':>7} {'recv':>4} {'buffers':>7} {'seconds':>8} {'GB/s':>7} {'vs memcpy':>9} "
          f"{'vs 1-buf':>8}")
    for r in rows:
        ratio = f"{r['vs_stop_and_wait']:.2f}x" if r["vs_stop_and_wait"] else "-"
        print(f"{r['bytes'] / 1e6:>6.0f} {r['senders']:>7} {r['receivers']:>4} {r['buffers']:>7} {r['seconds']:>8.3f} "
              f"{r['gbps']:>7.3f} {r['vs_memcpy']:>9.3f} {ratio:>8}")
    return 0


def main() -> int:
    """Standalone entry point (python -m hwsync_tools.bench.broadcast)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_broadcast_arguments(parser)
    return run_bench_broadcast(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
