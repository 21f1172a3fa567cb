"""HCCL process groups and the dtypes HCCL reduces.

The group is torch_npu's ProcessGroupHCCL built directly on a store, as vllm-ascend's stateless
process groups do (`ProcessGroupHCCL(prefix_store, rank, size, ProcessGroupHCCL.Options())`
with `options._timeout` set): no default world is touched, so trainer and engine processes
that already have their own worlds can still form one group. Its options are filled as
torch_npu's own factory fills them (torch_npu/_init/registry/distributed.py): no high-priority
stream, the timeout, the group's global ranks (an hwsync group is a world of its own: 0..size-1)
and a group id, which torch gives each group a unique name for; here rank 0 draws one and
publishes it through the group's store, so every hwsync group in a process has its own.
"""

from __future__ import annotations

import datetime
import importlib
import uuid

import torch
import torch.distributed as dist

from hwsync.communicator import claim_interface_env
from hwsync.nic import Nic
from hwsync_npu.api import HCCL_MODULE, import_torch_npu

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


GROUP_ID_KEY = "hwsync/hccl/group_id"
#: HCCL's host NIC for its rendezvous: an address (wins over the name) and a name ('=' for an exact match)
HCCL_IF_IP = "HCCL_IF_IP"
HCCL_IFNAME = "HCCL_SOCKET_IFNAME"


def hccl_interface(nic: Nic | None) -> str:
    """Point HCCL at `nic` unless the user chose (HCCL_IF_IP or HCCL_SOCKET_IFNAME); how the interface was chosen.

    torch_npu offers no per-group interface, and HCCL reads the variables from the process environment,
    so they are set here, before the group is built, and logged.
    """
    if nic is None:
        return ""
    return claim_interface_env("HCCL", {HCCL_IF_IP: nic.address, HCCL_IFNAME: f"={nic.name}"}, nic,
                               "from the process environment when it builds a communicator")


def hccl_group_id(store: dist.Store, rank: int) -> str:
    """A name for this group, the same on all its ranks and unlike any other group's (rank 0 draws it)."""
    if rank == 0:
        store.set(GROUP_ID_KEY, f"hwsync-{uuid.uuid4().hex}")
    return store.get(GROUP_ID_KEY).decode()  # waits for rank 0, up to the store's timeout


def hccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> object:
    """A ProcessGroupHCCL of its own on `store` (the factory ProcessGroupCommunicator calls)."""
    import_torch_npu()  # registers the HCCL bindings and the npu device
    c10d = importlib.import_module(HCCL_MODULE)
    options = c10d.ProcessGroupHCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    options.global_ranks_in_group = list(range(size))
    options.group_id = hccl_group_id(store, rank)
    group = c10d.ProcessGroupHCCL(store, rank, size, options)
    # torch's Backend method: numbers the group's collectives like groups made by new_group
    if hasattr(group, "_set_sequence_number_for_group"):
        group._set_sequence_number_for_group()
    return group
