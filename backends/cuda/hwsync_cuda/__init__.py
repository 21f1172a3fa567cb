"""hwsync's CUDA backend: NVIDIA GPUs through torch.cuda, NCCL collectives, CUDA IPC, and the
core's device shared memory (hwsync.backend.device_shm) over CudaDevice.

Importing this package imports nothing else, torch included: the names below load on first
use (`hwsync_cuda.CudaBackend`). The entry point names `hwsync_cuda.backend:CudaBackend`
directly. Import-safe on any machine, CPU-only torch included: nothing touches CUDA until a
method that needs the GPU runs, and `CudaBackend()` itself never does. On a machine without a
GPU the probe says exactly why ("torch 2.13.0+cpu was built without CUDA", "no NVIDIA GPU
visible ...").
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "CudaBackend": "hwsync_cuda.backend",
    "CudaDevice": "hwsync_cuda.device",
    "CudaIpcTransport": "hwsync_cuda.ipc",
    "NCCL_REDUCE_DTYPES": "hwsync_cuda.nccl",
    "device_uuid": "hwsync_cuda.device",
    "local_index_of_uuid": "hwsync_cuda.device",
    "normalize_uuid": "hwsync_cuda.device",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Load the backend's classes on first use (see module doc)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hwsync_cuda' has no attribute {name!r}")
