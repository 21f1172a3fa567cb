"""NPU IPC: receivers map the sender's device buffers directly, through torch_npu's storage
sharing (`UntypedStorage._share_npu_` / `_new_shared_npu`, the calls behind its
multiprocessing reductions).

Only from Ascend HDK 25.3.RC1 and CANN 8.3.RC1 on, and not in a process whose allocator has
expandable segments (PYTORCH_NPU_ALLOC_CONF; vllm-ascend turns them on outside sleep mode), whose memory
torch_npu shares through another path; elsewhere `available()` says why and the backend's default
transport falls back to shared memory, logging the reason once.
The receiver rebuilds each handle on its own current NPU (peer access when that is not the
sender's chip), as vllm-ascend and verl do: the sender's chip need not be visible to it.
Handles are plain msgpack values (ints, bytes, bools, None): no rebuild function, no pickle.
publish() and release() wait for an event on the current stream (torch_npu.npu.Event), not for the
whole device. The trainer's own memory is shared the same way for mapped sources, where NPU IPC is
allowed (device_segments(): hwsync_npu.segments); where it is not, device tensors go packed.
Run in CI against a stand-in torch_npu that applies StorageSharing.cpp's checks over CPU memory and
torch's real ref-counter files (tests/npu_torch_standin.py); unverified on an NPU (none here).
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
from hwsync_npu.api import import_torch_npu, torch_npu_installed
from hwsync_npu.device import current_visible_value, expandable_segments_reason, npu_device, physical_index
from hwsync_npu.segments import NpuDeviceSegments
from hwsync_npu.versions import IpcDecision, cann_version_from_files, decide_ipc, driver_version_from_files

log = logging.getLogger("hwsync")

HANDLE_KIND = "npu_ipc"
#: the order of the tuple `storage._share_npu_()` returns (torch_npu/multiprocessing/reductions.py)
SHARE_FIELDS = ("device", "handle", "storage_bytes", "storage_offset", "ref_counter_handle",
                "ref_counter_offset", "event_handle", "event_sync_required")

_MSGPACK_SCALARS = (str, int, float, bool, bytes, type(None))

# Senders alive in this process, by token: a receiver here uses their tensors directly.
_LOCAL_SENDERS: "weakref.WeakValueDictionary[str, NpuIpcSendBuffers]" = weakref.WeakValueDictionary()


def ensure_msgpack_safe(value: Any, where: str = "handles") -> None:
    """Raise TypeError unless `value` is made only of msgpack's plain types."""
    if isinstance(value, _MSGPACK_SCALARS):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            ensure_msgpack_safe(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has a non-string key {key!r}")
            ensure_msgpack_safe(item, f"{where}.{key}")
        return
    raise TypeError(f"{where} holds a {type(value).__name__}, which cannot travel without pickle")


def share_record(shared: tuple[Any, ...]) -> dict[str, Any]:
    """The result of `storage._share_npu_()` as a msgpack-safe dict (device index made physical)."""
    if len(shared) != len(SHARE_FIELDS):
        raise ValueError(f"_share_npu_ returned {len(shared)} fields, expected {len(SHARE_FIELDS)}; "
                         "this torch_npu is not the one hwsync-npu was checked against")
    record = dict(zip(SHARE_FIELDS, shared))
    device = record.pop("device")
    index = device.index if isinstance(device, torch.device) else int(device)
    record["physical_device"] = physical_index(index, current_visible_value())
    for key in ("handle", "ref_counter_handle", "event_handle"):
        if isinstance(record[key], str):
            record[key] = record[key].encode("latin-1")
    for key in ("storage_bytes", "storage_offset", "ref_counter_offset"):
        record[key] = int(record[key])
    record["event_sync_required"] = bool(record["event_sync_required"])
    ensure_msgpack_safe(record, "npu_ipc record")
    return record


def current_versions() -> tuple[str | None, str | None]:
    """(CANN, driver) versions: torch_npu's own query, else the install-info files."""
    cann = driver = None
    try:
        utils = import_torch_npu().npu.utils
        cann = utils.get_cann_version("CANN") or None  # "" below CANN 8.1.RC1 or when unknown
        driver = utils.get_cann_version("DRIVER") or None  # read from the driver's version.info
    except Exception:  # noqa: BLE001 - no torch_npu, or a torch_npu without the query: read the files
        pass
    return cann or cann_version_from_files(), driver or driver_version_from_files()


class NpuIpcSendBuffers(SendBuffers):
    """Device buffers whose memory receivers map, exported for each receiver process when first offered.

    torch_npu counts IPC consumers as torch counts CUDA's (one per export): see hwsync.backend.exports.
    """

    def __init__(self, device: torch.device, bucket_bytes: int, num_buffers: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.num_buffers = num_buffers
        self._torch_npu = import_torch_npu()
        self._torch_npu.npu.ipc_collect()  # blocks of earlier buffers that receivers have let go since
        self._buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device) for _ in range(num_buffers)]
        self._exports = ReceiverExports(self._export_all, _release_export)
        self.token = secrets.token_hex(16)
        _LOCAL_SENDERS[self.token] = self

    def _export_all(self) -> list[dict[str, Any]]:
        # _share_npu_, _release_ipc_counter_npu, _new_shared_npu: what torch_npu adds to torch's storages
        return [share_record(b.untyped_storage()._share_npu_()) for b in self._buffers]  # type: ignore[attr-defined]

    def handles(self) -> Handles:
        """Handles for one receiver process that is not told apart from others (see handles_for)."""
        return self.handles_for("", None, None)

    def handles_for(self, receiver: str, pid: int | None, host: str | None) -> Handles:
        """This receiver's own share record of each buffer (none in this process), plus the geometry."""
        return {"kind": HANDLE_KIND, "bytes": self.bucket_bytes, "pid": os.getpid(), "token": self.token,
                "buffers": self._exports.records_for(receiver, pid, host)}

    def release_for(self, receiver: str) -> None:
        """The receiver never maps its exports (refused, or died): release their counters for it."""
        self._exports.release(receiver)

    def buffer(self, index: int) -> torch.Tensor:
        """The device buffer to pack bucket `index` into."""
        return self._buffers[index]

    def publish(self, index: int, nbytes: int) -> None:
        """Wait until the packing copies (queued on the current stream) finished, so the receiver reads complete
        bytes: an event on that stream, not the whole device."""
        _wait_stream(self._torch_npu)

    def close(self) -> None:
        """Drop the buffers, release dead receivers' exports, and let torch_npu free what nobody maps."""
        if not self._buffers:
            return
        _LOCAL_SENDERS.pop(self.token, None)
        self._exports.forget()
        self._buffers = []
        self._torch_npu.npu.ipc_collect()


