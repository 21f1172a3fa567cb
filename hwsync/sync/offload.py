"""Onload parameters to the device for a sync, offload them after, on any backend.

Trainers often keep parameters in host memory (FSDP/DeepSpeed CPU offload) and need them on the
device only while a sync reads them. `onload` is that step, written once over plain torch
(`param.data = param.data.to(device)`) and the backend's Device for synchronisation, so it runs
unchanged on CUDA, Ascend and the CPU.

- parameters already on the target device are left alone; when nothing needs to move no timer
  is started and `onload_s`/`offload_s` are exactly 0.0;
- the original host tensors are kept and put back afterwards, so storage identity (and tied
  weights) survive; by default nothing is copied back, because a sync only reads the weights and
  the host copy is still current (`writeback=True` copies device values back into it);
- the parameters are restored on every exit path, exceptions included.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from hwsync.backend.interfaces import Device
from hwsync.errors import HwsyncError
from hwsync.sync.stats import OnloadStats, SyncStats


def _resolve_device(device: torch.device | str | None, api: Device) -> torch.device:
    if device is None:
        return api.torch_device()
    device = torch.device(device)
    if device.index is None and device.type == api.torch_type:
        # "cuda" means the current device: compare against a concrete index so parameters
        # already on it are recognised and left alone.
        device = api.torch_device()
    return device


def _tensors(params: torch.nn.Module | Iterable[torch.Tensor], include_buffers: bool) -> list[torch.Tensor]:
    if isinstance(params, torch.nn.Module):
        found: list[torch.Tensor] = list(params.parameters())
        if include_buffers:
            found += list(params.buffers())
    else:
        found = list(params)
    unique: dict[int, torch.Tensor] = {}
    for t in found:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"onload moves tensors and parameters, got {type(t).__name__}")
        unique.setdefault(id(t), t)  # a module lists a shared Parameter once, an iterable may not
    return list(unique.values())


def _alias_key(t: torch.Tensor) -> tuple:
    # Tensors that are the same memory (tied weights held as two tensor objects) get one
    # device copy, so onloading never costs more than the weights themselves.
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def _check_devices(target: torch.device, moving: list[torch.Tensor], api: Device) -> None:
    kinds = {target.type} | {t.device.type for t in moving}
    foreign = sorted(k for k in kinds if k not in ("cpu", api.torch_type))
    if foreign:
        raise HwsyncError(
            f"onload between {sorted(kinds)} needs the backend for {', '.join(foreign)} to synchronise, "
            f"but the Device given is {api.name!r} ({api.torch_type}); select that backend "
            "(HWSYNC_BACKEND) or pass its Device as backend_device"
        )


@contextmanager
def onload(
    params: torch.nn.Module | Iterable[torch.Tensor],
    device: torch.device | str | None = None,
    *,
    backend_device: Device | None = None,
    non_blocking: bool = True,
    writeback: bool = False,
    include_buffers: bool = True,
) -> Iterator[OnloadStats]:
    """Move `params` not on `device` there for the block, and put the originals back after."""
    if backend_device is None:
        from hwsync.backend.registry import get_backend  # lazy: only when the caller gave no Device

        backend_device = get_backend().device()
    target = _resolve_device(device, backend_device)
    stats = OnloadStats(device=str(target))
    moving = [t for t in _tensors(params, include_buffers) if t.device != target]
    if not moving:
        yield stats
        return
    _check_devices(target, moving, backend_device)

    originals: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its original .data)
    try:
        start = time.perf_counter()
        copies: dict[tuple, torch.Tensor] = {}
        for t in moving:
            host = t.data
            key = _alias_key(host)
            if key not in copies:
                copies[key] = host.to(target, non_blocking=non_blocking)
                stats.bytes_onloaded += host.numel() * host.element_size()
            originals.append((t, host))
            _point(t, copies[key])
        stats.tensors_moved = len(originals)
        # Copies may still be in flight: the block (and the timing) must see them complete.
        backend_device.synchronize()
        stats.onload_s = time.perf_counter() - start
        del copies
        yield stats
    finally:
        # Runs after the block or after a failure part-way through onloading: whatever was
        # swapped is swapped back.
        if originals:
            start = time.perf_counter()
            try:
                stats.bytes_offloaded = _restore(originals, writeback, non_blocking, backend_device)
            finally:
                stats.offload_s = time.perf_counter() - start


def _point(t: torch.Tensor, data: torch.Tensor) -> None:
    try:
        t.data = data
    except RuntimeError as exc:
        # torch re-points a tensor across devices only where the device type declares itself
        # compatible with cpu (cuda is in torch core; the Ascend plugin registers npu).
        raise HwsyncError(
            f"torch cannot point a {t.device.type} tensor at {data.device.type} memory ({exc}); this "
            f"device type does not declare itself shallow-copy compatible with {t.device.type}. Move the "
            "module with module.to(device) instead, or upgrade the device's torch plugin"
        ) from exc


def _restore(originals: list[tuple[torch.Tensor, torch.Tensor]], writeback: bool, non_blocking: bool,
             api: Device) -> int:
    moved = 0
    written: set[tuple] = set()
    try:
        for t, host in originals:
            if writeback and _alias_key(host) not in written:
                written.add(_alias_key(host))
                host.copy_(t.data, non_blocking=non_blocking)
                moved += host.numel() * host.element_size()
            t.data = host
    finally:
        for t, host in originals:  # a failed copy must not leave any tensor on the device
            t.data = host
        # Device-to-host copies must land before the host tensors are read; dropping the device
        # copies also needs the queue drained before the allocator reuses their memory.
        api.synchronize()
    return moved


@contextmanager
def onload_during(params: torch.nn.Module | Iterable[torch.Tensor] | None, device: Device,
                  stats: SyncStats) -> Iterator[None]:
    """A sender's `onload=`: `params` on the device for the block (nothing when None), timings into `stats`."""
    if params is None:
        yield
        return
    with onload(params, backend_device=device) as moved:
        yield
    stats.onload_s, stats.offload_s = moved.onload_s, moved.offload_s
    stats.onload = moved
