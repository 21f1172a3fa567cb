"""`hwsync roundtrip`: send tensors to a second process through the selected backend and verify them."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp

import torch

from hwsync.backend.registry import get_backend
from hwsync.colocated.receiver import WeightReceiver
from hwsync.colocated.sender import WeightSender
from hwsync.sync.options import SenderOptions


def _sample(megabytes: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, int(megabytes * 2**20 / 4 / 3))
    return {"embed": torch.randn(n, generator=g), "layer.0.w": torch.randn(n, generator=g).to(torch.bfloat16),
            "layer.0.b": torch.randint(-100, 100, (n,), generator=g, dtype=torch.int32), "scale": torch.tensor(2.5)}


def _digest(t: torch.Tensor) -> str:
    # received tensors live on the backend's device: copy to the host first (numpy() refuses device tensors)
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _receive(endpoint: str, q: "mp.Queue[dict]") -> None:
    got: dict[str, str] = {}
    with WeightReceiver(endpoint, timeout_s=60) as receiver:
        receiver.receive(lambda pairs: got.update({n: _digest(t) for n, t in pairs}))
    q.put(got)


def run_roundtrip(megabytes: float, as_json: bool) -> int:
    """Send ~`megabytes` of tensors to a spawned process; exit 0 only if every byte matches."""
    tensors = _sample(megabytes)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with WeightSender(options=SenderOptions(bucket_bytes=8 << 20, timeout_s=60)) as sender:
        proc = ctx.Process(target=_receive, args=(sender.endpoint, q))
        proc.start()
        try:
            stats = sender.send(tensors.items(), version=1)
            got = q.get(timeout=60)
        finally:
            proc.join(30)
    ok = got == {n: _digest(t) for n, t in tensors.items()}
    report = {"backend": get_backend().name, "transport": stats.transport, "verified": ok, **stats.to_dict()}
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(f"roundtrip over {report['backend']}/{stats.transport}: {stats.bytes / 1e6:.1f} MB in "
              f"{stats.tensors} tensors, {stats.buckets} buckets, {stats.gbps:.2f} GB/s -> "
              f"{'verified bit-exact' if ok else 'MISMATCH'}")
    return 0 if ok else 1
