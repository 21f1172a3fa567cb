"""hwsync's CPU backend: host memory, gloo collectives, the core's POSIX shared memory.

Importing this package imports nothing else, torch included: the classes load on first use
(`hwsync_cpu.CpuBackend`). The entry point names `hwsync_cpu.backend:CpuBackend` directly.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "CpuBackend": "hwsync_cpu.backend",
    "CpuDevice": "hwsync_cpu.device",
    "GLOO_REDUCE_DTYPES": "hwsync_cpu.gloo",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Load the backend's classes on first use (see module doc)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hwsync_cpu' has no attribute {name!r}")
