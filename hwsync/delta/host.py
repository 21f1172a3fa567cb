"""Copies made while a delta sync's encodes run, kept on the thread that makes them.

A torch op on a large host tensor splits itself across an OpenMP team, and every thread that calls one gets a
team of its own: the encode threads (two, and a helper for a large tensor's pieces) already keep the
cores busy, so each copy of a chunk's step units also woke a team's threads to share it, and the thread that
sends waited for a team's thread to be given a core before its copy could end (a group's payloads once took
17 ms to copy 1.4 MB). numpy's copies run on the calling thread; elsewhere than the host torch's ops do the
same work.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def keep(piece: np.ndarray) -> torch.Tensor:
    """A tensor copy of `piece`, a view of a compiled scan's output buffer, that outlives the buffer."""
    return torch.from_numpy(piece.copy())


def copy_into(out: torch.Tensor, src: torch.Tensor) -> None:
    """`src` into `out` (of its dtype and length), which may be on another device (a host payload into a device
    buffer: torch's copy moves it, where concat_into's cat wants one device)."""
    if out.device.type != "cpu" or src.device.type != "cpu":
        out.copy_(src)
        return
    np.copyto(out.detach().numpy(), src.detach().numpy())


def concat_into(pieces: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """`pieces` one after the other into `out` (of their dtype and total length)."""
    if out.device.type != "cpu":
        torch.cat(list(pieces), out=out)
        return
    concat_host(pieces, out.numpy())


def concat_host(pieces: Sequence[torch.Tensor], out: np.ndarray) -> None:
    """Host `pieces` one after the other into the numpy array `out` (of their dtype and total length)."""
    if pieces:
        np.concatenate([p.numpy() for p in pieces], out=out)
