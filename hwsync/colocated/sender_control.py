"""The sender's control socket: who its receivers are, waits with a timeout, and frames to this sync's receivers.

`SenderControl` owns the bound ROUTER socket, its connection log and the peer table (who
presented the token, who waits for the next sync). `SyncReceivers` is one sync's view of it: the
receivers chosen for the sync and its id, which the sender, the stream and the bucket links call
to send frames and to read the receivers' replies. Everything here is called from the sender's
thread, downwards: nothing in it calls back into the sender.

Errors name the bound address, never the endpoint string: that carries the token (and the CURVE
key), which must not reach a log.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from hwsync.control.endpoints import CloseSignal, Endpoint, peer_alive, raise_if_exited, receive_frame
from hwsync.control.sockets import ConnectionLog, Gate, Reply, bind_control, reply_on
from hwsync.errors import ClosedError, ProtocolError, RemoteError, SyncTimeoutError
from hwsync.protocol import TO_SENDER, Abort, Applied, Complete, Error, Frame, Gone, Ready, Stopped, cut, encode
from hwsync.sync.report import ReceiverReport
from hwsync.sync.stats import SyncStats
from hwsync.timing import CLOSE_LINGER_S

#: a frame of one of this sync's receivers: (its connection's identity, the checked frame)
Received = tuple[bytes, Frame]

#: frames after which a receiver reads none of the sync's memory: it loaded all, failed, or heard the abort
_DONE_READING = (Complete, Applied, Error, Stopped)
#: how often the wait for Stopped looks for a receiver that exited meanwhile
_STOP_POLL_S = 0.05


class SenderControl:
    """The bound control socket of a WeightSender, and the receivers it knows."""

    def __init__(self, ctx: zmq.Context, address: str, token: str, *, num_receivers: int, backend: str,
                 transport: str, timeout_s: float, closing: CloseSignal) -> None:
        self.timeout_s = timeout_s
        self.closing = closing
        self._sock: zmq.Socket | None
        self._sock, self.address, server_key = bind_control(ctx, address)
        self.endpoint = str(Endpoint(self.address, token, server_key))
        self._connections = ConnectionLog(self._sock, "the sender")
        self.peers = PeerTable(token, num_receivers, backend, transport, reply_on(self._socket_or_none))

    def _socket_or_none(self) -> zmq.Socket | None:
        return self._sock

    def socket(self) -> zmq.Socket:
        """The bound socket; ClosedError once closed."""
        if self._sock is None:
            raise ClosedError("this WeightSender is closed; make a new one to send again")
        return self._sock

    def await_ready(self, num_receivers: int, stats: SyncStats) -> list[Peer]:
        """The receivers of the next sync, once `num_receivers` said Ready (each Ready is answered as it comes)."""
        t0 = time.perf_counter()
        what, deadline = "waiting for receivers to call receive()", time.monotonic() + self.timeout_s
        while True:
            self.drain()  # a receiver that gave up says "gone" right after its "ready": read all that is queued
            refusal = self.peers.gate.take_fatal()
            if refusal is not None:  # the deployment is wrong: every receiver waiting for this sync hears it at once
                self._abort_waiting(f"the sender refused another receiver, so this sync cannot run: {refusal}")
                raise ProtocolError(f"a receiver was refused: {refusal}")
            dead = self.peers.take_dead_waiting()
            if dead:
                raise SyncTimeoutError(f"{dead[0]} exited after it said it was ready, {what} (endpoint "
                                       f"{self.address}); restart it and send again")
            if self.peers.ready_count() >= num_receivers:
                break
            try:
                self._take(receive_frame(self.socket(), self.timeout_s, what=what, endpoint=self.address,
                                         watches=[self.closing, self._connections], deadline=deadline, copy=False))
            except SyncTimeoutError as exc:
                died = self._connections.deaths
                if not died:
                    raise
                raise SyncTimeoutError(f"{exc} Process {', '.join(map(str, died))} connected to this sender and "
                                       "exited without presenting the token: a receiver killed before its ready "
                                       "frame?") from None
        stats.wait_s += time.perf_counter() - t0
        return self.peers.start_sync()

    def _abort_waiting(self, message: str) -> None:
        """Tell every receiver waiting for the next sync that it will not come (each raises, and reconnects)."""
        data = encode(Abort(sync=None, message=cut(message)))
        for peer in self.peers.drop_waiting():
            try:
                self.send_to(peer, data)
            except zmq.ZMQError:
                pass

    def _take(self, parts: list[zmq.Frame]) -> Received | None:
        """A checked frame of one of this sync's receivers, or None (handled, dropped, or another peer's)."""
        got = self.peers.take(parts)
        if got is None or self.peers.sync_peer(got[0]) is None:
            return None
        return got

    def drain(self) -> list[Received]:
        """Every message queued now, taken; the frames of this sync's receivers among them."""
        sock, frames = self.socket(), []
        self._connections.check()
        while sock.poll(0, zmq.POLLIN):
            got = self._take(sock.recv_multipart(copy=False))
            if got is not None:
                frames.append(got)
        return frames

    def recv(self, what: str, peers: list[Peer]) -> Received:
        """The next frame of one of this sync's receivers; anything else that arrives meanwhile is handled."""
        deadline = time.monotonic() + self.timeout_s  # one deadline, however many other frames arrive
        alive = [(p.pid, p.host) for p in peers]
        while True:
            got = self._take(receive_frame(self.socket(), self.timeout_s, what=what, endpoint=self.address,
                                           peers=alive, watches=[self.closing, self._connections], deadline=deadline,
                                           copy=False))
            if got is not None:
                return got

    def send_to(self, peer: Peer, data: bytes) -> None:
        """One encoded frame to one receiver."""
        self.socket().send_multipart([peer.identity, data])

    def end_sync(self, failed: bool) -> None:
        """The sync is over (see PeerTable.end_sync)."""
        self.peers.end_sync(failed)

    def close(self) -> None:
        """Close the monitor and the socket (after a short linger: an abort just sent reaches live receivers)."""
        self._connections.close()
        if self._sock is not None:
            self._sock.close(linger=int(CLOSE_LINGER_S * 1000))
            self._sock = None


