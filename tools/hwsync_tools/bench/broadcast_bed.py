"""`hwsync bench broadcast --hosts H --link RATE`: full syncs across the hosts of a bed, against the line.

Host 0 is the trainer (sender 0, and sender 1 when striped), hosts 1..H-1 the engines (one receiver
each); every host's link is limited to RATE in each direction. For each rate, senders (1, 2) and
engine hosts (1, H-1): one warm-up sync that builds the groups, then --repeat timed syncs of the
benchmark state dict; the median. Per row: seconds, bytes, GB/s and that as a fraction of the line
rate; what left the trainer host's interface per second (with several engine hosts the uplink
carries each byte once per host); the CPU the ranks used per second of sync (the machine's ceiling
is its core count); and, measured in the same bed, what one plain TCP stream gets on that link
(hwsync_tools.bed.stream): where a sync falls short of the line, these say whether the veth and tbf,
the CPU, or the collective library is the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from hwsync.sync.options import CrossNodeOptions

#: host 0's hub listens here (a port per configuration); each bed host is a namespace of its own
HUB_PORT = 29700


def _cpu() -> float:
    return time.process_time()  # every thread of the process: the collective threads' too


def bed_sender(rank: int, phases: list[dict], timeout_s: float) -> list[dict]:
    """Sender `rank` in host 0: for each phase it is part of, its syncs' seconds, uplink bytes and CPU seconds."""
    import torch

    from hwsync.control.nic import interface_bytes
    from hwsync.disaggregated import CrossNodeSender
    from hwsync_tools.bench.broadcast_model import state_dict as _model

    torch.set_num_threads(1)
    out: list[dict] = []
    for phase in phases:
        if rank >= phase["senders"]:
            out.append({})
            continue
        model = _model(phase["bytes"])
        rows = []
        with CrossNodeSender(
            phase["endpoint"], rank=rank, num_senders=phase["senders"], num_receivers=phase["receivers"],
            options=CrossNodeOptions(bucket_bytes=phase["bucket_bytes"], timeout_s=timeout_s,
                                     secret_key=phase.get("secret"))) as tx:
            nic = os.environ.get("HWSYNC_BED_INTERFACE", "")
            for v in range(phase["runs"]):
                sent0, cpu0 = interface_bytes(nic), _cpu()
                stats = tx.send(model, version=v)
                sent1 = interface_bytes(nic)
                rows.append({"seconds": stats.total_s, "bytes": stats.bytes, "cpu_s": _cpu() - cpu0,
                             "uplink_bytes": sent1[1] - sent0[1] if sent0 and sent1 else None})
        out.append({"syncs": rows})
    return out


def bed_receiver(rank: int, phases: list[dict], timeout_s: float) -> list[dict]:
    """Receiver `rank` in host 1+rank: for each phase it is part of, each sync's CPU seconds (it copies every
    tensor into its own, as an engine does)."""
    import torch

    from hwsync.disaggregated import CrossNodeReceiver

    torch.set_num_threads(1)
    out: list[dict] = []
    for phase in phases:
        if rank >= phase["receivers"]:
            out.append({})
            continue
        sink: dict[str, torch.Tensor] = {}

        def load(tensors: list, sink: dict = sink) -> None:
            for name, t in tensors:
                if name not in sink:
                    sink[name] = torch.empty_like(t)
                sink[name].copy_(t)

        cpu = []
        with CrossNodeReceiver(phase["endpoint"], rank=rank, timeout_s=timeout_s) as rx:
            for _ in range(phase["runs"]):
                cpu0 = _cpu()
                rx.receive(load)
                cpu.append(_cpu() - cpu0)
        out.append({"cpu_s": cpu})
    return out


def _phases(bed: Any, configs: list[tuple[int, int]], size: int, bucket: int, runs: int) -> list[dict]:
    from hwsync.control.endpoints import new_token
    from hwsync.control.sockets import curve_key_pair

    phases = []
    for i, (senders, receivers) in enumerate(configs):
        public, secret = curve_key_pair()
        phases.append({"endpoint": f"tcp://{bed.address(0)}:{HUB_PORT + i}#{new_token()}#{public}", "secret": secret,
                       "senders": senders, "receivers": receivers, "bytes": size, "bucket_bytes": bucket,
                       "runs": runs})
    return phases


