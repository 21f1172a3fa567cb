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
