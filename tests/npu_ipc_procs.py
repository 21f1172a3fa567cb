"""Processes with the stand-in torch_npu installed (tests/npu_torch_standin.py), driven by a test one call at a time.

`StandInProcess()` spawns a process, installs the stand-in there first thing (it changes torch and hwsync_npu for
good, so never in pytest's own process), and runs the functions below by name, returning their results.
Everything that crosses between processes is msgpack-safe, as it is between hwsync's peers.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import torch
from hwsync.sync.options import SenderOptions

CTX = mp.get_context("spawn")
STATE: dict[str, Any] = {}  # what a process keeps between calls: transports, buffers, tensors


class StandInProcess:
    """A spawned process with the stand-in torch_npu; `call(name, *args)` runs npu_ipc_procs.<name> there."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_serve, args=(child, env or {}), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.call("pid")

    def call(self, name: str, *args: Any, timeout_s: float = 120.0) -> Any:
        """Run `name(*args)` in the process; its exception comes back as a RuntimeError with the traceback."""
        self._conn.send((name, args))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{name} did not return in {timeout_s}s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        """Stop the process."""
        try:
            self._conn.send(None)
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _serve(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    import npu_torch_standin

    STATE["standin"] = npu_torch_standin.install()
    while (message := conn.recv()) is not None:
        name, args = message
        try:
            conn.send((True, globals()[name](*args)))
        except BaseException:  # noqa: BLE001 - the test gets it
            conn.send((False, traceback.format_exc()))
    npu_torch_standin.unlink_all()  # os._exit skips atexit, where the stand-in removes its segment files
    os._exit(0)


def pid() -> int:
    """This process's id."""
    return os.getpid()


def _transport() -> Any:
    if "transport" not in STATE:
        from hwsync.backend.registry import get_backend

        backend = STATE["backend"] = get_backend()
        STATE["transport"] = backend.transports()["npu_ipc"]
    return STATE["transport"]


def backend_report() -> dict[str, Any]:
    """Which backend hwsync selected here and what its transports say."""
    from hwsync.backend.registry import get_backend

    backend = get_backend()
    return {"backend": backend.name, "transports": {n: [t.available().usable, t.available().reason]
                                                   for n, t in backend.transports().items()}}


# --- the transport's buffers ------------------------------------------------------------------------

def open_sender(bucket_bytes: int, buffers: int) -> None:
    """NpuIpcTransport.open_sender, each buffer filled with its own byte pattern."""
    sender = STATE["sender"] = _transport().open_sender(bucket_bytes, buffers)
    for i in range(buffers):
        sender.buffer(i).copy_(torch.arange(bucket_bytes, dtype=torch.int64).add(i * 7).remainder(251).to(torch.uint8))
        sender.publish(i, bucket_bytes)


def handles_for(receiver: str, receiver_pid: int) -> bytes:
    """The sender's handles for one receiver process, as msgpack (what the Offer carries)."""
    return msgpack.packb(STATE["sender"].handles_for(receiver, receiver_pid, None), use_bin_type=True)


def open_receiver(packed: bytes, nbytes: int) -> list[list[int]]:
    """NpuIpcTransport.open_receiver over the sender's handles; the first bytes of each buffer's view."""
    handles = msgpack.unpackb(packed, raw=False)
    receiver = STATE["receiver"] = _transport().open_receiver(handles)
    return [receiver.view(i, nbytes)[:16].tolist() for i in range(len(handles["buffers"]))]


def close_receiver() -> None:
    """Drop the receiver's mappings (their storages free, and torch_npu's deleter takes each counter down)."""
    STATE.pop("receiver").close()
    import gc

    gc.collect()


def counters(packed: bytes) -> list[int | None]:
    """The ref counters of the exports in a handles message, read from torch's files (hwsync.backend.ipc_counters)."""
    from hwsync.backend.ipc_counters import counter

    handles = msgpack.unpackb(packed, raw=False)
    return [counter(r["ref_counter_handle"], r["ref_counter_offset"]) for r in handles["buffers"]]


def release_for(receiver: str) -> None:
    """The sender releases the exports of a receiver that never mapped them."""
    STATE["sender"].release_for(receiver)


def close_sender() -> list[str]:
    """Close the sender; the torch_npu calls it made."""
    STATE.pop("sender").close()
    import npu_torch_standin

    return [name for name, _ in npu_torch_standin.calls]


# --- mapped sources: the trainer's own segments ---------------------------------------------------------

def make_params(kinds: list[str]) -> list[list[int]]:
    """One tensor per kind, each in a segment of that kind: plain, nz (FRACTAL_NZ), pool (sleep mode's), expandable,
    heap (not in any allocator segment); returns the first values of each."""
    import npu_torch_standin as standin

    tensors = STATE["params"] = {}
    for i, kind in enumerate(kinds):
        arena = standin.NpuArena(1 << 16, expandable=kind == "expandable", pool=(1, 7) if kind == "pool" else (0, 0))
        tensor = arena.tensor((64, 32), torch.float32) if kind != "heap" else torch.empty(64, 32)
        tensor.copy_(torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) + 1000 * i)
        if kind == "nz":
            standin.npu_format_cast(tensor, standin.FRACTAL_NZ)
        tensors[kind] = tensor
    return [t.reshape(-1)[:4].tolist() for t in tensors.values()]


