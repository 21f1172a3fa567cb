"""The cuda backend: import safety and completeness anywhere; device, shm and NCCL on a GPU.

Tests that need an NVIDIA GPU skip with the probe's own reason ("torch ... was built without
CUDA", "no NVIDIA GPU visible ..."); the rest run on every machine, CPU-only torch included.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import subprocess
import sys
import traceback

import pytest
import torch

from hwsync.sizes import MiB
from hwsync.errors import HwsyncError
from hwsync.backend.interfaces import ReceiveBuffers, SendBuffers
from hwsync.backend.registry import installed_names, load_backend
from hwsync.backend.shm import leftover_segments
from hwsync.backend.device_shm import DeviceShmReceiveBuffers, DeviceShmSendBuffers, DeviceShmTransport
from hwsync_cuda import CudaBackend, CudaDevice
from hwsync_cuda.ipc import CudaIpcReceiveBuffers, CudaIpcSendBuffers



# ---- any machine ---------------------------------------------------------------------------


def test_registered_under_hwsync_backends() -> None:
    assert "cuda" in installed_names()
    assert isinstance(load_backend("cuda"), CudaBackend)


def test_every_abstract_method_is_implemented() -> None:
    backend = CudaBackend()
    classes = [type(backend), type(backend.device()), *(type(t) for t in backend.transports().values()),
               CudaIpcSendBuffers, CudaIpcReceiveBuffers, DeviceShmSendBuffers, DeviceShmReceiveBuffers]
    for cls in classes:
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
    assert issubclass(CudaIpcSendBuffers, SendBuffers) and issubclass(CudaIpcReceiveBuffers, ReceiveBuffers)
    assert list(backend.transports()) == ["cuda_ipc", "shm"]
    assert backend.device().visible_devices_env == "CUDA_VISIBLE_DEVICES"


def test_import_probe_and_availability_create_no_cuda_context() -> None:
    # A fresh interpreter: this test process may already have initialised CUDA.
    code = (
        "import torch, hwsync_cuda\n"
        "b = hwsync_cuda.CudaBackend()\n"
        "p = b.probe()\n"
        "avail = {n: t.available().usable for n, t in b.transports().items()}\n"
        "assert not torch.cuda.is_initialized(), 'probe initialised CUDA'\n"
        "print(p.usable, avail)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_shm_sender_of_host_tensors_never_initialises_cuda() -> None:
    # hwsync.backend.device_shm pins and waits only where CudaDevice.runtime_in_use(); a fresh interpreter, as above.
    code = (
        "import torch, hwsync_cuda\n"
        "s = hwsync_cuda.CudaBackend().transports()['shm'].open_sender(1 << 16, 2)\n"
        "s.buffer(0)[:8].copy_(torch.arange(8, dtype=torch.uint8))\n"
        "s.publish(0, 8)\n"
        "s.close()\n"
        "assert not torch.cuda.is_initialized(), 'the shm sender initialised CUDA'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_probe_reason_names_the_missing_cuda_build() -> None:
    if torch.version.cuda is not None:
        pytest.skip(f"torch {torch.__version__} is a CUDA build; this checks the CPU-build reason")
    probe = CudaDevice().probe()
    assert not probe.usable
    assert f"torch {torch.__version__} was built without CUDA" in probe.reason
    assert not CudaBackend().transports()["cuda_ipc"].available().usable


def test_probe_reason_names_an_empty_visible_devices_list() -> None:
    if torch.version.cuda is None:
        pytest.skip(f"torch {torch.__version__} was built without CUDA; the visible-devices reason needs a CUDA build")
    code = "import hwsync_cuda; print(hwsync_cuda.CudaDevice().probe().reason)"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "no NVIDIA GPU visible (CUDA_VISIBLE_DEVICES='')" in out.stdout, out.stdout + out.stderr


def test_communicator_without_nccl_is_a_clear_error() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_nccl_available():
        pytest.skip("this torch has NCCL; the missing-NCCL error cannot be provoked here")
    with pytest.raises(HwsyncError, match="NCCL"):
        CudaBackend().communicator("tcp://127.0.0.1:1", 0, 1)


def test_shm_round_trip_in_host_memory() -> None:
    transport = DeviceShmTransport(CudaDevice(), stage_on_device=False)
    sender = transport.open_sender(1 * MiB, 2)
    receiver = transport.open_receiver(sender.handles())
    try:
        for index in range(2):
            data = (torch.arange(4096, dtype=torch.int64) * (index + 3) % 251).to(torch.uint8)
            sender.buffer(index)[: data.numel()].copy_(data)
            sender.publish(index, data.numel())
            assert torch.equal(receiver.view(index, data.numel()), data)
            receiver.release(index)
    finally:
        receiver.close()
        sender.close()
    assert not leftover_segments(os.getpid())


# ---- on a GPU -------------------------------------------------------------------------------


def test_device_memory_and_identity(gpu: CudaDevice) -> None:
    free, total = gpu.mem_get_info()
    assert 0 < free <= total
    before = gpu.memory_allocated()
    block = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert gpu.memory_allocated() >= before + 64 * MiB
    assert gpu.memory_reserved() >= gpu.memory_allocated()
    del block
    gpu.empty_cache()
    for index in range(gpu.count()):
        uuid = gpu.physical_id(index)
        assert uuid.startswith("GPU-") and len(uuid) == len("GPU-") + 36
        assert gpu.local_index(uuid) == index
        assert gpu.local_index(uuid.removeprefix("GPU-").upper()) == index
    with pytest.raises(LookupError, match="CUDA_VISIBLE_DEVICES"):
        gpu.local_index("GPU-00000000-0000-0000-0000-000000000000")


def test_shm_from_gpu_into_a_staged_gpu_view(gpu: CudaDevice) -> None:
    transport = CudaBackend().transports()["shm"]
    assert isinstance(transport, DeviceShmTransport)
    sender = transport.open_sender(4 * MiB, 2)
    receiver = transport.open_receiver(sender.handles())
    try:
        data = (torch.arange(3 * MiB, device="cuda") % 253).to(torch.uint8)
        sender.buffer(1)[: data.numel()].copy_(data, non_blocking=True)  # may still be in flight
        sender.publish(1, data.numel())
        view = receiver.view(1, data.numel())
        assert view.is_cuda and torch.equal(view, data)
        receiver.release(1)
    finally:
        receiver.close()
        sender.close()


def _nccl_rank(rank: int, world_size: int, port: int, device_of_rank: list[int], results) -> None:
    try:
        torch.cuda.set_device(device_of_rank[rank])
        comm = CudaBackend().communicator(f"tcp://127.0.0.1:{port}", rank, world_size, timeout_s=120)
        try:
            x = torch.full((5,), float(rank + 1), device="cuda")
            comm.broadcast(x, src=1)
            assert x.tolist() == [2.0] * 5
            gathered = comm.all_gather(torch.tensor([rank, 10 + rank], dtype=torch.int32, device="cuda"))
            assert [g.tolist() for g in gathered] == [[r, 10 + r] for r in range(world_size)]
            for op, expected in (("sum", 3.0), ("min", 1.0), ("max", 2.0)):
                y = torch.tensor([rank + 1.0], dtype=torch.bfloat16, device="cuda")
                comm.all_reduce(y, op)
                assert y.item() == expected, (op, y.item())
            try:
                comm.all_reduce(torch.ones(1, dtype=torch.bool, device="cuda"))
                raise AssertionError("reducing bool should be refused")
            except HwsyncError as exc:
                assert "cannot reduce" in str(exc)
            comm.barrier()
        finally:
            comm.destroy()
        results.put((rank, "ok"))
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run_nccl(device_of_rank: list[int], port: int) -> dict[int, str]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(r, 2, port, device_of_rank, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


def test_nccl_collectives_between_two_processes(gpu: CudaDevice, free_port: int) -> None:
    if gpu.count() < 2:
        pytest.skip(f"NCCL needs one GPU per rank and {gpu.count()} is visible; see the one-GPU test below")
    assert _run_nccl([0, 1], free_port) == {0: "ok", 1: "ok"}


def test_nccl_two_processes_on_one_gpu_is_refused_clearly(gpu: CudaDevice, free_port: int) -> None:
    # NCCL itself forbids two ranks on one GPU; hwsync must say so before NCCL fails obscurely.
    out = _run_nccl([0, 0], free_port)
    for rank in (0, 1):
        assert out[rank].startswith("HwsyncError") and "two ranks on one GPU" in out[rank], out[rank]
