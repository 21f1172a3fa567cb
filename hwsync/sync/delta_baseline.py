"""What a sender's delta baseline holds: one tensor per name, in the dtype receivers hold it, and its digest.

The baseline owns its bytes: nothing in it is the caller's memory, so an optimizer step right after
send() returns cannot reach it. A full sync copies each tensor in as it is taken (`keep`). A dense delta's
bytes are copied, on the encode thread that made it, into the tensor that replaces the baseline's at commit
(`successor`); the replaced tensor becomes the spare that the next dense copy of that name is written into,
so no sync faults in fresh pages for it. A sparse delta's changes are written into the baseline after
commit, from payloads in the sender's own room (hwsync.delta.room).
"""

from __future__ import annotations

import threading
import time

import torch

from hwsync.backend.interfaces import Device


class Baseline:
    """The tensors of one sender's baseline, where they live (pinned host memory, or the device), and their digests."""

    def __init__(self, device: Device, *, on_device: bool = False) -> None:
        self._device = device
        #: keep the baseline on the trainer's device (fast diffs, device memory) rather than in host memory
        self.on_device = on_device
        self.tensors: dict[str, torch.Tensor] = {}
        #: the digest of each tensor (as the receivers hold it), once taken
        self.digests: dict[str, int] = {}
        #: host tensors pinned for device-to-host copies, by data pointer (unpinned when dropped)
        self._pinned: dict[int, torch.Tensor] = {}
        #: a dense delta's copy of each tensor, written on the encode threads: the baseline once the sync commits
        self._successors: dict[str, torch.Tensor] = {}
        #: the tensors commits replaced with their successors: room for the next dense copy of each name
        self._spares: dict[str, torch.Tensor] = {}
        #: this sync's copies of what the caller owns: bytes, and seconds summed over the threads that made them
        self._owned_bytes, self._owned_s = 0, 0.0
        self._owned_lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Memory the baseline's tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def spare_bytes(self) -> int:
        """Memory kept beside the baseline for the next dense copies (the tensors they replaced)."""
        return sum(t.numel() * t.element_size() for t in self._spares.values())

    @property
    def owned(self) -> tuple[int, float]:
        """This sync's copies of the caller's bytes so far: (bytes, seconds summed over the threads)."""
        with self._owned_lock:
            return self._owned_bytes, self._owned_s

    def begin(self) -> None:
        """A sync starts: the copies of one that did not commit go back to being spares, the counts to zero."""
        successors, self._successors = self._successors, {}
        for name, successor in successors.items():
            if name not in self._spares and successor is not self.tensors.get(name):
                self._spares[name] = successor
            else:
                self._forget(successor)
        with self._owned_lock:
            self._owned_bytes, self._owned_s = 0, 0.0

    def keep(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A full sync's tensor, cast into the baseline (the loader's op: `copy_`) as it is taken; the kept tensor."""
        kept = self.tensors.get(name)
        if kept is None or kept.shape != tensor.shape or kept.dtype != dtype:
            if kept is not None:
                self._forget(kept)
            kept = self.tensors[name] = self._allocate(tuple(tensor.shape), dtype, tensor.device)
        kept.copy_(tensor)  # before the next is taken: a source with stable_sources=False may refill it then
        return kept

    def copy_of_source(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor of an unstable source, copied as it is taken (before any encode reads it), and counted."""
        t0 = time.perf_counter()
        copy = tensor.detach().clone(memory_format=torch.contiguous_format)
        self._count_owned(copy, t0)
        return copy

    def successor(self, name: str, engine: torch.Tensor, fresh: bool) -> None:
        """What the baseline of `name` becomes if this sync commits: `engine` (the tensor as the receivers will hold
        it) in memory this sender owns, where the baseline lives (an encode thread's job). `fresh`: `engine` was made
        for this sync (a cast, a contiguous copy, a copy of an unstable source's tensor), not the caller's own memory,
        so where it already is where the baseline lives it is kept as it is."""
        where = engine.device if self.on_device else torch.device("cpu")
        if fresh and engine.device == where and engine.is_contiguous():
            self._successors[name] = engine
            return
        t0 = time.perf_counter()
        spare = self._spares.pop(name, None)
        if spare is None or spare.shape != engine.shape or spare.dtype != engine.dtype:
            if spare is not None:
                self._forget(spare)
            spare = self._allocate(tuple(engine.shape), engine.dtype, engine.device)
        spare.copy_(engine)
        self._successors[name] = spare
        self._count_owned(spare, t0)

    def take_successor(self, name: str) -> bool:
        """At commit: the successor of `name`, if this sync made one, is the baseline now (the replaced tensor a
        spare); whether there was one."""
        successor = self._successors.pop(name, None)
        if successor is None:
            return False
        kept, self.tensors[name] = self.tensors.get(name), successor
        if kept is not None:
            old = self._spares.pop(name, None)
            if old is not None:
                self._forget(old)
            self._spares[name] = kept
        return True

    def clear(self) -> int:
        """Free every tensor (and unpin it); returns the bytes freed."""
        freed = self.held_bytes + self.spare_bytes
        for kept in self._pinned.values():
            self._device.unpin_host_memory(kept)
        self._pinned, self.tensors, self.digests, self._spares, self._successors = {}, {}, {}, {}, {}
        return freed

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, source: torch.device) -> torch.Tensor:
        """Room for one tensor: on `source`'s device when kept there, else in (pinned) host memory."""
        if self.on_device:
            return torch.empty(shape, dtype=dtype, device=source)
        kept = torch.empty(shape, dtype=dtype)
        if source.type != "cpu" and self._device.pin_host_memory(kept):
            self._pinned[kept.data_ptr()] = kept  # device-to-host copies into it at full speed
        return kept

    def _forget(self, kept: torch.Tensor) -> None:
        """A tensor no longer kept: unpinned, so that its memory goes with it."""
        if self._pinned.pop(kept.data_ptr(), None) is not None:
            self._device.unpin_host_memory(kept)

    def _count_owned(self, copy: torch.Tensor, t0: float) -> None:
        with self._owned_lock:
            self._owned_bytes += copy.numel() * copy.element_size()
            self._owned_s += time.perf_counter() - t0
