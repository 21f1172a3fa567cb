"""CUDA IPC transport: the sender's GPU buffers mapped straight into receivers on the same node.

How it works, and the rules it keeps:
- the sender allocates N device buffers once and exports each with torch's own CUDA IPC
  (`torch.multiprocessing.reductions.reduce_tensor`, looked up when called, never at import);
- torch's export is (rebuild_cuda_tensor, args) meant for pickle. Nothing here is pickled: the
  args are written out field by field as str/int/bool/bytes/lists (`encode_export`) and turned
  back into rebuild_cuda_tensor's arguments on the receiver (`decode_export`);
- the receiver maps the buffers on its own current GPU, as vLLM, verl and SGLang rebuild CUDA
  IPC handles (torch's rebuild_cuda_tensor with the receiver's device index): processes with
  different CUDA_VISIBLE_DEVICES meet on the same GPU, and a receiver on another GPU than the
  sender's reads through peer access (which CUDA enables when it opens the handle);
- publish() waits for an event on the stream that ran the packing copies (the current stream of
  the buffers' GPU), so a receiver told "bucket k is ready" reads finished bytes; release() waits for
  one on the receiver's current streams, so the sender never overwrites bytes a receiver's queued
  copies still read. Events, not device-wide synchronizes: those would also wait for the trainer's
  and the engine's other streams (NCCL, prefetches) at every bucket;
- the trainer's own memory is shared the same way for mapped sources: device_segments() exports
  the caching allocator's segments that hold its tensors (hwsync_cuda.segments);
- torch counts one consumer per export (hwsync.backend.exports): each receiver process gets exports of
  its own, made when it is first offered the buffers; a receiver in the sender's process gets
  none; the exports of a receiver that failed before accepting, or died, are released by the
  sender (torch's _release_ipc_counter, only while the counter shows the receiver did not
  unmap them: hwsync.backend.ipc_counters), so no block waits in torch's IPC limbo for a consumer
  that will never come, nor for a counter released twice. close() and the next open collect
  (`torch.cuda.ipc_collect()`) what receivers have let go.
"""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from typing import Any

import torch

from hwsync.backend import (
    DeviceSegments,
    Handles,
    HwsyncError,
    ProbeResult,
    ReceiveBuffers,
    ReceiverExports,
    SendBuffers,
    Transport,
    release_if_held,
)
from hwsync_cuda.device import CudaDevice, device_uuid, expandable_segments_reason
from hwsync_cuda.segments import CudaDeviceSegments

log = logging.getLogger("hwsync")

HANDLE_KIND = "cuda_ipc"
# rebuild_cuda_tensor's positional arguments, in torch's order (torch/multiprocessing/reductions.py).
_ARG_NAMES = (
    "tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "device", "handle",
    "storage_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
    "ref_counter_offset", "event_handle", "event_sync_required",
)
_STORAGE_CLASSES = {"TypedStorage": lambda: torch.storage.TypedStorage, "UntypedStorage": lambda: torch.UntypedStorage}

# Senders alive in this process, by token: CUDA cannot open its own IPC handles, so a receiver
# in the sender's own process uses the sender's tensors directly.
_LOCAL_SENDERS: "weakref.WeakValueDictionary[str, CudaIpcSendBuffers]" = weakref.WeakValueDictionary()


def _reductions() -> Any:
    # Imported when used: keeps the module import-safe and the lookup honest about torch's API.
    import torch.multiprocessing.reductions as reductions

    return reductions


def _torch_ipc_changed(what: str) -> HwsyncError:
    return HwsyncError(
        f"torch {torch.__version__} shares CUDA tensors differently than hwsync-cuda expects ({what}); "
        "use the 'shm' transport, and report the torch version to hwsync"
    )


