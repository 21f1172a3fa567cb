"""The CPU backend for real: OS memory figures, gloo between processes, shared-memory lifecycle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from hwsync.errors import HwsyncError
from hwsync.backend.shm import SharedSegment, leftover_segments
from hwsync_cpu import CpuBackend


def test_memory_comes_from_the_os():
    device = CpuBackend().device()
    free, total = device.mem_get_info()
    with open("/proc/meminfo") as f:
        meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    assert total == meminfo["MemTotal"]
    assert abs(free - meminfo["MemAvailable"]) < 512 << 20
    assert 0 < device.memory_allocated() <= device.memory_reserved()


def _collectives(rank: int, world: int, addr: str, q) -> None:
    comm = CpuBackend().communicator(addr, rank, world, timeout_s=60)
    t = torch.full((3,), float(rank + 1))
    comm.broadcast(t, src=1)
    gathered = comm.all_gather(torch.tensor([rank * 10, rank], dtype=torch.int64))
    mx = torch.tensor([rank], dtype=torch.int32)
    comm.all_reduce(mx, "max")
    s = torch.tensor([rank + 0.5], dtype=torch.bfloat16)
    comm.all_reduce(s, "sum")
    try:
        comm.all_reduce(torch.zeros(1, dtype=torch.bool), "sum")
        bad = "no error"
    except HwsyncError as exc:
        bad = str(exc)
    comm.barrier()
    comm.destroy()
    q.put((rank, t.tolist(), [g.tolist() for g in gathered], mx.item(), s.float().item(), bad))


def test_gloo_communicator_between_processes(free_port):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = 3
    procs = [ctx.Process(target=_collectives, args=(r, world, f"tcp://127.0.0.1:{free_port}", q)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for rank, bcast, gathered, mx, s, bad in results:
        assert bcast == [2.0, 2.0, 2.0]
        assert gathered == [[0, 0], [10, 1], [20, 2]]
        assert mx == 2 and s == pytest.approx(4.5)
        assert "gloo cannot reduce torch.bool" in bad and "Cast the tensor" in bad


def _idle_rank(addr: str, ready, stop) -> None:
    comm = CpuBackend().communicator(addr, 0, 2, timeout_s=60)
    ready.set()
    stop.wait(60)  # joins the group, then never takes part in rank 1's broadcast
    comm.destroy()


def test_destroying_a_group_stuck_in_a_broadcast_returns_without_waiting_for_its_timeout(free_port):
    import threading

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    peer = ctx.Process(target=_idle_rank, args=(f"tcp://127.0.0.1:{free_port}", ready, stop), daemon=True)
    peer.start()
    try:
        comm = CpuBackend().communicator(f"tcp://127.0.0.1:{free_port}", 1, 2, timeout_s=60)
        assert ready.wait(60)
        failed: list[BaseException] = []

        def broadcast() -> None:
            try:
                comm.broadcast(torch.empty(1 << 16, dtype=torch.uint8), 0)
            except RuntimeError as exc:  # the group went away under it, as it should
                failed.append(exc)

        stuck = threading.Thread(target=broadcast, daemon=True)
        stuck.start()  # waits for rank 0, which never sends: only the group's 60 s timeout would end it
        time.sleep(0.5)
        t0 = time.monotonic()
        comm.destroy()  # releasing a gloo group joins its stuck operation; hwsync does that aside
        assert time.monotonic() - t0 < 20
    finally:
        stop.set()
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    stuck.join(30)
    assert not stuck.is_alive(), "the broadcast stuck on the destroyed group never ended"


def test_rendezvous_address_is_checked():
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        CpuBackend().communicator("127.0.0.1:1234", 0, 1)


def test_segment_is_removed_on_close():
    seg = SharedSegment.create(1 << 20)
    assert seg.name in leftover_segments(os.getpid())
    seg.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    other = SharedSegment(seg.name, 1 << 20, create=False)
    assert other.tensor[:4].tolist() == [1, 2, 3, 4]
    other.close()
    assert seg.name in leftover_segments(os.getpid()), "a receiver closing must not unlink"
    seg.close()
    seg.close()
    assert seg.name not in leftover_segments(os.getpid())


CREATE_AND_HANG = """
import sys, time
from hwsync.backend.shm import ShmTransport
buffers = ShmTransport().open_sender(1 << 20, 2)
print(" ".join(buffers.handles()["names"]), flush=True)
time.sleep(600)
"""


def test_segments_of_a_killed_process_are_removed():
    # A process of its own (not a multiprocessing child, which would share the test's resource
    # tracker): that is how a trainer runs, and its tracker must clean up after a SIGKILL.
    p = subprocess.Popen([sys.executable, "-c", CREATE_AND_HANG], stdout=subprocess.PIPE, text=True)
    names = p.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(leftover_segments())
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and set(names) & set(leftover_segments()):
        time.sleep(0.1)
    assert not set(names) & set(leftover_segments()), "the resource tracker did not unlink a killed sender's segments"
