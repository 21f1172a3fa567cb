"""Bit-level helpers of the delta codec, with torch ops only: pack a bool mask into bits, list the set bits.

`torch.nonzero` on the host scans about 2 ns per element on the machines measured, slower than the whole
diff may take, so on the host the set bits are found word by word: pack the mask 64 elements to an int64
word, list the non-zero words (64x fewer items to scan), then peel the lowest set bit off every live word
per round. Elsewhere (GPU, NPU) `nonzero` runs at memory speed and is used directly. Both give the same
sorted positions.
"""

from __future__ import annotations

import torch

# gathers the low bit of each of the 8 bytes of a word into its top byte (bit j of that byte = byte j)
_GATHER = 0x0102040810204080
_M1, _M2, _M4, _H01 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F, 0x0101010101010101
_EXP_MASK = 0x7FF


def pack_mask_into(mask: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask (length a multiple of 8) into `out` (uint8, a bit per element, little-endian)."""
    words = scratch[: mask.numel() // 8]
    torch.mul(mask.view(torch.uint8).view(torch.int64), _GATHER, out=words)
    words.bitwise_right_shift_(56)
    dest = out[: words.numel()]
    dest.copy_(words)  # int64 -> uint8 keeps the low byte
    return dest


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """The bits of a flat bool mask as uint8 (bit j of byte b is element 8b+j; the tail padded with 0)."""
    n = mask.numel()
    padded = torch.zeros((n + 63) // 64 * 64, dtype=torch.bool, device=mask.device)
    padded[:n] = mask
    out = torch.empty(padded.numel() // 8, dtype=torch.uint8, device=mask.device)
    pack_mask_into(padded, out, torch.empty(out.numel(), dtype=torch.int64, device=mask.device))
    return out[: (n + 7) // 8]


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` elements of a bool mask from its packed uint8 bits."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return bits.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)[:n].bool()


def popcount64(w: torch.Tensor) -> torch.Tensor:
    """Set bits per int64 word (0..64), SWAR: arithmetic shifts are masked, so the sign bit counts too."""
    v = w - ((w >> 1) & _M1)
    v = (v & _M2) + ((v >> 2) & _M2)
    v = (v + (v >> 4)) & _M4
    return v.mul_(_H01).bitwise_right_shift_(56)


def set_positions(words: torch.Tensor) -> torch.Tensor:
    """Sorted positions (int64) of the set bits of int64 `words`: bit j of word w is position 64*w + j."""
    if words.device.type != "cpu":
        bits = unpack_bits(words.view(torch.uint8), words.numel() * 64)
        return torch.nonzero(bits).view(-1)
    dirty = torch.nonzero(words).view(-1)
    if dirty.numel() == 0:
        return dirty
    w = words.index_select(0, dirty)
    counts = popcount64(w)
    end = counts.cumsum(0)
    out = torch.empty(int(end[-1]), dtype=torch.int64)
    slot = end.sub_(counts)  # each word's first slot in `out`: the output comes out sorted
    base = dirty.mul_(64).sub_(1023)  # minus the float64 exponent bias, added back by the exponent below
    while True:
        low = w & -w  # the lowest set bit (-2**63 for bit 63, whose float64 still has exponent 63)
        bit = low.to(torch.float64).view(torch.int64).bitwise_right_shift_(52).bitwise_and_(_EXP_MASK)
        out.index_copy_(0, slot, bit.add_(base))
        w.bitwise_xor_(low)
        live = torch.nonzero(w).view(-1)
        if live.numel() == 0:
            return out
        if live.numel() < w.numel():
            w, base, slot = w.index_select(0, live), base.index_select(0, live), slot.index_select(0, live)
        slot += 1
