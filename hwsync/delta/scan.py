"""What a diff's scan found in a tensor (or in one piece of it), how two pieces' findings join, and the block
code of a scan that made the step code alone (2-byte elements: kernels16.py).

The host encode cuts a large tensor in pieces at chunk boundaries and scans them on two threads (the last
large tensor of a sync would otherwise leave one encode thread idle). Everything a scan finds adds up
across a boundary except the step code's first step after it: each piece is scanned as if the last
change before it were the element just before the boundary, and `join` rewrites its leading fillers and
first step from where the pieces before it had their last change really. The joined step code is the one
a single scan gives, byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hwsync.delta import native
from hwsync.delta.header import blocks
from hwsync.delta.steps import FILLER_STEP


@dataclass
class Scan:
    """What a scan found: changes, the digest's gain, per-block counts, offsets, values, packed bits if any."""

    found: int = 0
    gained: int = 0
    counts: list[torch.Tensor] = field(default_factory=list)
    offsets: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    #: the change bits, or None where the scan made none (the host kernel: built from the block code if needed)
    packed: torch.Tensor | None = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    #: the step code's units and raw values (2-byte elements only), and the last change's position (moved on by
    #: the fillers a chunk's unchanged end took)
    units: list[torch.Tensor] = field(default_factory=list)
    raws: list[torch.Tensor] = field(default_factory=list)
    last: int = -1
    steps: bool = False
    #: the digest terms of the old values at the changes (mod 2**64): the step code's check of its base
    olds: int = 0

    @property
    def step_units(self) -> int | None:
        """The step code's count (units and raw values), or None where it was not made."""
        return sum(u.numel() for u in self.units) + sum(r.numel() for r in self.raws) if self.steps else None


def join(first: Scan, second: Scan, boundary: int) -> Scan:
    """The scan of [0, end) from the scans of [0, boundary) and [boundary, end), the second made as if the last
    change before it were at boundary - 1 (a host scan: block counts over the whole tensor each, or none where it
    made the step code alone)."""
    units, last = list(second.units), second.last
    if first.steps and second.found:
        units = _rebase(units, boundary - 1 - first.last)
    elif first.steps:  # no change from the boundary on: the next change's rebase makes the fillers from first.last
        units, last = [], first.last
    return Scan(found=first.found + second.found, gained=(first.gained + second.gained) % (1 << 64),
                counts=[first.counts[0] + second.counts[0]] if first.counts else [],
                offsets=first.offsets + second.offsets, values=first.values + second.values, packed=None,
                units=first.units + units, raws=first.raws + second.raws, last=last, steps=first.steps,
                olds=(first.olds + second.olds) % (1 << 64))


def _rebase(units: list[torch.Tensor], further: int) -> list[torch.Tensor]:
    """`units` with their first change `further` elements further from the last one than they say (0..254 after a
    piece with a change, more after pieces without)."""
    if further == 0:
        return units
    leading = 0  # fillers before the first change, across the pieces
    for at, piece in enumerate(units):
        changes = np.flatnonzero(piece.numpy())  # host scans only: numpy, on this thread (no OpenMP team)
        if changes.size == 0:
            leading += piece.numel()
            continue
        i = int(changes[0])
        unit = int(piece[i]) & 0xFFFF
        distance = FILLER_STEP * (leading + i) + (unit & 0xFF) + further
        fillers = (distance - 1) // FILLER_STEP
        step = distance - FILLER_STEP * fillers
        head = torch.zeros(fillers + 1, dtype=torch.int16, device=piece.device)
        head[-1] = _int16((unit & 0xFF00) | step)
        return [head, piece[i + 1:]] + units[at + 1:]
    return []  # no change after the boundary: only fillers, which the code does not end with


def trim_fillers(units: list[torch.Tensor]) -> None:
    """Drop the fillers after the tensor's last change: a chunk's unchanged end takes them ahead of a change
    that may never come (the torch path makes none: the code stays canonical, and no larger than it must be)."""
    while units:
        if units[-1].numel() and int(units[-1][-1]) != 0:  # the usual case: the code ends at a change already
            return
        changes = np.flatnonzero(units[-1].numpy())  # a change's unit is never 0 (its step is 1..255)
        if changes.size:
            units[-1] = units[-1][: int(changes[-1]) + 1]
            return
        units.pop()


def _int16(v: int) -> int:
    """A 16-bit pattern as the int16 of the same bits."""
    return v - (1 << 16) if v >= 1 << 15 else v


def block_code_from_steps(found: Scan, base_i: torch.Tensor, ints: torch.dtype, numel: int) -> None:
    """Fill in the block code's counts, offsets and values of a host scan that made the step code alone, against
    `base_i` (where the block or bitmap code is smaller: a very sparse tensor, or one mostly of escapes)."""
    unsteps = native.unsteps()
    assert unsteps is not None
    units = torch.cat(found.units) if found.units else torch.empty(0, dtype=torch.int16)
    raws = torch.cat(found.raws) if found.raws else torch.empty(0, dtype=torch.int16)
    offsets, values = torch.empty(found.found, dtype=torch.int16), torch.empty(found.found, dtype=ints)
    counts = torch.zeros(blocks(numel), dtype=torch.int64)
    unsteps(units.numpy(), raws.numpy(), base_i.numpy(), offsets.numpy(), values.view(torch.int16).numpy(),
            counts.numpy())
    found.counts, found.offsets, found.values = [counts], [offsets], [values]
