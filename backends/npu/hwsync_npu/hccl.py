"""HCCL communicators for hwsync's groups, made directly from HCCL's C API, and the dtypes HCCL reduces.

Why not torch_npu's ProcessGroupHCCL: which peers its communicator joins depends on process-wide
settings hwsync does not own (read from torch_npu 2.10.0.post4's ProcessGroupHCCL.cpp,
`createHCCLCommEx` / `createHCCLCommOrigin`). When RANK_TABLE_FILE names a readable file, or
ROOTINFO_SUBCOMM_ENABLE=1, a group whose options list global ranks is derived as a sub-communicator
of the process's own default HCCL world (the trainer's or vLLM's) over those ranks, not of hwsync's
peers, and a group that lists none becomes that world's global group. Both variables are common on
Ascend clusters and belong to the trainer's or the engine's own world, so hwsync can neither rely on
them being unset nor unset them. So hwsync does what vllm-ascend (PyHcclCommunicator), verl and
checkpoint-engine do: rank 0 asks HCCL for a root info (`HcclGetRootInfo`), publishes it through the
group's own store, and every rank joins with `HcclCommInitRootInfoConfig(size, root, rank, config)`;
that call reads neither variable, so the communicator holds exactly hwsync's peers everywhere.

The config sets the communicator's HCCL buffer (`HWSYNC_HCCL_BUFFSIZE_MB`, default 64 MB): HCCL
otherwise takes HCCL_BUFFSIZE or 200 MB per communicator, on engine NPUs and outside vLLM's memory
budget. Collectives run on the calling thread's current NPU stream, so later work on it is ordered
after them, as ProcessGroupCommunicator expects of a Work's wait(). libhccl.so is reached through
ctypes (CANN's set_env.sh puts it on LD_LIBRARY_PATH; torch_npu has loaded it already); every call's
prototype is declared once, in `PROTOTYPES`. Unverified on an NPU (none here): the calls run against
a stand-in library in tests/test_npu_hccl_groups.py, through the same ctypes prototypes.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from hwsync.backend import HwsyncError, Nic, claim_interface_env
from hwsync_npu.api import import_torch_npu

log = logging.getLogger("hwsync")

# HcclAllReduce's dataType, per the CANN HCCL API reference (hcclcpp_07_0020, CANN 8.5.0):
# - Atlas A2 / A3 training: int8, int16, int32, int64, float16, float32, bfp16
# - Atlas training (910A/910 Pro): int8, int32, int64, float16, float32
# - Atlas 300I Duo (310P): int8, int16, int32, float16, float32
# sum/max/min accept each listed type (only "prod" has further exclusions, which hwsync never uses).
HCCL_REDUCE_DTYPES_A2_A3 = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16}
)
HCCL_REDUCE_DTYPES_TRAINING = frozenset({torch.int8, torch.int32, torch.int64, torch.float16, torch.float32})
HCCL_REDUCE_DTYPES_310P = frozenset({torch.int8, torch.int16, torch.int32, torch.float16, torch.float32})
#: what every Ascend product reduces: used when the chip cannot be named
HCCL_REDUCE_DTYPES_ANY = HCCL_REDUCE_DTYPES_A2_A3 & HCCL_REDUCE_DTYPES_TRAINING & HCCL_REDUCE_DTYPES_310P


def hccl_reduce_dtypes(soc_name: str | None) -> frozenset[torch.dtype]:
    """The dtypes HCCL reduces on the chip `soc_name` (torch_npu.npu.get_device_name())."""
    name = (soc_name or "").strip().lower()
    # A2 reports "Ascend910B1".."Ascend910B4-1", A3 "Ascend910_93xx", both 910B-class silicon.
    if name.startswith("ascend910b") or name.startswith("ascend910_93"):
        return HCCL_REDUCE_DTYPES_A2_A3
    if name.startswith("ascend310p"):
        return HCCL_REDUCE_DTYPES_310P
    if name.startswith("ascend910"):  # Ascend910A, Ascend910ProA/B, Ascend910PremiumA: Atlas training
        return HCCL_REDUCE_DTYPES_TRAINING
    return HCCL_REDUCE_DTYPES_ANY


#: HCCL's host NIC for its rendezvous: an address (wins over the name) and a name ('=' for an exact match)
HCCL_IF_IP = "HCCL_IF_IP"
HCCL_IFNAME = "HCCL_SOCKET_IFNAME"
#: the process-wide settings that steer torch_npu's ProcessGroupHCCL to other peers, and which do not apply here
RANKTABLE_ENVS = ("RANK_TABLE_FILE", "ROOTINFO_SUBCOMM_ENABLE")


def hccl_interface(nic: Nic | None) -> str:
    """Point HCCL at `nic` unless the user chose (HCCL_IF_IP or HCCL_SOCKET_IFNAME); how the interface was chosen.

    HCCL offers no per-communicator interface and reads the variables from the process environment, so they are
    set here, before the communicator is made, and logged.
    """
    if nic is None:
        return ""
    return claim_interface_env("HCCL", {HCCL_IF_IP: nic.address, HCCL_IFNAME: f"={nic.name}"}, nic,
                               "from the process environment when it builds a communicator")


# --- HCCL's C API -----------------------------------------------------------------------------------

LIBRARY = "libhccl.so"
ROOT_INFO_KEY = "hwsync/hccl/root_info"
ROOT_INFO_BYTES = 4108  # HCCL_ROOT_INFO_BYTES
BUFFSIZE_ENV = "HWSYNC_HCCL_BUFFSIZE_MB"
DEFAULT_BUFFSIZE_MB = 64
HCCL_DEFAULT_BUFFSIZE_MB = 200  # HCCL_COMM_DEFAULT_BUFFSIZE: what a communicator takes when nobody says
HCCL_SUCCESS = 0
CONFIG_MAGIC_WORD = 0xF0F0F0F0  # HCCL_COMM_CONFIG_MAGIC_WORD
CONFIG_BUFFER_SIZE = 0  # HcclCommConfigCapability: HCCL_COMM_CONFIG_BUFFER_SIZE


class RootInfo(ctypes.Structure):
    """HcclRootInfo: the rendezvous token rank 0 draws and every rank joins with."""

    _fields_ = [("internal", ctypes.c_char * ROOT_INFO_BYTES)]


class CommConfig(ctypes.Structure):
    """HcclCommConfig as its first version laid it out (size, magic word, version, then the buffer size and
    determinism): HCCL reads a config up to the size and version it declares, and later versions only append."""

    _fields_ = [("size", ctypes.c_size_t), ("magic_word", ctypes.c_uint32), ("version", ctypes.c_uint32),
                ("reserved", ctypes.c_uint64), ("buffer_size_mb", ctypes.c_uint32),
                ("deterministic", ctypes.c_uint32)]

    @classmethod
    def with_buffer(cls, buffer_mb: int) -> CommConfig:
        """A version-1 config whose only setting is the buffer size (determinism off, HCCL's default)."""
        return cls(size=ctypes.sizeof(cls), magic_word=CONFIG_MAGIC_WORD, version=1, reserved=0,
                   buffer_size_mb=buffer_mb, deterministic=0)


_P = ctypes.c_void_p
_RESULT = ctypes.c_int
#: every HCCL function hwsync calls: (result type, argument types), from CANN's hccl.h
PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "HcclGetErrorString": (ctypes.c_char_p, (_RESULT,)),
    "HcclGetRootInfo": (_RESULT, (ctypes.POINTER(RootInfo),)),
    # HcclCommInitRootInfo(uint32 nRanks, const HcclRootInfo*, uint32 rank, HcclComm*)
    "HcclCommInitRootInfo": (_RESULT, (ctypes.c_uint32, ctypes.POINTER(RootInfo), ctypes.c_uint32,
                                       ctypes.POINTER(_P))),
    # HcclCommInitRootInfoConfig(uint32 nRanks, const HcclRootInfo*, uint32 rank, const HcclCommConfig*, HcclComm*)
    "HcclCommInitRootInfoConfig": (_RESULT, (ctypes.c_uint32, ctypes.POINTER(RootInfo), ctypes.c_uint32,
                                             ctypes.POINTER(CommConfig), ctypes.POINTER(_P))),
    "HcclGetCommConfigCapability": (ctypes.c_uint32, ()),
    # HcclBroadcast(void* buf, uint64 count, HcclDataType, uint32 root, HcclComm, aclrtStream)
    "HcclBroadcast": (_RESULT, (_P, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint32, _P, _P)),
    # HcclAllGather(void* send, void* recv, uint64 sendCount, HcclDataType, HcclComm, aclrtStream)
    "HcclAllGather": (_RESULT, (_P, _P, ctypes.c_uint64, ctypes.c_int, _P, _P)),
    # HcclAllReduce(void* send, void* recv, uint64 count, HcclDataType, HcclReduceOp, HcclComm, aclrtStream)
    "HcclAllReduce": (_RESULT, (_P, _P, ctypes.c_uint64, ctypes.c_int, ctypes.c_int, _P, _P)),
    "HcclCommDestroy": (_RESULT, (_P,)),
}
#: HcclDataType of the dtypes hwsync moves (bytes) or reduces
DATA_TYPES = {torch.int8: 0, torch.int16: 1, torch.int32: 2, torch.float16: 3, torch.float32: 4, torch.int64: 5,
              torch.uint8: 7, torch.bfloat16: 11}
