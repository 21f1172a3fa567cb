"""The segments of torch's caching allocator (CUDA's, and the NPU plugin's built alike), as mapped sources find them.

Shared by hwsync_cuda.segments and hwsync_npu.segments, which add how a segment is exported, mapped
and released. Here: which tensors count as kept by something else, and in which segment a tensor
lies. The allocator's snapshot (`memory_snapshot()`: each segment's device, `address`, `total_size`)
is taken only for a tensor outside every segment known, at most once per sync; a range read from it
stays trusted across syncs only while a segment holds a live anchor (a storage some receiver maps:
the allocator cannot give such a segment back to the driver), so a segment freed by `empty_cache()`
and another allocated at its address are never confused. Names no vendor module: a backend passes
its snapshot function.
"""

from __future__ import annotations

import bisect
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, cast

import torch

from hwsync.backend.interfaces import DeviceSegments, SegmentPlace

Snapshot = Callable[[], list[dict[str, Any]]]


class AllocatorSegments(DeviceSegments):
    """torch caching-allocator segments of one device type, located from the allocator's snapshot."""

    #: the torch device type whose tensors this shares ("cuda", "npu")
    device_type: str

    def __init__(self) -> None:
        #: per device index: base -> size of each segment known, and the sorted bases
        self._sizes: dict[int, dict[int, int]] = {}
        self._bases: dict[int, list[int]] = {}
        #: anchors handed out, by (device index, segment base): what keeps a known range valid across syncs
        self._anchors: dict[tuple[int, int], list[Any]] = {}
        self._fresh = False  # a snapshot was taken since the last collect()

    @abstractmethod
    def _snapshot(self) -> list[dict[str, Any]]:
        """The allocator's segments (memory_snapshot's dicts)."""

    def _refresh(self) -> None:
        sizes: dict[int, dict[int, int]] = {}
        for segment in self._snapshot():
            if segment.get("is_expandable"):
                continue  # shared as file descriptors, and a storage's offset is not its segment's: never exported
            sizes.setdefault(int(segment["device"]), {})[int(segment["address"])] = int(segment["total_size"])
        self._sizes, self._fresh = sizes, True
        self._bases = {index: sorted(found) for index, found in sizes.items()}

    def _segment_of(self, index: int, ptr: int) -> tuple[int, int] | None:
        """(base, size) of the segment holding address `ptr` of device `index`, snapshotting once if unknown."""
        for attempt in range(2):
            bases = self._bases.get(index, [])
            i = bisect.bisect_right(bases, ptr) - 1
            if i >= 0 and ptr < bases[i] + self._sizes[index][bases[i]]:
                return bases[i], self._sizes[index][bases[i]]
            if attempt or self._fresh:
                return None
            self._refresh()  # a segment made since the last look
        return None

    def locate(self, tensor: torch.Tensor) -> SegmentPlace | None:
        """The segment of a plain tensor of this device type (a Parameter counts); None for anything else."""
        if tensor.device.type != self.device_type or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return None
        index, ptr = tensor.device.index, tensor.data_ptr()
        if index is None:
            return None
        found = self._segment_of(index, ptr)
        if found is None:
            return None
        base, size = found
        return SegmentPlace((self.device_type, index, base), size, ptr - base)

    def held_elsewhere(self, tensor: torch.Tensor) -> bool:
        """A Parameter, or a storage another tensor shares (a state_dict() entry shares its parameter's)."""
        if isinstance(tensor, torch.nn.Parameter):
            return True
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        # this tensor and the temporary Python storage object count 2; a third holder keeps it past the sync
        return use_count is not None and use_count(tensor.untyped_storage()._cdata) >= 3

    def anchor(self, tensor: torch.Tensor) -> Any:
        """A weak reference to the tensor's storage; while it lives, its segment's range stays trusted."""
        from torch.multiprocessing.reductions import StorageWeakRef

        ref = StorageWeakRef(tensor.untyped_storage())
        place = self.locate(tensor)
        if place is not None:
            _, index, base = cast(tuple[str, int, int], place.key)  # locate's key
            self._anchors.setdefault((index, base), []).append(ref)
        return ref

    def alive(self, anchor: Any) -> bool:
        """Whether the storage still lives."""
        return not anchor.expired()

    def _storage(self, anchor: Any) -> torch.UntypedStorage | None:
        """The anchor's storage while it lives (a new Python object for it), else None."""
        return torch.UntypedStorage._new_with_weak_ptr(anchor.cdata)

    def collect(self) -> None:
        """Forget ranges no live anchor vouches for; the next unknown tensor takes a fresh snapshot."""
        self._anchors = {key: live for key, refs in self._anchors.items() if (live := [r for r in refs
                                                                                    if not r.expired()])}
        sizes: dict[int, dict[int, int]] = {}
        for index, base in self._anchors:
            size = self._sizes.get(index, {}).get(base)
            if size is not None:
                sizes.setdefault(index, {})[base] = size
        self._sizes, self._fresh = sizes, False
        self._bases = {index: sorted(found) for index, found in sizes.items()}
