"""SyncStats: what one sync moved and where its time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SyncStats:
    """Bytes, counts and seconds per phase of one sync, from one side's point of view.

    pack_s: copying tensors into buffers (sender); wait_s: blocked on the peer; load_s: the
    receiver's load callbacks; plan_s/onload_s/offload_s: the steps around a planned send,
    exactly 0.0 when they did nothing.
    """

    version: int | None = None
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    bucket_bytes: int = 0
    num_buffers: int = 0
    transport: str = ""
    plan_s: float = 0.0
    onload_s: float = 0.0
    pack_s: float = 0.0
    wait_s: float = 0.0
    load_s: float = 0.0
    offload_s: float = 0.0
    total_s: float = 0.0
    #: the receiver's own figures, as it reported them (sender side only)
    peer: dict[str, Any] = field(default_factory=dict)
    #: free-form notes: the plan's reason, the bucket size choice, ...
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Gigabytes (1e9) per second over the whole sync."""
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Flat dict for a trainer's logger (gbps included)."""
        out = asdict(self)
        out["gbps"] = self.gbps
        return out

    def __str__(self) -> str:
        return (f"v{self.version}: {self.bytes / 1e6:.1f} MB in {self.tensors} tensors, {self.buckets} buckets, "
                f"{self.total_s:.3f}s ({self.gbps:.2f} GB/s; pack {self.pack_s:.3f}s, wait {self.wait_s:.3f}s, "
                f"load {self.load_s:.3f}s)")
