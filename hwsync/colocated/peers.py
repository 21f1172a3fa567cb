"""Who may talk to a WeightSender: receivers bound by a Ready with the token, and who waits for the next sync.

Every message passes the socket's Gate first (hwsync.gate): nothing a peer sends changes any
state until it has presented the token in a Ready, which binds its connection's ZeroMQ
identity (a receiver that reconnects gets a new identity and presents the token again). A
Ready is answered at once: Welcome (the sender's pid and host, so the receiver can watch this
process between syncs), or Refused with the reason: another protocol version, a receiver whose
backend lacks the sender's transport (both end the sender's next send() too: the deployment
is wrong), or a receiver beyond `num_receivers` (only that receiver is told).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import zmq

from hwsync.control import peer_alive
from hwsync.gate import Gate, Reply
from hwsync.protocol import TO_SENDER, Frame, Gone, Ready


@dataclass
class Peer:
    """A receiver whose connection presented the token."""

    identity: bytes
    pid: int | None
    host: str | None
    #: the WeightReceiver's own id: a reconnection of the same receiver replaces its old identity
    instance: str = ""
    state: dict[str, Any] = field(default_factory=dict)
    #: whether it can read buckets from a shared doorbell
    doorbell: bool = False
    #: whether it copies straight into its own tensors (receive(into=...))
    into: bool = False

    def __str__(self) -> str:
        return f"receiver pid {self.pid} on {self.host}"


class PeerTable:
    """The sender's bound receivers, those waiting for the next sync, and those in the current one."""

    def __init__(self, token: str, num_receivers: int, backend: str, transport: str, reply: Reply) -> None:
        self.gate = Gate(token, Ready, TO_SENDER, reply)
        self._num_receivers = num_receivers
        self._backend = backend
        self._transport = transport
        self.bound: dict[bytes, Peer] = {}
        #: receivers that said Ready for the next sync, in the order they did
        self.waiting: dict[bytes, Peer] = {}
        #: the receivers of the sync that runs now
        self.in_sync: dict[bytes, Peer] = {}

    def take(self, parts: list[zmq.Frame]) -> tuple[bytes, Frame] | None:
        """The checked frame of one ROUTER message, or None when it was dropped or fully handled here."""
        got = self.gate.admit(parts)
        if got is None:
            return None
        identity, frame = got
        if isinstance(frame, Ready):
            self._on_ready(identity, frame)
            return None
        if isinstance(frame, Gone):
            self.waiting.pop(identity, None)
            return None
        return got

    def _on_ready(self, identity: bytes, ready: Ready) -> None:
        if self._transport not in ready.transports:
            self._refuse(identity, f"the receiver (pid {ready.pid} on {ready.host}) runs backend {ready.backend!r}, "
                                   f"whose transports {sorted(ready.transports)} lack this sender's "
                                   f"{self._transport!r} (backend {self._backend!r}); set HWSYNC_BACKEND alike on both "
                                   "sides, or give the sender a transport both have", fatal=True)
            return
        peer = Peer(identity, ready.pid, ready.host, ready.instance, ready.state, ready.doorbell, ready.into)
        for other in [p for p in self.bound.values() if p.instance == peer.instance and p.identity != identity]:
            self.waiting.pop(other.identity, None)  # the same receiver reconnected: its old connection is gone
            if other.identity not in self.in_sync:  # (frames of a sync it failed may still come on it)
                self._unbind(other.identity)
        others = self._members(exclude=peer)
        if len(others) >= self._num_receivers:
            self._refuse(identity, f"this sender serves num_receivers={self._num_receivers}, and "
                                   f"{', '.join(map(str, others))} already take part; {peer} was left out. Raise "
                                   "num_receivers, or stop the extra receiver", fatal=False)
            return
        self.bound[identity] = peer
        self.waiting.pop(identity, None)
        self.waiting[identity] = peer  # the most recent Ready counts, in arrival order
        self.gate.bind(identity)

    def _members(self, exclude: Peer) -> list[Peer]:
        """Other receivers that take part now or wait for the next sync (those whose process is gone are forgotten)."""
        members: dict[str, Peer] = {}
        for identity, peer in [*self.in_sync.items(), *self.waiting.items()]:
            if not peer_alive(peer.pid, peer.host):
                self._forget(identity)
            elif peer.instance != exclude.instance:
                members[peer.instance] = peer
        return list(members.values())

    def _refuse(self, identity: bytes, reason: str, *, fatal: bool) -> None:
        self._forget(identity)
        self.gate.refuse(identity, reason, fatal=fatal)

    def _unbind(self, identity: bytes) -> None:
        self.bound.pop(identity, None)
        self.gate.unbind(identity)

    def _forget(self, identity: bytes) -> None:
        self._unbind(identity)
        self.waiting.pop(identity, None)
        self.in_sync.pop(identity, None)

    def take_dead_waiting(self) -> list[Peer]:
        """Receivers that said Ready for the next sync and whose process is gone since (forgotten)."""
        dead = [peer for peer in self.waiting.values() if not peer_alive(peer.pid, peer.host)]
        for peer in dead:
            self._forget(peer.identity)
        return dead

    def drop_waiting(self) -> list[Peer]:
        """Every receiver waiting for the next sync, unbound (the sync they wait for will not run)."""
        waiting = list(self.waiting.values())
        for peer in waiting:
            self._forget(peer.identity)
        return waiting

    def ready_count(self) -> int:
        """How many receivers wait for the next sync (those whose process is gone are forgotten)."""
        for identity, peer in list(self.waiting.items()):
            if not peer_alive(peer.pid, peer.host):
                self._forget(identity)
        return len(self.waiting)

    def start_sync(self) -> list[Peer]:
        """The first `num_receivers` waiting receivers become this sync's."""
        chosen = list(self.waiting.values())[: self._num_receivers]
        for peer in chosen:
            del self.waiting[peer.identity]
        self.in_sync = {p.identity: p for p in chosen}
        return chosen

    def end_sync(self, failed: bool) -> None:
        """The sync is over; after a failure its receivers reconnect with new identities (unless already ready)."""
        if failed:
            for identity in self.in_sync:
                if identity not in self.waiting:
                    self._unbind(identity)
        self.in_sync = {}

    def sync_peer(self, identity: bytes) -> Peer | None:
        """The receiver of the current sync behind `identity`, or None."""
        return self.in_sync.get(identity)
