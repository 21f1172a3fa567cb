"""Every torch_npu name this backend touches, in one place, and the one way to import torch_npu.

tests/test_npu_api_conformance.py reads these tuples and checks each name against the real
torch-npu wheel (statically, without importing it), so the backend cannot drift from the
package it claims to support. Code in this package reaches torch_npu only through names listed
here; add a name here first when you need a new one.

This module imports no torch: it is read by tests and by the pre-import hook.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

#: the torch-npu release the static checks were run against (tests/test_npu_api_conformance.py)
CHECKED_TORCH_NPU_VERSION = "2.13.0"

#: Python-level names, as dotted paths from the top-level package `torch_npu`.
#: `torch.npu` is `torch_npu.npu` once torch_npu is imported; the backend uses the latter so
#: the path names the file that defines it.
PYTHON_ATTRIBUTES: tuple[str, ...] = (
    "torch_npu.__version__",
    "torch_npu.npu.device_count",
    "torch_npu.npu.current_device",
    "torch_npu.npu.set_device",
    "torch_npu.npu.synchronize",
    "torch_npu.npu.is_initialized",
    "torch_npu.npu.mem_get_info",
    "torch_npu.npu.memory_allocated",
    "torch_npu.npu.memory_reserved",
    "torch_npu.npu.empty_cache",
    "torch_npu.npu.get_device_name",
    "torch_npu.npu.ipc_collect",
    "torch_npu.npu.Event",  # events on the bucket path and before Complete (Device.record_event)
    "torch_npu.npu.current_stream",
    "torch_npu.npu.memory_snapshot",  # the caching allocator's segments, for mapped sources (segments.py)
    "torch_npu.npu.utils.get_cann_version",
    "torch_npu.npu.npurt",
    "torch_npu.distributed.is_hccl_available",
)

#: Methods torch_npu attaches to torch.UntypedStorage at import (torch_npu/utils/storage.py,
#: `_add_storage_methods`); the NPU IPC transport calls them on storages.
STORAGE_METHODS: tuple[str, ...] = ("_share_npu_", "_new_shared_npu", "_release_ipc_counter_npu")

#: Names that live in torch_npu's C extension (no .py/.pyi defines them): the test checks that
#: each is a symbol string in the wheel's shared libraries, which is as far as a static check
#: of compiled bindings goes.
C_EXTENSION_NAMES: tuple[str, ...] = (
    "_distributed_c10d",  # torch_npu._C._distributed_c10d
    "ProcessGroupHCCL",  # torch_npu._C._distributed_c10d.ProcessGroupHCCL(store, rank, size, options)
    "Options",  # ProcessGroupHCCL.Options()
    "_timeout",  # ProcessGroupHCCL.Options._timeout
    "is_high_priority_stream",  # ProcessGroupHCCL.Options.is_high_priority_stream
    "global_ranks_in_group",  # ProcessGroupHCCL.Options.global_ranks_in_group
    "group_id",  # ProcessGroupHCCL.Options.group_id
    "_share_npu_",
    "_new_shared_npu",
    "_release_ipc_counter_npu",
    "_npurt",  # torch_npu._C._npurt, what torch_npu.npu.npurt() returns
    "npuHostRegister",  # npurt().npuHostRegister(ptr, size, flags): aclrtHostRegisterV2
    "npuHostUnregister",
)

#: Module imported for the HCCL group (the binding named above).
HCCL_MODULE = "torch_npu._C._distributed_c10d"

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def torch_npu_installed() -> bool:
    """Whether a torch_npu package is on the path, without importing it."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def import_torch_npu() -> ModuleType:
    """Import torch_npu, leaving TORCH_DEVICE_BACKEND_AUTOLOAD as it was even when it fails."""
    # torch_npu/__init__.py forces the variable to "0" while it imports and restores it only at
    # the end; a failed import (no CANN) would leave "0" behind for every child process.
    saved = os.environ.get(AUTOLOAD_ENV)
    try:
        import torch_npu

        return torch_npu
    finally:
        if saved is None:
            os.environ.pop(AUTOLOAD_ENV, None)
        else:
            os.environ[AUTOLOAD_ENV] = saved
