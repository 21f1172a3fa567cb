"""Device buffers shared with receiver processes, exported the way torch counts IPC consumers.

torch's CUDA IPC (and the NPU runtime's, built the same way) gives every export of a block a
reference counter set to 1: one expected consumer. The consumer's mapping, when freed, takes
it to 0; the exporting process frees a block it dropped only once all of the block's counters
are at 0 (until then it is parked, and `ipc_collect()` retries). torch reads a counter as
unsigned, so one taken below 0 holds its block until the process exits (and torch warns
there): every export must be taken down exactly once. So:
- every receiver process gets an export of its own, made when it is first offered the buffers
  (never at allocation: a receiver in the sender's own process uses the tensors and needs none);
- two receivers never share one export: the first to close would take it to 0 under the other;
- a receiver takes down what it was sent: it unmaps what it mapped, and releases an export it
  read but could not map;
- the sender releases what no receiver will: exports of a receiver that died (a killed process
  never unmaps), and the exports of a failed attempt that the receiver may never have read.
  Which of those the receiver took down itself, only the counter says (a receiver that closed
  and exited looks like a killed one), so a release is made only while it is above 0
  (hwsync.backend.ipc_counters; the backends' release functions do that);
- a live receiver's failed attempt may still be unmapping when the sender learns of the
  failure, so its exports wait as orphans: released once that process is gone, or has come
  back to a later sync (its failure handling, which unmaps everything, is over). One whose
  process lives on and never comes back keeps its block parked until this process exits, as
  a consumer that never unmaps would.
A transport's SendBuffers keeps one ReceiverExports and says how to export one buffer and how to
release one export.

The same counting holds for device segments a sender's tensors lie in (mapped sources,
hwsync.colocated.mapped), kept by SegmentExports: one export per (receiver process, segment), made when
the receiver first needs it, mid-sync. Which exports a receiver mapped is known for sure only once it
completed a sync (`confirm`). After a failed sync the sender knows which of its receivers completed it
before another failed it (they keep every mapping); every other receiver of it unmaps all it mapped, and
the exports that sync made for it become orphans (`release_unconfirmed`: a frame carrying one may never
have been read).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from hwsync.control.endpoints import peer_alive

Record = dict[str, Any]
Release = Callable[[Record], None]


class _Orphans:
    """Exports of live receivers' failed attempts, each released once that attempt is surely over (this process's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_process: dict[tuple[int, str], list[tuple[Release, Record]]] = {}

    def add(self, pid: int | None, host: str | None, release_one: Release, records: Iterable[Record]) -> None:
        """Keep `records` until the receiver process is gone or comes back; released now where it cannot be told."""
        if pid is None or host is None or not peer_alive(pid, host):
            for record in records:
                release_one(record)
            return
        with self._lock:
            self._by_process.setdefault((pid, host), []).extend((release_one, r) for r in records)

    def settle(self, pid: int | None, host: str | None) -> None:
        """The process came back to a later sync: its failed attempt, which unmapped all it mapped, is over."""
        if pid is None or host is None:
            return
        with self._lock:
            orphans = self._by_process.pop((pid, host), [])
        for release_one, record in orphans:
            release_one(record)

    def settle_dead(self) -> None:
        """Release the orphans of processes that are gone."""
        with self._lock:
            gone = [key for key in self._by_process if not peer_alive(*key)]
        for pid, host in gone:
            self.settle(pid, host)

    def held(self) -> int:
        """Orphan exports waiting now."""
        with self._lock:
            return sum(len(o) for o in self._by_process.values())


#: one per process: orphans outlive the buffers and senders that made them, as torch's parked blocks do
ORPHANS = _Orphans()


def _pop_dead(by_receiver: dict[str, Any]) -> list[Any]:
    """Take out the receivers whose process is gone."""
    dead = [key for key, exports in by_receiver.items() if not peer_alive(exports.pid, exports.host)]
    return [by_receiver.pop(key) for key in dead]


@dataclass
class _Exports:
    pid: int | None
    host: str | None
    records: list[Record] = field(default_factory=list)