#: HcclReduceOp of torch's reduce ops (compared with ==: a ReduceOp and its RedOpType are equal, not one hash)
REDUCE_OPS = {dist.ReduceOp.SUM: 0, dist.ReduceOp.MAX: 2, dist.ReduceOp.MIN: 3}


class HcclLibrary:
    """libhccl.so's functions, each called through its declared prototype."""

    def __init__(self, library: Any) -> None:
        self._functions: dict[str, Any] = {}
        for name, (result, args) in PROTOTYPES.items():
            symbol = getattr(library, name, None)
            address = None if symbol is None else ctypes.cast(symbol, ctypes.c_void_p).value
            if address is None:
                continue  # optional ones (the config calls on an old CANN) are checked where used
            self._functions[name] = ctypes.CFUNCTYPE(result, *args)(address)

    @classmethod
    def load(cls) -> HcclLibrary:
        """The process's libhccl.so (CANN's set_env.sh puts it on LD_LIBRARY_PATH)."""
        try:
            return cls(ctypes.CDLL(LIBRARY))
        except OSError as exc:
            raise HwsyncError(f"hwsync's HCCL groups need CANN's {LIBRARY} ({exc}); `source "
                              "/usr/local/Ascend/ascend-toolkit/set_env.sh` before starting Python") from exc

    def has(self, name: str) -> bool:
        """Whether this HCCL exports `name`."""
        return name in self._functions

    def call(self, name: str, *args: Any) -> None:
        """Call an HCCL function; a result other than success raises with HCCL's own words."""
        if name not in self._functions:
            raise HwsyncError(f"this CANN's {LIBRARY} has no {name}; use a CANN that vllm-ascend supports")
        code = int(self._functions[name](*args))
        if code != HCCL_SUCCESS:
            words = self._functions["HcclGetErrorString"](code) if "HcclGetErrorString" in self._functions else None
            raise HwsyncError(f"{name} failed: HCCL error {code}"
                              f"{' (' + words.decode(errors='replace') + ')' if words else ''}")

    def root_info(self) -> bytes:
        """A fresh root info (rank 0 draws it)."""
        root = RootInfo()
        self.call("HcclGetRootInfo", ctypes.byref(root))
        return ctypes.string_at(ctypes.addressof(root), ROOT_INFO_BYTES)

    def buffer_configurable(self) -> bool:
        """Whether this HCCL takes a per-communicator buffer size."""
        if not (self.has("HcclCommInitRootInfoConfig") and self.has("HcclGetCommConfigCapability")):
            return False
        return int(self._functions["HcclGetCommConfigCapability"]()) > CONFIG_BUFFER_SIZE

    def join(self, size: int, root: bytes, rank: int, buffer_mb: int | None) -> int:
        """Rank `rank`'s handle of the communicator of `size` ranks that `root` names (buffer_mb: None for HCCL's)."""
        info = RootInfo.from_buffer_copy(root)
        comm = ctypes.c_void_p()
        if buffer_mb is None:
            self.call("HcclCommInitRootInfo", size, ctypes.byref(info), rank, ctypes.byref(comm))
        else:
            config = CommConfig.with_buffer(buffer_mb)
            self.call("HcclCommInitRootInfoConfig", size, ctypes.byref(info), rank, ctypes.byref(config),
                      ctypes.byref(comm))
        if not comm.value:
            raise HwsyncError("HCCL returned no communicator")
        return int(comm.value)


