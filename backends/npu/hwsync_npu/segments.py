"""Mapped sources on the NPU: the trainer's caching-allocator segments, exported once per receiver process.

torch_npu shares NPU memory the way torch shares CUDA memory (torch_npu/csrc/ipc/StorageSharing.cpp,
read from the torch-npu 2.13.0 and 2.10.0.post4 sources): `storage._share_npu_()` gives the handle of the
allocation (segment) that holds the storage (NPUCachingAllocator::shareIpcHandle) and the storage's offset
in it, a fresh ref-counter slot (one consumer) in torch's own RefcountedMapAllocator file, and an IPC event
handle where the runtime records one; `UntypedStorage._new_shared_npu(device, handle, size, offset, ...)`
maps the handle once per process (getIpcDevPtr) and makes a storage at any offset of it, whose deleter waits
for the current stream and takes the counter down. So the design of hwsync_cuda.segments holds unchanged:
one export per (receiver, segment) through a weakly held anchor storage, one storage over the whole segment
on the receiver, the segment's size from the allocator's snapshot (torch_npu.npu.memory_snapshot: `device`,
`address`, `total_size`, `is_expandable`, `segment_pool_id`), ipc_collect after drops. Never exported, so
their tensors go packed:
- expandable segments (shared through a separate VMM path; AllocatorSegments skips them);
- segments of a private pool (`segment_pool_id` not (0, 0)): vllm-ascend's sleep mode allocates through
  torch_npu's NPUPluggableAllocator into such a pool, and torch_npu does not share pluggable memory;
- storages not in a base format (FRACTAL_NZ and the like), which `_share_npu_` refuses;
- storages this process received from another (`_share_npu_` refuses re-sharing them; they are in no
  segment of this process's allocator, so they are never found).
NPU IPC exists only from Ascend HDK 25.3.RC1 and CANN 8.3.RC1 on: elsewhere the npu_ipc transport is
unavailable, says why in `hwsync info`, and offers no segments (device tensors go packed through shared
memory). Run in CI against a stand-in torch_npu that applies StorageSharing.cpp's checks over CPU memory
(tests/npu_torch_standin.py); unverified on an NPU (none here).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any, cast

import torch

from hwsync.backend import AllocatorSegments, HwsyncError, Record, SegmentPlace, release_if_held
from hwsync_npu.api import BASE_FORMATS, import_torch_npu
from hwsync_npu.device import TORCH_TYPE, npu_device

log = logging.getLogger("hwsync")

KIND = "npu_segment"
DEFAULT_POOL = (0, 0)  # segment_pool_id of the allocator's own segments


class NpuDeviceSegments(AllocatorSegments):
    """torch_npu's caching-allocator segments, shared through NPU IPC (finding them: AllocatorSegments)."""

    device_type = TORCH_TYPE

    def __init__(self) -> None:
        super().__init__()
        self._torch_npu: ModuleType | None = None
        self._told: set[str] = set()  # kinds of memory already logged as packed

    def _npu(self) -> Any:
        if self._torch_npu is None:
            self._torch_npu = import_torch_npu()
        return self._torch_npu.npu

    def _snapshot(self) -> list[dict[str, Any]]:
        segments = list(self._npu().memory_snapshot())
        pooled = [s for s in segments if tuple(s.get("segment_pool_id") or DEFAULT_POOL) != DEFAULT_POOL]
        if pooled:
            self._tell("pool", f"{len(pooled)} NPU segments belong to a private memory pool (vllm-ascend's sleep "
                               "mode allocates through torch_npu's pluggable allocator, which torch_npu does not share "
                               "by IPC): tensors in them go packed")
        return [s for s in segments if tuple(s.get("segment_pool_id") or DEFAULT_POOL) == DEFAULT_POOL]

    def locate(self, tensor: torch.Tensor) -> SegmentPlace | None:
        """The segment of a plain NPU tensor torch_npu can share; None for one it cannot (packed)."""
        place = super().locate(tensor)
        return place if place is not None and self.shareable(tensor) else None

    def shareable(self, tensor: torch.Tensor) -> bool:
        """Whether torch_npu shares the tensor's storage: only one in a base format (it refuses FRACTAL_NZ and the
        like with "Try to share a storage without base format")."""
        try:
            npu_format = int(import_torch_npu().get_npu_format(tensor))
        except Exception as exc:  # noqa: BLE001 - a format that cannot be read is not shared: packing is always right
            self._tell("format?", f"the storage format of an NPU tensor could not be read ({exc}): it goes packed")
            return False
        if npu_format not in BASE_FORMATS:
            self._tell(f"format{npu_format}", f"an NPU tensor is in storage format {npu_format} (FRACTAL_NZ is 29), "
                                              "which torch_npu does not share: such tensors go packed")
            return False
        return True

    def _tell(self, kind: str, message: str) -> None:
        if kind not in self._told:
            self._told.add(kind)
            log.info("hwsync: %s", message)

    def export(self, anchor: Any, place: SegmentPlace) -> Record:
        """`_share_npu_()` of the anchor's storage, for its whole segment (one ref-counter slot: one consumer)."""
        storage = self._storage(anchor)
        if storage is None:
            raise HwsyncError(f"npu: device segment {place.key} was freed before it could be exported")
        _, index, base = cast(tuple[str, int, int], place.key)  # locate's key
        shared = storage._share_npu_()  # type: ignore[attr-defined]  # torch_npu adds it at import
        if len(shared) != 8:
            raise HwsyncError(f"torch_npu shares NPU storages differently than hwsync-npu expects (_share_npu_ gave "
                              f"{len(shared)} fields, not 8); send with WeightSender(stable_sources=False), which "
                              "packs every tensor")
        _device, handle, _nbytes, offset, ref_handle, ref_offset, event_handle, event_sync = shared
        if int(offset) != storage.data_ptr() - base:
            raise HwsyncError(f"npu: torch_npu shares the storage at {int(offset)} bytes into its allocation, but the "
                              f"allocator's snapshot puts it at {storage.data_ptr() - base}; send with "
                              "WeightSender(stable_sources=False), which packs every tensor")
        from hwsync_npu.device import current_visible_value, physical_index

        return {"kind": KIND, "physical_device": physical_index(index, current_visible_value()), "pid": os.getpid(),
                "size": place.size, "handle": bytes(handle), "ref_counter_handle": _as_bytes(ref_handle),
                "ref_counter_offset": int(ref_offset), "event_handle": _as_bytes(event_handle or b""),
                "event_sync_required": bool(event_sync)}

    def release_export(self, record: Record) -> None:
        """torch_npu's _release_ipc_counter_npu for an export its receiver will never unmap, unless it already did."""
        record = _checked(record)
        release_if_held(record["ref_counter_handle"], record["ref_counter_offset"],
                        torch.UntypedStorage._release_ipc_counter_npu)  # type: ignore[attr-defined]  # torch_npu's

    def open(self, record: Record, size: int) -> torch.Tensor:
        """One storage over the whole segment on this thread's current NPU (peer access when not the sender's)."""
        record = _checked(record)
        if record["size"] != size:
            raise HwsyncError(f"npu: a device segment export of {record['size']} bytes announced as {size}")
        index = int(self._npu().current_device())
        storage = torch.UntypedStorage._new_shared_npu(  # type: ignore[attr-defined]  # torch_npu's
            index, record["handle"], size, 0, record["ref_counter_handle"], record["ref_counter_offset"],
            record["event_handle"], record["event_sync_required"])
        return torch.empty(0, dtype=torch.uint8, device=npu_device(index)).set_(storage, 0, (size,), (1,))

    def collect(self) -> None:
        """torch_npu.npu.ipc_collect(); forget ranges no live anchor vouches for."""
        super().collect()
        if self._torch_npu is not None:
            self._torch_npu.npu.ipc_collect()


def _as_bytes(value: Any) -> bytes:
    return value.encode("latin-1") if isinstance(value, str) else bytes(value)


def _checked(record: Record) -> Record:
    """A peer's export record with every field of its type; HwsyncError otherwise."""
    ok = isinstance(record, dict) and record.get("kind") == KIND and all(
        type(record.get(k)) is bytes for k in ("handle", "ref_counter_handle", "event_handle")) and type(
        record.get("event_sync_required")) is bool and all(
        type(record.get(k)) is int for k in ("size", "ref_counter_offset", "pid", "physical_device"))
    if not ok:
        raise HwsyncError(f"npu: not a device segment export of this hwsync: {str(record)[:120]}")
    return record
