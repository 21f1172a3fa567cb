"""`hwsync bench delta`: full against delta syncs of a model trained for real, between two hosts of the bed.

A Llama of about 300M parameters (random weights from a transformers config) trains in fp32 with
AdamW on the trainer host; the engine host holds it in bf16 (it says so: the trainer casts to the
engine's dtype, the loader's own cast), or with `--engine-dtype float32` in fp32: then nothing is cast,
the deltas are dense, and what owning the caller's bytes costs (the copy of each dense tensor into the
sender's next baseline, before send() returns: "owned" in the table) is what it costs most. For each
learning rate and link rate, the trainer host syncs once (full: the baseline), then each step trains
and sends a delta sync, as an RL loop does,
and at the end sends FULL_SYNCS full syncs of the last weights (a full sync's cost does not depend on
the step), over the cross-node path (CrossNodeSender / CrossNodeReceiver, gloo) and the bed's
rate-limited link. Printed per (LR, link): the density each step produced, bytes on the
wire, seconds per sync, each against the link's line rate, and the delta's two floors: its bytes at
the line rate, and one read of the new tensors and of the baseline at the single-thread copy speed
measured in the same process; the diff's seconds (what the trainer waited for its encode); the CPU
seconds the trainer's process took in the sync and the engine's from the plan to the end (the bed's two
hosts share this machine's cores, so on a fast link a delta costs about their sum over the cores). Every sync
also goes to a WeightReceiver process on the trainer's host (WeightSender, the same-host path, whose
encode runs up front): its seconds and its diff's. With `--stage` that receiver stages each sync (the engine
names its own tensors, the delta's base): what its staging area held once staged, against the model's bytes,
and its apply's seconds inside the pause (a delta writes its payloads in place; a full sync copies the model).
Needs root (the bed); `--json` for a machine-readable report.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

from hwsync.sync.options import CrossNodeOptions, SenderOptions
from hwsync_tools.bench import tiny_defaults

#: the trainer host's address, port and the endpoint's secrets are made by the parent and passed to both hosts
PORT = 29400
#: full syncs measured after the steps' delta syncs (their median is the full sync's seconds)
FULL_SYNCS = 3


def add_bench_delta_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `hwsync bench delta`."""
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5], help="AdamW learning rates")
    parser.add_argument("--links", nargs="+", default=["1gbit", "10gbit"], help="link rates of the bed")
    parser.add_argument("--steps", type=int, default=3, help="training steps (a delta sync each)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size of the Llama")
    parser.add_argument("--layers", type=int, default=18, help="decoder layers (18 x 1024: 368M parameters)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any wait may take")
    parser.add_argument("--engine-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the dtype the engine holds (float32: nothing cast, deltas dense)")
    parser.add_argument("--stage", action="store_true",
                        help="the same-host receiver stages each sync (StageOptions): its staging memory and apply")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    tiny_defaults(parser, hidden=128, layers=1, steps=2, lrs=[1e-5], links=["10gbit"])  # HWSYNC_BENCH_TINY=1


def _config(hidden: int, layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                       num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                       vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)


def cpu_s() -> float:
    """CPU seconds this process has taken so far, all its threads, user and system."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def copy_gbps(nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """Single-thread memory copy speed of this process, GB/s (best of `repeat`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9
    finally:
        torch.set_num_threads(threads)


def trainer(endpoint: str, secret: str, address: str, hidden: int, layers: int, lr: float, steps: int,
            timeout_s: float, engine_dtype: str = "bfloat16", stage: bool = False) -> dict[str, Any]:
    """The trainer host: trains and syncs; every sync's stats, the densities and the copy speed (JSON).

    Each sync goes twice: across the link (CrossNodeSender, the engine host's CrossNodeReceiver) and on this
    host (WeightSender, a WeightReceiver process beside it): what the diff costs on the same-host path.
    """
    import multiprocessing

    import torch
    from transformers import LlamaForCausalLM

    from hwsync import CrossNodeSender, WeightSender
    from hwsync.delta import warm

    warm.wait()  # compile (or load) the host kernels before anything is timed
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(hidden, layers))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"params": params, "copy_gbps": copy_gbps(), "syncs": [], "colocated": []}
    syncs = 1 + steps + FULL_SYNCS
    across = CrossNodeOptions(timeout_s=timeout_s, secret_key=secret)
    with CrossNodeSender(endpoint, num_receivers=1, group_host=address, options=across) as sender, \
            WeightSender(options=SenderOptions(timeout_s=timeout_s)) as local:
        beside = multiprocessing.get_context("spawn").Process(
            target=engine, args=(None, hidden, layers, syncs, timeout_s, local.endpoint, engine_dtype, stage),
            daemon=True)
        beside.start()

        def sync(step: int, version: int, delta: bool) -> None:
            for path, tx in (("syncs", sender), ("colocated", local)):
                # the other sender's last baseline writes end first (reading the size waits for them): the two
                # paths' costs do not overlap
                out["baselines_bytes"] = sender.delta_baseline_bytes + local.delta_baseline_bytes
                t0, cpu0 = time.perf_counter(), cpu_s()
                stats = tx.send(list(model.state_dict().items()), version=version, delta=delta)
                cpu = cpu_s() - cpu0
                note = stats.delta
                peer = ((stats.peer or {}).get("receivers") or [stats.peer or {}])[0]
                out[path].append({"step": step, "mode": note and note.mode, "seconds": time.perf_counter() - t0,
                                  "bytes": stats.bytes, "density": note and note.density,
                                  "diff_s": note and note.diff_s, "apply_s": stats.load_s, "wait_s": stats.wait_s,
                                  "pack_s": stats.pack_s, "baseline_bytes": note and note.baseline_bytes,
                                  "reason": note and note.reason, "check": (peer.get("delta") or {}).get("check"),
                                  "cpu_s": cpu, "owned_bytes": note and note.owned_bytes,
                                  "owned_s": note and note.owned_s,
                                  "staged_bytes": stats.stage.held_bytes if stats.stage else None,
                                  "stage_apply_s": stats.stage.apply_s if stats.stage else None})

        sync(0, 0, True)  # the first: full, it makes the baseline
        for step in range(1, steps + 1):
            tokens = torch.randint(0, 32000, (1, 32))
            loss = model(input_ids=tokens, labels=tokens).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sync(step, step, True)
        for extra in range(FULL_SYNCS):
            sync(steps, steps + 1 + extra, False)
        beside.join(timeout_s)
    out["new_bytes"] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return out


