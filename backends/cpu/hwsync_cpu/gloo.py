"""gloo process groups, on the interface hwsync chose for each group, and the dtypes gloo reduces."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from hwsync.backend import GroupFactory, Nic

log = logging.getLogger("hwsync")

# gloo reduces these; anything else fails inside C++ with a less helpful message.
GLOO_REDUCE_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
     torch.int32, torch.int64}
)
#: gloo's own variable: a process-wide interface (or a comma-separated list of them)
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> object:
    """A ProcessGroupGloo of its own on `store`, on gloo's default device (GLOO_SOCKET_IFNAME, or the hostname's)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def gloo_factory(nic: Nic | None) -> tuple[GroupFactory, str]:
    """The group factory for `nic`, and how the interface was chosen (for the group's log line).

    gloo takes a device per group (torch's ProcessGroupGloo options), so no variable is touched: the
    group binds `nic`'s address. A GLOO_SOCKET_IFNAME the user set wins (it is theirs to choose).
    """
    if nic is None:
        return gloo_group, ""
    theirs = os.environ.get(GLOO_IFNAME)
    if theirs:
        if nic.name not in theirs.split(","):
            log.warning("hwsync: %s=%s (set by the user) is kept for a gloo group, though the route to its peers goes "
                        "through %s; unset it to let hwsync choose", GLOO_IFNAME, theirs, nic)
        return gloo_group, f"{GLOO_IFNAME}={theirs} set by the user, kept"

    def on_nic(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> object:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=nic.address)]
        return dist.ProcessGroupGloo(store, rank, size, options)

    return on_nic, f"gloo device bound to {nic.address} for this group"
