"""hwsync's Ascend NPU backend: torch_npu devices, HCCL collectives, NPU IPC or shared memory.

Importing this package imports neither torch nor torch_npu: the classes load on first use
(`hwsync_npu.NpuBackend`), so the pre-import hook (hwsync_npu.preimport) can run before torch
and `hwsync info` works on any machine.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "NpuBackend": "hwsync_npu.backend",
    "NpuDevice": "hwsync_npu.device",
    "NpuIpcTransport": "hwsync_npu.ipc",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """Load the backend's classes on first use (see module doc)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hwsync_npu' has no attribute {name!r}")
