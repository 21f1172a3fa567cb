"""The baseline of `hwsync bench broadcast`: the collective stop-and-wait design peers ship, one buffer per rank.

Each sender rank s has a group of its own with every receiver (group rank 0, receivers 1..R) over the
backend's collective library, as hwsync's senders do, and one buffer: it packs a bucket, broadcasts it,
and packs the next only once that broadcast is done. Each receiver has one buffer: it receives a bucket,
copies every piece into its own tensors (as an engine loads), and only then posts the next broadcast.
Bucket k goes from sender k % S. Nothing but the bytes moves: every rank cuts the same buckets from the
bench's state dict (broadcast_model). A one-element all_reduce in each group opens each sync and one in
sender 0's group closes it, so its seconds run until every receiver has loaded every byte. hwsync's own
senders refuse one buffer (they need two to overlap), so this is a sender of its own, with no control
plane: a lower bound on that design's cost.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

from hwsync.backend.interfaces import Communicator
from hwsync_tools.bench.broadcast_model import end_ranks, state_dict

#: a piece of a bucket: (tensor index, byte offset in the tensor, bytes)
Piece = tuple[int, int, int]


def cut(sizes: list[int], bucket_bytes: int) -> list[list[Piece]]:
    """The buckets of tensors of `sizes` bytes, packed in order, a tensor split where a bucket fills."""
    buckets: list[list[Piece]] = [[]]
    room = bucket_bytes
    for index, size in enumerate(sizes):
        done = 0
        while done < size:
            if room == 0:
                buckets.append([])
                room = bucket_bytes
            take = min(room, size - done)
            buckets[-1].append((index, done, take))
            done, room = done + take, room - take
    return [b for b in buckets if b]


def _groups(backend_name: str, addresses: list[str], rank: int | None, senders: list[int], world: int,
            timeout_s: float) -> tuple[list[Communicator], torch.device]:
    """This rank's groups, in sender order (group rank 0 for a sender, 1 + `rank` for a receiver), and its device."""
    os.environ["HWSYNC_BACKEND"] = backend_name
    from hwsync.backend.registry import get_backend

    backend = get_backend()
    me = 0 if rank is None else 1 + rank
    comms = [backend.communicator(addresses[s], me, world, timeout_s) for s in senders]
    return comms, backend.device().torch_device()


def _flat(size: int) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.view(-1).view(torch.uint8)) for name, t in state_dict(size)]


def _meet(comm: Communicator, device: torch.device) -> None:
    """Return once every rank of the group got here: a one-element all_reduce through the library itself (a store
    barrier's host may leave while a peer still waits for its answer), read back on the host (a device's all_reduce
    is queued, not done, when it returns)."""
    one = torch.ones(1, device=device)
    comm.all_reduce(one)
    one.item()


def receiver(addresses: list[str], rank: int, receivers: int, size: int, bucket: int, runs: int, timeout_s: float,
             backend_name: str) -> None:
    """Receiver `rank`: one buffer; receive bucket k from sender k % S, load it, then post the next."""
    senders = len(addresses)
    comms, device = _groups(backend_name, addresses, rank, list(range(senders)), 1 + receivers, timeout_s)
    expected = _flat(size)
    sink = [torch.empty_like(t, device=device) for _, t in expected]  # the engine's tensors
    plan = cut([t.numel() for _, t in expected], bucket)
    buffer = torch.empty(bucket, dtype=torch.uint8, device=device)
    try:
        for _ in range(runs):
            for comm in comms:
                _meet(comm, device)
            for k, pieces in enumerate(plan):
                used = sum(n for _, _, n in pieces)
                comms[k % senders].broadcast(buffer[:used], 0)
                at = 0
                for index, offset, n in pieces:
                    sink[index][offset:offset + n].copy_(buffer[at:at + n])
                    at += n
            _meet(comms[0], device)  # sender 0's clock stops: every bucket is loaded here
        for comm in comms[1:]:
            _meet(comm, device)  # the other senders leave once every receiver took all their buckets
        for (name, want), got in zip(expected, sink):
            if not torch.equal(got.cpu(), want):
                raise SystemExit(f"stop-and-wait receiver {rank}: {name} arrived wrong")
    finally:
        for comm in comms:
            comm.destroy()


def _send(comm: Communicator, device: torch.device, rank: int, senders: int, size: int, bucket: int,
          runs: int) -> list[float]:
    """Sender `rank`'s syncs: one buffer; pack each of its buckets and broadcast it before packing the next. Sender 0
    returns each sync's seconds, from the start until every receiver has loaded every bucket."""
    source = _flat(size)
    plan = cut([t.numel() for _, t in source], bucket)
    buffer = torch.empty(bucket, dtype=torch.uint8, device=device)
    seconds = []
    for _ in range(runs):
        _meet(comm, device)
        t0 = time.perf_counter()
        for k in range(rank, len(plan), senders):
            at = 0
            for index, offset, n in plan[k]:
                buffer[at:at + n].copy_(source[index][1][offset:offset + n])
                at += n
            # the next pack waits for this broadcast: on the host (gloo returns once sent), or behind it on the
            # device's stream
            comm.broadcast(buffer[:at], 0)
        if rank == 0:
            _meet(comm, device)
            seconds.append(time.perf_counter() - t0)
    if rank > 0:
        _meet(comm, device)
    return seconds


def sender(addresses: list[str], rank: int, receivers: int, size: int, bucket: int, runs: int, timeout_s: float,
           backend_name: str) -> None:
    """Sender `rank` > 0, a process of its own."""
    (comm,), device = _groups(backend_name, addresses, None, [rank], 1 + receivers, timeout_s)
    try:
        _send(comm, device, rank, len(addresses), size, bucket, runs)
    finally:
        comm.destroy()


def measure(senders: int, receivers: int, size: int, bucket: int, repeat: int, timeout_s: float,
            backend_name: str) -> dict[str, Any]:
    """Median seconds of `repeat` stop-and-wait syncs (after one warm-up), this process sender 0; a row of the bench."""
    from hwsync.disaggregated.addresses import pick_port

    addresses = [f"tcp://127.0.0.1:{pick_port('127.0.0.1')}" for _ in range(senders)]
    runs = repeat + 1
    ctx = mp.get_context("spawn")
    common = (receivers, size, bucket, runs, timeout_s, backend_name)
    procs = [ctx.Process(target=receiver, args=(addresses, r, *common)) for r in range(receivers)]
    procs += [ctx.Process(target=sender, args=(addresses, s, *common)) for s in range(1, senders)]
    for p in procs:
        p.start()
    comm: Communicator | None = None
    try:
        (comm,), device = _groups(backend_name, addresses, None, [0], 1 + receivers, timeout_s)
        seconds = _send(comm, device, 0, senders, size, bucket, runs)[1:]  # the first sync connects the groups
    finally:
        failed = end_ranks(procs, timeout_s)
        if comm is not None:
            comm.destroy()  # last: its process hosts the group's store
    if failed:
        raise RuntimeError(f"a stop-and-wait rank failed (exit codes {failed}): see its output above")
    best = statistics.median(seconds)
    return {"senders": senders, "receivers": receivers, "bytes": size, "bucket_bytes": bucket, "buffers": 1,
            "design": "stop-and-wait", "seconds": best, "gbps": size / best / 1e9}