def hccl_buffer_mb(environ: dict[str, str] | Any = None) -> int:
    """The HCCL buffer each hwsync communicator asks for, in MB (HWSYNC_HCCL_BUFFSIZE_MB, default 64)."""
    raw = (os.environ if environ is None else environ).get(BUFFSIZE_ENV, "")
    if not raw.strip():
        return DEFAULT_BUFFSIZE_MB
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{BUFFSIZE_ENV}={raw!r}: give a whole number of megabytes, at least 1")
    return int(raw)


class HcclWork:
    """A collective queued on the current stream: later work on that stream runs after it."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self) -> bool:
        """Nothing to wait for on the host: the collective is ordered on the stream that queued it."""
        return True

    def is_completed(self) -> bool:
        """Whether the NPU has run it."""
        return bool(self._event.query())


class HcclGroup:
    """One HCCL communicator among an hwsync group's ranks, with the calls ProcessGroupCommunicator makes."""

    def __init__(self, library: HcclLibrary, comm: int, rank: int, size: int, buffer_mb: int | None,
                 torch_npu: Any) -> None:
        self.library, self._comm, self.rank, self.size = library, comm, rank, size
        #: the HCCL buffer of this communicator in MB (None: HCCL's own, HCCL_BUFFSIZE or 200 MB)
        self.buffer_mb = buffer_mb
        self._npu = torch_npu.npu

    def _stream(self) -> int:
        return int(self._npu.current_stream().npu_stream)

    def _queued(self) -> HcclWork:
        event = self._npu.Event()
        event.record(self._npu.current_stream())
        return HcclWork(event)

    def _comm_handle(self) -> int:
        if not self._comm:
            raise HwsyncError("the HCCL communicator was destroyed; build a new group")
        return self._comm

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> HcclWork:
        """HcclBroadcast of the one (byte) tensor from opts.rootRank."""
        (flat,) = tensors
        self.library.call("HcclBroadcast", flat.data_ptr(), flat.numel(), _data_type(flat), int(opts.rootRank),
                          self._comm_handle(), self._stream())
        return self._queued()

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> HcclWork:
        """HcclAllGather into one buffer, then each rank's part into its output tensor (device copies)."""
        (flat,), (outs,) = inputs, outputs
        gathered = torch.empty(flat.numel() * self.size, dtype=flat.dtype, device=flat.device)
        self.library.call("HcclAllGather", flat.data_ptr(), gathered.data_ptr(), flat.numel(), _data_type(flat),
                          self._comm_handle(), self._stream())
        for i, out in enumerate(outs):
            out.copy_(gathered[i * flat.numel():(i + 1) * flat.numel()])
        return self._queued()

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> HcclWork:
        """HcclAllReduce of the one tensor, written back in place."""
        (tensor,) = tensors
        op = next((code for reduce_op, code in REDUCE_OPS.items() if opts.reduceOp == reduce_op), None)
        if op is None:
            raise HwsyncError(f"HCCL groups of hwsync reduce by sum, max or min, not {opts.reduceOp}")
        out = torch.empty_like(tensor)
        self.library.call("HcclAllReduce", tensor.data_ptr(), out.data_ptr(), tensor.numel(), _data_type(tensor),
                          op, self._comm_handle(), self._stream())
        tensor.copy_(out)
        return self._queued()

    def shutdown(self) -> None:
        """HcclCommDestroy (once)."""
        comm, self._comm = self._comm, 0
        if comm:
            self.library.call("HcclCommDestroy", comm)

    def abort(self) -> None:
        """HCCL has no abort this side of HcclCommDestroy: destroy it."""
        self.shutdown()


