"""A trainer's first delta syncs in a fresh environment, run as a script with an empty NUMBA_CACHE_DIR: its
receiver (spawned: the same environment) and it each compile the codec's kernels on a thread of their own, and
no sync waits for that. Prints one JSON line: each sync's mode, exactness, seconds and whether the kernels were
loaded yet, then how long the sender's load took in all."""

from __future__ import annotations

import json
import sys
import time

import torch

from hwsync import WeightSender
from hwsync.delta import native, warm
from hwsync.sync.options import SenderOptions

import delta_procs
import transfer_procs as procs


def main(timeout_s: float) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = []
    with WeightSender(options=SenderOptions(delta=True, timeout_s=timeout_s)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "load", timeout_s=timeout_s)
        for step in (1, 2, 3):
            tensors = delta_procs.stepped(step)
            commands.put({"receive": True})
            stats = sender.send(tensors.items(), version=step)
            got = results.get(timeout=60)
            out.append({"mode": stats.delta.mode, "exact": got.get("digests") == procs.digests(tensors),
                        "error": got.get("error"), "seconds": stats.total_s, "kernels_loaded": native.ready()})
        commands.put({"stop": True})
        proc.join(30)
    loaded = warm.wait(600)  # the compile ends here, off every sync: the next process finds it in the cache
    print(json.dumps({"syncs": out, "loaded": loaded, "load_s": time.perf_counter() - t0}))


if __name__ == "__main__":
    main(float(sys.argv[1]))
