"""The benchmark state dict of `hwsync bench broadcast` (broadcast.py on one host, broadcast_bed.py on a bed), and
the end of its rank processes."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence

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


def end_ranks(procs: Sequence[mp.process.BaseProcess], timeout_s: float) -> list[int | None]:
    """Wait for each rank process (killed after `timeout_s`); the exit codes that were not 0."""
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join(5)
    return [p.exitcode for p in procs if p.exitcode != 0]
