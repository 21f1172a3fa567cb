"""The sim's device segments for mapped sources: a sender's allocations read in place by receiver processes.

What CUDA does (hwsync_cuda.segments), modelled on the sim's memory (hwsync_sim.runtime, .sharing):
- a segment is one sim allocation (a Memory): CUDA's caching allocator gives a large tensor a
  cudaMalloc segment of its own, and views of one storage (a flat parameter buffer) share one;
- an export is `sharing.share` of a flat uint8 alias of the whole allocation: one ref-counter slot,
  one consumer, exactly as torch's _share_cuda_ of a storage; the receiver maps it once per process
  (`sharing.open_shared`, cached per segment as torch's getIpcDevPtr is) on its own current device;
- the anchor is a weak reference to the allocation's Block: it dies when the last tensor on it does,
  and a block a receiver still maps then waits in IPC limbo (reported as a leak if nobody ever frees it);
- memory this process mapped from another is never exported again (torch refuses that too).
Counted (Runtime.counts), besides sharing's "exports", "opens" and "opens_cached" (which count the
transport's buffers too): "segment_exports" and "segment_opens", for mapped sources alone.
"""

from __future__ import annotations

import re
import sys
import weakref
from typing import Any

import torch

from hwsync.backend import DeviceSegments, HwsyncError, Record, SegmentPlace
from hwsync_sim import sharing
from hwsync_sim.runtime import FILE_PREFIX, Memory, SimError, runtime
from hwsync_sim.tensor import SimTensor, block_of, forget_dead_transplants, is_sim

KIND = "sim_segment"
#: what a sim export names: its segment and ref-counter files in /dev/shm (nothing else is ever opened)
_SEGMENT = re.compile(re.escape(FILE_PREFIX) + r"(\d+)-[0-9a-f]{16}")
_REFS = re.compile(re.escape(FILE_PREFIX) + r"(\d+)-refs-[0-9a-f]{8}")

_serials: "weakref.WeakKeyDictionary[Memory, int]" = weakref.WeakKeyDictionary()
_next_serial = [0]


def _serial(mem: Memory) -> int:
    serial = _serials.get(mem)
    if serial is None:
        _next_serial[0] += 1
        serial = _serials[mem] = _next_serial[0]
    return serial


class SimDeviceSegments(DeviceSegments):
    """The sim's allocations exported once per receiver process and mapped there in place."""

    def locate(self, tensor: torch.Tensor) -> SegmentPlace | None:
        """The allocation holding a sim tensor; None for host tensors and memory mapped from another process."""
        if not is_sim(tensor):
            return None
        try:
            block = block_of(tensor)
        except SimError:
            return None
        mem = block.mem
        if mem.mapping is not None:  # received from another process: not this process's to share
            return None
        # a plain sim tensor's storage offset counts from its Block's first byte too (hwsync_sim.tensor.as_sim)
        return SegmentPlace(("sim", _serial(mem)), mem.nbytes, tensor.storage_offset() * tensor.element_size())

    def held_elsewhere(self, tensor: torch.Tensor) -> bool:
        """A Parameter, or a block some other tensor holds too (counted on the Block: every SimTensor and every
        parameter moved with `.data =` holds it; plain tensors sharing a parameter's storage count there)."""
        if isinstance(tensor, torch.nn.Parameter):
            return True
        block = block_of(tensor)
        others = sys.getrefcount(block) - 3  # getrefcount's argument, `block` here, the holder `tensor` goes through
        if isinstance(tensor, SimTensor):
            return others >= 1
        return others >= 1 or torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) >= 3

    def anchor(self, tensor: torch.Tensor) -> Any:
        """A weak reference to the tensor's Block."""
        return weakref.ref(block_of(tensor))

    def alive(self, anchor: Any) -> bool:
        """Whether some tensor still holds the Block."""
        if anchor() is not None:
            forget_dead_transplants()  # a parameter moved elsewhere frees its old block now, as in torch
        return anchor() is not None

    def export(self, anchor: Any, place: SegmentPlace) -> Record:
        """`sharing.share` of the whole allocation as flat bytes (one ref-counter slot: one consumer)."""
        block = anchor()
        if block is None:
            raise HwsyncError(f"sim: device segment {place.key} was freed before it could be exported")
        flat = SimTensor(block, (block.mem.nbytes,), (1,), 0, torch.uint8)
        runtime().tally("segment_exports")
        return {"kind": KIND, **sharing.share(flat)}

    def release_export(self, record: Record) -> None:
        """Release an export that will never be unmapped (torch's _release_ipc_counter), unless it already was."""
        sharing.release_if_held(_checked(record))

    def open(self, record: Record, size: int) -> torch.Tensor:
        """Map the export on this thread's current sim device: flat uint8, `size` bytes."""
        record = _checked(record)
        if record["bytes"] != size or record["shape"] != [size] or record["dtype"] != "uint8":
            raise HwsyncError(f"sim: a device segment export of {record['bytes']} bytes announced as {size}")
        rt = runtime()
        rt.tally("segment_opens")
        return sharing.open_shared(record, rt.current())

    def collect(self) -> None:
        """sharing.collect: free limbo blocks every consumer has let go (torch.cuda.ipc_collect)."""
        sharing.collect(runtime(), report=False)


def _checked(record: Record) -> dict[str, Any]:
    """A peer's export record, each field of its type and its files the exporter's own; HwsyncError otherwise."""
    ints = ("bytes", "physical", "pid", "slot", "offset")
    if not isinstance(record, dict) or record.get("kind") != KIND or any(type(record.get(k)) is not int for k in ints):
        raise HwsyncError(f"sim: not a sim device segment export: {str(record)[:120]}")
    pid = str(record["pid"])
    for key, pattern in (("segment", _SEGMENT), ("refs", _REFS)):
        found = pattern.fullmatch(str(record.get(key)))
        if found is None or found.group(1) != pid:
            raise HwsyncError(f"sim: export names {key} {str(record.get(key))[:80]!r}, not a file of process {pid}")
    if not isinstance(record.get("shape"), list) or not isinstance(record.get("stride"), list):
        raise HwsyncError("sim: an export's shape and stride are lists")
    return record