def _as_bytes(value: Any, name: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise _torch_ipc_changed(f"{name} is a {type(value).__name__}")


def encode_export(reduced: tuple[Any, tuple[Any, ...]]) -> dict[str, Any]:
    """torch's (rebuild_cuda_tensor, args) as msgpack-safe fields; raises if torch's format changed."""
    rebuild, args = reduced
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor":
        raise _torch_ipc_changed(f"reduce_tensor returned {getattr(rebuild, '__name__', rebuild)!r}")
    if len(args) != len(_ARG_NAMES):
        raise _torch_ipc_changed(f"rebuild_cuda_tensor takes {len(args)} arguments, not {len(_ARG_NAMES)}")
    a = dict(zip(_ARG_NAMES, args))
    storage_name = getattr(a["storage_cls"], "__name__", str(a["storage_cls"]))
    if storage_name not in _STORAGE_CLASSES:
        raise _torch_ipc_changed(f"storage class {storage_name}")
    return {
        "size": [int(s) for s in a["size"]],
        "stride": [int(s) for s in a["stride"]],
        "tensor_offset": int(a["tensor_offset"]),
        "storage_cls": storage_name,
        "dtype": str(a["dtype"]).removeprefix("torch."),
        "handle": _as_bytes(a["handle"], "the memory handle"),
        "storage_bytes": int(a["storage_bytes"]),
        "storage_offset_bytes": int(a["storage_offset_bytes"]),
        "ref_counter_handle": _as_bytes(a["ref_counter_handle"], "the ref-counter handle"),
        "ref_counter_offset": int(a["ref_counter_offset"]),
        "event_handle": _as_bytes(a["event_handle"], "the event handle"),
        "event_sync_required": bool(a["event_sync_required"]),
    }


def decode_export(fields: dict[str, Any], device_index: int) -> tuple[Any, ...]:
    """rebuild_cuda_tensor's arguments from `encode_export` fields, on local device `device_index`."""
    dtype = getattr(torch, str(fields["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise HwsyncError(f"cuda_ipc handle names dtype {fields['dtype']!r}, which this torch lacks; "
                          "run the same torch version on both sides")
    if fields["storage_cls"] not in _STORAGE_CLASSES:
        raise HwsyncError(f"cuda_ipc handle names storage class {fields['storage_cls']!r}; "
                          "run the same torch version on both sides")
    return (
        torch.Tensor,
        tuple(int(s) for s in fields["size"]),
        tuple(int(s) for s in fields["stride"]),
        int(fields["tensor_offset"]),
        _STORAGE_CLASSES[fields["storage_cls"]](),
        dtype,
        device_index,  # the receiver's own index of the sender's GPU, found through its uuid
        _as_bytes(fields["handle"], "the memory handle"),
        int(fields["storage_bytes"]),
        int(fields["storage_offset_bytes"]),
        False,  # buffers never carry autograd state
        _as_bytes(fields["ref_counter_handle"], "the ref-counter handle"),
        int(fields["ref_counter_offset"]),
        _as_bytes(fields["event_handle"], "the event handle"),
        bool(fields["event_sync_required"]),
    )


def _cannot_map(handles: Handles, device: CudaDevice, index: int, exc: Exception) -> HwsyncError:
    sender, own = str(handles.get("uuid")), device.physical_id(index)
    where = "the sender's GPU" if sender == own else f"GPU {own}, not the sender's {sender} (peer access)"
    return HwsyncError(f"cuda_ipc could not map the sender's buffers on cuda:{index}, {where}: {exc}. Put the "
                       "receiver on the sender's GPU (torch.cuda.set_device), or use the 'shm' transport")


def _wait_streams(*indices: int) -> None:
    """Wait for the work queued so far on the current stream of each GPU (an event each, once per GPU)."""
    for index in dict.fromkeys(indices):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        event.synchronize()


class CudaIpcSendBuffers(SendBuffers):
    """N device buffers on the current GPU, exported for each receiver process when it is first offered them."""

    def __init__(self, bucket_bytes: int, num_buffers: int) -> None:
        if bucket_bytes <= 0 or num_buffers <= 0:
            raise ValueError(f"cuda_ipc needs bucket_bytes > 0 and num_buffers > 0, got {bucket_bytes}, {num_buffers}")
        self.bucket_bytes = bucket_bytes
        self.num_buffers = num_buffers
        self.device_index = torch.cuda.current_device()
        self.uuid = device_uuid(self.device_index)
        self.token = secrets.token_hex(16)
        torch.cuda.ipc_collect()  # blocks of earlier buffers that receivers have let go since
        device = torch.device("cuda", self.device_index)
        self.buffers: list[torch.Tensor] = [
            torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(num_buffers)
        ]
        self._exports = ReceiverExports(self._export_all, _release_export)
        _LOCAL_SENDERS[self.token] = self

    def _export_all(self) -> list[dict[str, Any]]:
        reduce_tensor = _reductions().reduce_tensor
        return [encode_export(reduce_tensor(buffer)) for buffer in self.buffers]

    def handles(self) -> Handles:
        """Handles for one receiver process that is not told apart from others (see handles_for)."""
        return self.handles_for("", None, None)

    def handles_for(self, receiver: str, pid: int | None, host: str | None) -> Handles:
        """The sender's GPU uuid and this receiver's own CUDA IPC export of each buffer (none in this process)."""
        if not self.buffers:
            raise HwsyncError("cuda_ipc send buffers are closed; open the transport again")
        records = self._exports.records_for(receiver, pid, host)
        return {"kind": HANDLE_KIND, "uuid": self.uuid, "bytes": self.bucket_bytes, "pid": os.getpid(),
                "token": self.token, "buffers": [dict(e) for e in records]}

    def release_for(self, receiver: str) -> None:
        """The receiver never maps its exports (refused, or died): release their counters for it."""
        self._exports.release(receiver)

    def buffer(self, index: int) -> torch.Tensor:
        """Device buffer `index` to pack into."""
        if not self.buffers:
            raise HwsyncError("cuda_ipc send buffers are closed; open the transport again")
        return self.buffers[index]

    def publish(self, index: int, nbytes: int) -> None:
        """Wait until the packing work queued on the GPU has finished writing the buffer."""
        if not 0 <= nbytes <= self.bucket_bytes:
            raise ValueError(f"cannot publish {nbytes} bytes from a buffer of {self.bucket_bytes}")
        # The core packs with copies on the current stream of the buffers' GPU; the receiver reads through its
        # own context, outside this process's stream order, so the host waits for them before announcing.
        _wait_streams(self.device_index)

    def close(self) -> None:
        """Drop the buffers; release dead receivers' exports; let torch free blocks nobody maps any more.

        A block a live receiver still maps stays parked until it closes it; the next open_sender
        (or the receiver's own process) collects it then.
        """
        if not self.buffers:
            return
        _LOCAL_SENDERS.pop(self.token, None)
        self._exports.forget()
        self.buffers = []
        torch.cuda.ipc_collect()


def _release_export(fields: dict[str, Any]) -> None:
    # what torch's rebuild_cuda_tensor does for an export it does not map (storage_cls._release_ipc_counter), only
    # while the receiver has not unmapped it: released twice, torch holds the buffer until exit (backend.ipc_counters)
    handle = _as_bytes(fields["ref_counter_handle"], "the ref-counter handle")
    if handle is not None:
        release_if_held(handle, int(fields["ref_counter_offset"]), torch.UntypedStorage._release_ipc_counter_cuda)


class CudaIpcReceiveBuffers(ReceiveBuffers):
    """The sender's buffers mapped into this process on its own current GPU."""

    def __init__(self, device: CudaDevice, handles: Handles) -> None:
        if handles.get("kind") != HANDLE_KIND:
            raise ValueError(f"cuda_ipc receiver got handles of kind {handles.get('kind')!r}")
        self.bucket_bytes = int(handles["bytes"])
        local = _LOCAL_SENDERS.get(str(handles.get("token")))
        if local is not None and int(handles.get("pid", -1)) == os.getpid():
            self.device_index = local.device_index
            self.tensors = list(local.buffers)
            return
        self.device_index = device.current_index()
        rebuild = _reductions().rebuild_cuda_tensor
        self.tensors = []
        with torch.cuda.device(self.device_index):
            for fields in handles["buffers"]:
                try:
                    tensor = rebuild(*decode_export(fields, self.device_index))
                except RuntimeError as exc:
                    raise _cannot_map(handles, device, self.device_index, exc) from exc
                if tensor.numel() < self.bucket_bytes or tensor.dtype != torch.uint8:
                    raise HwsyncError(
                        f"cuda_ipc buffer maps {tensor.numel()} {tensor.dtype} elements, but the sender "
                        f"announced {self.bucket_bytes} bytes of uint8; sender and receiver disagree"
                    )
                self.tensors.append(tensor)

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the sender's buffer `index`, in place on the GPU."""
        if not self.tensors:
            raise HwsyncError("cuda_ipc receive buffers are closed; open the transport again")
        if not 0 <= nbytes <= self.bucket_bytes:
            raise ValueError(f"cannot view {nbytes} bytes of a buffer of {self.bucket_bytes}")
        return self.tensors[index][:nbytes]

    def release(self, index: int) -> None:
        """Wait until this process's queued reads of the buffer are done, so it may be refilled."""
        _wait_streams(self.device_index, torch.cuda.current_device())

    def close(self) -> None:
        """Unmap the sender's buffers (their memory stays the sender's)."""
        self.tensors = []


class CudaIpcTransport(Transport):
    """CUDA IPC between processes on one node; the NVIDIA default."""

    name = HANDLE_KIND
    # Device-to-device copies run at hundreds of GB/s; big buckets amortise the per-bucket sync.
    default_bucket_bytes = 512 << 20

    def __init__(self, device: CudaDevice) -> None:
        self._device = device
        self._logged = False
        self._segments = CudaDeviceSegments()

    def _ipc_reason(self) -> str | None:
        """Why CUDA IPC cannot be used here at all (no GPU, WSL), or None."""
        probe = self._device.probe()
        if not probe.usable:
            return f"no usable GPU: {probe.reason}"
        try:
            with open("/proc/version") as f:
                if "microsoft" in f.read().lower():
                    return "CUDA IPC is not supported under WSL; use the 'shm' transport"
        except OSError:
            pass
        return None

    def available(self) -> ProbeResult:
        """Usable where a GPU is, the kernel is not WSL's (no CUDA IPC), and the allocator shares plain handles."""
        reason = self._ipc_reason()
        if reason is not None:
            return ProbeResult(False, reason)
        reason = expandable_segments_reason()
        if reason is not None:
            if not self._logged:  # the backend falls back to shm: say why, once
                self._logged = True
                log.warning("hwsync: cuda_ipc unavailable, falling back to shm: %s", reason)
            return ProbeResult(False, reason)
        return ProbeResult(True, "CUDA IPC between processes on this node; receivers also map the trainer's own "
                                 "allocator segments and copy its parameters once (mapped sources)")

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Allocate `num_buffers` device buffers on the current GPU (exported per receiver when offered)."""
        reason = expandable_segments_reason()
        if reason is not None:  # cuda_ipc was asked for by name: refuse with the reason, do not fail later
            raise HwsyncError(f"cuda_ipc cannot be used: {reason}")
        return CudaIpcSendBuffers(bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles, owner_pid: int | None = None) -> ReceiveBuffers:
        """Map the sender's buffers on this thread's current GPU."""
        return CudaIpcReceiveBuffers(self._device, handles)

    def device_segments(self) -> DeviceSegments | None:
        """The trainer's caching-allocator segments, mapped in place by receivers; None where CUDA IPC cannot be used
        at all (no GPU, WSL). Expandable segments are never exported (locate skips them; a sender with them on uses
        shm, whose tensors go packed), but a receiver with them on still maps a sender's plain segments."""
        return self._segments if self._ipc_reason() is None else None

