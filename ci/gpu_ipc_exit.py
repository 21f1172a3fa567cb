"""Which CUDA IPC export leaves torch's exit warning, on a GPU: `python ci/gpu_ipc_exit.py [--json]`.

torch prints "Producer process has been terminated before all shared CUDA tensors released" when,
at the exporting process's exit, its current ref-counter file still has an offset in use: an
exported storage that is still alive, or one freed while its counter was not 0 (parked in torch's
IPC limbo; torch reads the counter as unsigned, so one taken below 0 parks it for good). Each
scenario below runs in a process of its own: plain torch exports as controls, then hwsync's packed
and mapped paths, with a receiver that closes and exits or one that is killed while mapping. Each
reports, after every step, the counters above and below zero in its ref-counter files
(/dev/shm/torch_<pid>_*, after the allocator's 64-byte header), the CUDA tensors and storages
alive and the bytes still allocated, and the driver records whether its exit printed the warning
(hwsync's receiver process writes its stderr apart, so a warning of its own is told from the
sender's). The H200 run of 2026-11-28 found the cause this was written for: the sender released
the exports of receivers that had already unmapped them and exited (docs/cuda.md).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as tmp
from hwsync.sync.options import SenderOptions

WARNING = "Producer process has been terminated before all shared CUDA tensors released"
HEADER_WORDS = 64 // 8  # at::map_alloc_alignment
_KEEP: list[object] = []  # what a scenario keeps alive until the interpreter exits


def _live_cuda(objects: list[object]) -> list[torch.Tensor]:
    return [o for o in objects if isinstance(o, torch.Tensor) and o.is_cuda]


def counters() -> dict[str, object]:
    """This process's ref counters above zero (a consumer still holds an export) and its live CUDA tensors."""
    held = below = 0
    files = glob.glob(f"/dev/shm/torch_{os.getpid()}_*")
    for path in files:
        # torch's RefcountedMapAllocator keeps its own header in the first 64 bytes; the slots follow. torch reads
        # a slot as uint64: one taken below zero (released twice) reads as held forever
        slots = np.fromfile(path, dtype=np.int64)[HEADER_WORDS:]
        held += int(np.count_nonzero(slots > 0))
        below += int(np.count_nonzero(slots < 0))
    gc.collect()
    objects = gc.get_objects()
    live = _live_cuda(objects)
    # a storage kept without any tensor over it (what a tensor count misses), and who keeps it
    storages = [o for o in objects if isinstance(o, (torch.UntypedStorage, torch.TypedStorage)) and o.is_cuda]
    keepers = sorted({type(r).__name__ for s in storages for r in gc.get_referrers(s) if r is not objects})
    return {"files": len(files), "counters_held": held, "counters_below_zero": below, "cuda_tensors": len(live),
            "cuda_bytes": sum(t.untyped_storage().nbytes() for t in live), "cuda_storages": len(storages),
            "storage_keepers": keepers, "allocated": torch.cuda.memory_allocated()}


def step(name: str) -> None:
    print(json.dumps({"step": name, **counters()}), flush=True)


def _torch_child(q: "tmp.Queue[Any]", done: "tmp.Queue[Any]", mapped: bool) -> None:
    t: torch.Tensor = q.get()
    if mapped:
        float(t.sum())
    del t
    gc.collect()
    done.put("released")


def torch_export(keep_alive: bool, consumer_maps: bool) -> None:
    """Control: torch alone, one tensor put on a torch.multiprocessing queue to a spawned consumer."""
    ctx = tmp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    t = torch.ones(1 << 20, device="cuda")
    child = ctx.Process(target=_torch_child, args=(q, done, True))
    if consumer_maps:
        child.start()
        q.put(t)
        done.get(timeout=60)
        child.join(30)
    else:  # exported, never mapped: what a consumer that died before mapping leaves
        from torch.multiprocessing.reductions import reduce_tensor

        reduce_tensor(t)
    step("consumer done")
    if keep_alive:
        _KEEP.append(t)
    del t
    torch.cuda.ipc_collect()
    step("producer dropped and collected")


def _read_all(pairs: list[tuple[str, torch.Tensor]]) -> None:
    for _, t in pairs:
        float(t.float().sum())


