"""Copies made on the encode threads, kept on the thread that makes them.

A torch op on a large host tensor splits itself across an OpenMP team, and every thread that calls one gets a
team of its own: the encode threads (two, and a helper for a large tensor's second half) already keep the
cores busy, so each copy of a chunk's step units also woke a team's threads to share it. numpy's copies run on
the calling thread; elsewhere than the host torch's ops do the same work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def keep(piece: torch.Tensor) -> torch.Tensor:
    """A copy of host tensor `piece` that outlives the buffer it is a view of (the compiled scans' output)."""
    return torch.from_numpy(piece.numpy().copy())


def concat_into(pieces: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """`pieces` one after the other into `out` (of their dtype and total length)."""
    if out.device.type != "cpu":
        torch.cat(list(pieces), out=out)
        return
    if pieces:
        np.concatenate([p.numpy() for p in pieces], out=out.numpy())
