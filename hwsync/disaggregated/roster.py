"""Who takes part in a cross-node sync: each rank as its ready described it, and the readies the hub holds.

The hub (sender 0) keeps the latest ready of every rank until a sync starts with it (a later ready
of the same rank replaces an earlier one: that rank gave up on the earlier call), remembers the
last ready it saw of every rank so that a gather can say who a missing rank was and when it was
last heard of, and decides whether a rank of the running sync that readied again can simply be
started again in it (hwsync.disaggregated.hub).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from hwsync.sync.report import ReceiverReport

#: a rank's place in a sync: ("sender", s) for s >= 1, or ("receiver", r)
Key = tuple[str, int]


@dataclass
class PeerInfo:
    """A rank other than the hub, as its ready frame described it."""

    role: str  # "sender" or "receiver"
    rank: int
    identity: bytes
    pid: int | None
    host: str | None
    epoch: int | None
    address: str | None = None
    #: what it reported with its ready (a receiver's: what sender 0 plans from; a sender rank's is empty)
    report: ReceiverReport = field(default_factory=ReceiverReport)
    #: the address its control connection came from (a host name alone may not tell nodes apart)
    ip: str | None = None
    #: which of its readies this is (the rank counts them; the hub's Start names the one it took)
    attempt: int = 0
    #: when the hub read this ready (time.monotonic)
    seen: float = field(default_factory=time.monotonic)

    @property
    def key(self) -> Key:
        """(role, rank)."""
        return self.role, self.rank

    def __str__(self) -> str:
        at = f", {self.ip}" if self.ip and self.ip != self.host else ""
        return f"{self.role} {self.rank} (pid {self.pid} on {self.host}{at})"


def describe(peers: list[PeerInfo]) -> str:
    """'receiver 2 (pid 1 on h), sender 1 (...)'."""
    return ", ".join(str(p) for p in peers)


def this_process() -> dict[str, Any]:
    """pid and host, which let a peer on the same host check that this process still exists."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


def wanted(followers: int, receivers: int) -> list[Key]:
    """Every rank a sync of `followers` sender ranks (besides sender 0) and `receivers` receivers takes, in order."""
    return [("sender", s) for s in range(1, followers + 1)] + [("receiver", r) for r in range(receivers)]


class Roster:
    """The readies the hub holds for the next sync, and the last one seen of every rank."""

    def __init__(self) -> None:
        self.waiting: dict[Key, PeerInfo] = {}
        self.known: dict[Key, PeerInfo] = {}

    def add(self, peer: PeerInfo) -> PeerInfo | None:
        """Hold `peer`'s ready for the next sync; the one it replaces (the same rank's earlier ready), or None."""
        self.known[peer.key] = peer
        old, self.waiting[peer.key] = self.waiting.get(peer.key), peer
        return old

    def missing(self, keys: list[Key]) -> list[Key]:
        """The ranks of `keys` whose ready the hub does not hold."""
        return [key for key in keys if key not in self.waiting]

    def take(self, keys: list[Key]) -> list[PeerInfo]:
        """The readies of `keys`, in that order, no longer held."""
        return [self.waiting.pop(key) for key in keys]

    def describe_missing(self, keys: list[Key], *, ages: bool = True) -> str:
        """'receiver 1 (pid P on h, 10.0.0.3) (its last ready came 12.0 s ago), sender 1 (not heard of yet)'; without
        `ages`, the same without when (a text that changes only when the missing ranks do)."""
        now = time.monotonic()
        out = []
        for key in keys:
            known = self.known.get(key)
            when = f" (its last ready came {now - known.seen:.1f} s ago)" if known is not None and ages else ""
            out.append(f"{key[0]} {key[1]} (not heard of yet)" if known is None else f"{known}{when}")
        return ", ".join(out)


def restart_refusal(current: PeerInfo, again: PeerInfo, *, acted: bool, groups_announced: bool) -> str | None:
    """Why `current`, a rank of the running sync that readied again as `again`, cannot be started again in it;
    None if it can (it sent nothing in this sync, and its new ready fits what the sync already decided)."""
    if acted:
        return "it had already taken part in this sync"
    if again.report != current.report:
        return "its reported state changed, and the sync was planned from the old one"
    if not groups_announced and again.epoch != current.epoch:
        return (f"it now holds group epoch {again.epoch}, not the {current.epoch} this sync uses, and no new groups "
                "were announced")
    return None
