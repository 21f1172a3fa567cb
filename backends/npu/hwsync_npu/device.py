"""The Ascend NPU as an hwsync Device, over torch_npu.npu (which is torch.npu once imported),
and ASCEND_RT_VISIBLE_DEVICES: which physical NPUs this process sees, and in which order.

torch_npu is imported inside methods, never at module level: this module loads on machines
without torch_npu or CANN, and `probe()` reports why the NPU is unusable there.
IPC handles name a device; two processes with different visible lists give the same chip
different logical indices, so handles carry the physical id and each side maps it back
(`physical_index`, `logical_index`: pure functions over the variable's text).
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
from types import ModuleType
from typing import Any

import torch

from hwsync.backend import Device, ProbeResult
from hwsync_npu.api import import_torch_npu, torch_npu_installed
from hwsync_npu.host_register import HostPinning, HostRegister, open_host_pinning
from hwsync_npu.preimport import NOTE_ENV

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
#: torch's device type of NPU tensors; every NPU torch.device of this backend is made by npu_device()
TORCH_TYPE = "npu"


def npu_device(index: int | None) -> torch.device:
    """The torch.device of NPU `index` (the one place this backend names the type)."""
    return torch.device(TORCH_TYPE) if index is None else torch.device(TORCH_TYPE, index)


#: where torch_npu reads its caching allocator's settings (NPUAllocatorConfig.h)
ALLOC_CONF_ENV = "PYTORCH_NPU_ALLOC_CONF"


def expandable_segments(settings: str) -> bool:
    """Whether allocator settings ("key:value,key:value", the last of a key wins) enable expandable segments."""
    enabled = False
    for option in settings.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            enabled = value.strip() == "True"
    return enabled


def expandable_segments_reason(settings: str | None = None) -> str | None:
    """Why this process's NPU memory is not shared through NPU IPC here (its PYTORCH_NPU_ALLOC_CONF when None)."""
    if not expandable_segments(os.environ.get(ALLOC_CONF_ENV, "") if settings is None else settings):
        return None
    return (f"this process's NPU caching allocator has expandable_segments:True ({ALLOC_CONF_ENV}; vllm-ascend sets it "
            "by default outside sleep mode): torch_npu then shares memory through its separate VMM path, where a "
            "storage's offset is not its segment's and which hwsync does not use. hwsync uses the 'shm' transport "
            f"instead; to share NPU memory directly, set expandable_segments:False in {ALLOC_CONF_ENV} for this "
            "process (or enable vllm-ascend's sleep mode, which leaves it off)")


def parse_visible_devices(value: str | None) -> list[int] | None:
    """Physical ids in logical order; None when the variable is unset (every device visible).

    Follows the rules torch_npu applies (torch_npu/npu/__init__.py, `_parse_visible_devices`):
    ids are digits separated by commas, reading stops at the first other character, an empty
    element ends the list, and the runtime needs ascending ids, else it sees no device.
    """
    if value is None:
        return None
    ids: list[int] = []
    digits = ""
    for char in value + ",":
        if char.isdigit():
            digits += char
            continue
        if not digits:
            break  # an empty element, or garbage: the list ends here
        ids.append(int(digits))
        digits = ""
        if char != ",":
            break
    if any(later <= earlier for earlier, later in zip(ids, ids[1:])):
        return []  # the runtime refuses a non-ascending list: no device is visible
    return ids


def physical_index(logical: int, value: str | None) -> int:
    """The physical id of logical device `logical` under the visible-devices `value`."""
    ids = parse_visible_devices(value)
    if ids is None:
        return logical
    if not 0 <= logical < len(ids):
        raise ValueError(
            f"logical NPU {logical} is not visible ({VISIBLE_DEVICES_ENV}={value!r} shows {len(ids)}); "
            f"pick an index below {len(ids)} or widen {VISIBLE_DEVICES_ENV}"
        )
    return ids[logical]


def logical_index(physical: int, value: str | None) -> int:
    """The logical index under `value` of physical NPU `physical`, with an error naming the fix."""
    ids = parse_visible_devices(value)
    if ids is None:
        return physical
    if physical not in ids:
        raise ValueError(
            f"physical NPU {physical} is not visible to this process ({VISIBLE_DEVICES_ENV}={value!r}); "
            f"add {physical} to {VISIBLE_DEVICES_ENV}, or use the shm transport"
        )
    return ids.index(physical)


def current_visible_value() -> str | None:
    """This process's ASCEND_RT_VISIBLE_DEVICES (None when unset)."""
    return os.environ.get(VISIBLE_DEVICES_ENV)


def install_hint() -> str:
    """The pip command that matches this torch (torch-npu versions track torch's)."""
    base = torch.__version__.split("+")[0]
    return f"pip install torch-npu=={base} (torch-npu must match your torch {torch.__version__})"


def import_failure_reason(exc: BaseException, installed_version: str | None = None) -> str:
    """Why torch_npu failed to import, with the fix; `exc` is what the import raised."""
    what = f"torch_npu{' ' + installed_version if installed_version else ''} is installed but failed to import"
    message = f"{type(exc).__name__}: {exc}".strip()
    if "lib" in str(exc) and ".so" in str(exc):
        fix = ("CANN's libraries are missing: install CANN (toolkit and kernels) and "
               "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` before starting Python")
    else:
        fix = "check that torch-npu, torch and CANN versions match (see docs/ascend.md)"
    return f"{what} ({message}); {fix}"


def _installed_torch_npu_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch_npu")
    except PackageNotFoundError:
        return None


