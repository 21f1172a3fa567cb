"""How large the sender's buckets are, and how many: what the transport prefers for how receivers take tensors,
or ("auto") what the least free memory of sender and receivers allows."""

from __future__ import annotations

import logging

from hwsync.colocated.peers import Peer
from hwsync.interfaces import Device, Transport
from hwsync.memory import MemoryReport, choose_bucket_bytes, local_memory
from hwsync.stats import SyncStats

log = logging.getLogger("hwsync")


def bucket_geometry(transport: Transport, device: Device, peers: list[Peer], stats: SyncStats, bucket_bytes: int,
                    num_buffers: int, *, default: bool, auto: bool) -> tuple[int, int]:
    """(bucket bytes, buffers) for these receivers; `default`: neither was given, `auto`: size from memory."""
    geometry = transport.into_geometry
    if default:  # decided afresh whenever buffers are opened: receivers may have changed
        if geometry and all(p.into for p in peers):
            bucket_bytes, num_buffers = geometry
            stats.notes["bucket"] = (f"{geometry[0] >> 20} MiB x {geometry[1]} buffers: every receiver copies "
                                     f"into its own tensors, the {transport.name} transport's geometry for that")
        else:
            bucket_bytes, num_buffers = transport.default_bucket_bytes, 2
        stats.num_buffers = num_buffers
    if not auto:
        return bucket_bytes, num_buffers
    rows = [local_memory(device, rank=0)] + [
        {**p.state["memory"], "rank": i + 1} for i, p in enumerate(peers) if "memory" in p.state]
    choice = choose_bucket_bytes(MemoryReport.from_rows(device.torch_type, rows), num_buffers)
    stats.notes["bucket"] = choice.reason
    log.info("hwsync bucket size: %s", choice.reason)
    return choice.bucket_bytes, num_buffers
