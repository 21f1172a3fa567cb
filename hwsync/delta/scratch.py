"""A diff's chunk buffers: one set per device and dtype and encode thread, kept across tensors and syncs.

Each buffer is made the first time it is used: the torch path (a GPU or NPU baseline, or no numba) and
the compiled scans use different ones, and on a device a buffer made and never used would hold device
memory for as long as the sender lives (12 MiB per encode thread at the default chunk).
"""

from __future__ import annotations

from functools import cached_property

import torch

from hwsync.delta import native
from hwsync.delta.header import int_view, pad8


class Scratch:
    """Buffers of one device and dtype, kept across tensors and syncs (no page faults per chunk)."""

    def __init__(self, elems: int, dtype: torch.dtype, device: torch.device) -> None:
        self.elems, self.dtype, self.device = elems, dtype, device
        self.packed = torch.empty(0, dtype=torch.uint8, device=device)

    def _empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.device)

    @cached_property
    def cast(self) -> torch.Tensor:
        """A chunk of the trainer's tensor cast to the engine's dtype."""
        return self._empty(self.elems, self.dtype)

    @cached_property
    def xor(self) -> torch.Tensor:
        """The torch path's XOR of a chunk; the 1-, 4- and 8-byte kernel's changed values."""
        return self._empty(self.elems, int_view(self.dtype))

    @cached_property
    def mask(self) -> torch.Tensor:
        """The torch path's change mask of a chunk."""
        return self._empty(self.elems, torch.bool)

    @cached_property
    def words(self) -> torch.Tensor:
        """The torch path's packing words."""
        return self._empty(self.elems // 8, torch.int64)

    @cached_property
    def offsets(self) -> torch.Tensor:
        """The 1-, 4- and 8-byte kernel's offsets of the changes in their blocks."""
        return self._empty(self.elems, torch.int16)

    @cached_property
    def dirty(self) -> torch.Tensor:
        """The 1-, 4- and 8-byte kernel's list of the words of a run that differ."""
        return self._empty(native.DIRTY_RUN, torch.int64)

    @cached_property
    def units(self) -> torch.Tensor:
        """The 2-byte kernel's step units of a chunk: a unit per change and the fillers of its unchanged stretches."""
        return self._empty(self.elems + self.elems // 255 + 8, torch.int16)

    @cached_property
    def raws(self) -> torch.Tensor:
        """The 2-byte kernel's raw values (escapes) of a chunk."""
        return self._empty(self.elems, torch.int16)

    def bits_for(self, numel: int) -> torch.Tensor:
        """A buffer for the change bits of a tensor of `numel` elements, whole int64 words."""
        need = pad8((numel + 7) // 8)
        if self.packed.numel() < need:
            self.packed = self._empty(need, torch.uint8)
        return self.packed[:need]
