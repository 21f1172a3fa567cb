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

#: the torch-npu releases the static checks run against (tests/test_npu_api_conformance.py): the newest one,
#: and the one vllm-ascend 0.26.0rc1 pins (read from its aarch64 wheel: Atlas 800T A2 hosts are Kunpeng)
CHECKED_TORCH_NPU_VERSIONS: tuple[str, ...] = ("2.13.0", "2.10.0.post4")
CHECKED_TORCH_NPU_VERSION = CHECKED_TORCH_NPU_VERSIONS[0]

#: Python-level names every checked torch-npu defines, as dotted paths from the top-level package `torch_npu`.
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
    "torch_npu.npu.Event",  # events on the bucket path and after each HCCL collective (Device.record_event)
    "torch_npu.npu.current_stream",  # HCCL collectives run on it (its `npu_stream`)
    "torch_npu.npu.memory_snapshot",  # the caching allocator's segments, for mapped sources (segments.py)
    "torch_npu.npu.utils.get_cann_version",
    "torch_npu.distributed.is_hccl_available",
)

#: Names some checked torch-npu lacks, and what the backend does there instead
OPTIONAL_PYTHON_ATTRIBUTES: dict[str, str] = {
    # 2.13.0 has it; 2.10.0.post4 (vllm-ascend 0.26.0rc1's pin) and every v26.1.0 tag do not
    "torch_npu.npu.npurt": "host memory is registered through AscendCL's aclrtHostRegisterV2 (host_register.py)",
}

#: Methods torch_npu attaches to torch.UntypedStorage at import (torch_npu/utils/storage.py,
#: `_add_storage_methods`); the NPU IPC transport calls them on storages.
STORAGE_METHODS: tuple[str, ...] = ("_share_npu_", "_new_shared_npu", "_release_ipc_counter_npu")

#: Names that live in torch_npu's C extension (no .py/.pyi defines them): the test checks that
#: each is a symbol string in the wheel's shared libraries, which is as far as a static check
#: of compiled bindings goes.
C_EXTENSION_NAMES: tuple[str, ...] = (
    "_share_npu_",
    "_new_shared_npu",
    "_release_ipc_counter_npu",
    "npu_stream",  # torch_npu.npu.Stream.npu_stream: the aclrtStream HCCL calls take
    "get_npu_format",  # torch_npu.get_npu_format(tensor): _share_npu_ refuses storages not in a base format
    "aclrtHostRegisterV2",  # the AscendCL call every route of host registration ends in
)

#: C-extension names some checked torch-npu lacks (see OPTIONAL_PYTHON_ATTRIBUTES)
OPTIONAL_C_EXTENSION_NAMES: dict[str, str] = {
    "_npurt": "torch_npu._C._npurt, what torch_npu.npu.npurt() returns",
    "npuHostRegister": "npurt().npuHostRegister(ptr, size, flags): aclrtHostRegisterV2",
    "npuHostUnregister": "npurt().npuHostUnregister(ptr)",
}

#: What torch_npu's ProcessGroupHCCL logs on the paths that derive a group from the process's own world (its
#: createHCCLCommEx / createHCCLCommOrigin): present in a wheel, those paths are in it, and hwsync's groups
#: must not go through ProcessGroupHCCL (hccl.py)
RANKTABLE_PATHS: tuple[str, ...] = (
    "The rank_table_file is not available, switch to original interface.",
    "Sub comm derivation failed in createHCCLCommOrigin, fallback to rootinfo.",
)

#: storage formats torch_npu shares (FormatHelper::IsBaseFormatType: ND, NCHW, NHWC, NCDHW); any other (FRACTAL_NZ,
#: 29, say) makes `_share_npu_` refuse with "Try to share a storage without base format"
BASE_FORMATS = frozenset({0, 1, 2, 30})

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
