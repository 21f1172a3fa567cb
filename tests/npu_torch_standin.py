"""A stand-in torch_npu on the CPU, for running hwsync_npu's IPC, segment and shared-memory code where no NPU is.

No NPU and no CANN exist here. `install()` makes this process's `torch_npu` a stand-in of torch-npu
2.10.0.post4 (the one vllm-ascend 0.26.0rc1 pins: no `npurt`) whose one "NPU" is the CPU, and points
hwsync_npu's device type at "cpu". It is faithful where hwsync's code depends on torch_npu, as read in
Ascend/pytorch at v26.1.0-pytorch2.10.0 (never copied):
- NPU memory lives in shared-memory files the stand-in allocates, as the caching allocator's segments:
  `NpuArena(nbytes).tensor(shape, dtype)` gives a tensor with a storage of its own inside one segment, and
  `memory_snapshot()` lists every segment (`device`, `address`, `total_size`, `is_expandable`,
  `segment_pool_id`). A plain torch.empty storage is moved into a segment of its own when first shared.
- `UntypedStorage._share_npu_` (StorageSharing.cpp, THNPStorage_shareNpu) refuses a storage not in a base
  format (`npu_format_cast` tags one, `get_npu_format` reads it) and one received from another process; it
  returns the 8-tuple: device index (int), the allocation's handle (bytes: version 1, type 'c', the 65-byte
  key; shareIpcHandle), the storage's bytes, its offset in the allocation, a fresh slot in this process's
  ref-counter file (torch's own RefcountedMapAllocator file, 10000 int64 slots after its 64-byte header,
  set to 1), a 64-byte IPC event handle (ACL_IPC_EVENT_HANDLE_SIZE) and True (2.10.0.post4 records an IPC
  event where the runtime supports one). A pool segment (sleep mode's pluggable allocator) refuses to be
  shared, as NPUPluggableAllocator does; an expandable one is shared by another path (type 'e'), which the
  stand-in does not model and refuses to map.
- `UntypedStorage._new_shared_npu` takes exactly 8 arguments of THNPStorage_newSharedNpu's types (int
  device, bytes handle, int size, int offset, bytes ref counter, int offset, bytes event handle, bool), checks
  the handle's and (when a sync is required) the event handle's size, maps the allocation and returns a
  storage marked received, whose freeing takes its export's counter down by one (the deleter's
  `-= 1`); `_release_ipc_counter_npu(bytes, int)` does the same for an export never mapped.
- the rest of `torch_npu.npu` that hwsync_npu calls: one device, events, a current stream with an
  `npu_stream`, CANN 9.1.0 and driver 25.5.0 (NPU IPC allowed), ipc_collect, memory figures.
What it does not model: asynchrony (copies finish at once), peer access between chips, and the runtime's
own limits. The strict simulated accelerator (tests/plugins/hwsync_sim) models asynchrony for the core.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import secrets
import struct
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from typing import Any

import torch

VERSION = "2.10.0.post4"
REF_COUNTER_SLOTS = 10000  # NPU_IPC_REF_COUNTER_FILE_SIZE
REF_HEADER = 64  # RefcountedMapAllocator's header before the slots (hwsync.backend.ipc_counters.HEADER_BYTES)
EVENT_HANDLE_BYTES = 64  # ACL_IPC_EVENT_HANDLE_SIZE
KEY_BYTES = 65  # kAclIpcHandleSize
HANDLE_VERSION = 1  # SHAREABLE_HANDLE_VERSION
NPU_MALLOC, EXPANDABLE = ord("c"), ord("e")  # SHAREABLE_NPU_MALLOC, SHAREABLE_NPU_EXPANDABLE_SEGMENT
BASE_FORMATS = {0, 1, 2, 30}  # NCHW, NHWC, ND, NCDHW: FormatHelper::IsBaseFormatType
FRACTAL_NZ = 29
SHM = "/dev/shm"
PREFIX = "hwsync_npu_standin-"
ALIGN = 512  # the caching allocator rounds blocks to 512 bytes

NOT_BASE_FORMAT = "Try to share a storage without base format"
RESHARE = ("Supported to send NPU tensor received from another process; other is not currently supported. "
           "Consider cloning before sending.")


@dataclass
class Segment:
    """One allocation of the stand-in NPU: a shared-memory file, mapped here."""

    name: str
    size: int
    map: mmap.mmap
    base: int
    expandable: bool = False
    pool: tuple[int, int] = (0, 0)
    #: where the memory starts in the file (torch's own shared files keep a 64-byte header first)
    file_offset: int = 0


_lock = threading.RLock()
_segments: list[Segment] = []
_formats: dict[int, int] = {}  # storage data_ptr -> NPU format, for storages cast away from ND
_received: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()  # data_ptr -> its mapping
_counter = itertools.count()
_refs: dict[str, Any] = {}  # this process's ref-counter file: "values" (the int64 tensor), "handle", "next"
calls: list[tuple[str, Any]] = []  # what hwsync called, for the tests


def _new_file(nbytes: int) -> tuple[str, mmap.mmap]:
    name = f"{PREFIX}{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
    fd = os.open(os.path.join(SHM, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        return name, mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)


def unlink_all() -> None:
    """Remove this process's segment files from /dev/shm (at exit, or before an os._exit)."""
    for segment in _segments:
        if not segment.name.startswith(PREFIX):
            continue  # torch's own file: torch removes it
        try:
            os.unlink(os.path.join(SHM, segment.name))
        except OSError:
            pass