def _place(tensor: torch.Tensor) -> Any:
    """Where the tensor lies, found as the core's locate finds it (AllocatorSegments._segment_of, from the allocator's
    snapshot) but on device 0: the stand-in's NPU tensors are CPU tensors, which carry no device index, so the
    core's own locate() returns None for them before it looks (on an NPU every tensor has its index)."""
    from hwsync.backend.interfaces import SegmentPlace

    segments = _transport().device_segments()
    found = segments._segment_of(0, tensor.data_ptr())
    if found is None or not segments.shareable(tensor):
        return None
    base, size = found
    return SegmentPlace(("npu", 0, base), size, tensor.data_ptr() - base)


def locate(kind: str) -> bool:
    """Whether the NPU backend's device segments would export this tensor (mapped) rather than pack it."""
    return _place(STATE["params"][kind]) is not None


def export(kind: str) -> dict[str, Any]:
    """The export record of the tensor's segment, and where the tensor lies in it."""
    segments = _transport().device_segments()
    tensor = STATE["params"][kind]
    place = _place(tensor)
    from torch.multiprocessing.reductions import StorageWeakRef

    anchor = STATE.setdefault("anchors", {})[kind] = StorageWeakRef(tensor.untyped_storage())
    record = segments.export(anchor, place)
    packed = msgpack.packb(record, use_bin_type=True)
    return {"record": packed, "size": place.size, "offset": place.offset, "nbytes": tensor.numel() * 4}


def open_segment(packed: bytes, size: int, offset: int, nbytes: int) -> list[float]:
    """Map a segment export on this process's NPU; the tensor's first values read from it."""
    view = _transport().device_segments().open(msgpack.unpackb(packed, raw=False), size)
    STATE.setdefault("mapped", []).append(view)
    return view[offset:offset + nbytes].view(torch.float32)[:4].tolist()


def reshare_mapped() -> str:
    """What sharing a storage this process received does (torch_npu refuses), and whether hwsync would export it."""
    mapped = STATE["mapped"][-1]
    located = _place(mapped)
    try:
        mapped.untyped_storage()._share_npu_()
    except RuntimeError as exc:
        return f"located={located is not None}; {exc}"
    return f"located={located is not None}; shared"


def release_export(packed: bytes) -> int | None:
    """The sender releases one segment export no receiver mapped; its counter afterwards."""
    from hwsync.backend.ipc_counters import counter

    record = msgpack.unpackb(packed, raw=False)
    _transport().device_segments().release_export(record)
    return counter(record["ref_counter_handle"], record["ref_counter_offset"])


