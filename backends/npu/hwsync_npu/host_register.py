"""Page-locking host memory for NPU copies: AscendCL's aclrtHostRegisterV2, through what the installed torch_npu has.

torch_npu copies host memory at the DMA engine's speed, and asynchronously when asked, only
from pages the runtime knows as host memory: its own pinned allocator's, or pages registered
with the runtime (it asks aclrtPointerGetAttributes). From any other page a copy goes through a
bounce buffer and a non_blocking one is made synchronous. hwsync's shared segments come from
/dev/shm, not from torch_npu's allocator, so they are registered here, in this order:
- torch_npu's runtime module, `torch_npu.npu.npurt().npuHostRegister(ptr, size, flags)` (in
  torch-npu 2.13.0; not in 2.10.0.post4, the one vllm-ascend 0.26.0rc1 pins, nor any v26.1.0 tag);
- else AscendCL itself, `aclrtHostRegisterV2(ptr, size, flags)` / `aclrtHostUnregister(ptr)` of CANN's
  libascendcl.so (which torch_npu has loaded; 2.10.0.post4 calls the same function internally), through
  ctypes with the prototypes of CANN's acl_rt.h.
Never on a kernel at or below 5.10 (openEuler 22.03, Kylin V10: the usual Atlas 800T A2 host OSes):
CANN's reference for aclrtHostRegisterV2 says registering memory that is not page-locked fails there
("使用非锁页内存会导致异常") and such memory must come from aclrtMallocHost, which /dev/shm pages do not.
Where none applies, copies of shared memory stay pageable (slower, still correct) and `note` says why;
`hwsync info` shows it with the shm transport. AscendCL takes page-aligned memory only (segments are).

The flag is ACL_HOST_REG_MAPPED, the one torch_npu's own pinned allocator registers with (and
DeepSpeed's NPU accelerator, which measured PINNED-only registrations of large buffers falling
back to a fraction of the DMA speed). aclrtHostRegisterV2 exists on Atlas A2/A3 only, per CANN.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger("hwsync")

#: aclrtHostRegisterV2 flag: page-locked and mapped for the NPU's DMA (not aclrtHostRegister's type 0)
ACL_HOST_REG_MAPPED = 0x2
ACL_SUCCESS = 0
ACL_LIBRARY = "libascendcl.so"
#: the last kernel on which CANN forbids registering memory aclrtMallocHost did not allocate
LAST_FORBIDDING_KERNEL = (5, 10)
#: (result, argument types) of the AscendCL calls, from CANN's acl_rt.h
ACL_PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "aclrtHostRegisterV2": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32)),
    "aclrtHostUnregister": (ctypes.c_int, (ctypes.c_void_p,)),
}


class HostRegister:
    """Register / unregister host memory through one route (`via`: torch_npu's npurt, or AscendCL)."""

    def __init__(self, register: Callable[[int, int, int], int], unregister: Callable[[int], int], via: str) -> None:
        self._register, self._unregister, self.via = register, unregister, via

    def register(self, address: int, nbytes: int) -> bool:
        """Register `nbytes` of host memory at `address` (page-aligned); False when the runtime refuses."""
        code = int(self._register(address, nbytes, ACL_HOST_REG_MAPPED))
        if code != ACL_SUCCESS:
            log.warning("hwsync: registering %d bytes of host memory through %s failed (ACL error %d); copies of them "
                        "stay pageable", nbytes, self.via, code)
        return code == ACL_SUCCESS

    def unregister(self, address: int) -> None:
        """Undo register() for the memory at `address`."""
        code = int(self._unregister(address))
        if code != ACL_SUCCESS:  # the pages stay locked until the process exits; nothing reads them
            log.warning("hwsync: unregistering host memory through %s failed (ACL error %d)", self.via, code)


@dataclass(frozen=True)
class HostPinning:
    """How this process registers host memory for NPU copies (registrar None: it does not), and why."""

    registrar: HostRegister | None
    note: str


def kernel_release() -> str:
    """This machine's kernel release (`uname -r`)."""
    return platform.release()


def kernel_forbids(release: str) -> str | None:
    """Why CANN forbids registering /dev/shm pages under kernel `release`, or None where it allows it."""
    found = re.match(r"^(\d+)\.(\d+)", release)
    if found is None:
        return None  # a kernel hwsync cannot read: leave it to the runtime, whose refusal is logged
    if (int(found[1]), int(found[2])) <= LAST_FORBIDDING_KERNEL:
        return (f"the kernel is {release}: on kernels up to 5.10 CANN's aclrtHostRegisterV2 must not be given memory "
                "that aclrtMallocHost did not allocate, and hwsync's shared segments come from /dev/shm")
    return None


def npurt_route(npu: Any) -> tuple[HostRegister | None, str]:
    """torch_npu's runtime module (npurt), or why it cannot be used."""
    npurt = getattr(npu, "npurt", None)
    if npurt is None:
        return None, "this torch_npu has no npu.npurt"
    try:
        runtime = npurt()
    except RuntimeError as exc:
        return None, f"torch_npu's npurt() is unavailable ({exc})"
    if not (hasattr(runtime, "npuHostRegister") and hasattr(runtime, "npuHostUnregister")):
        return None, "torch_npu's npurt() has no npuHostRegister"
    return HostRegister(runtime.npuHostRegister, runtime.npuHostUnregister, "torch_npu's npurt"), ""


def load_acl() -> Any:
    """CANN's libascendcl.so (torch_npu loaded it already); raises OSError where it is not there."""
    return ctypes.CDLL(ACL_LIBRARY)


def acl_route(library: Any) -> tuple[HostRegister | None, str]:
    """AscendCL's aclrtHostRegisterV2 in `library`, called through its prototype, or why it cannot be used."""
    functions = {}
    for name, (result, args) in ACL_PROTOTYPES.items():
        symbol = getattr(library, name, None)
        address = None if symbol is None else ctypes.cast(symbol, ctypes.c_void_p).value
        if address is None:
            return None, f"this CANN's {ACL_LIBRARY} has no {name}"
        functions[name] = ctypes.CFUNCTYPE(result, *args)(address)
    return HostRegister(functions["aclrtHostRegisterV2"], functions["aclrtHostUnregister"],
                        f"AscendCL's aclrtHostRegisterV2 ({ACL_LIBRARY})"), ""


def open_host_pinning(npu: ModuleType | Any, *, release: str | None = None,
                      acl: Callable[[], Any] = load_acl) -> HostPinning:
    """How to register host memory with `npu` (torch_npu.npu): the first route that applies, or none and why."""
    forbidden = kernel_forbids(kernel_release() if release is None else release)
    if forbidden is not None:
        return _none(forbidden)
    registrar, why_not_npurt = npurt_route(npu)
    if registrar is not None:
        return HostPinning(registrar, f"shared-memory copies are pinned: pages registered through {registrar.via}")
    try:
        library = acl()
    except OSError as exc:
        return _none(f"{why_not_npurt}, and CANN's {ACL_LIBRARY} does not load ({exc})")
    registrar, why_not_acl = acl_route(library)
    if registrar is None:
        return _none(f"{why_not_npurt}, and {why_not_acl}")
    return HostPinning(registrar, f"shared-memory copies are pinned: pages registered through {registrar.via} "
                                  f"({why_not_npurt})")


def _none(reason: str) -> HostPinning:
    note = f"shared-memory copies stay pageable (slower, synchronous; still correct): {reason}"
    log.warning("hwsync: %s", note)
    return HostPinning(None, note)
