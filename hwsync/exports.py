"""Device buffers shared with receiver processes, exported the way torch counts IPC consumers.

torch's CUDA IPC (and the NPU runtime's, built the same way) gives every export of a block a
reference counter set to 1: one expected consumer. The consumer's mapping, when freed, takes
it to 0; the exporting process frees a block it dropped only once all of the block's counters
are at 0 (until then it is parked, and `ipc_collect()` retries). So:
- every receiver process gets an export of its own, made when it is first offered the buffers
  (never at allocation: a receiver in the sender's own process uses the tensors and needs none);
- an export its receiver never mapped (it refused the offer) or whose receiver died (a killed
  process never releases) is released by the sender, else the block stays parked until exit;
- two receivers never share one export: the first to close would free the block under the other.
A transport's SendBuffers keeps one ReceiverExports and says how to export one buffer and how to
release one export.

The same counting holds for device segments a sender's tensors lie in (mapped sources,
hwsync.colocated.mapped), kept by SegmentExports: one export per (receiver process, segment), made when
the receiver first needs it, mid-sync. Which exports a receiver mapped is known for sure only once it
completed a sync (`confirm`); after a failed sync every receiver of it unmaps all it mapped, and the
sender releases the exports that sync made (`release_unconfirmed`: a frame carrying them may never have
been read), so none keeps a block parked. Releasing twice (the receiver unmapped, the sender released)
takes a counter below zero, which torch treats as released.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hwsync.control import peer_alive

Record = dict[str, Any]


@dataclass
class _Exports:
    pid: int | None
    host: str | None
    records: list[Record] = field(default_factory=list)


class ReceiverExports:
    """The exports of N buffers made for each receiver, by receiver key."""

    def __init__(self, export_all: Callable[[], list[Record]], release_one: Callable[[Record], None]) -> None:
        self._export_all = export_all
        self._release_one = release_one
        self._by_receiver: dict[str, _Exports] = {}

    def records_for(self, receiver: str, pid: int | None, host: str | None) -> list[Record]:
        """The receiver's exports, made on first use; none for a receiver in this very process."""
        if pid == os.getpid() and host == socket.gethostname():
            return []
        exports = self._by_receiver.get(receiver)
        if exports is None:
            exports = self._by_receiver[receiver] = _Exports(pid, host, self._export_all())
        return exports.records

    def release(self, receiver: str) -> None:
        """The receiver does not map its exports (it refused them, or it died): release them for it."""
        exports = self._by_receiver.pop(receiver, None)
        if exports is not None:
            for record in exports.records:
                self._release_one(record)

    def release_dead(self) -> None:
        """Release the exports of receivers whose process is gone (their mappings went with them)."""
        for receiver, exports in list(self._by_receiver.items()):
            if not peer_alive(exports.pid, exports.host):
                self.release(receiver)

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

    def __init__(self, release_one: Callable[[Record], None]) -> None:
        self._release_one = release_one
        self._by_receiver: dict[str, _SegmentExports] = {}

    def record_for(self, receiver: str, pid: int | None, host: str | None, segment: int,
                   make: Callable[[], Record]) -> Record | None:
        """A new export of `segment` for the receiver, made by `make()`; None when it has one already."""
        exports = self._by_receiver.get(receiver)
        if exports is None:
            exports = self._by_receiver[receiver] = _SegmentExports(pid, host)
        if segment in exports.records:
            return None
        record = exports.records[segment] = make()
        exports.unconfirmed.add(segment)
        return record

    def count(self) -> int:
        """Exports alive now, over every receiver."""
        return sum(len(e.records) for e in self._by_receiver.values())

    def confirm(self) -> None:
        """Every receiver completed the sync: it maps every export it was sent."""
        for exports in self._by_receiver.values():
            exports.unconfirmed.clear()

    def release_unconfirmed(self, receivers: list[str]) -> None:
        """A sync of these receivers failed, and each unmaps all it mapped: release the exports that sync made for
        them (a frame carrying one may never have been read) and forget theirs; other receivers keep theirs."""
        for receiver in receivers:
            exports = self._by_receiver.pop(receiver, None)
            if exports is not None:
                for segment in exports.unconfirmed:
                    self._release_one(exports.records[segment])

    def release(self, receiver: str) -> None:
        """The receiver died with its mappings: release every export it had."""
        exports = self._by_receiver.pop(receiver, None)
        if exports is not None:
            for record in exports.records.values():
                self._release_one(record)

    def release_dead(self) -> None:
        """Release the exports of receivers whose process is gone."""
        for receiver, exports in list(self._by_receiver.items()):
            if not peer_alive(exports.pid, exports.host):
                self.release(receiver)

    def drop(self, segment: int) -> None:
        """The sender stopped sharing `segment`: live receivers unmap it when told; dead ones are released."""
        for exports in self._by_receiver.values():
            record = exports.records.pop(segment, None)
            if record is not None and not peer_alive(exports.pid, exports.host):
                self._release_one(record)
            exports.unconfirmed.discard(segment)