atexit.register(unlink_all)


def _address(buffer: mmap.mmap) -> int:
    return torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()


class NpuArena:
    """One segment of the stand-in NPU's caching allocator; `tensor()` places a storage of its own in it."""

    def __init__(self, nbytes: int, *, expandable: bool = False, pool: tuple[int, int] = (0, 0)) -> None:
        name, buffer = _new_file(nbytes)
        self.segment = Segment(name, nbytes, buffer, _address(buffer), expandable, pool)
        self._used = 0
        with _lock:
            _segments.append(self.segment)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` whose storage lies in this segment (as the caching allocator places blocks)."""
        nbytes = max(1, int(torch.Size(shape).numel()) * dtype.itemsize)
        offset = self._used
        if offset + nbytes > self.segment.size:
            raise MemoryError(f"stand-in NPU segment of {self.segment.size} bytes is full")
        self._used = -(-(offset + nbytes) // ALIGN) * ALIGN
        flat = torch.frombuffer(self.segment.map, dtype=torch.uint8, count=nbytes, offset=offset)
        return flat[: int(torch.Size(shape).numel()) * dtype.itemsize].view(dtype).view(shape)


def _segment_of(ptr: int) -> Segment | None:
    with _lock:
        return next((s for s in _segments if s.base <= ptr < s.base + s.size), None)


def _ref_slot() -> tuple[bytes, int]:
    """A fresh slot in this process's ref-counter file (torch's RefcountedMapAllocator file), set to 1."""
    with _lock:
        if not _refs:
            values = torch.zeros(REF_COUNTER_SLOTS, dtype=torch.int64).share_memory_()
            _manager, handle, _size = values.untyped_storage()._share_filename_cpu_()
            _refs.update(values=values, handle=bytes(handle), next=0)
        slot = _refs["next"]
        _refs["next"] += 1
        _refs["values"][slot] = 1
        return _refs["handle"], slot


def _decrement(handle: bytes, slot: int) -> None:
    """The `-= 1` torch_npu's deleter and _release_ipc_counter_npu apply to an export's slot."""
    try:
        fd = os.open(os.path.join(SHM, handle.decode().lstrip("/")), os.O_RDWR)
    except FileNotFoundError:
        return  # the exporter is gone: torch_npu ignores this too
    try:
        at = REF_HEADER + 8 * slot
        (value,) = struct.unpack("<q", os.pread(fd, 8, at))
        os.pwrite(fd, struct.pack("<q", value - 1), at)
    finally:
        os.close(fd)


def _is_long(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # THPUtils_checkLong


def _share_npu_(storage: torch.UntypedStorage) -> tuple:
    calls.append(("share", storage.data_ptr()))
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if _formats.get(ptr, 2) not in BASE_FORMATS:
        raise RuntimeError(NOT_BASE_FORMAT)
    if ptr in _received:
        raise RuntimeError(RESHARE)
    if not nbytes:
        return (0, None, 0, 0, None, 0, None, None)
    segment = _segment_of(ptr)
    if segment is None:
        # a plain allocation (torch.empty on the NPU: the allocator gave it a block of its own): moved into a shared
        # file in place, every tensor on it keeps working, and the file is its segment from now on
        storage.share_memory_()
        _manager, name, _size = storage._share_filename_cpu_()
        fd = os.open(os.path.join(SHM, name.decode().lstrip("/")), os.O_RDONLY)
        try:
            buffer = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        ptr = storage.data_ptr()
        segment = Segment(name.decode().lstrip("/"), nbytes, buffer, ptr, file_offset=REF_HEADER)
        with _lock:
            _segments.append(segment)
    if segment.pool != (0, 0):
        raise RuntimeError("NPUPluggableAllocator does not support IPC of its memory")
    kind = EXPANDABLE if segment.expandable else NPU_MALLOC
    key = f"{segment.name}:{segment.file_offset}".encode()  # what the runtime's 65-byte key names: the allocation
    handle = bytes([HANDLE_VERSION, kind]) + key.ljust(KEY_BYTES, b"\0")
    ref_handle, ref_offset = _ref_slot()
    event = secrets.token_bytes(EVENT_HANDLE_BYTES)
    return (0, handle, nbytes, ptr - segment.base, ref_handle, ref_offset, event, True)


def _bad_arguments(args: tuple) -> TypeError:
    kinds = ", ".join(type(a).__name__ for a in args)
    return TypeError(f"_new_shared in NPU mode received an invalid combination of arguments - got ({kinds}), but "
                     "expected (int device, bytes handle, int storage_size_bytes, int storage_offset_bytes, bytes "
                     "_ref_counter, int _ref_counter_offset, bytes event_handle, bool event_sync_required)")


def _new_shared_npu(*args: Any) -> torch.UntypedStorage:
    if len(args) != 8:
        raise RuntimeError("tuple of 8 items expected")
    device, handle, size, offset, ref_handle, ref_offset, event, sync = args
    if not (_is_long(device) and _is_long(size) and isinstance(handle, bytes) and isinstance(ref_handle, bytes)
            and isinstance(event, bytes) and _is_long(offset) and _is_long(ref_offset) and isinstance(sync, bool)):
        raise _bad_arguments(args)
    calls.append(("open", handle))
    if sync and len(event) != EVENT_HANDLE_BYTES:
        raise RuntimeError(f"incorrect handle: an IPC event handle is {EVENT_HANDLE_BYTES} bytes, not {len(event)}")
    if len(handle) != 2 + KEY_BYTES or handle[0] > HANDLE_VERSION:
        raise RuntimeError("received sharable handle from a future version of torch that this version does not "
                           "know how to handle")
    if handle[1] != NPU_MALLOC:
        raise RuntimeError("stand-in torch_npu: expandable-segment handles are not modelled")
    name, _, start = handle[2:].rstrip(b"\0").decode().rpartition(":")
    fd = os.open(os.path.join(SHM, name), os.O_RDWR)
    try:
        buffer = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    storage = torch.frombuffer(buffer, dtype=torch.uint8, count=size, offset=int(start) + offset).untyped_storage()
    # the deleter: when the storage (and so this mapping) goes, its export's counter goes down by one
    weakref.finalize(buffer, _decrement, ref_handle, ref_offset)
    _received[storage.data_ptr()] = buffer  # received: never shared on (while it lives)
    return storage


def _release_ipc_counter_npu(*args: Any) -> None:
    if len(args) != 2:
        raise RuntimeError("tuple of 2 items expected")
    handle, offset = args
    if not (isinstance(handle, bytes) and _is_long(offset)):
        raise TypeError("_release_ipc_counter in NPU mode received an invalid combination of arguments, expected "
                        "(bytes _ref_counter, int _ref_counter_offset)")
    calls.append(("release", (handle, offset)))
    _decrement(handle, offset)


class Event:
    """torch_npu.npu.Event: work is done when queued here (no asynchrony in the stand-in)."""

    def record(self, stream: Any = None) -> None:
        """Record on `stream` (nothing to wait for)."""

    def synchronize(self) -> None:
        """Wait for the recorded work (done)."""

    def query(self) -> bool:
        """Whether the recorded work is done (always)."""
        return True


def npu_format_cast(tensor: torch.Tensor, npu_format: int) -> torch.Tensor:
    """Tag the tensor's storage with an NPU format (FRACTAL_NZ: 29), as torch_npu.npu_format_cast leaves it."""
    _formats[tensor.untyped_storage().data_ptr()] = npu_format
    return tensor


def get_npu_format(tensor: torch.Tensor) -> int:
    """The NPU format of the tensor's storage (ND unless cast)."""
    return _formats.get(tensor.untyped_storage().data_ptr(), 2)


def memory_snapshot() -> list[dict[str, Any]]:
    """The stand-in allocator's segments, with the keys torch_npu's snapshot has (Module.cpp)."""
    with _lock:
        return [{"device": 0, "address": s.base, "total_size": s.size, "allocated_size": s.size,
                 "is_expandable": s.expandable, "segment_pool_id": s.pool, "segment_type": "large", "blocks": []}
                for s in _segments]


def _module() -> types.ModuleType:
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__spec__ = ModuleSpec("torch_npu", None)
    torch_npu.__version__ = VERSION
    npu = types.ModuleType("torch_npu.npu")
    stream = types.SimpleNamespace(npu_stream=0x5EED)
    npu.device_count = lambda: 1
    npu.current_device = lambda: 0
    npu.set_device = lambda index: None
    npu.synchronize = lambda device=None: calls.append(("synchronize", None))
    npu.is_initialized = lambda: True
    npu.mem_get_info = lambda index=None: (8 << 30, 16 << 30)
    npu.memory_allocated = lambda index=None: 0
    npu.memory_reserved = lambda index=None: 0
    npu.empty_cache = lambda: None
    npu.get_device_name = lambda index=None: "Ascend910B3"
    npu.ipc_collect = lambda: calls.append(("ipc_collect", None))
    npu.Event = Event
    npu.current_stream = lambda device=None: stream
    npu.memory_snapshot = memory_snapshot
    npu.utils = types.SimpleNamespace(get_cann_version=lambda module="CANN": {"CANN": "9.1.0",
                                                                             "DRIVER": "25.5.0"}.get(module, ""))
    torch_npu.npu = npu
    torch_npu.get_npu_format = get_npu_format
    torch_npu.npu_format_cast = npu_format_cast
    torch_npu.distributed = types.SimpleNamespace(is_hccl_available=lambda: True)
    return torch_npu


def install() -> types.ModuleType:
    """Make this process's torch_npu the stand-in and hwsync_npu's NPU the CPU; returns the module (once per
    process: it changes torch.UntypedStorage and hwsync_npu's device type for good)."""
    if "torch_npu" in sys.modules and getattr(sys.modules["torch_npu"], "__version__", None) == VERSION:
        return sys.modules["torch_npu"]
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")  # the ref-counter file: a named shm file
    module = _module()
    sys.modules["torch_npu"] = module
    sys.modules["torch_npu.npu"] = module.npu
    torch.UntypedStorage._share_npu_ = _share_npu_  # type: ignore[attr-defined]  # torch_npu's _add_storage_methods
    torch.UntypedStorage._new_shared_npu = staticmethod(_new_shared_npu)  # type: ignore[attr-defined]
    torch.UntypedStorage._release_ipc_counter_npu = staticmethod(_release_ipc_counter_npu)  # type: ignore[attr-defined]
    import hwsync_npu.device
    import hwsync_npu.segments

    # the stand-in NPU's memory is the CPU's: the one place hwsync_npu names the device type
    hwsync_npu.device.TORCH_TYPE = "cpu"
    hwsync_npu.device.NpuDevice.torch_type = "cpu"
    hwsync_npu.segments.NpuDeviceSegments.device_type = "cpu"
    os.environ["HWSYNC_BACKEND"] = "npu"
    return module
