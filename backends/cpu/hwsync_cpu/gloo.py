"""gloo process groups and the dtypes gloo reduces."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# gloo reduces these; anything else fails inside C++ with a less helpful message.
GLOO_REDUCE_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
     torch.int32, torch.int64}
)


def gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> object:
    """A ProcessGroupGloo of its own on `store` (the factory ProcessGroupCommunicator calls)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)
