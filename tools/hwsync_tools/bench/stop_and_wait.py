"""The baseline of `hwsync bench transfer`: the single-buffer, stop-and-wait design peers ship.

One buffer of the same transport hwsync's run uses (a host segment on the CPU, a GPU buffer
shared by CUDA IPC on a GPU): the sender packs a bucket, publishes it, sends its frame and waits
for the ack before packing the next. The receiver reassembles split tensors into fresh memory, as
those designs do, and releases the buffer before it acks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import zmq

from hwsync.backend.interfaces import ReceiveBuffers, Transport
from hwsync.sync.bucket import align_up, copy_bytes
from hwsync.sync.spec import dtype_from_name, dtype_name

Named = list[tuple[str, torch.Tensor]]


def pack(message: dict[str, Any]) -> bytes:
    """A message between the benchmark's own processes (plain msgpack: this is not hwsync's protocol)."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    """Inverse of pack."""
    return msgpack.unpackb(data, raw=False)


def stop_and_wait_receive(sock: zmq.Socket, transport: Transport, load: Callable[[Named], None],
                          timeout_s: float) -> None:
    """Receive stop-and-wait syncs over `transport` into `load` until the sender says "end"."""
    buffers: ReceiveBuffers | None = None
    partial: dict[str, torch.Tensor] = {}
    try:
        while True:
            if not sock.poll(int(timeout_s * 1000)):
                raise TimeoutError("stop-and-wait receiver: no frame from the sender")
            frame = unpack(sock.recv())
            if frame["t"] == "end":
                return
            if frame["t"] == "bucket":
                if buffers is None:
                    buffers = transport.open_receiver(frame["handles"])
                view, out = buffers.view(0, frame["used"]), []
                for name, dt, shape, off, coff, cbytes, total in frame["entries"]:
                    piece, dtype = view[off : off + cbytes], dtype_from_name(dt)
                    if cbytes == total:
                        out.append((name, piece.view(dtype).view(shape)))
                        continue
                    if coff == 0:
                        partial[name] = torch.empty(total, dtype=torch.uint8, device=view.device)
                    copy_bytes(partial[name], coff, view, off, cbytes)
                    if coff + cbytes == total:
                        out.append((name, partial.pop(name).view(dtype).view(shape)))
                load(out)
                del out, view
                buffers.release(0)
            sock.send(pack({"t": "ack"}))
    finally:
        if buffers is not None:
            buffers.close()


class StopAndWait:
    """The design peers ship: one shared buffer; pack a bucket, send its frame, wait for the ack."""

    def __init__(self, sock: zmq.Socket, transport: Transport, bucket_bytes: int, alive: Callable[[], bool],
                 timeout_s: float) -> None:
        self.sock, self.bucket_bytes, self.alive, self.timeout_s = sock, bucket_bytes, alive, timeout_s
        self.buffers = transport.open_sender(bucket_bytes, 1)
        self.entries: list[list[Any]] = []
        self.used = 0

    def send(self, named: Named) -> float:
        """One sync, in seconds (until the receiver acknowledged the end)."""
        t0 = time.perf_counter()
        buf = self.buffers.buffer(0)
        for name, tensor in named:
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            total, done, meta = flat.numel(), 0, (name, dtype_name(tensor.dtype), list(tensor.shape))
            if total <= self.bucket_bytes and align_up(self.used) + total > self.bucket_bytes:
                self._flush()
            while True:
                start = align_up(self.used)
                if start >= self.bucket_bytes:
                    self._flush()
                    continue
                take = min(self.bucket_bytes - start, total - done)
                copy_bytes(buf, start, flat, done, take, non_blocking=True)  # published before the frame
                self.entries.append([*meta, start, done, take, total])
                self.used, done = start + take, done + take
                if done >= total:
                    break
        if self.entries:
            self._flush()
        self._exchange({"t": "done"})
        return time.perf_counter() - t0

    def _flush(self) -> None:
        self.buffers.publish(0, self.used)
        self._exchange({"t": "bucket", "handles": self.buffers.handles(), "used": self.used,
                        "entries": self.entries})
        self.entries, self.used = [], 0

    def _exchange(self, frame: dict[str, Any]) -> dict[str, Any]:
        self.sock.send(pack(frame))
        return await_reply(self.sock, self.alive, self.timeout_s)

    def close(self) -> None:
        """Free the buffer (unlink its segment)."""
        self.buffers.close()


def await_reply(sock: zmq.Socket, alive: Callable[[], bool], timeout_s: float) -> dict[str, Any]:
    """The next frame from the receiver, or an error if it exited or stayed silent."""
    deadline = time.monotonic() + timeout_s
    while not sock.poll(200):
        if not alive():
            raise RuntimeError("the receiver process exited")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no reply from the receiver within {timeout_s:g} s")
    return unpack(sock.recv())