def drop_mapped() -> None:
    """Unmap every segment this process mapped."""
    STATE.pop("mapped", None)
    import gc

    gc.collect()


def segment_counter(packed: bytes) -> int | None:
    """The counter of a segment export."""
    from hwsync.backend.ipc_counters import counter

    record = msgpack.unpackb(packed, raw=False)
    return counter(record["ref_counter_handle"], record["ref_counter_offset"])


def bad_calls() -> list[str]:
    """What the stand-in's sharing calls say to arguments of the wrong kind (the checks StorageSharing.cpp makes)."""
    import npu_torch_standin as standin

    arena = standin.NpuArena(4096)
    good = list(arena.tensor((16,), torch.uint8).untyped_storage()._share_npu_())
    out = []
    for args in (good[:7], [str(good[0])] + good[1:], good[:7] + [1], good[:6] + [good[6][:63], True],
                 [good[0], good[1].decode("latin-1")] + good[2:]):
        try:
            torch.UntypedStorage._new_shared_npu(*args)
            out.append("accepted")
        except (RuntimeError, TypeError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


# --- whole syncs through the NPU backend -------------------------------------------------------------------

def sender_start(delta: bool, bucket_bytes: int) -> str:
    """A WeightSender on the NPU backend (stand-in) whose source tensors lie in the NPU allocator's segments."""
    import npu_torch_standin as standin

    from hwsync import WeightSender

    torch.manual_seed(0)
    arena = standin.NpuArena(1 << 22)
    params = STATE["train"] = {}
    for name, shape in (("embed", (512, 64)), ("w1", (64, 256)), ("w2", (256, 64)), ("bias", (64,))):
        params[name] = arena.tensor(shape, torch.float32)
        params[name].copy_(torch.randn(shape))
    sender = STATE["wsender"] = WeightSender(options=SenderOptions(delta=delta, bucket_bytes=bucket_bytes, timeout_s=60.0))
    return sender.endpoint


def sender_step(version: int, fraction: float) -> dict[str, Any]:
    """Change `fraction` of each tensor's elements (a training step), send as `version`; the stats and digests."""
    import hashlib

    params = STATE["train"]
    if version > 1:
        generator = torch.Generator().manual_seed(version)
        for tensor in params.values():
            flat = tensor.view(-1)
            picked = torch.rand(flat.numel(), generator=generator) < fraction
            flat[picked] += torch.randn(int(picked.sum()), generator=generator) * 1e-2
    stats = STATE["wsender"].send(list(params.items()), version=version)
    digests = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
               for n, t in params.items()}
    delta = {"mode": stats.delta.mode, "reason": stats.delta.reason} if stats.delta else {}
    return {"transport": stats.transport, "bytes": stats.bytes, "delta": delta, "digests": digests}


def sender_close() -> list[str]:
    """Close the WeightSender; which sharing calls the stand-in saw."""
    STATE.pop("wsender").close()
    import npu_torch_standin

    return sorted({name for name, _ in npu_torch_standin.calls})


def receiver_start(endpoint: str) -> None:
    """A WeightReceiver on the NPU backend whose destinations lie in this process's NPU segments."""
    from hwsync import WeightReceiver

    STATE["wreceiver"] = WeightReceiver(endpoint, timeout_s=60.0)
    STATE["held"] = {}


def receiver_sync() -> dict[str, Any]:
    """Receive one sync into NPU destination tensors; their digests."""
    import hashlib

    import npu_torch_standin as standin

    held = STATE["held"]
    arena = STATE.setdefault("rarena", standin.NpuArena(1 << 22))

    def into(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in held:
            held[name] = arena.tensor(tuple(shape), dtype)
        return held[name]

    stats = STATE["wreceiver"].receive(None, into=into)
    return {"version": stats.version, "digests": {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in held.items()}}


def receiver_close() -> None:
    """Close the WeightReceiver."""
    STATE.pop("wreceiver").close()

