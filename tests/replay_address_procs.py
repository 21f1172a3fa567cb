"""The receiver process of tests/test_replay_addresses.py (spawned: a module of its own, importable by name)."""

from __future__ import annotations

import torch

from hwsync import WeightReceiver
from hwsync.backend.registry import get_backend


def receive(endpoint: str, names: list[str], syncs: int, new_destinations_at: int | None, q) -> None:
    """Receive `syncs` syncs `into` tensors on this backend's device; before sync `new_destinations_at`, `into` gives
    new tensors of the same names and shapes (the old ones stay alive). After each sync: each tensor's first value."""
    device = get_backend().device()
    where = device.torch_device()
    dest = {name: torch.zeros(1024, device=where) for name in names}
    old = []
    with WeightReceiver(endpoint, timeout_s=60) as receiver:
        for n in range(syncs):
            if n == new_destinations_at:
                old.append(dest)
                dest = {name: torch.zeros(1024, device=where) for name in names}
            stats = receiver.receive(into=lambda name, dtype, shape: dest[name])
            device.synchronize()
            q.put({"values": [float(dest[name].cpu()[0]) for name in names], "replay": "replay" in stats.notes})
