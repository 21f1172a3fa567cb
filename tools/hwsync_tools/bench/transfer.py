"""`hwsync bench transfer`: GB/s process to process, hwsync against stop-and-wait and memory copy.

One run measures on the same synthetic state dict and bucket size: hwsync's WeightSender into
a spawned WeightReceiver process (several syncs on one session), the same tensors synced from
hwsync's shared memory by reference (one copy per byte; `--source packed` skips it), on a device
the same tensors read in place from the sender's own device memory (mapped sources: views of them,
as a module's state_dict() gives), a
single-buffer stop-and-wait sender (stop_and_wait.py: pack one bucket, send a frame, wait
for the ack: what peers ship), the device's copy bandwidth (single-thread on the host), and two
such copies in two processes at once (half their sum bounds any pipeline that copies each byte
twice). Tensors live on the selected backend's device, so on a GPU machine this measures a
colocated sync over the backend's default transport (CUDA IPC) against device-to-device copies. Both
receivers copy every tensor into preallocated destination tensors, as an engine does. Syncs after the first are
timed and the median taken; figures from shared machines are only comparable as ratios.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch
import zmq

from hwsync.control.endpoints import private_ipc_dir, remove_ipc_dir
from hwsync.sync.options import SenderOptions
from hwsync.sync.spec import dtype_name
from hwsync_tools.bench import tiny_defaults
from hwsync_tools.bench.stop_and_wait import StopAndWait, await_reply, pack
from hwsync_tools.bench.transfer_parts import (
    Spec,
    _receiver_main,
    bench_device,
    build,
    concurrent_copy_gbps,
    copy_gbps,
    count_summary,
    counted,
    host_to_device_gbps,
    load_copy_loop,
)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# a ~1.5B-parameter transformer (Qwen2.5-1.5B geometry): hidden, mlp, vocab, kv width, layers
_HIDDEN, _MLP, _VOCAB, _KV, _LAYERS = 1536, 8960, 151936, 256, 28


def _transformer(hidden: int, mlp: int, vocab: int, kv: int, layers: int) -> list[tuple[str, list[int], bool]]:
    """(name, shape, is_matrix) of an embedding plus `layers` decoder layers and a final norm."""
    out: list[tuple[str, list[int], bool]] = [("model.embed_tokens.weight", [vocab, hidden], True)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [hidden], False),
                (p + "self_attn.q_proj.weight", [hidden, hidden], True), (p + "self_attn.q_proj.bias", [hidden], False),
                (p + "self_attn.k_proj.weight", [kv, hidden], True), (p + "self_attn.k_proj.bias", [kv], False),
                (p + "self_attn.v_proj.weight", [kv, hidden], True), (p + "self_attn.v_proj.bias", [kv], False),
                (p + "self_attn.o_proj.weight", [hidden, hidden], True),
                (p + "post_attention_layernorm.weight", [hidden], False),
                (p + "mlp.gate_proj.weight", [mlp, hidden], True), (p + "mlp.up_proj.weight", [mlp, hidden], True),
                (p + "mlp.down_proj.weight", [hidden, mlp], True)]
    return out + [("model.norm.weight", [hidden], False)]


# a Qwen3-30B-A3B-shaped mixture of experts: hidden, expert mlp, vocab, q width, kv width, head dim, layers
_MOE_HIDDEN, _MOE_MLP, _MOE_VOCAB, _MOE_Q, _MOE_KV, _MOE_HEAD, _MOE_LAYERS = 2048, 768, 151936, 4096, 512, 128, 48


def _moe(hidden: int, mlp: int, vocab: int, q: int, kv: int, head: int, layers: int,
         experts: int) -> list[tuple[str, list[int], bool]]:
    """(name, shape, is_matrix) of a mixture-of-experts model: per layer attention, a router and `experts` experts
    of three matrices each (Qwen3-30B-A3B: 128 experts, 48 layers, ~18,900 tensors)."""
    out: list[tuple[str, list[int], bool]] = [("model.embed_tokens.weight", [vocab, hidden], True)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [hidden], False),
                (p + "self_attn.q_proj.weight", [q, hidden], True), (p + "self_attn.k_proj.weight", [kv, hidden], True),
                (p + "self_attn.v_proj.weight", [kv, hidden], True), (p + "self_attn.o_proj.weight", [hidden, q], True),
                (p + "self_attn.q_norm.weight", [head], False), (p + "self_attn.k_norm.weight", [head], False),
                (p + "post_attention_layernorm.weight", [hidden], False),
                (p + "mlp.gate.weight", [experts, hidden], True)]
        for e in range(experts):
            x = f"{p}mlp.experts.{e}."
            out += [(x + "gate_proj.weight", [mlp, hidden], True), (x + "up_proj.weight", [mlp, hidden], True),
                    (x + "down_proj.weight", [hidden, mlp], True)]
    return out + [("model.norm.weight", [hidden], False), ("lm_head.weight", [vocab, hidden], True)]


def model_spec(total_bytes: int, dtype: str, tensors: int | None = None, moe: int | None = None) -> Spec:
    """(name, shape, dtype) of the synthetic state dict: transformer-shaped, a mixture of `moe` experts a layer, or
    `tensors` equal ones."""
    def dt(matrix: bool) -> str:
        if dtype == "mix":  # mixed precision: matrices bf16, norms and biases fp32
            return "bfloat16" if matrix else "float32"
        return dtype_name(_DTYPES[dtype])

    size = 2 if dtype == "mix" else _DTYPES[dtype].itemsize
    if tensors:
        cols = 1024
        rows = max(1, total_bytes // (tensors * size * cols))
        return [(f"tensor{i}", [rows, cols], dt(True)) for i in range(tensors)]

    def nbytes(layout: list[tuple[str, list[int], bool]]) -> int:
        return sum(math.prod(s) * (size if m or dtype != "mix" else 4) for _, s, m in layout)

    if moe:  # every layer and expert kept (the tensor count is the point): widths, or above full size depth, scaled
        full = nbytes(_moe(_MOE_HIDDEN, _MOE_MLP, _MOE_VOCAB, _MOE_Q, _MOE_KV, _MOE_HEAD, _MOE_LAYERS, moe))
        if total_bytes >= full:
            layout = _moe(_MOE_HIDDEN, _MOE_MLP, _MOE_VOCAB, _MOE_Q, _MOE_KV, _MOE_HEAD,
                          max(1, round(_MOE_LAYERS * total_bytes / full)), moe)
        else:
            g = math.sqrt(total_bytes / full)

            def w(n: int) -> int:
                return max(16, int(n * g) // 16 * 16)

            layout = _moe(w(_MOE_HIDDEN), w(_MOE_MLP), w(_MOE_VOCAB), w(_MOE_Q), w(_MOE_KV), w(_MOE_HEAD),
                          _MOE_LAYERS, moe)
        return [(name, shape, dt(m)) for name, shape, m in layout]

    embed = nbytes(_transformer(_HIDDEN, _MLP, _VOCAB, _KV, 0))
    layer = nbytes(_transformer(_HIDDEN, _MLP, _VOCAB, _KV, 1)) - embed
    if total_bytes >= embed + layer:  # keep the real widths, scale the depth
        layout = _transformer(_HIDDEN, _MLP, _VOCAB, _KV, max(1, round((total_bytes - embed) / layer)))
    else:  # too small for one real layer: shrink every width, keep 2 layers
        f = math.sqrt(total_bytes / (embed + 2 * layer))
        def r(n: int) -> int:
            return max(64, int(n * f) // 64 * 64)

        layout = _transformer(r(_HIDDEN), r(_MLP), r(_VOCAB), r(_KV), 2)
    return [(name, shape, dt(m)) for name, shape, m in layout]


# ---------------------------------------------------------------- the run


class _Progress:
    """tqdm on stderr once a run passes a second, or plain lines when tqdm is missing."""

    def __init__(self, total: int) -> None:
        self.t0, self.n, self.total = time.perf_counter(), 0, total
        try:
            from tqdm import tqdm
            self.bar: Any = tqdm(total=total, file=sys.stderr, delay=1.0, unit="sync", leave=False)
        except ImportError:
            self.bar = None

    def step(self, what: str, seconds: float) -> None:
        """One sync done."""
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(what, refresh=False)
            self.bar.update(1)
        elif time.perf_counter() - self.t0 > 1.0:
            print(f"[{self.n}/{self.total}] {what}: {seconds:.3f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the transfers and the copy references; a dict of the figures."""
    from hwsync.backend.registry import get_backend
    from hwsync.colocated.sender import WeightSender
    from hwsync.sync.shared_params import SharedTensors

    torch.set_num_threads(args.threads)
    spec = model_spec(int(args.gb * 1e9), args.dtype, args.tensors, args.moe)
    device, settle = bench_device()
    named = build(spec, device)
    copy_loop_s = load_copy_loop(len(named), args.timeout)
    settle()  # filled: nothing but this list holds them, so they go packed (the mapped row sends views)
    total = sum(t.numel() * t.element_size() for _, t in named)
    bucket = None if args.bucket_mb is None else int(args.bucket_mb * (1 << 20))
    baseline_bucket = int(args.baseline_bucket_mb * (1 << 20))
    shared_syncs = args.syncs if args.source == "both" else 0
    memcpy = copy_gbps(args.copy_mib << 20)
    both = concurrent_copy_gbps(args.copy_mib << 20)
    h2d = host_to_device_gbps(args.copy_mib << 20)
    ipc_dir = private_ipc_dir()
    baseline_addr = f"ipc://{ipc_dir}/baseline"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(baseline_addr)
    proc: mp.process.BaseProcess | None = None
    sender: WeightSender | None = None
    shared: SharedTensors | None = None
    saw: StopAndWait | None = None
    chosen = get_backend().transports()[args.transport] if args.transport else get_backend().default_transport()
    # on a device whose transport shares device memory: the same tensors read in place (mapped sources)
    mapped_syncs = shared_syncs if device.type != "cpu" and chosen.device_segments() is not None else 0
    progress = _Progress(2 * args.syncs + shared_syncs + mapped_syncs)
    try:
        sender = WeightSender(
            transport=args.transport,
            options=SenderOptions(bucket_bytes=bucket, num_buffers=args.num_buffers, timeout_s=args.timeout))
        # the baseline runs over the transport hwsync's run picked, one buffer of it
        transport = get_backend().transports()[args.transport] if args.transport else get_backend().default_transport()
        proc = mp.get_context("spawn").Process(
            target=_receiver_main, daemon=True,
            args=(sender.endpoint, baseline_addr, transport.name, json.dumps(spec), args.syncs, shared_syncs,
                  args.threads, args.timeout, args.receive == "into", mapped_syncs))
        proc.start()
        runs, one_copy, mapped, sent_counts = [], [], [], []
        for v in range(args.syncs):
            before = counted(None)
            runs.append(sender.send(named, version=v))
            sent_counts.append(counted(before))
            progress.step("hwsync packed", runs[-1].total_s)
        if shared_syncs:  # the same tensors, kept in hwsync's shared memory: sent by reference
            # from host copies: SharedTensors finds tied tensors by data_ptr, which the simulated device's lack
            shared = SharedTensors([(name, t.cpu()) for name, t in named], device=get_backend().device())
            for v in range(shared_syncs):
                one_copy.append(sender.send(list(shared.items()), version=args.syncs + v))
                progress.step("hwsync one-copy", one_copy[-1].total_s)
            shared.close()
        views = [(name, t.detach()) for name, t in named]  # held by `named` too, as a module holds its parameters
        for v in range(mapped_syncs):
            before = counted(None)
            mapped.append(sender.send(views, version=args.syncs + shared_syncs + v))
            sent_counts.append(counted(before))
            progress.step("hwsync mapped", mapped[-1].total_s)
        sender.close()
        alive = proc.is_alive
        hello = await_reply(sock, alive, args.timeout)
        saw = StopAndWait(sock, transport, baseline_bucket, alive, args.timeout)
        base = []
        for _ in range(args.syncs):
            base.append(saw.send(named))
            progress.step("stop-and-wait", base[-1])
        sock.send(pack({"t": "end"}))
        bye = await_reply(sock, alive, args.timeout)
        proc.join(args.timeout)
    finally:
        progress.close()
        if saw is not None:
            saw.close()
        if shared is not None:
            shared.close()
        if sender is not None:
            sender.close()
        sock.close(linger=0)
        ctx.term()
        remove_ipc_dir(baseline_addr)
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(5)
    errors = [e for e in (hello.get("error"), bye.get("error")) if e]
    if errors:
        raise RuntimeError(f"received weights are wrong: {errors}")
    timed = runs[1:] or runs
    hw_s = statistics.median(s.total_s for s in timed)
    sw_s = statistics.median(base[1:] or base)
    hw, sw = total / hw_s / 1e9, total / sw_s / 1e9
    oc_s = statistics.median(s.total_s for s in one_copy[1:] or one_copy) if one_copy else None
    oc = total / oc_s / 1e9 if oc_s else None
    mp_s = statistics.median(s.total_s for s in mapped[1:] or mapped) if mapped else None
    mgb = total / mp_s / 1e9 if mp_s else None
    received = hello.get("counts") or []
    counts = {"packed": count_summary(sent_counts[:args.syncs], received[:args.syncs], total),
              "mapped": count_summary(sent_counts[args.syncs:], received[args.syncs + shared_syncs:], total)
              if mapped else None}
    return {
        "cpus": os.cpu_count(), "torch": torch.__version__, "device": str(device), "transport": runs[0].transport,
        "threads": args.threads, "bytes": total,
        "tensors": len(named), "dtype": args.dtype, "bucket_bytes": runs[-1].bucket_bytes,
        "num_buffers": runs[-1].num_buffers,
        "receive": args.receive, "baseline_bucket_bytes": baseline_bucket, "pool": runs[-1].notes.get("pool"),
        "syncs": args.syncs, "hwsync_gbps": hw, "stop_and_wait_gbps": sw, "copy_gbps": memcpy,
        "concurrent_copy_gbps": both, "host_to_device_gbps": h2d,
        "hwsync_vs_host_to_device": hw / h2d if h2d else None, "two_copy_ceiling_gbps": both / 2,
        "hwsync_vs_copy": hw / memcpy, "hwsync_vs_two_copy_ceiling": hw / (both / 2),
        "hwsync_vs_stop_and_wait": hw / sw,
        "hwsync_s": hw_s, "stop_and_wait_s": sw_s,
        "one_copy_gbps": oc, "one_copy_s": oc_s, "one_copy_vs_copy": oc / memcpy if oc else None,
        "one_copy_vs_packed": oc / hw if oc else None, "one_copy_seconds": [s.total_s for s in one_copy],
        # syncs after the first that were replays of its plan (hwsync.colocated.replay)
        "packed_replayed": sum("replay" in s.notes for s in runs[1:]),
        "one_copy_replayed": sum("replay" in s.notes for s in one_copy[1:]),
        "mapped_replayed": sum("replay" in s.notes for s in mapped[1:]),
        # seconds each side took to load the compiled host copy loop before the syncs (None: not used, or no numba)
        "copy_loop_load_s": {"sender": copy_loop_s, "receiver": hello.get("copy_loop_s")},
        "mapped_gbps": mgb, "mapped_s": mp_s, "mapped_vs_copy": mgb / memcpy if mgb else None,
        "mapped_vs_packed": mgb / hw if mgb else None, "mapped_seconds": [s.total_s for s in mapped],
        "mapped_tensors": mapped[-1].notes.get("mapped", {}).get("tensors", 0) if mapped else None,
        "counts": counts if counts["packed"] or counts["mapped"] else None,
        "hwsync_seconds": [s.total_s for s in runs], "stop_and_wait_seconds": base,
        "hwsync_phases": {k: statistics.median(getattr(s, k) for s in timed) for k in ("pack_s", "wait_s")}
        | {k: statistics.median(hello[h][1:] or hello[h]) for k, h in (("receiver_load_s", "load_s"),
                                                                        ("receiver_engine_copy_s", "engine_s"))},
    }