def _wait_stream(torch_npu: Any) -> None:
    """Wait for the work queued so far on the current NPU's current stream."""
    event = torch_npu.npu.Event()
    event.record(torch_npu.npu.current_stream())
    event.synchronize()


def _release_export(record: dict[str, Any]) -> None:
    # what torch_npu's rebuild_npu_tensor does for an export it does not map, only while the receiver has not unmapped
    # it (torch_npu's counters are torch's: hwsync.backend.ipc_counters)
    release_if_held(record["ref_counter_handle"], record["ref_counter_offset"],
                    torch.UntypedStorage._release_ipc_counter_npu)  # type: ignore[attr-defined]  # torch_npu's


class NpuIpcReceiveBuffers(ReceiveBuffers):
    """The sender's device buffers, mapped into this process on its own current NPU."""

    def __init__(self, handles: Handles) -> None:
        if handles.get("kind") != HANDLE_KIND:
            raise ValueError(f"NPU IPC receiver got handles of kind {handles.get('kind')!r}")
        self._torch_npu = import_torch_npu()
        local = _LOCAL_SENDERS.get(str(handles.get("token")))
        if local is not None and handles.get("pid") == os.getpid():  # the runtime cannot open its own export
            self._views: list[torch.Tensor] = list(local._buffers)
            return
        self._views = []
        device = npu_device(int(self._torch_npu.npu.current_device()))  # this receiver's own NPU
        for record in handles["buffers"]:
            storage = torch.UntypedStorage._new_shared_npu(  # type: ignore[attr-defined]
                device.index, record["handle"], record["storage_bytes"], record["storage_offset"],
                record["ref_counter_handle"], record["ref_counter_offset"],
                record["event_handle"], record["event_sync_required"],
            )
            self._views.append(torch.empty(0, dtype=torch.uint8, device=device).set_(storage))

    def view(self, index: int, nbytes: int) -> torch.Tensor:
        """Zero-copy view of the sender's buffer `index`."""
        return self._views[index][:nbytes]

    def release(self, index: int) -> None:
        """Wait until this process's queued reads of the buffer are done: the sender refills it once told."""
        # copies out of the mapped buffer run asynchronously on the NPU stream (verl and vllm-ascend
        # synchronize the device per bucket); the core receiver also waits before every release
        _wait_stream(self._torch_npu)

    def close(self) -> None:
        """Drop the mappings (the sender frees the memory)."""
        self._views = []


