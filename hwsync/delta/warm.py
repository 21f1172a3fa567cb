"""Load the host kernels before the first delta needs them.

numba compiles each kernel once per machine and caches it on disk (kernels.py, kernels16.py), and every
process still loads it from there at its first call with those argument types: 0.34 s for all of
bf16's here, which would land on the first delta sync (before the kernels were module-level functions,
numba's cache missed them and each process compiled them again: 2.8 s). Senders and receivers warm up
after their first full sync in delta mode, on a thread of their own while the trainer goes on, by
encoding and applying a small tensor of each dtype they carry in every code (the kernels then see the
argument types of real syncs).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from hwsync.delta import native
from hwsync.delta.diff import encode
from hwsync.delta.digest import tensor_digest
from hwsync.delta.header import INT_VIEW
from hwsync.delta.patch import apply_into

_warm: set[torch.dtype] = set()
_lock = threading.Lock()


def warm_up(dtypes: Iterable[torch.dtype]) -> None:
    """Load the kernels that deltas of `dtypes` (the engine's) run, from an fp32 trainer tensor where they are
    floating; at once where numba is missing or they are loaded already."""
    if native.kernel() is None:
        return
    with _lock:
        todo = [d for d in dict.fromkeys(dtypes) if d not in _warm and d.itemsize in INT_VIEW]
        _warm.update(todo)
    for dtype in todo:
        base = torch.zeros(1 << 16, dtype=dtype)
        ints = base.view(INT_VIEW[dtype.itemsize])
        for every, far in ((50, False), (1000, True), (3, True)):  # the step, block and bitmap codes
            new = base.clone()
            bits = new.view(ints.dtype)
            bits[::every] = 0x5A if far and dtype.itemsize > 1 else 1  # 1-byte: 1 keeps a bool a bool
            trainers = [new]
            if dtype.is_floating_point and dtype.itemsize < 4:
                trainers.append(new.float())  # the cast of fp32 masters
            for trainer in trainers:
                delta = encode(trainer, base, base_digest=tensor_digest(base))
                apply_into(base.clone(), delta.header, delta.payload, gain=True)
