"""The benchmark state dict of `hwsync bench broadcast` (broadcast.py on one host, broadcast_bed.py on a bed)."""

from __future__ import annotations

import torch

TENSOR_BYTES = 16 << 20  # fp32 tensors of 16 MB, the last one shorter


def state_dict(total: int) -> list[tuple[str, torch.Tensor]]:
    """`total` bytes of fp32 tensors, `layer<i>.weight` of TENSOR_BYTES each (the last shorter), each filled with i + 1
    (none with zeros, which fresh memory already holds: a receiver's check of what arrived can fail)."""
    out, left, i = [], total, 0
    while left > 0:
        n = min(TENSOR_BYTES, left) // 4
        out.append((f"layer{i}.weight", torch.full((n,), float(i + 1), dtype=torch.float32)))
        left -= n * 4
        i += 1
    return out