def engine(endpoint: str | None, hidden: int, layers: int, syncs: int, timeout_s: float,
           local: str | None = None, engine_dtype: str = "bfloat16", stage: bool = False) -> dict[str, Any]:
    """The engine: holds the model in bf16 and receives `syncs` syncs into it, from across the link (`endpoint`)
    or from a sender on this host (`local`: a WeightSender's endpoint; `stage`: it stages each sync)."""
    import torch
    from transformers import LlamaForCausalLM

    from hwsync import CrossNodeReceiver, WeightReceiver
    from hwsync.delta import warm
    from hwsync.sync.report import ReceiverState, engine_dtypes

    warm.wait()  # compile (or load) the host kernels before anything is timed
    with torch.device("meta"):
        shapes = LlamaForCausalLM(_config(hidden, layers)).state_dict()
    held = {name: torch.empty(t.shape, dtype=getattr(torch, engine_dtype)) for name, t in shapes.items()}
    state = ReceiverState(dtypes=engine_dtypes(held.items()))
    seconds, cpu, began = [], [], [0.0]

    class Engine:  # a Loader: writes into the held tensors, and marks the CPU clock when a sync's plan arrives
        @staticmethod
        def load(tensors: list) -> None:
            raise AssertionError("every tensor has a destination")

        @staticmethod
        def into(name: str, dtype: Any, shape: Any) -> Any:
            return held.get(name)

        @staticmethod
        def accept(version: int, manifest: Any) -> None:
            began[0] = cpu_s()

    receiver = WeightReceiver(local, timeout_s=timeout_s, stage=stage) if local else \
        CrossNodeReceiver(str(endpoint), rank=0, timeout_s=timeout_s)
    with receiver:
        for _ in range(syncs):
            # CPU from the plan on: not the wait for the sender, nor the digest of a full sync run meanwhile
            stats = receiver.receive(Engine(), state=state)
            seconds.append(stats.total_s)
            cpu.append(cpu_s() - began[0])
    return {"syncs": len(seconds), "receive_s": seconds, "cpu_s": cpu}


def _run_pair(bed: Any, lr: float, args: argparse.Namespace) -> dict[str, Any]:
    from hwsync.control.endpoints import new_token
    from hwsync.control.sockets import curve_key_pair

    public, secret = curve_key_pair()
    address = bed.address(0)
    endpoint = f"tcp://{address}:{PORT}#{new_token()}#{public}"
    target = "hwsync_tools.bench.delta:"
    syncs = 1 + args.steps + FULL_SYNCS
    train = bed.start(0, target + "trainer", endpoint, secret, address, args.hidden, args.layers, lr, args.steps,
                      args.timeout, args.engine_dtype, args.stage)
    held = bed.start(1, target + "engine", endpoint, args.hidden, args.layers, syncs, args.timeout, None,
                     args.engine_dtype)
    limit = args.timeout * (syncs + 2)
    result = train.result(timeout=limit)
    result["engine"] = held.result(timeout=limit)
    return result