class SyncReceivers:
    """The receivers of one sync: frames out to all of them, their replies in, failures raised."""

    def __init__(self, control: SenderControl, peers: list[Peer], sync: int) -> None:
        self.control = control
        self.peers = peers
        self.sync = sync
        #: receivers that said they read none of the sync's memory any more (Complete, Applied, Error, Stopped)
        self.done_reading: set[bytes] = set()
        #: those of them that loaded (or staged) the whole sync: each maps every export it was sent
        self.completed: set[bytes] = set()

    @property
    def identities(self) -> list[bytes]:
        """The receivers' connection identities, in rank order."""
        return [p.identity for p in self.peers]

    def broadcast(self, frame: Frame) -> None:
        """Send `frame` to every receiver of the sync."""
        data = encode(frame)
        for peer in self.peers:
            self.control.send_to(peer, data)

    def recv(self, what: str) -> Received:
        """The next frame of one of the sync's receivers; an error frame of this sync raises."""
        identity, frame = self.control.recv(what, self.peers)
        self._note(identity, frame)
        self.raise_if_error(frame, identity)
        return identity, frame

    def _note(self, identity: bytes, frame: Frame) -> None:
        if isinstance(frame, _DONE_READING) and frame.sync in (self.sync, None):
            self.done_reading.add(identity)
            if isinstance(frame, (Complete, Applied)):
                self.completed.add(identity)

    def poll(self, what: str) -> list[Received]:
        """Without waiting: raise on close(), an error frame or a receiver that exited; the sync's frames queued now.

        Every frame queued now is read (a Ready of another receiver is answered at once).
        """
        self.control.closing.check(what)
        frames = self.control.drain()
        for identity, frame in frames:
            self._note(identity, frame)
        for identity, frame in frames:
            self.raise_if_error(frame, identity)
        raise_if_exited([(p.pid, p.host) for p in self.peers], what=what, endpoint=self.control.address)
        return frames

    def await_each(self, kind: type[Frame], what: str, stats: SyncStats,
                   peers: list[Peer] | None = None) -> list[Any]:
        """The frame of `kind` of this sync from every receiver (or each of `peers`), in rank order."""
        t0 = time.perf_counter()
        peers = self.peers if peers is None else peers
        wanted = {p.identity for p in peers}
        replies: dict[bytes, Any] = {}
        while len(replies) < len(wanted):
            identity, frame = self.recv(what)
            if isinstance(frame, kind) and getattr(frame, "sync", None) == self.sync and identity in wanted:
                replies[identity] = frame
        stats.wait_s += time.perf_counter() - t0
        return [replies[p.identity] for p in peers]

    def raise_if_error(self, frame: Frame, identity: bytes | None = None) -> None:
        """An error frame of this sync (or of none) raises ProtocolError or RemoteError with its message (and the
        receiver's pid and host)."""
        if isinstance(frame, Error) and frame.sync in (self.sync, None):
            cls = ProtocolError if frame.kind == "protocol" else RemoteError
            peer = next((p for p in self.peers if p.identity == identity), None)
            raise cls(f"receiver failed: {frame.message}" if peer is None else f"{peer} failed: {frame.message}")

    def abort(self, exc: BaseException) -> list[Peer]:
        """Tell every receiver the sync failed, and why, and wait until each one reads none of its memory; the
        receivers that did not say so within the timeout (nor exited).

        A receiver may still be copying from the trainer's memory (shared segments, device exports) when another
        one fails. send() raises after this, and the trainer steps then: had it not waited, that receiver could
        complete with bytes of two steps. Each receiver answers the Abort with Stopped once its copies ended (one
        that completed, applied or failed first has said so already)."""
        try:
            self.broadcast(Abort(sync=self.sync, message=cut(f"{type(exc).__name__}: {exc}")))
        except (zmq.ZMQError, ClosedError):
            return []  # the socket is gone: no receiver hears anything from it any more
        deadline = time.monotonic() + self.control.timeout_s
        while True:
            try:
                for identity, frame in self.control.drain():
                    self._note(identity, frame)
            except (zmq.ZMQError, ClosedError, ProtocolError):
                return []
            reading = [p for p in self.peers if p.identity not in self.done_reading and peer_alive(p.pid, p.host)]
            left = deadline - time.monotonic()
            if not reading or left <= 0:
                return reading
            try:
                self.control.socket().poll(int(min(left, _STOP_POLL_S) * 1000) + 1, zmq.POLLIN)
            except (zmq.ZMQError, ClosedError):
                return []


# -- peers: receivers bound by a Ready with the token, and who waits for the next sync -----------------------
@dataclass
class Peer:
    """A receiver whose connection presented the token."""

    identity: bytes
    pid: int | None
    host: str | None
    #: the WeightReceiver's own id: a reconnection of the same receiver replaces its old identity
    instance: str = ""
    #: what it reported in its Ready (what the sender plans from)
    report: ReceiverReport = field(default_factory=ReceiverReport)
    #: whether it can read buckets from a shared doorbell
    doorbell: bool = False
    #: whether it copies straight into its own tensors (receive(into=...), or a staging area)
    into: bool = False
    #: whether it stages: its Complete means staged, and it applies on the sync's Apply
    stage: bool = False
    #: the sync whose one-copy plan it holds (0: none)
    plan: int = 0

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
        peer = Peer(identity, ready.pid, ready.host, ready.instance, ready.report, ready.doorbell, ready.into,
                    ready.stage, ready.plan)
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
