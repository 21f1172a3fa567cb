"""The simulated accelerator's driver: devices, the current device per thread, streams, memory.

What it keeps, and why each is modelled the way CUDA (and torch_npu) behave:
- N devices per node (HWSYNC_SIM_DEVICES, default 2), of which a process sees those listed in
  HWSYNC_SIM_VISIBLE_DEVICES (default all), numbered 0.. in that order, like CUDA_VISIBLE_DEVICES;
- the current device is per thread, and every new thread starts on device 0 (cudaSetDevice is
  per host thread); HWSYNC_SIM_DEVICE is the device the process's main thread starts on, standing
  in for a launcher that calls set_device(local_rank) first thing;
- strictness: device work (allocation, copy, kernel, collective) on a tensor of device k from a
  thread whose current device is j is an error. CUDA would run it on k through a device guard;
  in hwsync such a mismatch always means a thread that never set its device (its allocations,
  synchronizations and communicators are then on the wrong device), so the sim says so at once;
- each device has a default stream; device synchronize waits for all of the device's streams
  (the collective library's included), as cudaDeviceSynchronize does;
- device memory is host memory; fresh allocations are filled with UNINITIALIZED, freed or
  released memory with POISON, so a late reader sees garbage instead of the bytes it hoped for;
- free memory is the "driver's" view: every process's allocations on the same physical device
  count (a usage file per process in /dev/shm, ignored once its process is gone);
- a forked child cannot use it, as CUDA cannot;
- it counts what bounds a sync's speed on hardware (`counts`): copy launches (each copy the host
  issues: a copy_, a cast, or one foreach copy of many tensors), bytes copied on each device, device-wide
  synchronizes and event waits, IPC exports, and opens (new mappings) against re-opens of a block this
  process maps already. A test or a benchmark reads them through SimDevice.counters().
"""

from __future__ import annotations

import atexit
import collections
import glob
import json
import os
import socket
import struct
import threading
import warnings
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker

import torch

from hwsync_sim.streams import SimStream

TYPE = "sim"
ENV_DEVICES = "HWSYNC_SIM_DEVICES"
ENV_VISIBLE = "HWSYNC_SIM_VISIBLE_DEVICES"
ENV_MAIN_DEVICE = "HWSYNC_SIM_DEVICE"
ENV_MEMORY_GIB = "HWSYNC_SIM_MEMORY_GIB"
ENV_DELAY = "HWSYNC_SIM_STREAM_DELAY_S"
ENV_LEAK_LOG = "HWSYNC_SIM_LEAK_LOG"

UNINITIALIZED = 0xA5  # what fresh device memory holds: not zeros, as on a GPU
POISON = 0xDD  # what freed or released memory holds
SHM_DIR = "/dev/shm"
FILE_PREFIX = "hwsync_sim-"  # files of the sim in /dev/shm (not "hwsync-": those are hwsync's own)


class SimError(RuntimeError):
    """Something a real accelerator would refuse (or silently get wrong) was done to the sim."""


class SimDeviceError(SimError):
    """Device work on a tensor of one device from a thread whose current device is another."""


class SimOutOfMemoryError(SimError):
    """An allocation larger than the simulated device's free memory."""


class SimLeakWarning(UserWarning):
    """Device memory that stays held although its owner let it go (IPC limbo)."""


@dataclass(frozen=True)
class NodeConfig:
    """The simulated node as this process sees it (from the environment)."""

    devices: int
    visible: tuple[int, ...]  # physical index of each local index
    memory_bytes: int
    delay_s: float
    main_device: int

    @classmethod
    def from_env(cls) -> "NodeConfig":
        """Read HWSYNC_SIM_* (see the module doc); errors name the variable."""
        devices = int(os.environ.get(ENV_DEVICES, "2"))
        if devices < 1:
            raise SimError(f"{ENV_DEVICES}={devices}: the simulated node needs at least one device")
        text = os.environ.get(ENV_VISIBLE)
        visible = tuple(range(devices)) if text is None else tuple(int(x) for x in text.split(",") if x.strip())
        bad = [v for v in visible if not 0 <= v < devices]
        if bad:
            raise SimError(f"{ENV_VISIBLE}={text!r} names devices {bad}, but the node has {devices} "
                           f"({ENV_DEVICES}); use indices 0..{devices - 1}")
        return cls(devices, visible, int(float(os.environ.get(ENV_MEMORY_GIB, "16")) * (1 << 30)),
                   float(os.environ.get(ENV_DELAY, "0.2")), int(os.environ.get(ENV_MAIN_DEVICE, "0")))


#: the next device address an allocation gets: each takes a range of its own size (rounded up to 512 bytes, a
#: device allocator's alignment), never given again, so the addresses of two live allocations, and of views into
#: them, never meet, whichever host memory holds their bytes
_next_address = [1 << 40]
_address_lock = threading.Lock()


