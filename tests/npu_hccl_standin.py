"""Stand-ins for HCCL where no NPU is: libhccl.so's C functions, and torch_npu's ProcessGroupHCCL with its peer logic.

`StandInHccl` is a library object whose functions are C function pointers (ctypes callbacks) with the
prototypes of CANN's hccl.h, so hwsync_npu.hccl calls them through the same ctypes conversions as the
real libhccl.so. Its communicators are formed by root info, as HCCL's: rank 0 draws one, every rank
joins with it, and the members of a communicator are exactly those that joined with one root info.
Collectives meet per communicator (threads of this process standing for the ranks) and move bytes
between the ranks' buffers (host memory standing for NPU memory).

`StandInProcessGroupHCCL` ports the branch logic torch_npu 2.10.0.post4's ProcessGroupHCCL uses to pick
its communicator's peers (ProcessGroupHCCL.cpp: the constructor sets the process-wide `global_` for a
group whose options list no global ranks; at its first collective `createHCCLCommEx` takes the ranktable
path when RANK_TABLE_FILE names a readable file, `createHCCLCommOrigin` the sub-communicator path when
ROOTINFO_SUBCOMM_ENABLE=1, and `createHCCLCommSub` derives the communicator from `global_`'s world over
the listed global ranks; else root info through the group's store). A communicator derived from the
process's own world has that world's peers, not the group's: the stand-in says so, naming them, where
HCCL would hang or move the wrong bytes.
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from typing import Any

from hwsync_npu import hccl

HCCL_E_PARA, HCCL_E_TIMEOUT = 1, 9


class _Comm:
    def __init__(self, size: int, buffer_mb: int | None) -> None:
        self.size, self.buffer_mb = size, buffer_mb
        self.ranks: dict[int, int] = {}  # handle -> rank
        self.joined = threading.Barrier(size)
        self.meet = threading.Barrier(size)
        self.lock = threading.Lock()
        self.posted: dict[int, tuple] = {}


class StandInHccl:
    """libhccl.so as hwsync_npu.hccl.HcclLibrary finds it: attributes that are C function pointers."""

    def __init__(self, capability: int = 12, timeout_s: float = 30.0) -> None:
        self.capability, self.timeout_s = capability, timeout_s
        self._by_root: dict[bytes, _Comm] = {}
        self._by_handle: dict[int, _Comm] = {}
        self._lock = threading.Lock()
        self._next = 0x1000
        #: what was called, in order: (function, rank or None)
        self.calls: list[tuple[str, int | None]] = []
        self._callbacks: list[Any] = []  # kept alive: ctypes frees a callback with its last reference
        for name, (result, args) in getattr(hccl, "PROTOTYPES", {}).items():
            callback = ctypes.CFUNCTYPE(result, *args)(getattr(self, "_" + name))
            self._callbacks.append(callback)
            setattr(self, name, callback)

    def comms(self) -> list[_Comm]:
        """The communicators formed so far."""
        return list(self._by_root.values())

    # -- the C functions ------------------------------------------------------------------------------

    def _HcclGetErrorString(self, code: int) -> bytes:
        return {HCCL_E_PARA: b"parameter error", HCCL_E_TIMEOUT: b"timeout"}.get(code, b"error")

    def _HcclGetRootInfo(self, root: Any) -> int:
        token = f"root-{uuid.uuid4().hex}".encode()
        ctypes.memmove(ctypes.addressof(root.contents), token, len(token))
        self.calls.append(("HcclGetRootInfo", None))
        return 0

    def _join(self, size: int, root: Any, rank: int, buffer_mb: int | None, out: Any) -> int:
        key = bytes(root.contents.internal).rstrip(b"\0")
        with self._lock:
            comm = self._by_root.setdefault(key, _Comm(size, buffer_mb))
            if comm.size != size or not 0 <= rank < size:
                return HCCL_E_PARA
            self._next += 0x10
            handle = self._next
            comm.ranks[handle] = rank
            self._by_handle[handle] = comm
        try:
            comm.joined.wait(self.timeout_s)  # HcclCommInitRootInfo returns once every rank joined
        except threading.BrokenBarrierError:
            return HCCL_E_TIMEOUT
        out.contents.value = handle
        return 0

    def _HcclCommInitRootInfo(self, size: int, root: Any, rank: int, out: Any) -> int:
        self.calls.append(("HcclCommInitRootInfo", rank))
        return self._join(size, root, rank, None, out)

    def _HcclCommInitRootInfoConfig(self, size: int, root: Any, rank: int, config: Any, out: Any) -> int:
        self.calls.append(("HcclCommInitRootInfoConfig", rank))
        c = config.contents
        if c.magic_word != hccl.CONFIG_MAGIC_WORD or c.size < ctypes.sizeof(hccl.CommConfig) or c.version < 1:
            return HCCL_E_PARA  # HCCL reads a config only by its declared size and version
        return self._join(size, root, rank, int(c.buffer_size_mb), out)

    def _HcclGetCommConfigCapability(self) -> int:
        return self.capability

    def _collective(self, comm_handle: int, post: tuple, act: Any) -> int:
        comm = self._by_handle.get(comm_handle)
        if comm is None:
            return HCCL_E_PARA
        rank = comm.ranks[comm_handle]
        with comm.lock:
            comm.posted[rank] = post
        try:
            comm.meet.wait(self.timeout_s)  # every rank's buffers are posted
            act(comm, rank)
            comm.meet.wait(self.timeout_s)  # every rank's bytes have arrived before anyone reuses a buffer
        except threading.BrokenBarrierError:
            return HCCL_E_TIMEOUT
        return 0

    def _HcclBroadcast(self, buf: int, count: int, dtype: int, root: int, comm: int, stream: int) -> int:
        self.calls.append(("HcclBroadcast", None))
        size = _itemsize(dtype) * count

        def act(c: _Comm, rank: int) -> None:
            if rank != root:
                ctypes.memmove(buf, c.posted[root][0], size)

        return self._collective(comm, (buf, size), act)

    def _HcclAllGather(self, send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> int:
        self.calls.append(("HcclAllGather", None))
        size = _itemsize(dtype) * count

        def act(c: _Comm, rank: int) -> None:
            for peer in range(c.size):
                ctypes.memmove(recv + peer * size, c.posted[peer][0], size)

        return self._collective(comm, (send, size), act)

    def _HcclAllReduce(self, send: int, recv: int, count: int, dtype: int, op: int, comm: int,
                       stream: int) -> int:
        self.calls.append(("HcclAllReduce", None))
        import torch

        torch_dtype = {v: k for k, v in hccl.DATA_TYPES.items()}[dtype]
        size = torch_dtype.itemsize * count

        def act(c: _Comm, rank: int) -> None:
            values = [torch.frombuffer((ctypes.c_byte * size).from_address(c.posted[p][0]), dtype=torch_dtype).clone()
                      for p in range(c.size)]
            stacked = torch.stack(values)
            out = {0: stacked.sum(0), 2: stacked.max(0).values, 3: stacked.min(0).values}[op].to(torch_dtype)
            ctypes.memmove(recv, out.data_ptr(), size)

        return self._collective(comm, (send, size), act)

    def _HcclCommDestroy(self, comm: int) -> int:
        self.calls.append(("HcclCommDestroy", None))
        return 0 if self._by_handle.pop(comm, None) is not None else HCCL_E_PARA


def _itemsize(dtype: int) -> int:

    return {v: k for k, v in hccl.DATA_TYPES.items()}[dtype].itemsize


# --- torch_npu's ProcessGroupHCCL, as far as whom its communicator connects ---------------------------------

class Options:
    """ProcessGroupHCCL.Options: attributes the caller sets."""

    def __init__(self) -> None:
        self.global_ranks_in_group: list[int] = []
        self.group_id = ""
        self.is_high_priority_stream = False
        self._timeout = None


class WrongPeers(RuntimeError):
    """A communicator whose peers are not the group's (HCCL would hang or move another group's bytes)."""


class StandInProcessGroupHCCL:
    """ProcessGroupHCCL's choice of peers, ported: `peers()` is what its first collective's communicator joins."""

    Options = Options
    global_: StandInProcessGroupHCCL | None = None  # the process's default world (ProcessGroupHCCL::global_)
    built: list[StandInProcessGroupHCCL] = []

    def __init__(self, store: Any, rank: int, size: int, options: Options, world: str = "") -> None:
        self.store, self.rank, self.size, self.options = store, rank, size, options
        self.world = world  # a name for the world this group is, when it is a default world
        if not options.global_ranks_in_group:  # ProcessGroupHCCL.cpp: `global_ = this`
            StandInProcessGroupHCCL.global_ = self
        StandInProcessGroupHCCL.built.append(self)

    def peers(self) -> str:
        """createHCCLComm: createHCCLCommEx, else createHCCLCommOrigin; who the communicator connects."""
        listed = self.options.global_ranks_in_group
        ranktable = os.environ.get("RANK_TABLE_FILE", "")
        if ranktable and os.access(ranktable, os.R_OK):  # createHCCLCommEx
            if not listed:
                return f"the ranktable's world ({ranktable})"  # createGlobalHcclComm(ranktable, rank)
            derived = self._sub()
            if derived is not None:
                return derived
        if os.environ.get("ROOTINFO_SUBCOMM_ENABLE") == "1" and listed:  # IsSubCommRootInfoEnable
            derived = self._sub()
            if derived is not None:
                return derived
        return f"its own group {self.options.group_id!r} (root info through its store)"

    def _sub(self) -> str | None:
        """createHCCLCommSub: a sub-communicator of global_'s world over the listed ranks, if there is a global_."""
        world = StandInProcessGroupHCCL.global_
        if world is None or world is self:
            return None  # "The global process group is not exist, switch to original interface."
        return f"ranks {self.options.global_ranks_in_group} of the process's own world {world.world!r}"

    def broadcast(self, tensors: list, opts: Any) -> Any:
        """The first collective: it runs only on a communicator of the group's own peers."""
        found = self.peers()
        if not found.startswith("its own group"):
            raise WrongPeers(f"ProcessGroupHCCL {self.options.group_id!r} connected {found}, not its own peers")
        raise NotImplementedError("the stand-in ProcessGroupHCCL models only whom it connects")
