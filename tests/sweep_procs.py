"""Processes for tests/test_sweep.py: a sender spawned by multiprocessing that is killed between or during syncs."""

from __future__ import annotations

import os
import time

import torch

from hwsync import WeightSender
from hwsync.sync.shared_params import SharedTensors
from hwsync.sync.options import SenderOptions

import transfer_procs as procs


def sender_main(q, mode: str) -> None:
    """Serve one sync (shared parameter segments and packed tensors), then idle ("between") or sync slowly ("mid")."""
    torch.set_num_threads(1)
    shared = SharedTensors(procs.versioned(1).items())
    sender = WeightSender(options=SenderOptions(timeout_s=60))
    q.put({"pid": os.getpid(), "endpoint": sender.endpoint, "params": shared.segment_names})
    sender.send([*shared.items(), ("packed", torch.arange(1000.0))], version=1)
    q.put({"synced": 1})
    if mode == "between":
        time.sleep(600)

    def slowly():
        for i, item in enumerate(procs.versioned(2).items()):
            if i == 2:
                q.put({"mid": True})
            time.sleep(0.2)
            yield item
        time.sleep(600)

    sender.send(slowly(), version=2)
