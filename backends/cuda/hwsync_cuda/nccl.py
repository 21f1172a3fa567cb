"""NCCL process groups for hwsync's ProcessGroupCommunicator.

`torch.distributed.ProcessGroupNCCL` exists only in CUDA builds of torch, so it is looked up
when a group is built, never at import. NCCL refuses two ranks on one GPU ("Duplicate GPU
detected", an ncclInvalidUsage at the first collective); the factory checks that up front
through the rendezvous store and says what to do instead.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from hwsync.backend import HwsyncError, Nic, claim_interface_env
from hwsync_cuda.device import device_uuid

# What ProcessGroupNCCL reduces natively (ncclInt8/Uint8/Int32/Int64/Float16/Bfloat16/Float32/
# Float64). Float8 reductions and bool are left out: torch rejects or rewrites them.
NCCL_REDUCE_DTYPES = frozenset(
    {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
     torch.float64}
)

_GPU_KEY = "hwsync-cuda/gpu/{rank}"
#: NCCL's interface for its bootstrap and socket transport; a leading '=' matches the name exactly (not as a prefix)
NCCL_IFNAME = "NCCL_SOCKET_IFNAME"


def nccl_interface(nic: Nic | None) -> str:
    """Point NCCL at `nic` unless the user chose (NCCL_SOCKET_IFNAME); how the interface was chosen.

    torch offers no per-group interface for NCCL, and NCCL reads the variable once per process, when it
    starts its first communicator: so it is set here, before the group is built, and logged.
    """
    if nic is None:
        return ""
    return claim_interface_env("NCCL", {NCCL_IFNAME: f"={nic.name}"}, nic,
                               "once per process, at its first communicator")


def nccl_missing_reason() -> str | None:
    """Why NCCL cannot be used by this torch, or None when it can."""
    if not dist.is_available():
        return f"torch {torch.__version__} was built without torch.distributed"
    if getattr(dist, "ProcessGroupNCCL", None) is None or not dist.is_nccl_available():
        return (
            f"torch {torch.__version__} was built without NCCL; install a CUDA build of torch "
            "(e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128)"
        )
    return None


def _refuse_shared_gpu(store: dist.Store, rank: int, world_size: int, uuid: str) -> None:
    # Every rank publishes its GPU and reads all others, so all ranks raise the same error.
    store.set(_GPU_KEY.format(rank=rank), uuid)
    owners: dict[str, list[int]] = {}
    for peer in range(world_size):
        owners.setdefault(store.get(_GPU_KEY.format(rank=peer)).decode(), []).append(peer)
    shared = {gpu: ranks for gpu, ranks in owners.items() if len(ranks) > 1}
    if shared:
        listing = "; ".join(f"ranks {ranks} on {gpu}" for gpu, ranks in sorted(shared.items()))
        raise HwsyncError(
            f"NCCL cannot put two ranks on one GPU ({listing}): NCCL would fail with "
            "'Duplicate GPU detected'. Give each rank its own GPU (torch.cuda.set_device / "
            "CUDA_VISIBLE_DEVICES), or connect same-GPU peers with the cuda_ipc or shm transport."
        )


def nccl_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> object:
    """A ProcessGroupNCCL over `store` for the current CUDA device (the factory ProcessGroupCommunicator calls)."""
    reason = nccl_missing_reason()
    if reason is not None:
        raise HwsyncError(f"cannot build an NCCL group: {reason}")
    _refuse_shared_gpu(store, rank, world_size, device_uuid(torch.cuda.current_device()))
    nccl = dist.ProcessGroupNCCL
    options = nccl.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout  # the only way ProcessGroupNCCL takes a timeout, as in init_process_group
    return nccl(store, rank, world_size, options)
