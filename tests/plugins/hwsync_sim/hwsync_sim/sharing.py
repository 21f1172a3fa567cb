"""Device memory shared between processes, counted the way torch counts CUDA IPC.

What torch does (torch/csrc/CudaIPCTypes.cpp, StorageSharing.cpp, and rebuild_cuda_tensor in
torch/multiprocessing/reductions.py), and the sim with it:
- every export of a block (`storage._share_cuda_()`, here `share`) takes a fresh slot in the
  exporting process's ref-counter file and sets it to 1: one export expects one consumer;
- a consumer maps a block once per process; mapping another export of a block it already maps
  releases that export's counter at once;
- when a consumer's mapping is freed it waits for its stream and decrements the counter of the
  export it mapped. A killed consumer never does;
- when the exporter frees the block: if any of its counters is not 0 the block goes to limbo,
  else it is freed at once. torch reads a counter as unsigned (uint64_t), so one taken below 0
  (released twice: two consumers of one export, or a consumer's unmap and the exporter's
  release) holds its block until the process exits, and makes torch print "Producer process has
  been terminated before all shared CUDA tensors released" then, as the H200 showed
  (docs/cuda.md). The sim poisons freed memory, so a consumer reading a block that was really
  freed reads garbage, as it would read another tensor's bytes on a GPU;
- collect (torch.cuda.ipc_collect, also run after every free) frees limbo blocks whose counters
  are all 0. torch keeps the rest silently until the process exits. The sim reports a block as
  a leak, saying why, as soon as nothing can free it any more: when its owner collects (a
  transport's close) and one of its exports was mapped by a process that exited without
  closing it, or was released twice. A block still mapped by a live process is freed by a later collect
  once that process closes it; if it is still parked at the owner's exit (or when a test asks,
  `report_parked`), it is reported then.
The sim always synchronises the stream at export (torch does once it runs out of IPC events),
and a process cannot open its own export (cudaIpcOpenMemHandle refuses that too).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import struct
import threading
import weakref
from multiprocessing import resource_tracker
from typing import Any

import torch

from hwsync.backend import SharedSegment
from hwsync_sim.runtime import (
    FILE_PREFIX,
    POISON,
    SHM_DIR,
    TYPE,
    Block,
    Memory,
    Runtime,
    SimError,
    process_alive,
    runtime,
)
from hwsync_sim.tensor import SimTensor

SLOTS = 4096
SLOT = struct.Struct("qq")  # counter, pid of the process that mapped the export (0: none yet)

_lock = threading.RLock()
_limbo: list[Memory] = []
_reported: set[int] = set()  # id() of limbo memories already reported
_mapped: dict[str, "weakref.ref[Block]"] = {}  # segment name -> the Block this process maps it as
_counters: "_Counters | None" = None  # the file new exports take their slot in
_files: "dict[str, _Counters]" = {}  # every counter file of this process still in use, by name
_exported: "weakref.WeakSet[Memory]" = weakref.WeakSet()  # live exported memories, unlinked at exit
_exiting = False


class _Counters:
    """One ref-counter file of this process (torch's CudaIPCRefCountersFile): one slot per export, handed out in
    order and never reused (torch only counts the slots returned), so a late release of an old export can never
    take down a newer one's counter. A full file is followed by a new one, and removed once every slot it gave
    out is back."""

    def __init__(self, pid: int) -> None:
        self.name = f"{FILE_PREFIX}{pid}-refs-{secrets.token_hex(4)}"
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        resource_tracker.register("/" + self.name, "shared_memory")
        os.ftruncate(fd, SLOTS * SLOT.size)
        os.close(fd)
        self.next = 0
        self.used = 0

    @property
    def full(self) -> bool:
        """Whether every slot was handed out (new exports take a new file)."""
        return self.next >= SLOTS

    def take(self) -> int:
        """The next slot, set to 1."""
        slot, self.next, self.used = self.next, self.next + 1, self.used + 1
        update(self.name, slot, set_to=(1, 0))
        return slot

    def give_back(self, slot: int) -> bool:
        """The export is gone (its slot is not reused); whether the file is done with (full, every slot back)."""
        self.used -= 1
        return self.full and not self.used

    def close(self) -> None:
        """Remove the file (consumers that still hold a slot's name fail softly, as in torch)."""
        try:
            os.unlink(self.path)
            resource_tracker.unregister("/" + self.name, "shared_memory")
        except OSError:
            pass


def update(name: str, slot: int, delta: int = 0, mapper: int | None = None,
           set_to: tuple[int, int] | None = None) -> tuple[int, int]:
    """Read-modify-write one slot of a counter file under a lock; returns (counter, mapper pid)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX, SLOT.size, slot * SLOT.size)
        counter, pid = set_to if set_to is not None else SLOT.unpack(os.pread(fd, SLOT.size, slot * SLOT.size))
        counter += delta
        pid = pid if mapper is None else mapper
        os.pwrite(fd, SLOT.pack(counter, pid), slot * SLOT.size)
        return counter, pid
    finally:
        os.close(fd)  # closing drops the lock


def share(tensor: SimTensor) -> dict[str, Any]:
    """Export the block behind `tensor` (storage._share_cuda_): a msgpack-safe record for open()."""
    global _counters
    rt = runtime()
    mem = tensor._block.mem
    rt.require_current(mem.index, "exporting device memory")
    if mem.segment is None:
        _move_to_shared(rt, mem)
    rt.tally("exports")
    with _lock:
        if _counters is None or _counters.full:
            _counters = _Counters(rt.pid)
            _files[_counters.name] = _counters
        slot = _counters.take()
        mem.sent.append((_counters.name, slot))
        _exported.add(mem)
        refs = _counters.name
    return {"segment": mem.segment.name, "bytes": mem.nbytes, "physical": rt.physical(mem.index), "pid": rt.pid,
            "refs": refs, "slot": slot, "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape), "stride": list(tensor.stride()), "offset": tensor.storage_offset()}


def _move_to_shared(rt: Runtime, mem: Memory) -> None:
    """Put a block's bytes in a shared segment, in stream order (all earlier writes land first)."""
    rt.synchronize(mem.index, counted=False)
    segment = SharedSegment(f"{FILE_PREFIX}{rt.pid}-{secrets.token_hex(8)}", max(mem.nbytes, 1), create=True)

    def swap() -> None:
        segment.tensor[: mem.nbytes].copy_(mem.data)
        mem.data, mem.segment = segment.tensor[: mem.nbytes], segment

    rt.stream(mem.index).call(swap)


def open_shared(record: dict[str, Any], index: int | None = None) -> SimTensor:
    """Map another process's export (_new_shared_cuda / _new_shared_npu) as a tensor of device `index`.

    None means this process's index of the exporting device, as torch's rebuild_cuda_tensor does; any
    other visible device works too (peer access, what torch_npu and vllm-ascend use).
    """
    rt = runtime()
    if int(record["pid"]) == rt.pid:
        raise SimError("sim: a process cannot open its own IPC export (CUDA refuses that too); use the tensor itself")
    if index is None:
        index = rt.local_of_physical(int(record["physical"]))
        if index is None:
            raise SimError(f"sim: the exported block is on physical device {record['physical']}, which this "
                           f"process does not see ({rt.config.visible}); make it visible or map it on a device "
                           "it sees (peer access)")
    rt.check_index(index)
    rt.require_current(index, "opening an IPC handle")
    dtype = getattr(torch, str(record["dtype"]))
    name, refs, slot = str(record["segment"]), str(record["refs"]), int(record["slot"])
    with _lock:
        ref = _mapped.get(name)
        block = ref() if ref is not None else None
        if block is not None:
            rt.tally("opens_cached")
            update(refs, slot, delta=-1)  # already mapped here: this export is released at once
        else:
            rt.tally("opens")
            try:
                segment = SharedSegment(name, max(int(record["bytes"]), 1), create=False)
            except FileNotFoundError as exc:
                raise SimError(f"sim: IPC handle {name} names a block its owner (pid {record['pid']}) already "
                               "freed") from exc
            mem = Memory(index, segment.tensor[: int(record["bytes"])])
            mem.segment, mem.mapping = segment, (refs, slot)
            block = Block(mem)
            weakref.finalize(block, rt.free, mem)
            _mapped[name] = weakref.ref(block)
            update(refs, slot, mapper=rt.pid)
    return SimTensor(block, record["shape"], record["stride"], int(record["offset"]), dtype)


def release_export(record: dict[str, Any]) -> None:
    """Release an export that will never be mapped (torch's _release_ipc_counter_cuda): down by one, whatever it is."""
    try:
        update(str(record["refs"]), int(record["slot"]), delta=-1)
    except OSError:
        pass  # the exporter is gone; torch ignores this too


def release_if_held(record: dict[str, Any]) -> None:
    """What the sim's transports release with, as hwsync.backend.ipc_counters does over torch's files: release_export only
    while the export's counter is above 0 (its consumer has not unmapped it)."""
    try:
        counter, _ = update(str(record["refs"]), int(record["slot"]))
    except OSError:
        return  # the exporter is gone, and its counters with it
    if counter > 0:
        release_export(record)


def freed(rt: Runtime, mem: Memory) -> None:
    """Runtime.free for shared memory: a consumer releases its export, an exporter frees or parks."""
    if mem.mapping is not None:
        stream = rt.stream(mem.index)
        if threading.current_thread() is not stream.thread:
            if stream.holds_lock():  # run by garbage collection inside the stream's own lock: waiting there never ends
                stream.after_lock(lambda: freed(rt, mem))
                return
            stream.record().synchronize()  # torch syncs the stream before releasing the counter
        refs, slot = mem.mapping
        try:
            update(refs, slot, delta=-1)
        except OSError:
            pass  # the exporter is gone; torch ignores this too
        mem.data = torch.empty(0, dtype=torch.uint8)
        mem.segment.close()
        return
    if _exiting:
        return  # at_exit already let this process's exports go
    with _lock:
        if any(update(name, slot)[0] != 0 for name, slot in mem.sent):  # torch: an unsigned counter above 0
            _limbo.append(mem)
        else:
            _release(rt, mem)
    collect(rt, report=False)


def _release(rt: Runtime, mem: Memory) -> None:
    """Really free an exported block: poison it (consumers still mapping it see that), unlink it."""
    mem.data.fill_(POISON)
    mem.data = torch.empty(0, dtype=torch.uint8)
    mem.segment.close()
    for name, slot in mem.sent:
        if _files[name].give_back(slot):
            _files.pop(name).close()
    mem.sent = []
    rt.account(mem.index, -mem.nbytes)


def collect(rt: Runtime, report: bool = True, parked: bool = False) -> list[str]:
    """Free limbo blocks whose counters reached 0 (torch.cuda.ipc_collect); report leaks once.

    `report`: blocks nothing can free any more (an export never mapped, or mapped by a process
    that exited without closing it); `parked` too: every block still held, whatever the reason.
    """
    from hwsync_sim.tensor import forget_dead_transplants  # tensor builds on this module's runtime only

    forget_dead_transplants()  # memory whose last tensor is gone is freed (or parked) before the limbo is read
    leaks = []
    with _lock:
        for mem in list(_limbo):
            states = [update(name, slot) for name, slot in mem.sent]
            if all(counter == 0 for counter, _ in states):
                _limbo.remove(mem)
                _reported.discard(id(mem))
                _release(rt, mem)
            elif (parked or (report and _stuck(states))) and id(mem) not in _reported:
                _reported.add(id(mem))
                leaks.append(_leak_text(rt, mem, states))
    for text in leaks:
        rt.report_leak(text)
    return leaks


def report_parked(rt: Runtime) -> list[str]:
    """Collect, then report every block still parked (what torch would keep until exit)."""
    return collect(rt, report=True, parked=True)


def _stuck(states: list[tuple[int, int]]) -> bool:
    # one below 0 never comes back; one a process mapped and exited without closing was the exporter's to release.
    # One never mapped is not stuck yet: hwsync releases a failed receiver's exports once its attempt is surely over
    # (hwsync.backend.exports' orphans), so it is reported if still parked at the exporter's exit, or when a test asks
    return any(counter < 0 or (counter > 0 and pid != 0 and not process_alive(pid)) for counter, pid in states)


def _leak_text(rt: Runtime, mem: Memory, states: list[tuple[int, int]]) -> str:
    why = []
    for (counter, pid), (_, slot) in zip(states, mem.sent):
        if counter == 0:
            continue
        if counter < 0:
            why.append(f"export {slot} was released {1 - counter} times (its counter is {counter}, which torch reads "
                       "as unsigned: held until exit)")
        elif pid == 0:
            why.append(f"export {slot} was never mapped")
        elif not process_alive(pid):
            why.append(f"export {slot} was mapped by process {pid}, which exited without closing it")
        else:
            why.append(f"export {slot} is still mapped by process {pid}")
    return (f"sim IPC leak: {mem.nbytes} bytes of {TYPE}:{mem.index} in process {rt.pid} stay held after their "
            f"owner freed them ({'; '.join(why)}). torch parks such a block until every process that mapped "
            "each export closed it, and until exit when none ever does")


def limbo_bytes() -> int:
    """Bytes of this process's blocks waiting in limbo."""
    with _lock:
        return sum(mem.nbytes for mem in _limbo)


def at_exit(rt: Runtime) -> None:
    """Process exit: report what is still parked, then let everything go (the driver frees it all)."""
    global _exiting
    try:
        report_parked(rt)
        with _lock:
            _exiting = True
            for mem in list(_limbo) + list(_exported):
                if mem.segment is not None:
                    mem.segment.close()
            _limbo.clear()
            for counters in _files.values():
                counters.close()
            _files.clear()
    except Exception:  # noqa: BLE001 - never fail an interpreter's exit
        pass
