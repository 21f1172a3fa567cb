"""Parts of `hwsync bench transfer`: where its tensors live, the copy references, and the receiver process."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import torch
import zmq

from hwsync.sync.spec import dtype_from_name
from hwsync_tools.bench.stop_and_wait import pack, stop_and_wait_receive

Named = list[tuple[str, torch.Tensor]]
Spec = list[tuple[str, list[int], str]]


def counted(before: dict[str, int] | None) -> dict[str, int]:
    """What the backend's device counted since `before` (Device.counters: the simulated accelerator counts)."""
    from hwsync.backend.registry import get_backend

    after = get_backend().device().counters() or {}
    return {k: v - (before or {}).get(k, 0) for k, v in after.items() if v != (before or {}).get(k, 0)}


def count_summary(sent: list[dict[str, int]], received: list[dict[str, int]], nbytes: int) -> dict[str, Any] | None:
    """Per sync (median over the syncs after the first), what both processes' devices counted: device bytes copied
    per byte synced, copy launches, segment exports and opens, device-wide synchronizes; None where nothing counts."""
    if not any(sent) and not any(received):
        return None
    both = [{k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}} for a, b in zip(sent, received)]
    later = both[1:] or both

    def median(key: str, rows: list[dict[str, int]] = later) -> float:
        values = sorted(r.get(key, 0) for r in rows)
        return values[len(values) // 2]

    return {"device_bytes_per_byte": median("copy_bytes") / nbytes, "copy_launches": median("copy_launches"),
            "device_syncs": median("device_syncs"), "event_waits": median("event_waits"),
            "segment_exports_first": both[0].get("segment_exports", 0) if both else 0,
            "segment_opens_first": both[0].get("segment_opens", 0) if both else 0,
            "segment_exports_later": sum(r.get("segment_exports", 0) for r in both[1:]),
            "segment_opens_later": sum(r.get("segment_opens", 0) for r in both[1:])}


def bench_device() -> tuple[torch.device, Callable[[], None]]:
    """Where the benchmark's tensors live (the selected backend's device) and how to wait for it."""
    from hwsync.backend.registry import get_backend

    device = get_backend().device()
    return device.torch_device(), device.synchronize


def build(spec: Spec, device: torch.device | str = "cpu") -> Named:
    """Tensors of the spec; tensor i is filled with i % 128 (exact in every dtype) for the check."""
    return [(n, torch.full(s, float(i % 128), dtype=dtype_from_name(d), device=device))
            for i, (n, s, d) in enumerate(spec)]


def copy_gbps(nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """`dst.copy_(src)` bandwidth on the backend's device over `nbytes` of uint8, best of `repeat`, in GB/s."""
    device, sync = bench_device()
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst
    sync()
    best = min(_timed(lambda: (dst.copy_(src), sync())) for _ in range(repeat))
    return nbytes / best / 1e9


def host_to_device_gbps(nbytes: int = 1 << 30, repeat: int = 3) -> float | None:
    """Copy bandwidth from pinned host memory onto the backend's device, best of `repeat`, in GB/s; None on the CPU.

    The reference for a transport that stages buckets in host memory (the shm transport on a GPU or NPU).
    """
    from hwsync.backend.registry import get_backend

    device = get_backend().device()
    target, sync = device.torch_device(), device.synchronize
    if target.type == "cpu":
        return None
    src = torch.ones(nbytes, dtype=torch.uint8)
    pinned = device.pin_host_memory(src)
    try:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=target)
        dst.copy_(src, non_blocking=pinned)
        sync()
        best = min(_timed(lambda: (dst.copy_(src, non_blocking=pinned), sync())) for _ in range(repeat))
    finally:
        if pinned:
            device.unpin_host_memory(src)
    return nbytes / best / 1e9


def _copy_worker(nbytes: int, barrier: Any, q: Any) -> None:
    torch.set_num_threads(1)
    device, sync = bench_device()
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    barrier.wait()  # both processes copy at the same time, as sender and receiver do
    q.put(nbytes / min(_timed(lambda: (dst.copy_(src), sync())) for _ in range(3)) / 1e9)


def concurrent_copy_gbps(nbytes: int, processes: int = 2) -> float:
    """Summed bandwidth of `processes` single-thread copies running at once, in GB/s.

    A sync copies every byte twice (packed by the sender, loaded by the receiver), both at once,
    so half of this is the most any two-copy pipeline can move on this machine.
    """
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_copy_worker, args=(nbytes, barrier, q), daemon=True) for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        return sum(q.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(10)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def load_copy_loop(tensors: int, timeout_s: float) -> float | None:
    """Load hwsync's compiled host copy loop (hwsync.sync.host_copy) before the timed syncs, where a plan of this
    many tensors uses it: a trainer's next sync comes seconds after its first, by when the load a plan starts in the
    background is done, while these syncs follow each other at once. Its load time, or None where it is not used."""
    from hwsync.sync import host_copy

    if tensors < host_copy.COMPILED_FROM:
        return None
    t0 = time.perf_counter()
    return time.perf_counter() - t0 if host_copy.wait(timeout_s) else None


def _receiver_main(endpoint: str, baseline: str, transport: str, spec_json: str, syncs: int, shared_syncs: int,
                   threads: int, timeout_s: float, into: bool, mapped_syncs: int = 0) -> None:
    """The spawned engine stand-in: packed syncs, one-copy syncs from shared host memory, syncs from the sender's
    mapped device memory, then stop-and-wait syncs, into the same destinations; what its device counted per sync."""
    torch.set_num_threads(threads)
    from hwsync.colocated.receiver import WeightReceiver

    spec: Spec = json.loads(spec_json)
    copy_loop_s = load_copy_loop(len(spec), timeout_s)
    device, _ = bench_device()
    dest = {n: torch.empty(s, dtype=dtype_from_name(d), device=device) for n, s, d in spec}
    for t in dest.values():
        t.fill_(-1)  # resident, like an engine's parameters

    copy_s = [0.0]

    def load(tensors: Named) -> None:
        t0 = time.perf_counter()
        for name, t in tensors:
            dest[name].copy_(t)
        copy_s[0] += time.perf_counter() - t0

    def check() -> str | None:
        for i, (n, _, _) in enumerate(spec):
            t = dest[n].reshape(-1)
            if t.numel() and (float(t[0]) != i % 128 or float(t[-1]) != i % 128):
                return f"tensor {n} holds {float(t[0])}, expected {i % 128}"
        for t in dest.values():
            t.fill_(-1)  # the next transfer must write every tensor again
        return None

    load_s, engine_s, errors, counts = [], [], [], []
    with WeightReceiver(endpoint, timeout_s=timeout_s) as rx:
        for count in (syncs, shared_syncs, mapped_syncs):
            for _ in range(count):
                copy_s[0] = 0.0
                before = counted(None)
                if into:  # hwsync copies each tensor's bytes straight into the engine's tensor
                    load_s.append(rx.receive(into=lambda name, dtype, shape: dest[name]).load_s)
                    engine_s.append(load_s[-1])
                else:
                    load_s.append(rx.receive(load).load_s)
                    engine_s.append(copy_s[0])
                counts.append(counted(before))
            errors.append(check() if count else None)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(baseline)
    try:
        sock.send(pack({"t": "hello", "error": errors[0] or errors[1] or errors[2], "load_s": load_s[:syncs],
                        "engine_s": engine_s[:syncs], "counts": counts, "copy_loop_s": copy_loop_s}))
        from hwsync.backend.registry import get_backend

        def load_and_wait(tensors: Named) -> None:  # the baseline's ack must follow the copies (release waits
            load(tensors)  # for nothing on every transport: on the sim, not on NPU IPC before this release either)
            get_backend().device().synchronize()

        stop_and_wait_receive(sock, get_backend().transports()[transport], load_and_wait, timeout_s)
        sock.send(pack({"t": "bye", "error": check()}))
    finally:
        sock.close()
        ctx.term()
