"""Parameters that live in hwsync-owned shared host memory, so a sync can read them in place.

A trainer that keeps its parameters (or, offloading, their host copies) here lets a same-host
WeightSender send references instead of bytes: each receiver maps the segments once and copies
every tensor once, straight into its own memory (see hwsync.colocated.refs).

- `SharedTensors(named)`: copies of (name, tensor) pairs, packed into a few large segments
  (`hwsync-<pid>-<start>-<pidns>-params-<hex>` in /dev/shm, each tensor at a 256-byte aligned offset);
- `SharedParameters(module)`: the module's parameters and buffers moved into such segments
  (`param.data` points there, so optimizer steps update them in place and nothing is copied per
  step). A module on an accelerator is offloaded into them; `to_device()` before a training
  step and `to_host()` after it move it to the device and back (to_host copies device values in).
  (A sync's own onload is `send(onload=...)`: it reads device memory for the sync; here the sync
  reads the shared host copy, and these move the module for training.)

Segments are pinned (page-locked) where the backend's Device can (CUDA), plain shared memory
on the CPU. This process owns them: they are registered with Python's resource tracker (gone
even if this process is killed), unlinked at close() and at exit; memory already mapped (the
parameters' own, a receiver's) stays valid until unmapped, as for any unlinked file.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator

import torch

from hwsync.backend.devices import PLAIN_TENSOR_TYPES, identified
from hwsync.backend.interfaces import Device
from hwsync.backend.shm import SharedSegment
from hwsync.protocol.layout import ALIGNMENT, SegmentSpec

#: a new segment is started once the open one would pass this many bytes (a larger tensor gets one of its own)
DEFAULT_SEGMENT_BYTES = 1 << 30

_lock = threading.Lock()
#: every live shared parameter segment of this process, by name: what a sender may send references into (a sender
#: reads it empty, the common case, without a call: a sync of a process that shares nothing does no work for them)
LIVE: dict[str, SharedSegment] = {}


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def live_segments() -> list[SegmentSpec]:
    """This process's shared parameter segments now (not those a forked child inherited: they are its parent's)."""
    with _lock:
        return [SegmentSpec(s.name, s.size) for s in LIVE.values() if s.created_here]


def find_shared(tensor: torch.Tensor) -> tuple[SegmentSpec, int] | None:
    """(segment, byte offset) of a tensor that lies whole in one of this process's segments, else None.

    Only contiguous host tensors qualify, at an aligned offset: anything else goes the packed way.
    """
    if not LIVE:  # the common case, a process that shares nothing: no per-tensor work on the packed path
        return None
    return SegmentIndex().find(tensor)


class SegmentIndex:
    """This process's live segments by address, taken once for many lookups (one sync's tensors): a binary search
    per tensor, not a scan of every segment (a large model lies in tens of them)."""

    def __init__(self) -> None:
        with _lock:
            # a forked child's inherited mappings are its parent's segments, not this sender's to name
            found = sorted(((s.tensor.data_ptr(), s) for s in LIVE.values() if s.created_here), key=lambda f: f[0])
        self._bases = [base for base, _ in found]
        self._ends = [base + segment.size for base, segment in found]
        self._specs = [SegmentSpec(segment.name, segment.size) for _, segment in found]

    def find(self, tensor: torch.Tensor, nbytes: int | None = None) -> tuple[SegmentSpec, int] | None:
        """(segment, byte offset) of `tensor` (of `nbytes`, when the caller knows them) if it lies whole in one of
        the segments, contiguous, at an aligned offset; else None."""
        if not self._bases:
            return None
        if type(tensor) not in PLAIN_TENSOR_TYPES or not tensor.is_cpu or not tensor.is_contiguous():
            return None
        if nbytes is None:
            nbytes = tensor.numel() * tensor.element_size()
        if not nbytes:
            return None
        start = tensor.data_ptr()
        i = bisect_right(self._bases, start) - 1
        if i < 0 or start + nbytes > self._ends[i]:
            return None
        offset = start - self._bases[i]
        return (self._specs[i], offset) if offset % ALIGNMENT == 0 else None


def _new_segment(size: int) -> SharedSegment:
    segment = SharedSegment.create(size, kind="params")  # <owner>-params-<hex>: protocol.layout.SHARED_SEGMENT_NAME
    with _lock:
        LIVE[segment.name] = segment
    return segment


def _drop_segments(segments: list[SharedSegment], pinned: list[torch.Tensor], device: Device | None) -> None:
    """Unpin, forget and unlink; the mappings go when the last view of them does."""
    for tensor in pinned:
        if device is not None:
            device.unpin_host_memory(tensor)
    pinned.clear()
    with _lock:
        for segment in segments:
            LIVE.pop(segment.name, None)
    for segment in segments:
        segment.close()
    segments.clear()


class SharedTensors:
    """Copies of named tensors in shared segments this process owns; `tensors` maps each name to its copy."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 device: Device | None = None, pin: bool = True) -> None:
        items = list(named)
        self._segments: list[SharedSegment] = []
        self._pinned: list[torch.Tensor] = []
        self._device = device
        #: unlink at exit (or when collected) even if close() is never called
        self._finalizer = weakref.finalize(self, _drop_segments, self._segments, self._pinned, device)
        self.tensors: dict[str, torch.Tensor] = {}
        copies: dict[tuple, torch.Tensor] = {}  # tied tensors (one memory, several names) get one copy
        address = torch.Tensor.data_ptr if device is None else device.data_ptr
        try:
            for (name, tensor), (index, offset) in zip(items, self._layout(items, segment_bytes)):
                ptr = address(tensor)  # a tensor with no address of its own is tied to none
                key = ((tensor.device, ptr, tensor.dtype, tuple(tensor.shape), tensor.stride())
                       if identified(ptr, tensor, address) else (id(tensor),))
                if key not in copies:
                    nbytes = tensor.numel() * tensor.element_size()
                    flat = self._segments[index].tensor[offset: offset + nbytes]
                    copies[key] = flat.view(tensor.dtype).view(tensor.shape)
                    copies[key].copy_(tensor.detach())
                self.tensors[name] = copies[key]
            if pin and device is not None and device.torch_type != "cpu":
                for segment in self._segments:
                    if device.pin_host_memory(segment.tensor):
                        self._pinned.append(segment.tensor)
        except BaseException:
            self.close()
            raise

    def _layout(self, items: list[tuple[str, torch.Tensor]], segment_bytes: int) -> list[tuple[int, int]]:
        """(segment index, offset) of each tensor; creates the segments."""
        places: list[tuple[int, int]] = []
        sizes: list[int] = []
        used = 0
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.layout is not torch.strided:
                raise TypeError(f"{name!r}: only materialised dense tensors can live in shared memory, "
                                f"got {type(tensor).__name__}; materialise it first")
            nbytes = _align(tensor.numel() * tensor.element_size())
            if not sizes or (used and used + nbytes > segment_bytes):
                sizes.append(0)
                used = 0
            places.append((len(sizes) - 1, used))
            used += nbytes
            sizes[-1] = used
        for size in sizes:
            self._segments.append(_new_segment(max(size, ALIGNMENT)))
        return places

    @property
    def segment_names(self) -> list[str]:
        """Names of the segments in /dev/shm."""
        return [s.name for s in self._segments]

    @property
    def pinned(self) -> bool:
        """Whether the segments are page-locked for device copies."""
        return bool(self._pinned)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, shared tensor) pairs: a source for WeightSender.send."""
        return iter(self.tensors.items())

    def close(self) -> None:
        """Unpin and unlink the segments; views still held stay readable until dropped. Safe to call twice."""
        self._finalizer()


class SharedParameters:
    """A module whose parameters and buffers live in hwsync's shared host memory (see the module doc).

    On the CPU the module trains in place in shared memory. On an accelerator the constructor
    offloads it into shared memory; `to_device()` brings it to the device for the training step,
    `to_host()` copies the step's result back and frees the device memory, and a sync then
    reads the shared copy: `sender.send(shared.items(), ...)` (or the module's state_dict
    while on the host). close() moves the tensors back into private memory.
    """

    def __init__(self, module: torch.nn.Module, *, device: torch.device | str | None = None,
                 include_buffers: bool = True, segment_bytes: int = DEFAULT_SEGMENT_BYTES, pin: bool = True) -> None:
        """`device`: where to_device() puts the tensors (default: the device they are on now)."""
        from hwsync.backend.registry import get_backend

        self.module = module
        self._device_api = get_backend().device()
        owners: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in module.named_parameters(remove_duplicate=False)]
        if include_buffers:
            owners += [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None]
        devices = {t.device for _, t in owners}
        if len(devices) > 1:
            raise ValueError(f"the module's tensors are on several devices {sorted(map(str, devices))}; "
                             "move it to one device (or the CPU) before sharing it")
        #: where to_device() puts the tensors: the device they were on, or the CPU (then to_device does nothing)
        self.home = torch.device(device) if device is not None else \
            next(iter(devices)) if devices else torch.device("cpu")
        if self.home.type == self._device_api.torch_type and self.home.index is None:
            self.home = self._device_api.torch_device()
        self.shared = SharedTensors(owners, segment_bytes=segment_bytes, device=self._device_api, pin=pin)
        if any(d.type != "cpu" for d in devices | {self.home}):
            self._device_api.synchronize()
        self._owners = owners
        self.on_device = False
        self._rebind(lambda name, tensor: self.shared.tensors[name])

    def _rebind(self, new: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        done: set[int] = set()
        for name, tensor in self._owners:
            if id(tensor) not in done:  # a tied Parameter is listed under each name: move it once
                tensor.data = new(name, tensor)
                done.add(id(tensor))

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, shared host tensor) of every parameter and buffer; the host copies must be current."""
        if self.on_device:
            raise RuntimeError("the parameters are on the device and the shared host copy is stale: call "
                               "to_host() before syncing from it")
        return self.shared.items()

    def to_device(self) -> None:
        """Copy the parameters to their device for training (nothing to do for a module trained on the CPU)."""
        if self.home.type == "cpu" or self.on_device:
            return
        self._rebind(lambda name, tensor: self.shared.tensors[name].to(self.home, non_blocking=True))
        self._device_api.synchronize()
        self.on_device = True

    def to_host(self) -> None:
        """Copy the device values into the shared host copy and point the parameters at it (frees device memory)."""
        if not self.on_device:
            return
        for name, tensor in self._owners:
            self.shared.tensors[name].copy_(tensor.data, non_blocking=True)
        self._device_api.synchronize()
        self._rebind(lambda name, tensor: self.shared.tensors[name])
        self.on_device = False

    def close(self) -> None:
        """Give the module private memory again (on the host, or its device if there) and unlink the segments."""
        if not self.on_device:
            self._rebind(lambda name, tensor: tensor.data.clone())
        self.shared.close()

    def __enter__(self) -> "SharedParameters":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all_at_exit() -> None:
    """Unlink what is still live (weakref.finalize also runs at exit; this covers objects in cycles)."""
    with _lock:
        segments = list(LIVE.values())
        LIVE.clear()
    for segment in segments:
        segment.close()
