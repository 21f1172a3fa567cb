"""The host as an hwsync Device: one of it, memory figures from the kernel (/proc)."""

from __future__ import annotations

import os
import socket

from hwsync.backend import Device, ProbeResult


def _meminfo() -> dict[str, int]:
    """Fields of /proc/meminfo in bytes: the kernel's own view of host memory."""
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            parts = value.split()
            fields[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return fields


class CpuDevice(Device):
    """The host as a device: one of it, memory from the OS."""

    name = "cpu"
    torch_type = "cpu"
    visible_devices_env = None

    def probe(self) -> ProbeResult:
        """The host is always there."""
        return ProbeResult(True, "host CPU and memory are always available", {"cpus": os.cpu_count()})

    def count(self) -> int:
        """One host."""
        return 1

    def current_index(self) -> int:
        """Always 0."""
        return 0

    def set_index(self, index: int) -> None:
        """Only index 0 exists."""
        if index != 0:
            raise ValueError(f"the cpu backend has one device (index 0), not index {index}")

    def synchronize(self) -> None:
        """CPU work is synchronous."""

    def mem_get_info(self, index: int | None = None) -> tuple[int, int]:
        """(MemAvailable, MemTotal) from /proc/meminfo."""
        info = _meminfo()
        return info["MemAvailable"], info["MemTotal"]

    def memory_allocated(self, index: int | None = None) -> int:
        """Resident set size of this process."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def memory_reserved(self, index: int | None = None) -> int:
        """Virtual size of this process (what it has reserved from the OS)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")

    def empty_cache(self) -> None:
        """The host has no caching allocator to empty."""

    def physical_id(self, index: int | None = None) -> str:
        """The host name: the one host this device lives on."""
        return f"host:{socket.gethostname()}"
