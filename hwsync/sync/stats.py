"""SyncStats: what one sync moved and where its time went; what its plan, its onload and its delta did."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DeltaStats:
    """What a sync of a sender in delta mode did: full or delta and why, what it sent and what that cost.

    On a receiver only `mode` and `check` are set."""

    #: "delta" (only what changed) or "full"
    mode: str
    #: why: "every receiver holds ... complete", or what made the sync full
    reason: str = ""
    #: the baseline id the delta applied on (None for a full sync)
    base: str | None = None
    #: the share of elements that changed (of the tensors encoded so far; 1.0 where dense won early)
    density: float = 0.0
    #: bytes of payloads the delta sent
    wire_bytes: int = 0
    #: tensors sent in each code: same, dense, block, bitmap, step
    codes: dict[str, int] = field(default_factory=dict)
    #: seconds the sender waited for its encodes
    diff_s: float = 0.0
    #: memory the baseline holds, with the spares
    baseline_bytes: int = 0
    #: host memory the payloads are written into, kept across syncs
    room_bytes: int = 0
    #: memory kept for the next dense copies (the tensors the last dense deltas replaced)
    spare_bytes: int = 0
    #: bytes copied so that the sync owns what the caller may change once send() returns, and the seconds it took
    owned_bytes: int = 0
    owned_s: float = 0.0
    #: a receiver's: how it checked the results ("changed elements", "whole tensors")
    check: str | None = None


@dataclass
class StageStats:
    """A sync that receivers staged: the memory staging held and how long applying it paused the engine."""

    #: receivers that staged the sync (a receiver: 1)
    receivers: int = 0
    #: bytes the staging area holds (the sender: the largest of any receiver's), and what this sync newly allocated
    held_bytes: int = 0
    new_bytes: int = 0
    #: seconds from the offer until staged and checked (a receiver's; the sender: the slowest receiver's)
    stage_s: float = 0.0
    #: seconds the apply took inside the engine's pause (the sender: the longest of any receiver's)
    apply_s: float = 0.0
    #: the sender's seconds from sending Apply until every receiver applied
    commit_s: float = 0.0
    #: seconds the engine's generation was paused for the apply, where an integration paused it (vLLM's
    #: pause_generation to resume_generation)
    pause_s: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StageStats:
        """From a receiver's reported stats (missing figures are 0)."""
        data = data or {}
        return cls(**{k: data[k] for k in ("receivers", "held_bytes", "new_bytes", "stage_s", "apply_s", "commit_s",
                                                    "pause_s")
                      if isinstance(data.get(k), (int, float))})


@dataclass
class PlanStats:
    """What a TrainerModel's plan decided for one sync: what it sends, in which mode, and why."""

    #: the parts sent: "full", "adapters_only", "base_then_adapters", ...
    send: str
    #: the model's mode: "full", "merged_lora", "unmerged_lora"
    mode: str
    reason: str
    #: the engine state the plan was made from (EngineState.to_dict()), or None
    engine: dict[str, Any] | None = None


@dataclass
class OnloadStats:
    """What one onload/offload moved and how long each direction took (seconds)."""

    device: str
    onload_s: float = 0.0
    offload_s: float = 0.0
    tensors_moved: int = 0
    bytes_onloaded: int = 0
    bytes_offloaded: int = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain values for logs."""
        return dict(vars(self))


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
    #: a sender in delta mode: whether this sync was a delta, why, and what it cost (a receiver: how it checked)
    delta: DeltaStats | None = None
    #: receivers that stage: what staging held and how long the apply paused the engine
    stage: StageStats | None = None
    #: a TrainerModel's plan for this sync
    plan: PlanStats | None = None
    #: what onload= moved
    onload: OnloadStats | None = None
    #: why the buckets have the size they have, where hwsync chose it
    bucket_reason: str | None = None
    #: other figures of one path or another (the buffer pool's choice, mapped segments, a collective's share)
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
