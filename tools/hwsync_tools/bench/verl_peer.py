"""`hwsync bench transfer --peer verl`: verl's own colocated sender on the same state dict, in the same run.

verl 0.9.1 moves weights from its checkpoint engine into vLLM with BucketedWeightSender /
BucketedWeightReceiver (verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py), over
shared memory where the platform has no device IPC (as its vLLM adapter decides). Both run
here unmodified: the file is loaded by path (its package needs vLLM, the file does not), on a
CPU host with verl's platform registry given a "cpu" platform (hwsync.integrations.verl.
cpu_platform), and each sync is what verl's adapter does per update: a new sender (a fresh
shared-memory bucket), a new receiver copying every tensor into the engine's tensors. Bucket
sizes: verl's default, a sweep down to the smallest that holds the largest tensor (usually the
fastest), and one below it, where verl's shared-memory path refuses the tensor (verl issue
#5952): reported, not crashed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import multiprocessing as mp
import os
import statistics
import time
from types import ModuleType
from typing import Any

import torch
import zmq

from hwsync.control.endpoints import private_ipc_dir, remove_ipc_dir
from hwsync.sizes import MiB
from hwsync.sync.spec import dtype_from_name
from hwsync_tools.bench.stop_and_wait import await_reply, pack
from hwsync_tools.bench.verl_bare import default_bucket_mb, import_verl

if importlib.util.find_spec("verl") is None:
    raise SystemExit("hwsync bench transfer --peer verl needs verl: pip install 'hwsync[verl]', or run it in "
                     ".venv-verl (ci/setup-verl.sh)")



def load_verl_transfer(device_type: str, timeout_s: float) -> ModuleType:
    """verl's bucketed_weight_transfer module, loaded by path and unmodified; on the host, verl's platform is "cpu"."""
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARNING")  # verl's own switch: no INFO line per process
    verl = import_verl()
    if device_type == "cpu":
        from hwsync.integrations.verl.cpu_platform import use_cpu_platform

        use_cpu_platform()
    # verl's sockets come from the process's shared context and wait without a timeout; a default
    # receive timeout on that context turns a dead peer into an error instead of a hang
    zmq.Context.instance().setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    path = os.path.join(os.path.dirname(str(verl.__file__)), "workers", "rollout", "vllm_rollout",
                        "bucketed_weight_transfer.py")
    spec = importlib.util.spec_from_file_location("hwsync_bench_verl_bucketed_weight_transfer", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _use_shm() -> bool:
    from verl.utils.device import is_support_ipc

    return not is_support_ipc()  # verl's vLLM adapter makes the same choice


def _receiver_main(handle: str, reply: str, spec_json: str, syncs: int, threads: int, device: str,
                   timeout_s: float) -> None:
    """The engine stand-in: verl's receiver per sync, copying into preallocated tensors; checks each sync."""
    torch.set_num_threads(threads)
    transfer = load_verl_transfer(torch.device(device).type, timeout_s)
    spec = json.loads(spec_json)
    dest = {n: torch.full(s, -1.0, dtype=dtype_from_name(d), device=device) for n, s, d in spec}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(reply)
    try:
        sock.send(pack({"t": "up"}))
        for _ in range(syncs):
            seen: list[str] = []

            def load(weights: list[tuple[str, torch.Tensor]], is_last: bool, seen: list[str] = seen) -> None:
                for name, tensor in weights:  # what an engine's load does: copy out of the bucket
                    dest[name].copy_(tensor)
                    seen.append(name)

            transfer.BucketedWeightReceiver(handle, device=torch.device(device), use_shm=_use_shm()).receive_weights(
                on_bucket_received=load)
            error = None if len(seen) == len(spec) else f"received {len(seen)} of {len(spec)} tensors"
            for i, (name, _, _) in enumerate(spec):
                flat = dest[name].reshape(-1)
                if error is None and flat.numel() and (float(flat[0]) != i % 128 or float(flat[-1]) != i % 128):
                    error = f"tensor {name} holds {float(flat[0])}, expected {i % 128}"
                flat.fill_(-1)  # before replying: the sender's next timed sync starts on the reply
            sock.send(pack({"t": "sync", "error": error}))
    finally:
        sock.close()
        ctx.term()


