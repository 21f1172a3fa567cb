"""Trainer ranks and engine ranks as Ray actors, syncing weights over a collective group.

    python examples/ray_disaggregated.py --senders 2 --engines 2 --steps 3

On a real cluster the actors land on different nodes (use placement groups or node
resources); here `ray.init()` starts a local cluster. Each engine actor stands for an engine
node: it receives with a CrossNodeReceiver; in production its load would forward into the
local vLLM engine (see hwsync.disaggregated.LocalForwarder and docs/disaggregated.md). Every rank
runs on the CPU backend here (gloo); on GPUs the same code runs with NCCL, on Ascend with HCCL.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading

import ray
import torch
from hwsync.sync.options import CrossNodeOptions


def model_weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """A stand-in for the trainer's state dict at `step` (one tensor larger than a bucket)."""
    g = torch.Generator().manual_seed(step)
    return [("embed.weight", torch.randn(4096, 64, generator=g)),
            ("layer0.weight", torch.randn(256, 256, generator=g).to(torch.bfloat16)),
            ("layer0.bias", torch.randn(256, generator=g))]


def node_ip() -> str:
    """The address other nodes reach this actor's node at."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostbyname(socket.gethostname())


@ray.remote
class Trainer:
    """One trainer rank; rank 0 creates the control endpoint everyone else connects to."""

    def __init__(self, rank: int, senders: int, engines: int, endpoint: str | None, bucket_bytes: int) -> None:
        os.environ.setdefault("HWSYNC_BACKEND", "cpu")
        from hwsync.disaggregated import CrossNodeSender

        ip = node_ip()
        self.sender = CrossNodeSender(endpoint or f"tcp://{ip}:0", rank=rank, num_senders=senders, num_receivers=engines, group_host=ip, options=CrossNodeOptions(bucket_bytes=bucket_bytes, timeout_s=60))

    def endpoint(self) -> str:
        """Rank 0's control endpoint (with its token)."""
        return self.sender.endpoint

    def sync(self, step: int) -> dict:
        """Send this step's weights; returns the SyncStats as a dict."""
        return self.sender.send(model_weights(step), version=step).to_dict()


@ray.remote
class Engine:
    """One engine rank; receives on a thread so the actor keeps answering calls."""

    def __init__(self, rank: int, endpoint: str) -> None:
        os.environ.setdefault("HWSYNC_BACKEND", "cpu")
        from hwsync.disaggregated import CrossNodeReceiver

        self.receiver = CrossNodeReceiver(endpoint, rank=rank, timeout_s=60)
        self.weights: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start_receive(self) -> None:
        """Begin receiving one sync (returns at once)."""
        def run() -> None:
            try:
                self.receiver.receive(lambda ts: self.weights.update({n: t.clone() for n, t in ts}))
            except BaseException as exc:  # noqa: BLE001 - reported by finish_receive
                self._error = exc
        self._error, self._thread = None, threading.Thread(target=run)
        self._thread.start()

    def finish_receive(self, step: int) -> bool:
        """Wait for the sync; True if the weights equal the trainer's of `step`, bit for bit."""
        assert self._thread is not None
        self._thread.join()
        if self._error is not None:
            raise self._error
        return all(torch.equal(self.weights[n], t) for n, t in model_weights(step))


def main() -> int:
    """Start the actors, run --steps syncs, print each one's figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bucket-kb", type=int, default=256)
    args = parser.parse_args()
    ray.init(num_cpus=args.senders + args.engines, include_dashboard=False, log_to_driver=True)
    try:
        bucket = args.bucket_kb << 10
        trainer0 = Trainer.remote(0, args.senders, args.engines, None, bucket)
        endpoint = ray.get(trainer0.endpoint.remote())
        trainers = [trainer0] + [Trainer.remote(s, args.senders, args.engines, endpoint, bucket)
                                 for s in range(1, args.senders)]
        engines = [Engine.remote(r, endpoint) for r in range(args.engines)]
        for step in range(args.steps):
            ray.get([e.start_receive.remote() for e in engines])
            stats = ray.get([t.sync.remote(step) for t in trainers])
            exact = ray.get([e.finish_receive.remote(step) for e in engines])
            print(f"step {step}: {stats[0]['bytes'] / 1e6:.1f} MB, {stats[0]['buckets']} buckets over "
                  f"{args.senders} senders in {stats[0]['total_s']:.3f}s; bit-exact on every engine: {all(exact)}")
            if not all(exact):
                return 1
        return 0
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
