"""The cuda_ipc transport: handle encoding anywhere; real CUDA IPC between spawned processes on a GPU.

Handles travel as msgpack (never pickle), so every multi-process test ships them packed with
msgpack, exactly as the control plane does.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import traceback

import msgpack
import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from hwsync.sizes import MiB
from hwsync.errors import HwsyncError
from hwsync_cuda import CudaBackend, CudaDevice
from hwsync_cuda.ipc import decode_export, encode_export



# ---- handle encoding, on any machine ----------------------------------------------------------


def _fake_export(device: int = 3) -> tuple:
    # The shape of torch's (rebuild_cuda_tensor, args) for a 1-D uint8 buffer.
    args = (torch.Tensor, torch.Size([1024]), (1,), 0, torch.storage.TypedStorage, torch.uint8, device,
            b"\x01ipc-handle\x00", 2 * MiB, 4096, False, b"/torch_ref_counter", 8, b"\x02event", True)
    return rebuild_cuda_tensor, args


def test_export_survives_msgpack_and_maps_the_device() -> None:
    fields = encode_export(_fake_export(device=3))
    wire = msgpack.unpackb(msgpack.packb(fields), raw=False)
    args = decode_export(wire, device_index=0)
    original = _fake_export()[1]
    assert args[6] == 0, "the receiver's own index must replace the sender's"
    assert args[:6] == (torch.Tensor, (1024,), (1,), 0, torch.storage.TypedStorage, torch.uint8)
    assert args[7:] == original[7:]


def test_export_from_another_torch_format_is_refused() -> None:
    rebuild, args = _fake_export()
    with pytest.raises(HwsyncError, match="shm"):
        encode_export((rebuild, args[:-1]))
    with pytest.raises(HwsyncError, match="shm"):
        encode_export((lambda *a: None, args))
    fields = encode_export((rebuild, args))
    with pytest.raises(HwsyncError, match="same torch version"):
        decode_export(dict(fields, dtype="float1234"), 0)


# ---- real CUDA IPC, on a GPU -----------------------------------------------------------------


def _receiver(conn, wire: bytes, visible: str | None) -> None:
    """Child: map the sender's buffers and answer read requests with a digest of the bytes."""
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before this process initialises CUDA
    try:
        receiver = CudaBackend().transports()["cuda_ipc"].open_receiver(msgpack.unpackb(wire, raw=False))
        conn.send(("ready", receiver.device_index))
        while True:
            request = conn.recv()
            if request[0] == "close":
                receiver.close()
                conn.send(("closed",))
                return
            _, index, nbytes = request
            digest = hashlib.sha256(receiver.view(index, nbytes).cpu().numpy().tobytes()).hexdigest()
            receiver.release(index)
            conn.send(("read", digest))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _pattern(n: int, seed: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * (2 * seed + 1) + seed) % 251).to(torch.uint8)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


class _Child:
    """A spawned receiver process and the pipe to it."""

    def __init__(self, sender, visible: str | None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver, args=(child_conn, msgpack.packb(sender.handles()), visible))
        self.proc.start()

    def ask(self, *request) -> tuple:
        if request:
            self.conn.send(request)
        if not self.conn.poll(180):
            raise TimeoutError("receiver process stayed silent for 180 s")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("close",))
                self.conn.poll(60) and self.conn.recv()
        finally:
            self.proc.join(timeout=60)
            if self.proc.is_alive():
                self.proc.kill()


def _round_trip(sender_index: int, visible: str | None) -> int:
    """Send three buckets through two reused buffers to a child; returns the child's device index."""
    torch.cuda.set_device(sender_index)
    sender = CudaBackend().transports()["cuda_ipc"].open_sender(4 * MiB, 2)
    child = _Child(sender, visible)
    try:
        reply = child.ask()
        assert reply[0] == "ready", reply[1] if len(reply) > 1 else reply
        for step, nbytes in enumerate((4 * MiB, 1 * MiB + 7, 3 * MiB)):  # buffer 0 is refilled
            index = step % 2
            expected = _pattern(nbytes, seed=step)
            sender.buffer(index)[:nbytes].copy_(expected.cuda(), non_blocking=True)
            sender.buffer(index)[:nbytes].add_(0)  # more queued work publish() must wait for
            sender.publish(index, nbytes)
            assert child.ask("read", index, nbytes) == ("read", _digest(expected)), f"bucket {step} differs"
        return reply[1]
    finally:
        child.stop()
        sender.close()


def test_ipc_round_trip_between_two_processes(gpu: CudaDevice) -> None:
    assert _round_trip(0, visible=None) == 0


def test_ipc_receiver_that_names_the_gpu_by_uuid(gpu: CudaDevice) -> None:
    # The child sees the same GPU through a differently written CUDA_VISIBLE_DEVICES.
    assert _round_trip(0, visible=gpu.physical_id(0)) == 0


def test_ipc_uuid_remapping_with_reordered_visible_devices(gpu: CudaDevice) -> None:
    if gpu.count() < 2:
        pytest.skip(f"remapping to another index needs 2 GPUs; {gpu.count()} visible")
    uuids = [gpu.physical_id(i) for i in range(2)]
    # The sender's cuda:1 is the child's cuda:0.
    assert _round_trip(1, visible=f"{uuids[1]},{uuids[0]}") == 0


def test_ipc_receiver_on_another_gpu_maps_on_its_own_or_is_told_how_to_fix_it(gpu: CudaDevice) -> None:
    if gpu.count() < 2:
        pytest.skip(f"a receiver on another GPU than the sender's needs 2 GPUs; {gpu.count()} visible")
    torch.cuda.set_device(0)
    sender = CudaBackend().transports()["cuda_ipc"].open_sender(1 * MiB, 2)
    child = _Child(sender, visible=gpu.physical_id(1))  # it sees only GPU 1, as its cuda:0
    try:
        reply = child.ask()
        if reply[0] == "ready":  # mapped on its own GPU through peer access, as vLLM and verl map handles
            assert reply[1] == 0
            sender.buffer(0)[:100].fill_(5)
            sender.publish(0, 100)
            assert child.ask("read", 0, 100) == ("read", _digest(torch.full((100,), 5, dtype=torch.uint8)))
        else:  # no peer access between the two GPUs: the error names the fix
            assert reply[0] == "error" and "'shm' transport" in reply[1], reply
    finally:
        child.stop()
        sender.close()


def test_ipc_handles_are_msgpack_safe_and_same_process_receiver_works(gpu: CudaDevice) -> None:
    transport = CudaBackend().transports()["cuda_ipc"]
    assert transport.available().usable
    sender = transport.open_sender(1 * MiB, 2)
    try:
        handles = sender.handles_for("here", os.getpid(), socket.gethostname())  # this process: no export
        assert handles["buffers"] == []
        assert msgpack.unpackb(msgpack.packb(handles), raw=False) == handles
        receiver = transport.open_receiver(handles)
        sender.buffer(1)[:100].fill_(7)
        sender.publish(1, 100)
        assert torch.equal(receiver.view(1, 100), torch.full((100,), 7, dtype=torch.uint8, device="cuda"))
        receiver.release(1)
        receiver.close()
    finally:
        sender.close()
    sender.close()  # twice is safe
