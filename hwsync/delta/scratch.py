"""A diff's chunk buffers: one set per device and dtype and encode thread, kept across tensors and syncs."""

from __future__ import annotations

import torch

from hwsync.delta import native
from hwsync.delta.header import int_view, pad8


class Scratch:
    """Buffers of one device and dtype, kept across tensors and syncs (no page faults per chunk)."""

    def __init__(self, elems: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.xor = torch.empty(elems, dtype=int_view(dtype), device=device)
        self.mask = torch.empty(elems, dtype=torch.bool, device=device)
        self.words = torch.empty(elems // 8, dtype=torch.int64, device=device)
        self.cast = torch.empty(elems, dtype=dtype, device=device)
        self.offsets = torch.empty(elems, dtype=torch.int16, device=device)
        self.dirty = torch.empty(native.DIRTY_RUN, dtype=torch.int64, device=device)
        # a chunk's step units: a unit per change and the fillers of its unchanged stretches (see native.scan)
        self.units = torch.empty(elems + elems // 255 + 8, dtype=torch.int16, device=device)
        self.raws = torch.empty(elems, dtype=torch.int16, device=device)
        self.packed = torch.empty(0, dtype=torch.uint8, device=device)

    def bits_for(self, numel: int) -> torch.Tensor:
        """A buffer for the change bits of a tensor of `numel` elements, whole int64 words."""
        need = pad8((numel + 7) // 8)
        if self.packed.numel() < need:
            self.packed = torch.empty(need, dtype=torch.uint8, device=self.device)
        return self.packed[:need]
