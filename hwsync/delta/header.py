"""The header of one encoded tensor and the layout of its payload: plain ints and strs, msgpack-safe."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from hwsync.sync.spec import WIRE_DTYPES

#: elements per block of the block code: a changed element's offset in its block fits a uint16
BLOCK = 1 << 16
#: the tensor is unchanged: no payload
SAME = "same"
#: the payload is the whole new tensor
DENSE = "dense"
#: per block of 65536 elements an int32 count, per changed element its uint16 offset in the block, the values
BLOCKS = "block"
#: a bit per element (set where changed), then the values in element order
BITMAP = "bitmap"
#: 2-byte elements only: per change a step (uint8) from the last and the value's difference (int8) from the one
#: held, escapes for the rest (steps.py); about 2 bytes a change where the block code takes 4
STEPS = "step"
CODES = (SAME, DENSE, BLOCKS, BITMAP, STEPS)  # a code's index is its number on the wire: append only

# the integer of each element width: diffs compare bit patterns, so NaN payloads, -0.0 and subnormals are exact
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pad8(n: int) -> int:
    """`n` rounded up to a multiple of 8: every payload section starts 8-byte aligned."""
    return (n + 7) & ~7


def blocks(numel: int) -> int:
    """Blocks of the block code for a tensor of `numel` elements."""
    return (numel + BLOCK - 1) // BLOCK


def int_view(dtype: torch.dtype, name: str = "tensor") -> torch.dtype:
    """The integer dtype of the same width, whose values are the bit patterns; an error names the tensor."""
    view = INT_VIEW.get(dtype.itemsize)
    if view is None:
        raise TypeError(f"{name}: a delta compares elements as 1, 2, 4 or 8-byte integers; {dtype} has "
                        f"{dtype.itemsize} bytes: send it whole")
    return view


def payload_bytes(code: str, numel: int, count: int, itemsize: int) -> int:
    """Bytes of the payload of a tensor encoded with `code` (sections padded to 8 bytes)."""
    if code == SAME:
        return 0
    if code == DENSE:
        return numel * itemsize
    if code == BLOCKS:
        return pad8(4 * blocks(numel)) + pad8(2 * count) + itemsize * count
    if code == BITMAP:
        return pad8((numel + 7) // 8) + itemsize * count
    if code == STEPS:  # the escape count, the check of the base, then `count` 2-byte units
        return pad8(16 + 2 * count)
    raise ValueError(f"unknown delta code {code!r}: one of {', '.join(CODES)}")


def max_step_units(numel: int) -> int:
    """The most units a step code of `numel` elements can hold: every element changed and escaped, and fillers."""
    return 2 * numel + numel // 255 + 1


def smallest_code(numel: int, count: int, itemsize: int, step_units: int | None = None) -> str:
    """The code with the fewest payload bytes for `count` changed elements (ties: the simpler one); the step code
    competes when its size is known (`step_units`, from the scan: it depends on where and how much they changed)."""
    if count == 0:
        return SAME
    sizes = {c: payload_bytes(c, numel, count, itemsize) for c in (DENSE, BITMAP, BLOCKS)}
    if step_units is not None and itemsize == 2:
        sizes[STEPS] = payload_bytes(STEPS, numel, step_units, itemsize)
    return min(sizes, key=lambda c: sizes[c])


@lru_cache(maxsize=4096)  # a model has few distinct sizes: the search took 2.6 ms of every delta sync
def dense_from(numel: int, itemsize: int) -> int:
    """The fewest changes at which no sparse code is smaller than dense (payload sizes grow with changes)."""
    lo, hi = 1, max(1, numel)
    while lo < hi:
        mid = (lo + hi) // 2
        # the step code takes at least a unit per change
        sparse = [payload_bytes(c, numel, mid, itemsize) for c in (BLOCKS, BITMAP)]
        if itemsize == 2:
            sparse.append(payload_bytes(STEPS, numel, mid, itemsize))
        if min(sparse) >= numel * itemsize:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class DeltaHeader:
    """How one tensor is encoded: code, wire dtype name, elements, elements carried, digest of the result.

    `count` is the number of values in the payload: 0 for same, `numel` for dense, the changed elements
    for block and bitmap, the 2-byte units (and raw values) of step (steps.py).
    `digest` is `tensor_digest` of the new tensor (in the engine's dtype): a receiver checks it
    on what it holds after applying.
    """

    code: str
    dtype: str
    numel: int
    count: int
    digest: int

    @property
    def nbytes(self) -> int:
        """Bytes of the payload that goes with this header."""
        return payload_bytes(self.code, self.numel, self.count, WIRE_DTYPES[self.dtype].itemsize)

    def to_wire(self) -> list[Any]:
        """The header as a msgpack-safe list."""
        return [self.code, self.dtype, self.numel, self.count, self.digest]

    @classmethod
    def from_wire(cls, obj: Any, name: str = "tensor") -> "DeltaHeader":
        """Parse and check a header from the wire; a malformed one raises ValueError naming the tensor."""
        if not isinstance(obj, (list, tuple)) or len(obj) != 5:
            raise ValueError(f"{name}: a delta header is [code, dtype, numel, count, digest], got {obj!r}")
        code, dtype, numel, count, digest = obj
        if code not in CODES:
            raise ValueError(f"{name}: unknown delta code {code!r}: one of {', '.join(CODES)}")
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"{name}: unknown dtype {dtype!r} in a delta header")
        if WIRE_DTYPES[dtype].itemsize not in INT_VIEW:
            raise ValueError(f"{name}: a delta cannot carry {dtype} ({WIRE_DTYPES[dtype].itemsize}-byte elements)")
        if any(type(v) is not int for v in (numel, count, digest)) or numel < 0 or not 0 <= digest < 1 << 64:
            raise ValueError(f"{name}: numel, count and digest of a delta header must be ints in range, got "
                             f"{numel!r}, {count!r}, {digest!r}")
        if code == STEPS and WIRE_DTYPES[dtype].itemsize != 2:
            raise ValueError(f"{name}: a step delta carries 2-byte elements, not {dtype}")
        expected = {SAME: 0, DENSE: numel}.get(code)
        most = max_step_units(numel) if code == STEPS else numel
        if (expected is not None and count != expected) or not 0 <= count <= most:
            raise ValueError(f"{name}: a {code} delta of {numel} elements cannot carry {count} values")
        return cls(code, dtype, numel, count, digest)


#: int64 words per tensor in a streamed group's descriptor: code, count, digest
WORDS_PER_HEADER = 3


def headers_to_words(headers: list[DeltaHeader]) -> torch.Tensor:
    """A streamed group's descriptor: per tensor its code's index, count and digest, as int64 (what a collective
    carries; dtype and numel are the announced targets')."""
    words = []
    for header in headers:
        digest = header.digest - (1 << 64) if header.digest >= 1 << 63 else header.digest
        words += [CODES.index(header.code), header.count, digest]
    return torch.tensor(words, dtype=torch.int64)


def headers_from_words(words: torch.Tensor, targets: list[tuple[str, str, int]]) -> list[DeltaHeader]:
    """Parse and check a group's descriptor against its (name, dtype, numel) targets; ValueError names the tensor."""
    if words.dtype != torch.int64 or words.numel() != WORDS_PER_HEADER * len(targets):
        raise ValueError(f"a group descriptor of {len(targets)} tensors has {WORDS_PER_HEADER * len(targets)} int64 "
                         f"words, got {words.numel()} {words.dtype}")
    values = words.tolist()
    headers = []
    for i, (name, dtype, numel) in enumerate(targets):
        code, count, digest = values[WORDS_PER_HEADER * i: WORDS_PER_HEADER * (i + 1)]
        if not 0 <= code < len(CODES):
            raise ValueError(f"{name}: delta code number {code} is not one of 0..{len(CODES) - 1}")
        headers.append(DeltaHeader.from_wire([CODES[code], dtype, numel, count, digest % (1 << 64)], name))
    return headers