class NpuDevice(Device):
    """Ascend NPUs visible to this process."""

    name = "npu"
    torch_type = TORCH_TYPE
    visible_devices_env = VISIBLE_DEVICES_ENV

    def __init__(self) -> None:
        self._torch_npu: ModuleType | None = None
        #: how host memory is registered for NPU copies, decided at the first pin (None: not yet)
        self._pinning: HostPinning | None = None

    def _npu(self) -> ModuleType:
        """torch_npu.npu, importing torch_npu on first use."""
        if self._torch_npu is None:
            self._torch_npu = import_torch_npu()
        return self._torch_npu.npu

    def probe(self) -> ProbeResult:
        """Usable when torch_npu imports (CANN present) and at least one NPU is visible."""
        if not torch_npu_installed():
            return ProbeResult(False, f"torch_npu is not installed: {install_hint()}")
        note = os.environ.get(NOTE_ENV)
        try:
            npu = self._npu()
        except Exception as exc:  # noqa: BLE001 - RuntimeError/ImportError/OSError: whatever a broken stack raises
            reason = import_failure_reason(exc, _installed_torch_npu_version())
            return ProbeResult(False, reason + (f" [{note}]" if note else ""), {"error": type(exc).__name__})
        try:
            # device_count asks the driver (ascend_hal) and does not initialise the ACL runtime
            count = int(npu.device_count())
        except Exception as exc:  # noqa: BLE001 - reported as the probe's reason
            return ProbeResult(False, f"torch_npu imported but counting NPUs failed ({type(exc).__name__}: {exc}); "
                                      "check the driver with `npu-smi info`")
        version = getattr(self._torch_npu, "__version__", "unknown")  # _npu() imported torch_npu
        details: dict[str, Any] = {"torch_npu": version, "count": count,
                                   VISIBLE_DEVICES_ENV: current_visible_value()}
        if count < 1:
            return ProbeResult(False, f"torch_npu {version} sees no NPU "
                                      f"({VISIBLE_DEVICES_ENV}={current_visible_value()!r}); check `npu-smi info` "
                                      f"and {VISIBLE_DEVICES_ENV}", details)
        return ProbeResult(True, f"torch_npu {version} sees {count} NPU(s)", details)

    def count(self) -> int:
        """Number of NPUs visible to this process."""
        return int(self._npu().device_count())

    def current_index(self) -> int:
        """Index of the current NPU."""
        return int(self._npu().current_device())

    def set_index(self, index: int) -> None:
        """Make `index` the current NPU."""
        self._npu().set_device(index)

    def synchronize(self) -> None:
        """Wait for all work queued on the current NPU."""
        self._npu().synchronize()

    def record_event(self, index: int | None = None) -> Any:
        """A torch_npu.npu.Event recorded now on the current stream of NPU `index` (the current NPU when None)."""
        npu = self._npu()
        event = npu.Event()
        event.record(npu.current_stream(self.current_index() if index is None else index))
        return event

    def runtime_in_use(self) -> bool:
        """Whether this process has initialised torch_npu's NPU state (only then can NPU work be in flight);
        imports nothing and initialises nothing."""
        module = self._torch_npu if self._torch_npu is not None else sys.modules.get("torch_npu")
        try:
            return module is not None and bool(module.npu.is_initialized())
        except Exception:  # noqa: BLE001 - a half-imported or stand-in torch_npu: nothing was queued through it
            return False

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(free, total) from the driver (torch_npu's mem_get_info)."""
        free, total = self._npu().mem_get_info(self.current_index() if index is None else index)
        return int(free), int(total)

    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes held by live tensors of this process's NPU allocator."""
        return int(self._npu().memory_allocated(index))

    def memory_reserved(self, index: int | None = None) -> int:
        """Bytes reserved by this process's NPU caching allocator."""
        return int(self._npu().memory_reserved(index))

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the driver."""
        self._npu().empty_cache()

    def physical_id(self, index: int | None = None) -> str:
        """host:npu<physical id>; torch_npu exposes no device uuid, so the host names the node."""
        logical = self.current_index() if index is None else index
        return f"{socket.gethostname()}:npu{physical_index(logical, current_visible_value())}"

    def soc_name(self) -> str | None:
        """The chip name (e.g. Ascend910B3), which decides the HCCL reduce dtypes."""
        try:
            return str(self._npu().get_device_name())
        except Exception:  # noqa: BLE001 - an unnamed chip gets the dtypes every Ascend product reduces
            return None

    def host_pinning(self) -> HostPinning:
        """How this process registers host memory for NPU copies (npurt, AscendCL, or not at all), and why."""
        if self._pinning is None:
            try:
                npu = self._npu()
            except Exception as exc:  # noqa: BLE001 - no usable torch_npu: nothing to copy to, nothing to register for
                return HostPinning(None, f"no usable torch_npu here ({type(exc).__name__}), so no NPU copies")
            self._pinning = open_host_pinning(npu)
        return self._pinning

    def _registrar(self) -> HostRegister | None:
        return self.host_pinning().registrar

    def pin_host_memory(self, tensor: torch.Tensor, *, read_only: bool = False) -> bool:
        """Register the tensor's pages (shared memory included) with the NPU runtime, so torch_npu copies them at
        full speed; False where no route applies (host_pinning says why), the memory does not start on a page
        (AscendCL requires it) or the runtime refuses. AscendCL has no read-only flag: read-only pages are
        registered alike (whether the runtime accepts them is unverified: no NPU here; a refusal leaves the copies
        pageable)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes or tensor.device.type != "cpu" or tensor.data_ptr() % mmap.PAGESIZE:
            return False
        registrar = self._registrar()
        return registrar is not None and registrar.register(tensor.data_ptr(), nbytes)

    def unpin_host_memory(self, tensor: torch.Tensor) -> None:
        """Unregister what pin_host_memory registered."""
        registrar = self._registrar()
        if registrar is not None:
            registrar.unregister(tensor.data_ptr())