def run_on_bed(args: argparse.Namespace) -> list[dict]:
    """Every (link, senders, engine hosts) configuration on a bed of args.hosts hosts; one row each."""
    from hwsync_tools.bed import Bed, parse_rate
    from hwsync_tools.bed.stream import measure as stream

    if args.hosts < 2:
        raise SystemExit("--hosts needs at least 2 (a trainer host and an engine host)")
    engines = sorted({min(r, args.hosts - 1) for r in (args.receivers or [1, args.hosts - 1])})
    configs = [(s, r) for s in args.senders for r in engines]
    size, bucket = args.sizes_mb[0] * 1_000_000, int(args.bucket_mb * (1 << 20))
    rows = []
    for text in args.link:
        rate = parse_rate(text)
        with Bed(args.hosts, rate_bps=rate) as bed:
            line = stream(bed, 0, 1, seconds=2.0)["bps"]  # one TCP stream, before any rank takes the CPU
            phases = _phases(bed, configs, size, bucket, args.repeat + 1)
            target = "hwsync_tools.bench.broadcast_bed:"
            public = [{k: v for k, v in p.items() if k != "secret"} for p in phases]
            # no interface variable: each rank binds what hwsync finds from the addresses, as the tests check
            ranks = [bed.start(0, target + "bed_sender", 0, phases, args.timeout, interface_vars=False)]
            ranks += [bed.start(0, target + "bed_sender", s, public, args.timeout, interface_vars=False)
                      for s in range(1, max(args.senders))]
            ranks += [bed.start(1 + r, target + "bed_receiver", r, public, args.timeout, interface_vars=False)
                      for r in range(max(engines))]
            limit = args.timeout * (len(configs) * (args.repeat + 1) + 2)
            got = [p.result(limit) for p in ranks]
        for i, (senders, receivers) in enumerate(configs):
            timed = got[0][i]["syncs"][1:]  # the first sync builds the groups
            seconds = statistics.median(r["seconds"] for r in timed)
            cpu = [statistics.median(r["cpu_s"] for r in g[i]["syncs"][1:]) for g in got[:senders]]
            cpu += [statistics.median(g[i]["cpu_s"][1:]) for g in got[max(args.senders):][:receivers]]
            up = [r["uplink_bytes"] for r in timed if r["uplink_bytes"] is not None]
            nbytes = timed[0]["bytes"]
            rows.append({"link_bps": rate, "senders": senders, "engine_hosts": receivers, "bytes": nbytes,
                         "bucket_bytes": bucket, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                         "vs_line": nbytes * 8 / seconds / rate if rate else None,
                         "uplink_vs_line": statistics.median(up) * 8 / seconds / rate if rate and up else None,
                         "cpu_cores": sum(cpu) / seconds, "stream_bps": line,
                         "stream_vs_line": line / rate if rate else None, "cpus": os.cpu_count()})
    return rows


def print_bed_table(rows: list[dict], args: argparse.Namespace) -> None:
    """The table of run_on_bed's rows."""
    if args.json:
        print(json.dumps({"hosts": args.hosts, "cpus": os.cpu_count(), "repeat": args.repeat, "rows": rows}, indent=2))
        return
    print(f"hwsync bench broadcast on a bed of {args.hosts} hosts: gloo, {os.cpu_count()} CPUs, bucket "
          f"{args.bucket_mb:g} MiB, median of {args.repeat} full syncs; x line = bits/s of the state dict against the "
          "link rate; uplink = what left the trainer host; stream = one plain TCP stream on the same link")
    print(f"{'link':>10} {'senders':>7} {'engines':>7} {'MB':>6} {'seconds':>8} {'GB/s':>6} {'x line':>6} "
          f"{'uplink':>6} {'cores':>5} {'stream':>6}")

    def ratio(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "-"

    for r in rows:
        link = f"{r['link_bps'] / 1e9:g} Gbit/s" if r["link_bps"] else "unlimited"
        print(f"{link:>10} {r['senders']:>7} {r['engine_hosts']:>7} {r['bytes'] / 1e6:>6.0f} {r['seconds']:>8.3f} "
              f"{r['gbps']:>6.3f} {ratio(r['vs_line']):>6} {ratio(r['uplink_vs_line']):>6} {r['cpu_cores']:>5.2f} "
              f"{ratio(r['stream_vs_line']):>6}")
