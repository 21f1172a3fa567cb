"""Page-locking host memory for NPU copies: torch_npu's runtime module, `torch_npu.npu.npurt()`.

torch_npu copies host memory at the DMA engine's speed, and asynchronously when asked, only
from pages the runtime knows as host memory: its own pinned allocator's, or pages registered
with the runtime (it asks aclrtPointerGetAttributes). From any other page a copy goes through a
bounce buffer and a non_blocking one is made synchronous. hwsync's shared segments come from
/dev/shm, not from torch_npu's allocator, so they are registered here, through
`npurt().npuHostRegister(ptr, size, flags)` (AscendCL's aclrtHostRegisterV2).

The flag is ACL_HOST_REG_MAPPED, the one torch_npu's own pinned allocator registers with (and
DeepSpeed's NPU accelerator, which measured PINNED-only registrations of large buffers falling
back to a fraction of the DMA speed). A torch_npu without `npurt`, or whose runtime does not
start, gives no registrar: the caller keeps pageable copies.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

log = logging.getLogger("hwsync")

#: aclrtHostRegisterV2 flag: page-locked and mapped for the NPU's DMA (not aclrtHostRegister's type 0)
ACL_HOST_REG_MAPPED = 0x2
ACL_SUCCESS = 0


class HostRegister:
    """npuHostRegister / npuHostUnregister of torch_npu's runtime module."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def register(self, address: int, nbytes: int) -> bool:
        """Register `nbytes` of host memory at `address` (page-aligned); False when the runtime refuses."""
        code = int(self._runtime.npuHostRegister(address, nbytes, ACL_HOST_REG_MAPPED))
        if code != ACL_SUCCESS:
            log.warning("hwsync: npuHostRegister of %d bytes failed (ACL error %d); copies of them stay pageable",
                        nbytes, code)
        return code == ACL_SUCCESS

    def unregister(self, address: int) -> None:
        """Undo register() for the memory at `address`."""
        code = int(self._runtime.npuHostUnregister(address))
        if code != ACL_SUCCESS:  # the pages stay locked until the process exits; nothing reads them
            log.warning("hwsync: npuHostUnregister failed (ACL error %d)", code)


def open_host_register(npu: ModuleType) -> HostRegister | None:
    """A HostRegister over `npu` (torch_npu.npu), or None where it has no npurt or its runtime does not start."""
    npurt = getattr(npu, "npurt", None)
    if npurt is None:
        return None
    try:
        runtime = npurt()
    except RuntimeError as exc:
        log.warning("hwsync: torch_npu's runtime module is unavailable (%s); NPU copies of shared memory stay "
                    "pageable", exc)
        return None
    if not (hasattr(runtime, "npuHostRegister") and hasattr(runtime, "npuHostUnregister")):
        return None
    return HostRegister(runtime)
