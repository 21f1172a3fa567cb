"""Processes for the one-copy tests: receivers of shared-memory syncs, and a sender that can be killed."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hwsync import WeightReceiver, WeightSender
from hwsync.backend.registry import get_backend
from hwsync.sync.options import SenderOptions
from transfer_procs import digest


def model(seed: int = 0) -> torch.nn.Module:
    """A small MLP with a buffer (a running mean), deterministic."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.ReLU(), torch.nn.Linear(128, 40),
                              torch.nn.LayerNorm(40))
    net.register_buffer("running", torch.arange(40, dtype=torch.float32))
    return net


def receive_digests(endpoint: str, syncs: int, q, mode: str = "into", slow_s: float = 0.0,
                    timeout_s: float = 30.0) -> None:
    """Receive `syncs` syncs `into` tensors on this backend's device or through `load` (sleeping `slow_s`
    before reading each view), or fail in `into` ("fail"); report every tensor's digest, or the error with the
    digests of what load read before it."""
    torch.set_num_threads(1)
    device = get_backend().device().torch_device()
    dest: dict[str, torch.Tensor] = {}

    def into(name, dtype, shape):
        if mode == "fail":
            raise RuntimeError(f"the engine has no room for {name} (test)")
        if name not in dest:
            dest[name] = torch.empty(shape, dtype=dtype, device=device)
        return dest[name]

    with WeightReceiver(endpoint, timeout_s=timeout_s) as receiver:
        for _ in range(syncs):
            got: dict[str, list] = {}

            def load(pairs):
                for name, t in pairs:
                    if slow_s:
                        print("loading", flush=True)
                        time.sleep(slow_s)  # the trainer would step now if send() had returned
                    got[name] = digest(t)

            try:
                stats = receiver.receive(load, into=into if mode in ("into", "fail") else None)
                got.update({n: digest(t) for n, t in dest.items()})
                q.put({"digests": got, "version": receiver.version, "tensors": stats.tensors,
                       "buckets": stats.buckets})
            except Exception as exc:
                q.put({"error": f"{type(exc).__name__}: {exc}", "incomplete": receiver.incomplete, "read": got})


def slow_receiver_main(endpoint: str) -> None:
    """A receiver whose load stalls on the first shared view (to be killed); prints when loading."""
    with WeightReceiver(endpoint, timeout_s=30) as receiver:
        def load(pairs):
            print("loading", flush=True)
            time.sleep(600)

        receiver.receive(load)


def sender_main() -> None:
    """A trainer whose parameters live in shared memory: sends them, then one packed tensor, then stalls."""
    from hwsync import SharedParameters

    net = model()
    shared = SharedParameters(net)

    def source():
        yield from net.state_dict().items()
        yield "packed", torch.ones(1000)  # a packed tensor: the references before it go out first
        print("stalling", flush=True)
        time.sleep(600)

    with WeightSender(options=SenderOptions(timeout_s=30)) as sender:
        print(json.dumps({"endpoint": sender.endpoint, "pid": os.getpid(), "segments": shared.shared.segment_names}),
              flush=True)
        sender.send(source(), version=1)


if __name__ == "__main__":
    if sys.argv[1] == "sender":
        sender_main()
    elif sys.argv[1] == "slow_receiver":
        slow_receiver_main(sys.argv[2])
