"""Device memory across ranks: gather it, say which ranks are out of line, size buckets from it.

- every figure comes from the backend's Device: free is the driver's own query
  (`mem_get_info`), never total minus allocated, so memory held by other processes counts;
- an imbalance is a warning or an error that names the ranks and their numbers, never a silent
  abort and never something a user has to disable with an environment variable;
- the reference for "out of line" is the median across ranks, so one odd rank is named instead
  of every other rank, in either direction;
- bucket size can follow the smallest free memory of any rank: tensors are split across
  buckets, so the largest tensor does not matter.

On the cpu backend, free is the host's MemAvailable, shared by every rank on the host; compare
`allocated` (each process's resident memory) there to see per-rank differences.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from hwsync.backend.interfaces import Communicator, Device
from hwsync.errors import HwsyncError, MemoryImbalanceError
from hwsync.sizes import DEFAULT_NUM_BUFFERS, GiB, MiB

log = logging.getLogger("hwsync")

Field = Literal["free", "total", "allocated", "reserved"]
FIELDS: tuple[Field, ...] = ("free", "total", "allocated", "reserved")

CAUSES = (
    "Usual causes: ranks that loaded the model at different times, parameters offloaded on some "
    "ranks only, or another process on the same device (check nvidia-smi / npu-smi)."
)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class RankMemory:
    """One rank's device memory in bytes."""

    rank: int
    free: int
    total: int
    allocated: int
    reserved: int

    def get(self, field: Field) -> int:
        """One figure by name."""
        if field not in FIELDS:
            raise ValueError(f"memory field {field!r} is not one of {FIELDS}")
        return int(getattr(self, field))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankMemory:
        """From to_dict() output (e.g. a receiver's report)."""
        return cls(**{k: int(data[k]) for k in ("rank", *FIELDS)})