def _hwsync_receiver(endpoint: str, syncs: int, into: bool, done: "tmp.Queue[object]", stderr: str,
                     killed: bool) -> None:
    # the receiver's own stderr, to the exit: tells its warning from the sender's (one stream otherwise)
    with open(stderr, "w") as f:
        os.dup2(f.fileno(), 2)
    from hwsync.colocated.receiver import WeightReceiver

    dest: dict[str, torch.Tensor] = {}

    def into_fn(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return dest.setdefault(name, torch.empty(shape, dtype=dtype, device="cuda"))

    with WeightReceiver(endpoint, timeout_s=60) as receiver:
        for _ in range(syncs):
            if into:
                receiver.receive(into=into_fn)
            else:
                receiver.receive(_read_all)
        if killed:  # gone with everything mapped, as a killed engine: the sender must release its exports
            done.put({"receiver": "killed while mapping"})
            done.close()
            done.join_thread()  # the queue's feeder thread has written it before the kill
            os.kill(os.getpid(), signal.SIGKILL)
    gc.collect()
    done.put({"receiver_cuda_tensors_after_close": len(_live_cuda(gc.get_objects()))})


def hwsync_sync(mapped: bool, keep_model: bool, drop_sender: bool, syncs: int = 2, killed: bool = False) -> None:
    """hwsync's sender here, a WeightReceiver in a spawned process: packed buffers, or the model's own segments."""
    from hwsync.colocated.sender import WeightSender

    ctx = tmp.get_context("spawn")
    done = ctx.Queue()
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda().to(torch.bfloat16)
    sender = WeightSender(options=SenderOptions(bucket_bytes=8 << 20, timeout_s=60))
    receiver_log = f"/tmp/hwsync-ipc-exit-{os.getpid()}-receiver.log"
    child = ctx.Process(target=_hwsync_receiver, args=(sender.endpoint, syncs, mapped, done, receiver_log, killed))
    child.start()
    for version in range(1, syncs + 1):
        if mapped:
            stats = sender.send(model.named_parameters(), version=version)
        else:  # tensors made for the sync: they go packed through the exported buffers
            stats = sender.send([(n, p.detach().clone()) for n, p in model.named_parameters()], version=version)
    print(json.dumps({"step": "synced", "notes": {k: str(v) for k, v in stats.notes.items()},
                      **done.get(timeout=60)}), flush=True)
    child.join(30)
    with open(receiver_log) as f:
        print(json.dumps({"step": "receiver's exit", "receiver_warned": WARNING in f.read()}), flush=True)
    os.unlink(receiver_log)
    step("receiver closed and exited")
    sender.close()
    step("sender closed")
    if drop_sender:
        del sender
    if keep_model:
        _KEEP.append(model)
    del model
    torch.cuda.ipc_collect()
    step("model dropped, collected")


SCENARIOS = {
    "torch: consumer released, producer freed": lambda: torch_export(False, True),
    "torch: consumer released, tensor alive at exit": lambda: torch_export(True, True),
    "torch: exported, never mapped": lambda: torch_export(False, False),
    "hwsync packed (as roundtrip)": lambda: hwsync_sync(False, False, False),
    "hwsync packed, receiver killed": lambda: hwsync_sync(False, False, True, killed=True),
    "hwsync mapped, model freed": lambda: hwsync_sync(True, False, True),
    "hwsync mapped, model alive at exit": lambda: hwsync_sync(True, True, True),
    "hwsync mapped, receiver killed": lambda: hwsync_sync(True, False, True, killed=True),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=list(SCENARIOS))
    parser.add_argument("--only", default="", help="run the scenarios whose name contains this")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.scenario:
        SCENARIOS[args.scenario]()
        return 0
    rows: list[dict[str, Any]] = []
    for name in [n for n in SCENARIOS if args.only in n]:
        run = subprocess.run([sys.executable, __file__, "--scenario", name], capture_output=True, text=True,
                             timeout=180)
        steps = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        rows.append({"scenario": name, "exit": run.returncode, "warning": WARNING in run.stderr, "steps": steps,
                     "stderr_tail": run.stderr[-600:] if run.returncode else ""})
    if args.json:
        print(json.dumps(rows, indent=1))
    for row in rows:
        print(f"{row['scenario']:48} exit {row['exit']}  warning at exit: {'YES' if row['warning'] else 'no'}")
        for s in row["steps"]:
            print("    ", s)
        if row["stderr_tail"]:
            print("     stderr:", row["stderr_tail"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