def _data_type(tensor: torch.Tensor) -> int:
    if tensor.dtype not in DATA_TYPES:
        raise HwsyncError(f"hwsync's HCCL groups move bytes and reduce {sorted(map(str, DATA_TYPES))}, "
                          f"not {tensor.dtype}")
    return DATA_TYPES[tensor.dtype]


def hccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> HcclGroup:
    """An HCCL communicator of hwsync's own `size` ranks (the factory ProcessGroupCommunicator calls): rank 0
    draws the root info and publishes it through `store`; every rank joins on its current NPU. The wait for rank
    0's root info is the store's (`timeout`); joining is bounded by HCCL's own HCCL_CONNECT_TIMEOUT."""
    torch_npu = import_torch_npu()
    library = HcclLibrary.load()
    if rank == 0:
        store.set(ROOT_INFO_KEY, library.root_info())  # type: ignore[arg-type]  # a Store takes bytes too
    root = store.get(ROOT_INFO_KEY)  # waits for rank 0, up to the store's timeout
    buffer_mb = hccl_buffer_mb() if library.buffer_configurable() else None
    comm = library.join(size, root, rank, buffer_mb)
    ignored = [f"{name}={os.environ[name]}" for name in RANKTABLE_ENVS if os.environ.get(name)]
    log.info("hwsync: HCCL communicator of %d ranks (rank %d) made from a root info%s; HCCL buffer %s", size, rank,
             "" if not ignored else f" ({', '.join(ignored)} apply to torch_npu's groups, not this one)",
             f"{buffer_mb} MB ({BUFFSIZE_ENV})" if buffer_mb is not None else
             f"HCCL's own (HCCL_BUFFSIZE or {HCCL_DEFAULT_BUFFSIZE_MB} MB: this CANN takes no per-communicator size)")
    return HcclGroup(library, comm, rank, size, buffer_mb, torch_npu)


def buffer_note() -> str:
    """What `hwsync info` says of the HCCL buffer each hwsync communicator takes (without loading HCCL)."""
    try:
        mb = hccl_buffer_mb()
    except ValueError as exc:
        return str(exc)
    return (f"{mb} MB per hwsync HCCL communicator ({BUFFSIZE_ENV}; a CANN without per-communicator configs "
            f"gives HCCL_BUFFSIZE or {HCCL_DEFAULT_BUFFSIZE_MB} MB)")