def _summary(run: dict[str, Any], rate_bps: float) -> dict[str, Any]:
    deltas = [s for s in run["syncs"] if s["mode"] == "delta"]
    fulls = [s for s in run["syncs"] if s["mode"] == "full" and s["step"] > 0]
    line = rate_bps / 8
    read_floor = (run["new_bytes"] + (deltas[0]["baseline_bytes"] if deltas else 0)) / (run["copy_gbps"] * 1e9)
    engine_cpu = run.get("engine", {}).get("cpu_s", [])  # one per sync, in the trainer's order
    rows = []
    for d in deltas:
        wire_floor, at = d["bytes"] / line, run["syncs"].index(d)
        rows.append({**d, "wire_floor_s": wire_floor, "read_floor_s": read_floor,
                     "vs_floor": d["seconds"] / max(wire_floor, read_floor),
                     "engine_cpu_s": engine_cpu[at] if at < len(engine_cpu) else None})
    full_s = statistics.median(f["seconds"] for f in fulls) if fulls else None
    delta_s = statistics.median(d["seconds"] for d in deltas) if deltas else None
    full_bytes = fulls[0]["bytes"] if fulls else None
    near = run.get("colocated", [])
    near_fulls = [s["seconds"] for s in near if s["mode"] == "full" and s["step"] > 0]
    staged_fulls = [s for s in near if s["mode"] == "full" and s["step"] > 0 and s.get("staged_bytes") is not None]
    colocated = {"deltas": [s for s in near if s["mode"] == "delta"],
                 "full_s": statistics.median(near_fulls) if near_fulls else None,
                 "full_staged_bytes": staged_fulls[0]["staged_bytes"] if staged_fulls else None,
                 "full_apply_s": statistics.median(s["stage_apply_s"] for s in staged_fulls) if staged_fulls else None}
    return {"params": run["params"], "copy_gbps": run["copy_gbps"], "deltas": rows, "fulls": fulls,
            "colocated": colocated,
            "full_s": full_s, "full_bytes": full_bytes, "delta_s": delta_s,
            "speedup": full_s / delta_s if full_s and delta_s else None,
            "full_vs_line": full_bytes / full_s / line if full_bytes and full_s else None}


def run_bench_delta(args: argparse.Namespace) -> int:
    """Run every (LR, link) and print the table (or --json)."""
    from hwsync_tools.bed import Bed, parse_rate, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"hwsync bench delta needs the multi-host bed: {reason}")
        return 1
    report: list[dict[str, Any]] = []
    for link in args.links:
        rate = parse_rate(link)
        assert rate is not None, f"a link rate, e.g. 1gbit: {link}"
        with Bed(2, rate_bps=rate) as bed:
            for lr in args.lrs:
                summary = _summary(_run_pair(bed, lr, args), rate)
                report.append({"link": link, "lr": lr, "engine_dtype": args.engine_dtype, **summary})
                if not args.json:
                    _print(report[-1])
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def _print(r: dict[str, Any]) -> None:
    engine = "bf16" if r.get("engine_dtype", "bfloat16") == "bfloat16" else "fp32"
    print(f"\n== link {r['link']}, LR {r['lr']:g}: {r['params'] / 1e6:.0f}M parameters (fp32 masters, {engine} "
          f"engine), copy {r['copy_gbps']:.1f} GB/s")
    full_s, full_bytes = r["full_s"], r["full_bytes"]
    if full_s:
        print(f"   full sync: {full_bytes / 1e6:.0f} MB in {full_s:.3f} s = {r['full_vs_line']:.2f}x the line rate")
    print("   step  density   wire MB   delta s   diff s  apply s   wire floor s  read floor s  vs floor  "
          "owned MB  owned s  CPU s: trainer  engine  receiver checked")
    for d in r["deltas"]:
        engine = "-" if d.get("engine_cpu_s") is None else f"{d['engine_cpu_s']:.3f}"
        print(f"   {d['step']:>4}  {d['density']:>7.4%}  {d['bytes'] / 1e6:>8.2f}  {d['seconds']:>8.3f}  "
              f"{d['diff_s']:>7.3f}  {d['apply_s']:>7.3f}  {d['wire_floor_s']:>12.3f}  {d['read_floor_s']:>12.3f}  "
              f"{d['vs_floor']:>7.2f}x  {(d.get('owned_bytes') or 0) / 1e6:>8.1f}  {d.get('owned_s') or 0.0:>7.3f}  "
              f"{d['cpu_s']:>14.3f}  {engine:>6}  {d.get('check') or '-'}")
    if r["speedup"]:
        print(f"   delta sync {r['speedup']:.1f}x faster than a full sync (medians)")
    near = r["colocated"]
    if near["deltas"]:
        full = f"{near['full_s']:.3f} s" if near["full_s"] else "-"
        print(f"   same host (WeightSender to a WeightReceiver process beside it; a full sync {full}):")
        staged = near.get("full_staged_bytes") is not None
        print("   step   delta s   diff s   wire MB" + ("  staged MB  vs full  apply s  vs full" if staged else ""))
        for d in near["deltas"]:
            row = f"   {d['step']:>4}  {d['seconds']:>8.3f}  {d['diff_s']:>7.3f}  {d['bytes'] / 1e6:>8.2f}"
            if staged and d.get("staged_bytes") is not None:
                row += (f"  {d['staged_bytes'] / 1e6:>9.2f}  {d['staged_bytes'] / near['full_staged_bytes']:>6.3f}x"
                        f"  {d['stage_apply_s']:>7.3f}  {d['stage_apply_s'] / near['full_apply_s']:>6.3f}x")
            print(row)
        if staged:
            print(f"   staged full sync: {near['full_staged_bytes'] / 1e6:.1f} MB held, applied in "
                  f"{near['full_apply_s']:.3f} s (median)")
