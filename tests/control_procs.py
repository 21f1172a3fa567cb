"""Processes for the control-plane tests: receivers that serve until killed, senders that die between syncs."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hwsync import CrossNodeReceiver, WeightReceiver, WeightSender
from hwsync.sync.options import SenderOptions

import transfer_procs as procs


def _receive_and_report(receiver, q) -> bool:
    """Receive one sync; report its digests and version, or the error (with when); whether it succeeded."""
    got: dict[str, list] = {}

    def load(pairs):
        for name, t in pairs:
            got[name] = procs.digest(t)

    t0 = time.monotonic()
    try:
        receiver.receive(load)
        q.put({"digests": got, "version": receiver.version})
        return True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        q.put({"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0, "at": time.time()})
        return False


def serve(endpoint: str, q, doorbell: bool = True, timeout_s: float = 30.0) -> None:
    """Receive syncs until killed; report each one's digests and version, or the error."""
    if not doorbell:
        os.environ["HWSYNC_DOORBELL"] = "0"  # one ZeroMQ frame per bucket and per release
    torch.set_num_threads(1)
    receiver = WeightReceiver(endpoint, timeout_s=timeout_s)
    q.put({"up": os.getpid()})
    while True:
        _receive_and_report(receiver, q)


def serve_collective(endpoint: str, q, rank: int = 0, timeout_s: float = 30.0, proto: int | None = None,
                     toy: bool = False) -> None:
    """A CrossNodeReceiver that receives syncs until killed; a misfit one (`proto`, `toy`, rank) stops at a failure.

    `proto`: the protocol version this process speaks; `toy`: run the third-party test backend
    (tests/plugins/hwsync_toy, gloo under another name) instead of cpu.
    """
    os.environ["HWSYNC_BACKEND"] = "cpu"
    if proto is not None:  # this process runs a "newer" hwsync
        import hwsync.disaggregated.link

        hwsync.disaggregated.link.PROTOCOL_VERSION = proto
    backend = None
    if toy:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "plugins", "hwsync_toy"))
        from hwsync_toy import ToyBackend

        backend = ToyBackend()
    receiver = CrossNodeReceiver(endpoint, rank=rank, timeout_s=timeout_s, backend=backend)
    misfit = proto is not None or toy or rank > 0
    q.put({"up": os.getpid()})
    while _receive_and_report(receiver, q) or not misfit:
        pass
    receiver.close()


def receive_once(endpoint: str, q, timeout_s: float) -> None:
    """One receive; report its outcome and how long it took."""
    receiver = WeightReceiver(endpoint, timeout_s=timeout_s)
    q.put({"up": os.getpid()})
    t0 = time.monotonic()
    try:
        receiver.receive(lambda pairs: None)
        q.put({"version": receiver.version, "after_s": time.monotonic() - t0})
    except Exception as exc:  # noqa: BLE001
        q.put({"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0})
    receiver.close()


def sender_then_idle(address: str, syncs: int) -> None:
    """A sender that prints its endpoint, completes `syncs` syncs, prints "idle" and waits to be killed.

    `address` is "ipc" (a private ipc:// socket) or a tcp:// address to bind.
    """
    with WeightSender(None if address == "ipc" else address, options=SenderOptions(timeout_s=30)) as sender:
        print(json.dumps({"endpoint": sender.endpoint, "pid": os.getpid()}), flush=True)
        for v in range(1, syncs + 1):
            sender.send(procs.versioned(v).items(), version=v)
        print("idle", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    sender_then_idle(sys.argv[1], int(sys.argv[2]))
