"""`hwsync roundtrip`: send tensors to a second process through the selected backend and verify them.

What it times, apart: the receiver process's start-up (spawn, imports, connect: no sync's cost), the
first sync (which also opens and maps the shared buffers) and a warm sync on the same session, whose
rate is what every later training step sees. Each sync carries other bytes, and each is verified.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import time
from typing import Any

import torch

from hwsync.backend.registry import get_backend
from hwsync.colocated.receiver import WeightReceiver
from hwsync.colocated.sender import WeightSender
from hwsync.sync.options import SenderOptions
from hwsync.sync.stats import SyncStats

#: the syncs sent: the first (buffers set up) and a warm one
SYNCS = 2


def _sample(megabytes: float, version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    n = max(1, int(megabytes * 2**20 / 4 / 3))
    return {"embed": torch.randn(n, generator=g), "layer.0.w": torch.randn(n, generator=g).to(torch.bfloat16),
            "layer.0.b": torch.randint(-100, 100, (n,), generator=g, dtype=torch.int32),
            "scale": torch.tensor(2.5 + version)}


def _digest(t: torch.Tensor) -> str:
    # received tensors live on the backend's device: copy to the host first (numpy() refuses device tensors)
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _receive(endpoint: str, q: "mp.Queue[Any]") -> None:
    with WeightReceiver(endpoint, timeout_s=60) as receiver:
        q.put("up")  # the start-up ends here: what follows is the first sync
        for _ in range(SYNCS):
            got: dict[str, str] = {}

            def load(pairs: list[tuple[str, torch.Tensor]], got: dict[str, str] = got) -> None:
                got.update({n: _digest(t) for n, t in pairs})

            receiver.receive(load)
            q.put(got)


def _rate(stats: SyncStats) -> dict[str, Any]:
    return {"seconds": stats.total_s, "gbps": stats.gbps, "stats": stats.to_dict()}


def run_roundtrip(megabytes: float, as_json: bool) -> int:
    """Send ~`megabytes` of tensors to a spawned process twice; exit 0 only if every byte of both syncs matches."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    syncs: list[SyncStats] = []
    verified: list[bool] = []
    with WeightSender(options=SenderOptions(bucket_bytes=8 << 20, timeout_s=60)) as sender:
        t0 = time.perf_counter()
        proc = ctx.Process(target=_receive, args=(sender.endpoint, q))
        proc.start()
        try:
            assert q.get(timeout=60) == "up"
            startup_s = time.perf_counter() - t0
            for version in range(1, SYNCS + 1):
                tensors = _sample(megabytes, version)
                syncs.append(sender.send(tensors.items(), version=version))
                verified.append(q.get(timeout=60) == {n: _digest(t) for n, t in tensors.items()})
        finally:
            proc.join(30)
    first, warm = syncs[0], syncs[-1]
    ok = all(verified)
    report = {"backend": get_backend().name, "transport": warm.transport, "verified": ok, "bytes": warm.bytes,
              "tensors": warm.tensors, "buckets": warm.buckets, "startup_s": startup_s, "gbps": warm.gbps,
              "first_sync": _rate(first), "warm_sync": _rate(warm)}
    if as_json:
        print(json.dumps(report, indent=2))
        return 0 if ok else 1
    print(f"roundtrip over {report['backend']}/{warm.transport}: {warm.bytes / 1e6:.1f} MB in {warm.tensors} tensors, "
          f"{warm.buckets} buckets of {warm.bucket_bytes >> 20} MiB x {warm.num_buffers}, "
          f"{'both syncs verified bit-exact' if ok else 'MISMATCH'}")
    print(f"  receiver start-up {startup_s:6.3f} s   (spawn, imports, connect: not part of any sync)")
    print(f"  first sync        {first.total_s:6.3f} s   {first.gbps:6.2f} GB/s  (also opens and maps the buffers)")
    print(f"  warm sync         {warm.total_s:6.3f} s   {warm.gbps:6.2f} GB/s  (a sync's rate, as each later step "
          f"sees it)")
    return 0 if ok else 1
