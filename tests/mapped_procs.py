"""Processes for the mapped-source tests: receivers that report digests and what the device counted, and a
trainer that can be killed mid-sync."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from transfer_procs import digest

from hwsync import WeightReceiver, WeightSender
from hwsync.backend.registry import get_backend
from hwsync.sync.options import SenderOptions


def model(device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A small MLP with a buffer, deterministic, on `device`."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.ReLU(), torch.nn.Linear(128, 40),
                              torch.nn.LayerNorm(40))
    net.register_buffer("running", torch.arange(40, dtype=torch.float32))
    return net.to(device)


def step(net: torch.nn.Module, seed: int) -> None:
    """An optimizer-like step: every parameter and buffer updated in place (autograd does not run on the sim)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            t.mul_(0.5).add_(torch.randn(t.shape, generator=g).to(t.device))


def counted(device, before: dict) -> dict:
    """What the device counted since `before` (nothing where it does not count)."""
    after = device.counters() or {}
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def receive(endpoint: str, syncs: int, q, mode: str = "into", die_in_sync: int | None = None,
            timeout_s: float = 60.0, env: dict[str, str] | None = None, hold=None) -> None:
    """Receive `syncs` syncs into tensors on this backend's device (or through `load`); report each sync's
    digests, counts and how many device segments stay mapped. `die_in_sync`: SIGKILL itself in that sync's first
    into() call, with the sender's segments mapped. `env`: set before the device starts (HWSYNC_SIM_*);
    `hold`: an Event to wait for after each receive() returned, before anything reads the destinations."""
    os.environ.update(env or {})
    torch.set_num_threads(1)
    device = get_backend().device()
    where = device.torch_device()
    dest: dict[str, torch.Tensor] = {}
    current = [0]

    def into(name, dtype, shape):
        if die_in_sync == current[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        if name not in dest:
            dest[name] = torch.empty(shape, dtype=dtype, device=where)
        return dest[name]

    with WeightReceiver(endpoint, timeout_s=timeout_s) as receiver:
        for n in range(syncs):
            current[0] = n
            got: dict[str, list] = {}

            def load(pairs, got=got):
                for name, t in pairs:
                    got[name] = digest(t)

            before = dict(device.counters() or {})
            try:
                stats = receiver.receive(load, into=into if mode == "into" else None)
                counts = counted(device, before)  # before the digests below copy anything
                if hold is not None:
                    hold.wait(60)
                got.update({name: digest(t) for name, t in dest.items()})
                q.put({"digests": got, "version": receiver.version, "counts": counts, "tensors": stats.tensors,
                       "buckets": stats.buckets, "mapped": receiver._shared.device_segments.mapped})
            except Exception as exc:  # noqa: BLE001 - reported to the test
                q.put({"error": f"{type(exc).__name__}: {exc}",
                       "mapped": receiver._shared.device_segments.mapped if receiver._shared else 0})


def sender_main() -> None:
    """A trainer on the sim device: one sync of its parameters, then one whose source stalls after the references
    went out (a packed tensor follows them); prints its endpoint, then `stalling`."""
    device = get_backend().device()
    net = model(device.torch_device())

    def source():
        yield from net.state_dict().items()
        yield "packed", torch.ones(1000)  # a host tensor, packed: the references before it go out first
        print("stalling", flush=True)
        time.sleep(600)

    with WeightSender(options=SenderOptions(timeout_s=30)) as sender:
        print(json.dumps({"endpoint": sender.endpoint, "pid": os.getpid()}), flush=True)
        sender.send(net.state_dict().items(), version=1)
        sender.send(source(), version=2)


if __name__ == "__main__":
    if sys.argv[1] == "sender":
        sender_main()