def add_bench_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hwsync bench transfer`."""
    parser.add_argument("--gb", type=float, default=2.0, help="state dict size in GB (1e9 bytes)")
    parser.add_argument("--dtype", choices=[*_DTYPES, "mix"], default="bf16",
                        help="tensor dtype; mix: matrices bf16, norms and biases fp32")
    parser.add_argument("--tensors", type=int, default=None,
                        help="N equal tensors instead of the ~1.5B transformer's shapes")
    parser.add_argument("--moe", type=int, nargs="?", const=128, default=None, metavar="EXPERTS",
                        help="a mixture-of-experts model of this many experts a layer (default 128: Qwen3-30B-A3B's "
                             "48 layers, ~18,900 tensors), its widths scaled to --gb")
    parser.add_argument("--syncs", type=int, default=8, help="syncs per transfer; the median excludes the first")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="hwsync's bucket size in MiB (default: the transport's, for how the receiver takes "
                             "tensors)")
    parser.add_argument("--num-buffers", type=int, default=None,
                        help="hwsync's buffers (default: the transport's; the baseline has 1)")
    parser.add_argument("--baseline-bucket-mb", type=float, default=32.0,
                        help="the stop-and-wait baseline's bucket size in MiB (its best here)")
    parser.add_argument("--receive", choices=["into", "load"], default="into",
                        help="how hwsync's receiver fills the engine's tensors: into= (copied straight in) or a "
                             "load callback copying whole tensors (split ones reassembled first)")
    parser.add_argument("--source", choices=["both", "packed"], default="both",
                        help="both: also sync the same tensors from hwsync's shared memory, by reference (one copy "
                             "per byte); packed: only the packed path")
    parser.add_argument("--transport", default=None,
                        help="hwsync's transport by name (default: the backend's first usable one; `hwsync info` "
                             "lists them, e.g. cuda_ipc or shm on a GPU)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the copy reference in MiB")
    parser.add_argument("--timeout", type=float, default=120.0, help="timeout_s of every wait")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--peer", choices=["verl"], default=None,
                        help="also run a peer's own transfer code on the same state dict (verl: its colocated "
                             "BucketedWeightSender/Receiver, unmodified; needs verl installed)")
    parser.add_argument("--verl-bucket-mb", type=int, nargs="+", default=None,
                        help="verl's bucket sizes in MiB (default: its default, 1024, 512, the smallest holding the "
                             "largest tensor, and one below it)")
    parser.add_argument("--verl-syncs", type=int, default=4,
                        help="syncs per verl bucket size; the median excludes the first")
    tiny_defaults(parser, gb=0.01, syncs=2, copy_mib=8, verl_syncs=2)


def run_bench_transfer(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON); 0 on success."""
    if args.moe is not None and (args.tensors or args.moe < 1):
        raise SystemExit("--moe takes a positive number of experts and does not go with --tensors")
    if args.syncs < 1 or (args.num_buffers is not None and args.num_buffers < 2) or args.threads < 1 \
            or args.verl_syncs < 1:
        raise SystemExit("--syncs, --verl-syncs and --threads must be at least 1, --num-buffers at least 2")
    # a peer's module is imported first: without the peer installed the run stops before measuring anything
    peer = importlib.import_module(f"hwsync_tools.bench.{args.peer}_peer") if args.peer else None
    try:
        r = measure(args)
        if peer is not None:
            r[args.peer] = peer.measure_peer(args, r["hwsync_s"])
    except KeyboardInterrupt:
        print("hwsync bench transfer: interrupted (segments, sockets and the receiver process cleaned up)",
              file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"hwsync bench transfer: {r['cpus']} CPUs, torch {r['torch']}, tensors on {r['device']}, transport "
          f"{r['transport']}, {r['threads']} thread(s) per process; "
          f"{r['bytes'] / 1e9:.2f} GB in {r['tensors']} tensors ({r['dtype']}); hwsync buckets "
          f"{r['bucket_bytes'] / 2**20:g} MiB x {r['num_buffers']}, receiving by {r['receive']}; stop-and-wait "
          f"bucket {r['baseline_bucket_bytes'] / 2**20:g} MiB; "
          + (f"median of syncs 2-{r['syncs']}" if r["syncs"] > 1 else "one sync"))
    rows = [(f"hwsync packed ({r['num_buffers']} buf)", f"{r['hwsync_gbps']:.2f}", f"{r['hwsync_s']:.3f}"),
            ("stop-and-wait (1 buffer)", f"{r['stop_and_wait_gbps']:.2f}", f"{r['stop_and_wait_s']:.3f}"),
            ("single-thread copy" if r["device"] == "cpu" else f"copy on {r['device']}", f"{r['copy_gbps']:.2f}", ""),
            ("2 copies at once (sum)", f"{r['concurrent_copy_gbps']:.2f}", ""),
            ("two-copy ceiling (sum/2)", f"{r['two_copy_ceiling_gbps']:.2f}", ""),
            ("hwsync / copy", f"{r['hwsync_vs_copy']:.2f}x", ""),
            ("hwsync / two-copy ceiling", f"{r['hwsync_vs_two_copy_ceiling']:.2f}x", ""),
            ("hwsync / stop-and-wait", f"{r['hwsync_vs_stop_and_wait']:.2f}x", "")]
    if r["host_to_device_gbps"]:  # on an accelerator: the reference for a transport staged in host memory
        rows[4:4] = [("pinned host-to-device copy", f"{r['host_to_device_gbps']:.2f}", "")]
        rows += [("hwsync / host-to-device", f"{r['hwsync_vs_host_to_device']:.2f}x", "")]
    if r["one_copy_gbps"]:
        rows[1:1] = [("hwsync one-copy (shared)", f"{r['one_copy_gbps']:.2f}", f"{r['one_copy_s']:.3f}")]
        rows += [("one-copy / copy", f"{r['one_copy_vs_copy']:.2f}x", ""),
                 ("one-copy / packed", f"{r['one_copy_vs_packed']:.2f}x", "")]
    if r["mapped_gbps"]:  # on a device: read in place from the sender's own memory
        rows[1:1] = [("hwsync mapped (device)", f"{r['mapped_gbps']:.2f}", f"{r['mapped_s']:.3f}")]
        rows += [("mapped / copy", f"{r['mapped_vs_copy']:.2f}x", ""),
                 ("mapped / packed", f"{r['mapped_vs_packed']:.2f}x", "")]
    print(f"{'':26} {'GB/s':>8} {'s/sync':>8}")
    for label, gbps, secs in rows:
        print(f"{label:26} {gbps:>8} {secs:>8}")
    p = r["hwsync_phases"]
    for path in ("packed", "one_copy", "mapped"):
        if path == "packed" or r[f"{path}_gbps"]:
            print(f"{path.replace('_', '-')} syncs after the first replayed as planned: {r[f'{path}_replayed']} of "
                  f"{len(r['hwsync_seconds' if path == 'packed' else f'{path}_seconds']) - 1}")
    loop = r["copy_loop_load_s"]
    if loop["sender"] is not None or loop["receiver"] is not None:
        print("host copies of a replay: numba's compiled loop, loaded before the syncs in "
              + ", ".join(f"{side} {s:.1f} s" for side, s in loop.items() if s is not None))
    print(f"hwsync per sync: sender pack {p['pack_s']:.3f} s, wait {p['wait_s']:.3f} s; receiver buckets "
          f"{p['receiver_load_s']:.3f} s, of which load()'s copies {p['receiver_engine_copy_s']:.3f} s")
    for path, c in (r["counts"] or {}).items():  # what the device counted (the simulated accelerator counts)
        if c:
            print(f"counted per sync, {path}: {c['device_bytes_per_byte']:.2f} device bytes copied per byte synced, "
                  f"{c['copy_launches']:g} copy launches, {c['device_syncs']:g} device synchronizes, "
                  f"{c['event_waits']:g} event waits; segments exported {c['segment_exports_first']} and opened "
                  f"{c['segment_opens_first']} at the first sync, {c['segment_exports_later']} and "
                  f"{c['segment_opens_later']} after it")
    if r["pool"]:
        rate = r["pool"]["gbps"]
        print(f"buffer pool: using the {r['pool']['mode']} mode; last measured: hot pair {rate['hot']} GB/s, "
              f"whole pool (cold) {rate['cold']} GB/s")
    if peer is not None:
        peer.print_peer(r)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hwsync_tools.bench.transfer`."""
    parser = argparse.ArgumentParser(prog="hwsync bench transfer", description=__doc__.splitlines()[0])
    add_bench_transfer_arguments(parser)
    return run_bench_transfer(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
