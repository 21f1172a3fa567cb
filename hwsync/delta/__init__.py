"""Delta syncs' codec: what changed in each tensor since the version a receiver holds, exact on bit patterns.

A sender keeps a baseline per tensor in the engine's dtype (and its digest); each sync encodes the new
tensor against it (`encode`: cast to the engine's dtype, diff as integers, pick the smallest of
same / dense / block / bitmap / step), the bytes travel like any tensor's, a receiver applies them (`apply_into`,
`apply_to_copy`) and checks the result's digest (`verify`); after a committed sync the sender moves its
baseline (`advance`) and keeps `header.digest` as the baseline's digest.

Modules: header (the wire header and payload layout), diff (encode), patch (apply), digest (the check),
bits (bit packing with torch ops), native (the host kernels, compiled by numba where it is installed).
"""

from hwsync.delta.diff import CHUNK_ELEMS, SPAN_ELEMS, Delta, DeltaEncoder, encode, to_engine_dtype
from hwsync.delta.digest import tensor_digest
from hwsync.delta.header import (
           BITMAP,
           BLOCK,
           BLOCKS,
           CODES,
           DENSE,
           SAME,
           STEPS,
           DeltaHeader,
           payload_bytes,
           smallest_code,
)
from hwsync.delta.patch import advance, apply_into, apply_to_copy, verify

__all__ = ["BITMAP", "BLOCK", "BLOCKS", "CHUNK_ELEMS", "CODES", "SPAN_ELEMS", "DENSE", "SAME", "STEPS", "Delta",
           "DeltaEncoder", "DeltaHeader", "advance", "apply_into", "apply_to_copy", "encode", "payload_bytes",
           "smallest_code", "tensor_digest", "to_engine_dtype", "verify"]