class NpuIpcTransport(Transport):
    """Same-node transfer through shared NPU memory (HDK >= 25.3.RC1, CANN >= 8.3.RC1)."""

    name = "npu_ipc"
    default_bucket_bytes = 256 << 20  # no copy on either side: fewer, larger buckets cost nothing

    def __init__(self, device_fn: Any) -> None:
        self._device_fn = device_fn
        self._decision: IpcDecision | None = None
        self._logged = False
        self._segments = NpuDeviceSegments()

    def decision(self) -> IpcDecision:
        """The IPC-or-shm decision for this machine, made once."""
        if self._decision is None:
            if not torch_npu_installed():
                self._decision = IpcDecision(False, "torch_npu is not installed, so there is no NPU memory to share")
            else:
                self._decision = decide_ipc(*current_versions())
        return self._decision

    def available(self) -> ProbeResult:
        """Usable when the versions allow it and this process's allocator shares plain handles (no expandable
        segments); the first refusal is logged once with its reason."""
        decision = self.decision()
        reason = decision.reason if not decision.use_ipc else expandable_segments_reason()
        if reason is not None:
            if not self._logged:
                self._logged = True
                log.warning("hwsync: npu_ipc unavailable, falling back to shm: %s", reason)
            return ProbeResult(False, reason)
        return ProbeResult(True, decision.reason)

    def open_sender(self, bucket_bytes: int, num_buffers: int) -> SendBuffers:
        """Allocate `num_buffers` shareable device buffers (refused, with the reason, under expandable segments)."""
        self._require()
        reason = expandable_segments_reason()
        if reason is not None:  # npu_ipc was asked for by name: refuse with the reason, do not fail later
            raise HwsyncError(f"npu_ipc cannot be used: {reason}")
        return NpuIpcSendBuffers(self._device_fn(), bucket_bytes, num_buffers)

    def open_receiver(self, handles: Handles, owner_pid: int | None = None) -> ReceiveBuffers:
        """Map the sender's buffers."""
        self._require()
        return NpuIpcReceiveBuffers(handles)

    def device_segments(self) -> DeviceSegments | None:
        """The trainer's allocator segments, mapped in place by receivers, where NPU IPC is allowed; else None (the
        reason is available()'s, shown by `hwsync info`) and device tensors go packed. Expandable segments,
        vllm-ascend's sleep-pool segments and storages not in a base format are never exported
        (NpuDeviceSegments.locate)."""
        return self._segments if self.decision().use_ipc else None

    def _require(self) -> None:
        decision = self.decision()
        if not decision.use_ipc:
            raise RuntimeError(f"npu_ipc cannot be used here: {decision.reason}")
