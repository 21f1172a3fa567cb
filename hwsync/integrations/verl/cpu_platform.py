"""The host CPU as a verl platform, registered through verl's own platform registry.

verl 0.9.1 knows nvidia, huawei (npu) and rocm platforms and falls back to "nvidia" when it
detects none; its device-generic code then calls torch's CUDA module, which a CPU-only torch lacks.
verl's documented extension point is `PlatformRegistry.register(platform=...)`; this module
registers "cpu" there, and `use_cpu_platform()` (or VERL_PLATFORM=cpu before verl's first
get_platform(), inherited by child processes) selects it. Nothing of verl is patched. hwsync's
tests and `hwsync bench transfer --peer verl` use it; on GPU or NPU hosts verl's own platforms apply.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, get_platform


def _host_memory() -> tuple[int, int]:
    """(free, total) bytes of host memory, what verl's memory log asks a device for."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


#: what verl calls on `get_torch_device()`: torch.cpu has synchronize but no allocator cache to empty, and
#: no allocator statistics (verl's memory log in its colocated update reads them: zeros, host memory)
CPU_MODULE = types.SimpleNamespace(
    synchronize=torch.cpu.synchronize, empty_cache=lambda: None, ipc_collect=lambda: None,
    current_device=lambda: 0, device_count=lambda: 1, is_available=lambda: True, set_device=lambda index: None,
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    memory_allocated=lambda *a: 0, memory_reserved=lambda *a: 0, max_memory_allocated=lambda *a: 0,
    max_memory_reserved=lambda *a: 0, mem_get_info=lambda *a: _host_memory(),
)


@PlatformRegistry.register(platform="cpu")
class CpuPlatform(PlatformBase):
    """The host as a verl platform: gloo for collectives, shared memory instead of device IPC."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPU_MODULE

    def is_available(self) -> bool:
        """Always: the host is there."""
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """Never auto-detected, so a GPU or NPU host keeps its own platform: select this one explicitly."""
        return False

    def current_device(self) -> int:
        """The one host device."""
        return 0

    def device_count(self) -> int:
        """One host device."""
        return 1

    def set_device(self, device_index: int) -> None:
        """Nothing to select."""

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for queued CPU work (none: CPU ops are synchronous)."""
        torch.cpu.synchronize()

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed torch's CPU generator."""
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        """The CPU allocator has no such settings."""

    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache."""

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        """No compute capability."""
        return (None, None)

    def communication_backend_name(self) -> str:
        """gloo, torch's CPU collective library."""
        return "gloo"

    def visible_devices_envvar(self) -> str:
        """Unused on the host; verl reads it only to pin accelerators."""
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        """No profiler ranges."""
        yield

    def profiler_start(self) -> None:
        """No device profiler."""

    def profiler_stop(self) -> None:
        """No device profiler."""

    def ray_resource_name(self) -> str:
        """Ray's CPU resource."""
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        """None to set."""
        return []

    def is_ipc_supported(self) -> bool:
        """No device IPC: verl's colocated sender takes its shared-memory path."""
        return False

    def cudart(self) -> None:
        """No CUDA runtime."""
        return None


def use_cpu_platform() -> None:
    """Make "cpu" verl's platform in this process and the ones it starts; raises if verl already chose another."""
    os.environ["VERL_PLATFORM"] = "cpu"
    chosen = get_platform().device_name
    if chosen != "cpu":
        raise RuntimeError(f"verl's platform was already resolved to {chosen!r} in this process; call "
                           "use_cpu_platform() (or set VERL_PLATFORM=cpu) before anything calls verl's get_platform()")
