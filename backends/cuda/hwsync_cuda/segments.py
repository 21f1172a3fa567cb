"""Mapped sources on CUDA: the trainer's caching-allocator segments, exported once per receiver process.

How torch shares CUDA memory (torch/csrc/StorageSharing.cpp, CudaIPCTypes.cpp, multiprocessing/reductions.py),
and what is built on it here:
- `storage._share_cuda_()` exports the cudaMalloc allocation (the caching allocator's segment) that
  holds a storage: the IPC handle is the segment base's, with the storage's offset in it, plus a fresh
  ref-counter slot (one consumer) and, while torch has IPC events left, an event the consumer's stream
  waits for once. The segment's size comes from the allocator's snapshot (torch.cuda.memory_snapshot:
  its segments' `address` and `total_size`; hwsync.backend.segments says when it is taken);
- the receiver calls `UntypedStorage._new_shared_cuda(device, handle, segment size, 0, ...)`: one
  storage over the whole segment, mapped on its own current GPU (cudaIpcOpenMemHandle, cached per
  handle inside torch, so a second export of a segment it maps opens nothing), whose deleter waits for
  its stream and takes the export's counter to 0. Nothing goes through torch's python-level rebuild
  cache, so each export has exactly one storage, and one decrement;
- the anchor is a StorageWeakRef of the storage the segment was found through. While a receiver maps
  the export, torch keeps that block when the trainer frees it (IPC limbo), so the segment stays
  allocated under the receiver; `torch.cuda.ipc_collect()` frees it once the receivers let go;
- with expandable segments torch shares memory as file descriptors (pidfd_getfd) and a storage's
  offset is not its segment's: the transport then offers no segments (expandable_segments_reason),
  and device tensors go packed.
Written against torch's APIs as in torch 2.11 / 2.13 (their sources above), then run on an H100 and
an H200 (docs/cuda.md); the simulated accelerator models the same rules.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch

from hwsync.backend import AllocatorSegments, HwsyncError, Record, SegmentPlace, release_if_held

KIND = "cuda_segment"
_BYTES_FIELDS = ("handle", "ref_counter_handle")


def _snapshot_segments() -> list[dict[str, Any]]:
    """The caching allocator's segments, without the traces where this torch can leave them out."""
    try:
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:  # an older torch: no such argument
        return torch.cuda.memory_snapshot()


class CudaDeviceSegments(AllocatorSegments):
    """torch's caching-allocator segments, shared through CUDA IPC (finding them: AllocatorSegments)."""

    device_type = "cuda"

    def _snapshot(self) -> list[dict[str, Any]]:
        return _snapshot_segments()

    def export(self, anchor: Any, place: SegmentPlace) -> Record:
        """`_share_cuda_()` of the anchor's storage, for its whole segment (one ref-counter slot: one consumer)."""
        storage = self._storage(anchor)
        if storage is None:
            raise HwsyncError(f"cuda: device segment {place.key} was freed before it could be exported")
        _, index, base = cast(tuple[str, int, int], place.key)  # locate's key
        shared = storage._share_cuda_()
        if len(shared) != 8:
            raise HwsyncError(f"torch {torch.__version__} shares CUDA storages differently than hwsync-cuda expects "
                              f"(_share_cuda_ gave {len(shared)} fields, not 8); send with "
                              "WeightSender(stable_sources=False), which packs every tensor")
        _device, handle, _nbytes, offset, ref_handle, ref_offset, event_handle, event_sync = shared
        if int(offset) != storage.data_ptr() - base:
            raise HwsyncError(f"cuda: torch shares the storage at {int(offset)} bytes into its allocation, but the "
                              f"allocator's snapshot puts it at {storage.data_ptr() - base}; send with "
                              "WeightSender(stable_sources=False), which packs every tensor")
        from hwsync_cuda.device import device_uuid

        return {"kind": KIND, "uuid": device_uuid(index), "pid": os.getpid(), "size": place.size,
                "handle": bytes(handle), "ref_counter_handle": bytes(ref_handle), "ref_counter_offset": int(ref_offset),
                "event_handle": None if event_handle is None else bytes(event_handle),
                "event_sync_required": bool(event_sync)}

    def release_export(self, record: Record) -> None:
        """torch's _release_ipc_counter_cuda for an export its receiver will never unmap, unless it already did."""
        record = _checked(record)
        release_if_held(record["ref_counter_handle"], record["ref_counter_offset"],
                        torch.UntypedStorage._release_ipc_counter_cuda)

    def open(self, record: Record, size: int) -> torch.Tensor:
        """One storage over the whole segment on this thread's current GPU (peer access when it is not the sender's)."""
        record = _checked(record)
        if record["size"] != size:
            raise HwsyncError(f"cuda: a device segment export of {record['size']} bytes announced as {size}")
        torch.cuda._lazy_init()
        index = torch.cuda.current_device()
        with torch.cuda.device(index):
            try:
                storage = torch.UntypedStorage._new_shared_cuda(
                    index, record["handle"], size, 0, record["ref_counter_handle"], record["ref_counter_offset"],
                    record["event_handle"], record["event_sync_required"])
            except RuntimeError as exc:
                raise HwsyncError(f"cuda: could not map the sender's device segment on cuda:{index} (the sender's "
                                  f"GPU is {record['uuid']}): {exc}. Put the receiver on the sender's GPU, or send "
                                  "with WeightSender(stable_sources=False), which packs every tensor") from exc
            return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage, 0, (size,), (1,))

    def collect(self) -> None:
        """torch.cuda.ipc_collect(): free blocks receivers have let go; forget ranges no live anchor vouches for."""
        super().collect()
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()


def _checked(record: Record) -> Record:
    """A peer's export record with every field of its type; HwsyncError otherwise (torch's own calls check no more)."""
    ok = isinstance(record, dict) and record.get("kind") == KIND and all(
        type(record.get(k)) is bytes for k in _BYTES_FIELDS) and all(
        type(record.get(k)) is int for k in ("size", "ref_counter_offset", "pid")) and type(
        record.get("event_sync_required")) is bool and (record.get("event_handle") is None or type(
            record.get("event_handle")) is bytes) and isinstance(record.get("uuid"), str)
    if not ok:
        raise HwsyncError(f"cuda: not a device segment export of this hwsync: {str(record)[:120]}")
    return record