@dataclass(frozen=True)
class MemoryReport:
    """Every rank's device memory, in rank order."""

    device_type: str
    ranks: tuple[RankMemory, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a memory report needs at least one rank")

    def values(self, field: Field = "free") -> list[int]:
        """One figure for every rank, in rank order."""
        return [r.get(field) for r in self.ranks]

    @property
    def min_free(self) -> RankMemory:
        """The rank with the least free memory."""
        return min(self.ranks, key=lambda r: r.free)

    def table(self) -> str:
        """A fixed-width table, one line per rank, in GiB."""
        lines = [f"{'rank':>5} {'free':>10} {'total':>10} {'allocated':>10} {'reserved':>10}   "
                 f"({self.device_type}, GiB)"]
        for r in self.ranks:
            lines.append(f"{r.rank:>5} " + " ".join(f"{r.get(f) / GiB:>10.2f}" for f in FIELDS))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (msgpack/JSON-safe)."""
        return {"device_type": self.device_type, "ranks": [asdict(r) for r in self.ranks]}

    @classmethod
    def from_rows(cls, device_type: str, rows: Iterable[RankMemory | Mapping[str, Any]]) -> MemoryReport:
        """Join rows gathered some other way (e.g. receivers' reported local_memory), renumbered 0..n-1."""
        out = []
        for i, row in enumerate(rows):
            values = asdict(row) if isinstance(row, RankMemory) else dict(row)
            out.append(RankMemory.from_dict({**values, "rank": i}))
        return cls(device_type, tuple(out))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        """From to_dict() output."""
        return cls(data["device_type"], tuple(RankMemory.from_dict(r) for r in data["ranks"]))


def local_memory(device: Device, rank: int = 0, index: int | None = None) -> RankMemory:
    """This process's view of its device, without any communication."""
    free, total = device.mem_get_info(index)
    return RankMemory(rank, int(free), int(total), int(device.memory_allocated(index)),
                      int(device.memory_reserved(index)))


def memory_report(communicator: Communicator | None, device: Device | None = None,
                  index: int | None = None) -> MemoryReport:
    """Gather every rank's memory (a collective: all ranks call it); one rank if communicator is None."""
    if device is None:
        from hwsync.backend.registry import get_backend  # lazy: only when the caller gave no Device

        device = get_backend().device()
    if communicator is None:
        return MemoryReport(device.torch_type, (local_memory(device, 0, index),))
    mine = local_memory(device, communicator.rank, index)
    # NCCL/HCCL need the tensor on the device; a ProcessGroupCommunicator knows which one.
    where = getattr(communicator, "device", None) or device.torch_device(index)
    row = torch.tensor([mine.get(f) for f in FIELDS], dtype=torch.int64, device=where)
    gathered = communicator.all_gather(row)
    ranks = tuple(RankMemory(rank, *(int(v) for v in t.cpu().tolist())) for rank, t in enumerate(gathered))
    return MemoryReport(device.torch_type, ranks)


@dataclass(frozen=True)
class Outlier:
    """A rank whose figure is outside the tolerance of the median."""

    rank: int
    value: int
    deviation: int  # value minus the median, bytes


@dataclass(frozen=True)
class BalanceResult:
    """The outcome of check_balance: which ranks are out of line, and a sentence saying so."""

    balanced: bool
    field: str
    median: int
    threshold: int
    outliers: tuple[Outlier, ...]
    message: str

    def to_dict(self) -> dict[str, Any]:
        """Plain values for logs."""
        return asdict(self)


def check_balance(
    report: MemoryReport,
    tolerance: float = 0.10,
    mode: Literal["warn", "raise"] = "warn",
    *,
    field: Field = "free",
    min_gap_bytes: int = 256 * MiB,
) -> BalanceResult:
    """Name the ranks whose `field` differs from the median by more than tolerance×median (and min_gap_bytes)."""
    if mode not in ("warn", "raise"):
        raise ValueError(f"mode {mode!r} must be 'warn' or 'raise'")
    if tolerance < 0:
        raise ValueError(f"tolerance {tolerance} must be a non-negative fraction, e.g. 0.1 for 10%")
    values = report.values(field)
    median = int(statistics.median(values))
    # The absolute floor keeps noise (a few MiB of allocator slack) from being called an imbalance
    # when the median itself is small, e.g. `allocated` on ranks that hold almost nothing.
    threshold = max(int(tolerance * median), int(min_gap_bytes))
    outliers = tuple(Outlier(r.rank, v, v - median) for r, v in zip(report.ranks, values)
                     if abs(v - median) > threshold)
    head = (f"{field} device memory across {len(values)} ranks ({report.device_type}): median {_gib(median)}, "
            f"tolerance ±{_gib(threshold)} ({tolerance:.0%} of the median, at least {_gib(min_gap_bytes)})")
    if not outliers:
        return BalanceResult(True, field, median, threshold, (), f"{head}: balanced")
    named = "; ".join(f"rank {o.rank} has {_gib(o.value)} {field} ({'+' if o.deviation > 0 else '-'}"
                      f"{_gib(abs(o.deviation))} vs the median)" for o in outliers)
    message = f"{head}: {named}. {CAUSES}"
    result = BalanceResult(False, field, median, threshold, outliers, message)
    if mode == "raise":
        raise MemoryImbalanceError(
            f"{message} To continue anyway pass mode='warn'; to size buckets for the smallest rank "
            "use bucket_bytes='auto' (choose_bucket_bytes)."
        )
    log.warning("hwsync: %s", message)
    return result


@dataclass(frozen=True)
class BucketChoice:
    """A bucket size and why it was chosen."""

    bucket_bytes: int
    limiting_rank: int
    min_free: int
    reason: str


def choose_bucket_bytes(
    report: MemoryReport,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    fraction: float = 0.2,
    floor: int = 16 * MiB,
    cap: int = 1 * GiB,
    align: int = 1 * MiB,
) -> BucketChoice:
    """Each of `num_buffers` buffers: fraction × (least free memory of any rank) / num_buffers, clamped and aligned."""
    if num_buffers < 1:
        raise ValueError(f"num_buffers={num_buffers} must be at least 1")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1]: the share of free memory buckets may use")
    if align < 1 or align & (align - 1):
        raise ValueError(f"align={align} must be a power of two")
    floor = -(-floor // align) * align
    cap = cap // align * align
    if not 0 < floor <= cap:
        raise ValueError(f"need 0 < floor <= cap after aligning to {align} bytes, got floor={floor}, cap={cap}")
    least = report.min_free
    budget = int(least.free * fraction) // num_buffers // align * align
    where = (f"rank {least.rank} has the least free memory ({_gib(least.free)}); "
             f"{fraction:.0%} of it over {num_buffers} buffers is {budget / MiB:.0f} MiB")
    if budget > cap:
        size, why = cap, f"{where}, capped at {cap / MiB:.0f} MiB (larger buckets add little speed)"
    elif budget >= floor:
        size, why = budget, where
    else:
        if floor * num_buffers > least.free:
            raise HwsyncError(
                f"rank {least.rank} has only {_gib(least.free)} free, less than {num_buffers} buffers of the "
                f"{floor / MiB:.0f} MiB floor; free device memory first (offload, empty_cache), or lower "
                "num_buffers or floor"
            )
        size, why = floor, f"{where}, raised to the {floor / MiB:.0f} MiB floor (memory is tight)"
        log.warning("hwsync: bucket size %d MiB: %s", size // MiB, why)
    reason = f"bucket_bytes={size} ({size / MiB:.0f} MiB): {why}"
    log.info("hwsync: %s", reason)
    return BucketChoice(size, least.rank, least.free, reason)
