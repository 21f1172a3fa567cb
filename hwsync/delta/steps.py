"""The step code of 2-byte elements, with torch ops (any device); the host runs the same in native.py.

An RL update moves a bf16 weight by one unit in the last place when it moves it at all, and at 1-4%
changed the next change is a few dozen elements on. So per change one 2-byte unit: the step from the
last change (uint8, 1..255) and the new value's difference from the one the receiver holds (int8,
on the bit patterns as int16). A unit of 0 is a filler: 255 elements on, nothing changed (steps of
256 or more take (step - 1) // 255 fillers first). A difference outside -127..127 is an escape (its
byte is -128) and the new value is the next raw value, kept after the units. A difference is right only
on the value it was taken from, so the payload also carries the digest terms of the old values at the
changes (`olds`): the receiver sums the same over what it holds there and writes nothing unless they
agree (the block and bitmap codes carry whole values, which the digest check alone verifies). The
payload: the escape count and olds as int64, the units, the raw values: 16 + 2 x (units + escapes)
bytes, which the header's count (units + escapes) fixes before the payload arrives. Canonical: one set
of changes has one encoding, whichever engine or chunking made it.
"""

from __future__ import annotations

import torch

from hwsync.delta import digest as dg

#: the difference byte of an escape: the value is the next raw one
ESCAPE = -128
#: elements a filler moves on
FILLER_STEP = 255


def old_terms(pos: torch.Tensor, old: torch.Tensor) -> int:
    """The digest terms of the values `old` (int16) at flat `pos`: the step code's check of its base."""
    return dg.element_delta(pos, torch.zeros_like(old), old)


def encode_units(pos: torch.Tensor, new: torch.Tensor, old: torch.Tensor, last: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(units, raw values, the last position) for changes at sorted `pos` (after position `last`; -1 at the start)
    from `old` to `new` (int16 bit patterns)."""
    if pos.numel() == 0:
        return torch.empty(0, dtype=torch.int16, device=pos.device), new[:0], last
    prev = torch.cat([torch.tensor([last], dtype=torch.int64, device=pos.device), pos[:-1]])
    distance = pos - prev
    fillers = (distance - 1) // FILLER_STEP
    step = distance - FILLER_STEP * fillers
    diff = new.to(torch.int32) - old.to(torch.int32)
    small = (diff > ESCAPE) & (diff < -ESCAPE)
    byte = torch.where(small, diff, torch.full_like(diff, ESCAPE)).bitwise_and_(0xFF)
    unit = step.to(torch.int32).bitwise_or_(byte << 8)
    slot = torch.cumsum(fillers + 1, 0) - 1  # each change's unit comes after its fillers
    units = torch.zeros(int(slot[-1]) + 1, dtype=torch.int32, device=pos.device)
    units.index_copy_(0, slot, unit)
    return units.to(torch.int16), new[~small], int(pos[-1])


def decode_units(units: torch.Tensor, raws: torch.Tensor, numel: int, name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, difference, escaped) of every change of a step code, checked: fillers carry no difference, no
    position reaches `numel`, the escapes match the raw values. ValueError names the tensor."""
    u = units.to(torch.int32)
    gap = u.bitwise_and(0xFF)
    byte = (u >> 8).bitwise_and_(0xFF)
    byte = torch.where(byte >= 128, byte - 256, byte)  # the signed difference
    filler = gap == 0
    if bool((filler & (byte != 0)).any()):
        raise ValueError(f"{name}: a filler of the delta's step code carries a difference")
    pos = torch.cumsum(torch.where(filler, FILLER_STEP, gap).to(torch.int64), 0) - 1
    change = ~filler
    pos, byte = pos[change], byte[change]
    if pos.numel() and int(pos[-1]) >= numel:  # checked here: on a GPU a bad index is a device assert
        raise ValueError(f"{name}: the delta's steps run past the tensor's {numel} elements")
    escaped = byte == ESCAPE
    escapes = int(escaped.sum())
    if escapes != raws.numel():
        raise ValueError(f"{name}: the delta's step code has {escapes} escapes and {raws.numel()} raw values")
    return pos, byte, escaped


def new_values(old: torch.Tensor, byte: torch.Tensor, escaped: torch.Tensor, raws: torch.Tensor) -> torch.Tensor:
    """The values the changes write (int16): the held value plus the difference, or the next raw value."""
    moved = (old.to(torch.int32) + byte).to(torch.int16)
    if raws.numel() == 0:
        return moved
    index = (torch.cumsum(escaped.to(torch.int64), 0) - 1).clamp_(min=0)
    return torch.where(escaped, raws.index_select(0, index), moved)