def _address_for(nbytes: int) -> int:
    with _address_lock:
        address = _next_address[0]
        _next_address[0] += max(512, -(-nbytes // 512) * 512)
        return address


class Memory:
    """The bytes of one device allocation: host memory, or a shared segment once exported."""

    __slots__ = ("index", "nbytes", "address", "data", "segment", "sent", "mapping", "__weakref__")

    def __init__(self, index: int, data: torch.Tensor) -> None:
        self.index = index
        self.nbytes = data.numel()
        #: its device address (Device.data_ptr): stays when its bytes move into a shared segment at the first export,
        #: as a GPU allocation's does
        self.address = _address_for(self.nbytes)
        self.data = data  # flat uint8 host tensor standing in for the device memory
        self.segment = None  # hwsync.backend.shm.SharedSegment once the memory is shared
        self.sent: list[tuple[str, int]] = []  # (counter file, slot) of each of its exports (hwsync_sim.sharing)
        self.mapping = None  # for memory mapped from another process: what to release on free


class Block:
    """What device tensors hold on to: when the last one goes, its Memory is freed."""

    __slots__ = ("mem", "__weakref__")

    def __init__(self, mem: Memory) -> None:
        self.mem = mem


class Runtime:
    """One process's view of the simulated node."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._streams: dict[int, list[SimStream]] = {}
        self._allocated = [0] * len(config.visible)
        self.leaks: list[str] = []
        main = config.main_device
        if not 0 <= main < len(config.visible):
            raise SimError(f"{ENV_MAIN_DEVICE}={main} but this process sees {len(config.visible)} device(s)")
        self._usage_name = f"{FILE_PREFIX}{self.pid}-usage"
        self._usage_fd = os.open(os.path.join(SHM_DIR, self._usage_name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        resource_tracker.register("/" + self._usage_name, "shared_memory")  # gone even if we are killed
        os.ftruncate(self._usage_fd, 8 * config.devices)
        #: host ranges page-locked by pin_host_memory: (address, bytes)
        self.pinned: list[tuple[int, int]] = []
        #: what this process's device work counted (see the module doc)
        self.counts: collections.Counter[str] = collections.Counter()
        atexit.register(self._at_exit)

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Whether a host tensor's bytes lie in pinned memory (device copies then read it asynchronously)."""
        start = host.data_ptr()
        end = start + host.numel() * host.element_size()
        return any(base <= start and end <= base + size for base, size in list(self.pinned))

    # -- devices and threads -----------------------------------------------------------------

    def count(self) -> int:
        """Devices visible to this process."""
        return len(self.config.visible)

    def current(self) -> int:
        """This thread's current device: 0 in a new thread, HWSYNC_SIM_DEVICE in the main one."""
        self.check_process()
        index = getattr(self._local, "index", None)
        if index is None:
            index = self.config.main_device if threading.current_thread() is threading.main_thread() else 0
            self._local.index = index
        return index

    def set_current(self, index: int) -> None:
        """Make `index` this thread's current device."""
        self.check_index(index)
        self._local.index = index

    def check_index(self, index: int) -> None:
        """Raise unless `index` is a visible device."""
        if not 0 <= index < self.count():
            raise SimError(f"sim device {index} does not exist: this process sees {self.count()} "
                           f"({ENV_VISIBLE}={os.environ.get(ENV_VISIBLE, 'unset')!r})")

    def require_current(self, index: int, what: str) -> None:
        """Raise SimDeviceError unless `index` is this thread's current device."""
        current = self.current()
        if index != current:
            name = threading.current_thread().name
            raise SimDeviceError(
                f"sim: {what} touches memory of {TYPE}:{index} from thread {name!r}, whose current device is "
                f"{TYPE}:{current}. Either the thread never set its device (the current device is per thread and a "
                f"new thread starts on 0), or the memory was put on another device than the thread's")

    def check_process(self) -> None:
        """Refuse a forked child: CUDA's state does not survive fork, nor does the sim's."""
        if os.getpid() != self.pid:
            raise SimError("sim: the simulated device was initialised before this process forked; a forked "
                           "child cannot use it (neither can it use CUDA). Start processes with spawn")

    def physical(self, index: int) -> int:
        """The node-wide index of local device `index`."""
        self.check_index(index)
        return self.config.visible[index]

    def local_of_physical(self, physical: int) -> int | None:
        """This process's index of physical device `physical`, or None if it is not visible."""
        try:
            return self.config.visible.index(physical)
        except ValueError:
            return None

    def physical_id(self, index: int) -> str:
        """A device's identity valid across processes, uuid-like: SIM-<host>-<physical index>."""
        return f"SIM-{self.host}-{self.physical(index)}"

    # -- streams ---------------------------------------------------------------------------------

    def stream(self, index: int) -> SimStream:
        """Device `index`'s default stream."""
        streams = self._streams.get(index)
        if streams is None:
            with self._lock:
                streams = self._streams.setdefault(index, [SimStream(f"{TYPE}:{index}", self.config.delay_s)])
        return streams[0]

    def new_stream(self, index: int, name: str) -> SimStream:
        """Another stream on device `index` (a collective library's own stream)."""
        self.stream(index)
        stream = SimStream(f"{TYPE}:{index}/{name}", self.config.delay_s)
        with self._lock:
            self._streams[index].append(stream)
        return stream

    def drop_stream(self, index: int, stream: SimStream) -> None:
        """Forget a stream made by new_stream (its group is gone)."""
        with self._lock:
            if stream in self._streams.get(index, []):
                self._streams[index].remove(stream)

    def tally(self, key: str, n: int = 1) -> None:
        """Add `n` to counter `key` (thread-safe)."""
        with self._lock:
            self.counts[key] += n

    def count_copy(self, index: int, nbytes: int, launches: int = 1) -> None:
        """A copy the host launched on local device `index`, moving `nbytes`."""
        with self._lock:
            self.counts["copy_launches"] += launches
            self.counts["copy_bytes"] += nbytes
            self.counts[f"copy_bytes:{self.config.visible[index]}"] += nbytes

    def synchronize(self, index: int, counted: bool = True) -> None:
        """Wait for every stream of device `index` (cudaDeviceSynchronize); `counted=False` for the sim's own."""
        if counted:
            self.tally("device_syncs")
        for stream in list(self._streams.get(index, [])):
            stream.synchronize()

    # -- memory ----------------------------------------------------------------------------------

    def allocate(self, index: int, nbytes: int) -> Block:
        """A new allocation on device `index`, filled with UNINITIALIZED; OOM past free memory."""
        self.check_index(index)
        if nbytes >= 1 << 20:  # small ones only count against this process's own use
            free, total = self.mem_get_info(index)
        else:
            free, total = self.config.memory_bytes - self._allocated[index], self.config.memory_bytes
        if nbytes > free:
            raise SimOutOfMemoryError(f"sim: out of memory on {TYPE}:{index}: tried to allocate {nbytes} bytes, "
                                      f"{free} of {total} free")
        return self.adopt(index, torch.full((nbytes,), UNINITIALIZED, dtype=torch.uint8))

    def adopt(self, index: int, data: torch.Tensor) -> Block:
        """Account `data` (flat uint8) as device memory of `index` and hand out its Block."""
        mem = Memory(index, data)
        self.account(index, mem.nbytes)
        block = Block(mem)
        weakref.finalize(block, self.free, mem)
        return block

    def free(self, mem: Memory) -> None:
        """The last tensor of `mem` is gone: return it to the device, poisoned (IPC rules apply)."""
        from hwsync_sim import sharing  # sharing builds on this module

        if mem.sent or mem.mapping is not None:
            sharing.freed(self, mem)
        else:
            mem.data.fill_(POISON)
            self.account(mem.index, -mem.nbytes)

    def account(self, index: int, delta: int) -> None:
        """Add `delta` bytes to this process's use of device `index` (and its usage file)."""
        with self._lock:
            self._allocated[index] += delta
            value = self._allocated[index]
        if self._usage_fd >= 0:  # closed at exit, after which finalizers may still free memory
            os.pwrite(self._usage_fd, struct.pack("q", value), 8 * self.config.visible[index])

    def allocated(self, index: int) -> int:
        """Bytes of live allocations of this process on device `index`."""
        return self._allocated[index]

    def mem_get_info(self, index: int) -> tuple[int, int]:
        """(free, total) of device `index`: what every live process on the node holds counts."""
        physical = self.physical(index)
        used = 0
        for path in glob.glob(os.path.join(SHM_DIR, f"{FILE_PREFIX}*-usage")):
            pid = int(os.path.basename(path)[len(FILE_PREFIX):].split("-")[0])
            if pid != self.pid and not process_alive(pid):
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(8 * physical)
                    raw = f.read(8)
            except OSError:
                continue
            used += struct.unpack("q", raw)[0] if len(raw) == 8 else 0
        total = self.config.memory_bytes
        return max(0, total - used), total

    # -- leaks -----------------------------------------------------------------------------------

    def report_leak(self, text: str) -> None:
        """Say that device memory stays held: a warning here, a line in HWSYNC_SIM_LEAK_LOG for tests."""
        self.leaks.append(text)
        warnings.warn(text, SimLeakWarning, stacklevel=3)
        path = os.environ.get(ENV_LEAK_LOG)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"pid": self.pid, "leak": text}) + "\n")

    def _at_exit(self) -> None:
        from hwsync_sim import sharing

        sharing.at_exit(self)
        try:
            fd, self._usage_fd = self._usage_fd, -1
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, self._usage_name))
            resource_tracker.unregister("/" + self._usage_name, "shared_memory")
        except OSError:
            pass


def process_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def read_leak_log(path: str, clear: bool = False) -> list[dict]:
    """The leak reports every process appended to `path` (HWSYNC_SIM_LEAK_LOG); optionally emptied."""
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
    if clear:
        open(path, "w").close()
    return rows


_runtime: Runtime | None = None
_init_lock = threading.Lock()


def runtime() -> Runtime:
    """The process's simulated node, set up (and torch taught the "sim" device) on first use."""
    global _runtime
    if _runtime is None:
        with _init_lock:
            if _runtime is None:
                from hwsync_sim.tensor import install_torch_device

                install_torch_device()
                _runtime = Runtime(NodeConfig.from_env())
    _runtime.check_process()
    return _runtime


def initialized() -> bool:
    """Whether this process has used the sim (so it may have device work in flight)."""
    return _runtime is not None