class ReceiverExports:
    """The exports of N buffers made for each receiver, by receiver key."""

    def __init__(self, export_all: Callable[[], list[Record]], release_one: Release) -> None:
        self._export_all = export_all
        self._release_one = release_one
        self._by_receiver: dict[str, _Exports] = {}

    def records_for(self, receiver: str, pid: int | None, host: str | None) -> list[Record]:
        """The receiver's exports, made on first use; none for a receiver in this very process."""
        if pid == os.getpid() and host == socket.gethostname():
            return []
        exports = self._by_receiver.get(receiver)
        if exports is None:
            ORPHANS.settle(pid, host)
            exports = self._by_receiver[receiver] = _Exports(pid, host, self._export_all())
        return exports.records

    def release(self, receiver: str) -> None:
        """The receiver failed before accepting: what it did not take down is released once its attempt is over."""
        exports = self._by_receiver.pop(receiver, None)
        if exports is not None:
            ORPHANS.add(exports.pid, exports.host, self._release_one, exports.records)

    def release_dead(self) -> None:
        """Release the exports of receivers whose process is gone (what they mapped went with them)."""
        for exports in _pop_dead(self._by_receiver):
            for record in exports.records:
                self._release_one(record)
        ORPHANS.settle_dead()

    def forget(self) -> None:
        """The buffers are gone: live receivers release what they map when they close it."""
        self.release_dead()
        self._by_receiver = {}


@dataclass
class _SegmentExports:
    pid: int | None
    host: str | None
    records: dict[int, Record] = field(default_factory=dict)
    #: segments exported to this receiver in the running sync (not yet known to be mapped)
    unconfirmed: set[int] = field(default_factory=set)


class SegmentExports:
    """Device segments exported to each receiver process, one export per (receiver, segment id)."""

    def __init__(self, release_one: Release) -> None:
        self._release_one = release_one
        self._by_receiver: dict[str, _SegmentExports] = {}

    def record_for(self, receiver: str, pid: int | None, host: str | None, segment: int,
                   make: Callable[[], Record]) -> Record | None:
        """A new export of `segment` for the receiver, made by `make()`; None when it has one already."""
        exports = self._by_receiver.get(receiver)
        if exports is None:
            ORPHANS.settle(pid, host)
            exports = self._by_receiver[receiver] = _SegmentExports(pid, host)
        if segment in exports.records:
            return None
        record = exports.records[segment] = make()
        exports.unconfirmed.add(segment)
        return record

    def count(self) -> int:
        """Exports alive now, over every receiver."""
        return sum(len(e.records) for e in self._by_receiver.values())

    def held_by(self, receiver: str) -> set[int]:
        """The segments `receiver` is known to map (exported to it and not released since): after a failed sync of
        its, none, even if it completed that sync before another receiver failed it."""
        exports = self._by_receiver.get(receiver)
        return set() if exports is None else set(exports.records)

    def confirm(self) -> None:
        """Every receiver completed the sync: it maps every export it was sent."""
        for exports in self._by_receiver.values():
            exports.unconfirmed.clear()

    def release_unconfirmed(self, receivers: list[str], completed: Collection[str] = ()) -> None:
        """A sync of these receivers failed. One that failed or stopped unmaps all it mapped: the exports that sync
        made for it become orphans (a frame carrying one may never have been read); its others are forgotten. One
        whose process is gone (killed in the sync) never unmaps any: every export it had is released now. One
        of `completed` (it completed the sync before another receiver failed it) maps every export it was sent, and
        keeps them, as after a sync that succeeded. Other receivers keep theirs."""
        for receiver in receivers:
            if receiver in completed and receiver in self._by_receiver:
                self._by_receiver[receiver].unconfirmed.clear()
                continue
            exports = self._by_receiver.pop(receiver, None)
            if exports is None:
                continue
            if not peer_alive(exports.pid, exports.host):  # killed in the sync: it never unmaps any, so all go now
                self._release_all(exports)
                continue
            ORPHANS.add(exports.pid, exports.host, self._release_one,
                        [exports.records[s] for s in exports.unconfirmed])

    def release_dead(self) -> None:
        """Release the exports of receivers whose process is gone (what they mapped went with them)."""
        for exports in _pop_dead(self._by_receiver):
            self._release_all(exports)
        ORPHANS.settle_dead()

    def _release_all(self, exports: _SegmentExports) -> None:
        for record in exports.records.values():
            self._release_one(record)

    def drop(self, segment: int) -> None:
        """The sender stopped sharing `segment`: live receivers unmap it when told; dead ones are released."""
        for exports in self._by_receiver.values():
            record = exports.records.pop(segment, None)
            if record is not None and not peer_alive(exports.pid, exports.host):
                self._release_one(record)
            exports.unconfirmed.discard(segment)