def run_bucket(named: list[tuple[str, torch.Tensor]], spec: list, bucket_mb: int, syncs: int, threads: int,
               timeout_s: float) -> dict[str, Any]:
    """verl's sender here, its receiver in a spawned process, `syncs` syncs at one bucket size."""
    device = str(named[0][1].device)
    transfer = load_verl_transfer(named[0][1].device.type, timeout_s)
    ipc_dir = private_ipc_dir()
    handle, reply = f"ipc://{ipc_dir}/verl", f"ipc://{ipc_dir}/reply"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(reply)
    proc = mp.get_context("spawn").Process(target=_receiver_main, daemon=True,
                                           args=(handle, reply, json.dumps(spec), syncs, threads, device, timeout_s))
    proc.start()
    seconds: list[float] = []
    error = None
    try:
        await_reply(sock, proc.is_alive, timeout_s)
        for _ in range(syncs):
            sender = transfer.BucketedWeightSender(handle, bucket_size_mb=bucket_mb, use_shm=_use_shm())
            t0 = time.perf_counter()
            try:
                asyncio.run(sender.async_send_weights(iter(named)))
            except AssertionError as exc:  # verl's shared-memory path refuses a tensor larger than the bucket
                error = str(exc)
                break
            seconds.append(time.perf_counter() - t0)
            wrong = await_reply(sock, proc.is_alive, timeout_s).get("error")
            if wrong:
                raise RuntimeError(f"verl's receiver got wrong weights at {bucket_mb} MiB: {wrong}")
    finally:
        sock.close()
        ctx.term()
        proc.kill()
        proc.join(10)
        remove_ipc_dir(handle)
    timed = seconds[1:] or seconds
    median = statistics.median(timed) if timed else None
    total = sum(t.numel() * t.element_size() for _, t in named)
    return {"bucket_mb": bucket_mb, "seconds": seconds, "median_s": median,
            "gbps": total / median / 1e9 if median else None, "error": error}


def sweep(largest_bytes: int, default_mb: int) -> list[int]:
    """verl's default, 1024 and 512 MiB, the smallest size holding the largest tensor, and the power of two below."""
    fits = math.ceil(largest_bytes / MiB)
    below = 1 << max(0, fits - 1).bit_length() - 1 if fits > 1 else 0
    sizes = {default_mb, 1024, 512, fits} | ({below} if below else set())
    return sorted((s for s in sizes if s >= below), reverse=True)


def measure_peer(args: Any, hwsync_s: float) -> dict[str, Any]:
    """verl's sender at each bucket size of the sweep (or --verl-bucket-mb) on the bench's state dict; ratios."""
    from hwsync_tools.bench.transfer import bench_device, build, model_spec

    spec = model_spec(int(args.gb * 1e9), args.dtype, args.tensors)
    named = build(spec, bench_device()[0])

    verl = import_verl()
    default_mb = default_bucket_mb()
    largest = max(named, key=lambda nt: nt[1].numel() * nt[1].element_size())
    largest_bytes = largest[1].numel() * largest[1].element_size()
    sizes = args.verl_bucket_mb or sweep(largest_bytes, default_mb)
    runs = [run_bucket(named, spec, mb, args.verl_syncs, args.threads, args.timeout) for mb in sizes]
    done = [r for r in runs if r["median_s"]]
    best = min(done, key=lambda r: r["median_s"]) if done else None
    default = next((r for r in done if r["bucket_mb"] == default_mb), None)
    return {"version": verl.__version__, "bare": getattr(verl, "bare_because", None), "use_shm": _use_shm(),
            "syncs": args.verl_syncs,
            "largest_tensor": largest[0], "largest_tensor_bytes": largest_bytes, "default_bucket_mb": default_mb,
            "runs": runs, "best_bucket_mb": best["bucket_mb"] if best else None,
            "failed_bucket_mb": [r["bucket_mb"] for r in runs if r["error"]],
            "hwsync_vs_verl_default": default["median_s"] / hwsync_s if default else None,
            "hwsync_vs_verl_best": best["median_s"] / hwsync_s if best else None}


def print_peer(r: dict[str, Any]) -> None:
    """The verl rows under `hwsync bench transfer`'s table."""
    v = r["verl"]
    print(f"\nverl {v['version']} BucketedWeightSender/Receiver ({'shared memory' if v['use_shm'] else 'device IPC'}), "
          f"run unmodified on the same state dict; largest tensor {v['largest_tensor']} "
          f"{v['largest_tensor_bytes'] / MiB:.0f} MiB; median of syncs 2-{v['syncs']}")
    if v["bare"]:
        print(f"(verl's packages loaded bare: {v['bare']}; its transfer code runs as it is)")
    print(f"{'':44} {'GB/s':>8} {'s/sync':>8} {'hwsync is':>10}")
    print(f"{'hwsync':44} {r['hwsync_gbps']:>8.2f} {r['hwsync_s']:>8.3f}")
    for run in v["runs"]:
        tags = [t for t, hit in (("verl default", run["bucket_mb"] == v["default_bucket_mb"]),
                                 ("best", run["bucket_mb"] == v["best_bucket_mb"])) if hit]
        label = f"verl, {run['bucket_mb']} MiB bucket" + (f" ({', '.join(tags)})" if tags else "")
        if run["error"]:
            print(f"{label:44} FAILED: {run['error']}")
        else:
            print(f"{label:44} {run['gbps']:>8.2f} {run['median_s']:>8.3f} "
                  f"{run['median_s'] / r['hwsync_s']:>9.2f}x")
    for key, what in (("hwsync_vs_verl_default", "verl's default bucket"),
                      ("hwsync_vs_verl_best", "verl's best bucket")):
        if v[key]:
            print(f"hwsync vs {what}: {v[key]:.2f}x faster")
