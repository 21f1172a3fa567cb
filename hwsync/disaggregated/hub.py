"""The disaggregated path's control plane: sender rank 0 is the hub, every other rank holds a Link to it.

No main thread ever calls a collective (each group's calls run on a CollectiveWorker, see
worker.py), so the main threads stay free to answer the hub's pings, to notice aborts, and to
name the rank that died or stalled. The frames are hwsync.protocol's (TO_HUB, TO_RANK).

Failure detection, all on the hub (sender rank 0):
- a peer on the same host whose process is gone is named at once;
- an error frame names its sender; a peer whose collective failed ("collective" errors) does
  not know who is to blame, so the hub pings everyone and names those that do not answer;
- when nothing has happened for half the timeout the hub pings too; at the timeout it gives up.
The hub sends Alive frames meanwhile, so the other ranks time out only when it goes silent.

Who may talk to the hub is its Gate's (hwsync.gate): a rank presents the token in its
RankReady, which binds its connection; the hub answers Welcome, or Refused with the reason (a
role or rank this sync has no place for, another protocol version, another backend). A Link
notices at once when the hub's connection goes (its monitor), and the hub's pid from Welcome.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from hwsync.control import Endpoint, peer_alive
from hwsync.disaggregated.worker import CollectiveWorker, Result
from hwsync.errors import ProtocolError, RemoteError, SyncError, SyncTimeoutError
from hwsync.gate import Gate, reply_on
from hwsync.protocol import PROTOCOL_VERSION, TO_HUB, TO_RANK, Abort, Alive, BadFrame, Error, Frame, Ping, \
    PlanFrame, Pong, RankReady, Refused, Setup, Welcome, decode, encode, peek
from hwsync.protocol.limits import MAX_PEER_FRAME_BYTES, MAX_SENDER_FRAME_BYTES, check_size, cut
from hwsync.sockets import ConnectionLog, bind_control, connect_control
from hwsync.timing import CONTROL_SLICE_S, ERROR_LINGER_S

log = logging.getLogger("hwsync")

#: error kind a rank reports when its own collective failed and it cannot tell who is at fault
COLLECTIVE = "collective"


def _close(sock: zmq.Socket, ctx: zmq.Context) -> None:
    """Close a socket (a short linger lets a last error frame out) and its context; idempotent."""
    if not sock.closed:
        sock.close(linger=int(ERROR_LINGER_S * 1000))
    if not ctx.closed:
        ctx.term()



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
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        """(role, rank)."""
        return self.role, self.rank

    def __str__(self) -> str:
        return f"{self.role} {self.rank} (pid {self.pid} on {self.host})"


def describe(peers: list[PeerInfo]) -> str:
    """'receiver 2 (pid 1 on h), sender 1 (...)'."""
    return ", ".join(str(p) for p in peers)


def this_process() -> dict[str, Any]:
    """pid and host, which let a peer on the same host check that this process still exists."""
    return {"pid": os.getpid(), "host": socket.gethostname()}


class Hub:
    """Sender rank 0's ROUTER socket: gathers the other ranks, collects their replies, names failures."""

    def __init__(self, address: str, token: str, timeout_s: float, *, num_senders: int = 1, num_receivers: int = 1,
                 backend: str = "", secret_key: str | None = None) -> None:
        self.token = token
        self.timeout_s = timeout_s
        self.num_senders, self.num_receivers, self.backend = num_senders, num_receivers, backend
        self._ctx = zmq.Context()
        self._sock, self.address, self.server_key = bind_control(self._ctx, address, secret_key)
        self._sock.setsockopt(zmq.LINGER, int(ERROR_LINGER_S * 1000))  # lets a final abort reach live peers
        self.gate = Gate(token, RankReady, TO_HUB, reply_on(lambda: self._sock), names=("rank", "hub"))
        self._connections = ConnectionLog(self._sock, "the hub")
        self.waiting: dict[tuple[str, int], PeerInfo] = {}  # ready ranks for the next sync
        self.peers: list[PeerInfo] = []
        self.sync = 0
        self.replies: dict[type[Frame], dict[tuple[str, int], Any]] = {}
        self.workers: list[CollectiveWorker] = []
        self.on_result: Callable[[Result], None] = lambda result: None
        self._by_identity: dict[bytes, PeerInfo] = {}
        self._suspect: str | None = None
        self._ping_deadline = 0.0
        self._pings = 0
        self._last_alive = 0.0
        self.last_event = time.monotonic()

    @property
    def endpoint(self) -> str:
        """What the other ranks pass as `endpoint` (address, token and, for tcp://, the CURVE key)."""
        return str(Endpoint(self.address, self.token, self.server_key))

    def gather(self, followers: int, receivers: int) -> list[PeerInfo]:
        """Wait for every other rank's RankReady, then start a sync with them."""
        wanted = [("sender", s) for s in range(1, followers + 1)] + [("receiver", r) for r in range(receivers)]
        self._by_identity = {}  # late frames of the previous sync are ignored from here on
        deadline = time.monotonic() + self.timeout_s
        while True:
            refusal = self.gate.take_fatal()
            if refusal is not None:
                raise ProtocolError(f"a rank was refused: {refusal}")
            if all(key in self.waiting for key in wanted):
                break
            if time.monotonic() > deadline:
                missing = ", ".join(f"{role} {rank}" for role, rank in wanted if (role, rank) not in self.waiting)
                raise SyncTimeoutError(f"timed out after {self.timeout_s:.1f}s waiting for {missing} to call "
                                  f"send()/receive() (endpoint {self.address}); start them, or raise timeout_s")
            self._poll_once(CONTROL_SLICE_S)
        self.sync += 1
        self.peers = [self.waiting.pop(key) for key in wanted]
        self._by_identity = {p.identity: p for p in self.peers}
        self.replies = {}
        self._suspect, self._pings = None, 0
        self.last_event = time.monotonic()
        return self.peers

    def send(self, frame: Frame, peers: list[PeerInfo] | None = None) -> None:
        """Send a frame of the current sync to `peers` (all of this sync's peers by default)."""
        data = check_size(encode(dataclasses.replace(frame, sync=self.sync)), MAX_SENDER_FRAME_BYTES,
                          f"the hub's {frame.T} frame")
        for peer in self.peers if peers is None else peers:
            self._sock.send_multipart([peer.identity, data])

    def replied(self, kind: type[Frame]) -> dict[tuple[str, int], Any]:
        """Frames of `kind` received in this sync, by (role, rank)."""
        return self.replies.setdefault(kind, {})

    def wait_for(self, kind: type[Frame], peers: list[PeerInfo], what: str,
                 also: Callable[[], bool] = lambda: True) -> None:
        """Pump until every peer in `peers` sent a `kind` frame and also() holds."""
        self.pump_until(lambda: all(p.key in self.replied(kind) for p in peers) and also(), what)

    def pump_until(self, done: Callable[[], bool], what: str) -> None:
        """Process frames and worker results until done(); raise SyncError naming any failed rank."""
        while not done():
            self._poll_once(CONTROL_SLICE_S)
            self._check(what)

    def _poll_once(self, slice_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._connections.fileno_or_socket(), zmq.POLLIN)
        for worker in self.workers:
            poller.register(worker, zmq.POLLIN)
        ready = dict(poller.poll(int(slice_s * 1000)))
        self._connections.check()
        if self._sock in ready:
            while self._sock.poll(0, zmq.POLLIN):
                got = self.gate.admit(self._sock.recv_multipart(copy=False))
                if got is not None:
                    self._on_frame(*got)
        for worker in self.workers:
            for result in worker.results():
                self.last_event = time.monotonic()
                if result[2] is not None and self._suspect is None:
                    self._start_round(f"sender 0's own collective failed: {result[2]}")
                self.on_result(result)

    def _on_frame(self, identity: bytes, frame: Frame) -> None:
        if isinstance(frame, RankReady):
            self._on_ready(identity, frame)
            return
        peer = self._by_identity.get(identity)
        if peer is None or getattr(frame, "sync", None) != self.sync:
            return  # a frame of an earlier sync, or of a rank outside this one
        self.last_event = time.monotonic()
        if isinstance(frame, Error):
            if frame.kind != COLLECTIVE:
                raise RemoteError(f"{peer} failed: {frame.message}")
            if self._suspect is None:
                self._start_round(f"{peer} reported: {frame.message}")
        self.replied(type(frame))[peer.key] = frame

    def _on_ready(self, identity: bytes, frame: RankReady) -> None:
        """Take a rank for the next sync (bound and welcomed), or refuse it with the reason."""
        places = {"sender": range(1, self.num_senders), "receiver": range(self.num_receivers)}
        if frame.role not in places or frame.rank not in places[frame.role]:
            limits = f"num_senders={self.num_senders}, num_receivers={self.num_receivers}"
            self.gate.refuse(identity, f"{frame.role} {frame.rank} (pid {frame.pid} on {frame.host}) has no place in "
                                       f"this sync ({limits}; sender ranks 1.., receiver ranks 0..): give each rank a "
                                       "distinct rank below those counts", fatal=False)
            return
        if frame.backend != self.backend:
            self.gate.refuse(identity, f"{frame.role} {frame.rank} (pid {frame.pid} on {frame.host}) runs backend "
                                       f"{frame.backend!r} and sender 0 runs {self.backend!r}: their collectives cannot "
                                       "meet; set HWSYNC_BACKEND alike on every rank", fatal=True)
            return
        peer = PeerInfo(frame.role, frame.rank, identity, frame.pid, frame.host, frame.epoch, frame.address,
                        frame.state)
        old = self.waiting.get(peer.key)
        if old is not None and old.identity != identity and old.identity not in self._by_identity:
            self.gate.unbind(old.identity)  # a restarted rank: its old connection is gone
        self.waiting[peer.key] = peer  # a later ready (a restarted rank) replaces an earlier one
        self.gate.bind(identity)

    def _start_round(self, reason: str | None) -> None:
        """Ping every peer; whoever does not answer within a quarter of the timeout is named."""
        self._suspect = reason or ""
        self._pings += 1
        self.send(Ping(n=self._pings))
        self._ping_deadline = time.monotonic() + self.timeout_s / 4

    def _check(self, what: str) -> None:
        now = time.monotonic()
        gone = [p for p in self.peers if not peer_alive(p.pid, p.host)]
        if gone:
            raise SyncError(f"{describe(gone)} exited while {what}; restart it and sync again "
                            "(the group is rebuilt on the next sync)")
        if now - self._last_alive > self.timeout_s / 4:
            self.send(Alive())
            self._last_alive = now
        if self._suspect is not None and now > self._ping_deadline:
            pongs = self.replied(Pong)
            silent = [p for p in self.peers if getattr(pongs.get(p.key), "n", None) != self._pings]
            reason = f" ({self._suspect})" if self._suspect else ""
            if silent:
                raise SyncError(f"{describe(silent)} stopped answering while {what}{reason}: it died, stalled "
                                f"or lost its network for over {self.timeout_s / 4:.1f}s. Check its log; the "
                                "next sync rebuilds the group")
            if self._suspect:
                raise SyncError(f"the collective failed while {what}{reason}, though every rank still answers; "
                                "check the network between the ranks")
            self._suspect = None
        idle = now - self.last_event
        if idle > self.timeout_s:
            raise SyncTimeoutError(f"nothing moved for {self.timeout_s:.1f}s while {what}, though every rank answers "
                              "pings: the collective is stuck (network?). Raise timeout_s for slow links")
        if idle > self.timeout_s / 2 and self._suspect is None and self._pings == 0:
            self._start_round(None)

    def abort(self, message: str) -> None:
        """Tell this sync's peers it failed, with the reason."""
        try:
            self.send(Abort(sync=None, message=cut(message)))
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        """Close the socket and the context; safe to call twice."""
        self._connections.close()
        _close(self._sock, self._ctx)


class Link:
    """A non-hub rank's DEALER socket to the hub: replies to pings, notices aborts and hub silence."""

    def __init__(self, endpoint: str, timeout_s: float, backend: str = "") -> None:
        self.endpoint = Endpoint.parse(endpoint)
        self.timeout_s = timeout_s
        self.backend = backend
        self._ctx = zmq.Context()
        self._sock, self._watch = connect_control(self._ctx, self.endpoint)
        self.refused = False  # the hub refused this rank: it is told nothing more
        self.sync = 0  # the sync in progress (0 before the first plan or setup frame)
        self.hub: tuple[int | None, str | None] = (None, None)  # the hub's pid and host, once known
        self.workers: list[CollectiveWorker] = []
        self.on_result: Callable[[Result], None] = lambda result: None
        self.reported: str | None = None  # a collective failure already reported to the hub

    def send(self, frame: Frame) -> None:
        """Send a frame, tagged with the current sync."""
        self._send(dataclasses.replace(frame, sync=self.sync))

    def _send(self, frame: Frame) -> None:
        self._sock.send(check_size(encode(frame), MAX_PEER_FRAME_BYTES, f"this rank's {frame.T} frame"))

    def ready(self, role: str, rank: int, epoch: int | None, *, address: str | None = None,
              state: dict[str, Any] | None = None) -> None:
        """Announce this rank for the next sync."""
        self.reported, self.refused = None, False
        self.sync += 1  # the next sync's id is higher than any before: older frames are stale from here on
        self._send(RankReady(token=self.endpoint.token, proto=PROTOCOL_VERSION, backend=self.backend, role=role,
                             rank=rank, epoch=epoch, pid=os.getpid(), host=socket.gethostname(), address=address,
                             state=state or {}))

    def wait(self, kinds: tuple[type[Frame], ...], what: str, done: Callable[[], bool] = lambda: False
             ) -> Any:
        """The next frame of `kinds` from the hub, or None as soon as done() holds; raises on abort or silence."""
        last = time.monotonic()
        while not done():
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._watch.fileno_or_socket(), zmq.POLLIN)
            for worker in self.workers:
                poller.register(worker, zmq.POLLIN)
            ready = dict(poller.poll(int(CONTROL_SLICE_S * 1000)))
            for worker in self.workers:
                for result in worker.results():
                    last = time.monotonic()
                    if result[2] is not None and self.reported is None:
                        # the hub finds out who is to blame; meanwhile keep answering its pings
                        self.reported = result[2]
                        self.send(Error(sync=None, kind=COLLECTIVE, message=result[2]))
                    self.on_result(result)
            while self._sock in ready and self._sock.poll(0, zmq.POLLIN):
                frame = self._decode(self._sock.recv())  # only the hub reaches this socket
                if isinstance(frame, Welcome):
                    self.hub = (frame.pid, frame.host)
                    continue
                if frame.sync is not None and frame.sync < self.sync:
                    continue  # left over from an earlier sync
                last = time.monotonic()
                if isinstance(frame, (Setup, PlanFrame, Abort)):
                    self.sync = frame.sync if frame.sync is not None else self.sync
                if isinstance(frame, (Setup, PlanFrame)):
                    self.hub = (frame.pid, frame.host)
                if isinstance(frame, Abort):
                    raise RemoteError(f"the sync was aborted: {frame.message}")
                if isinstance(frame, Ping):
                    self.send(Pong(n=frame.n))
                elif isinstance(frame, kinds):
                    return frame
            self._watch.check(what)  # the hub's connection closed: it exited or was closed
            if not peer_alive(*self.hub):
                raise SyncError(f"sender 0 (the hub, pid {self.hub[0]}) exited while {what}; restart the trainer")
            if time.monotonic() - last > self.timeout_s:
                raise SyncTimeoutError(f"timed out after {self.timeout_s:.1f}s {what}: sender 0 (the hub, "
                                  f"{self.endpoint.address}) went silent. Check its log, or raise timeout_s")
        return None

    def _decode(self, data: bytes) -> Frame:
        """A frame from the hub; a Refused (of any protocol version) raises its reason."""
        try:
            frame = decode(data, TO_RANK)
        except BadFrame:
            raw = peek(data)
            if raw is None or raw.get("t") != Refused.T or not isinstance(raw.get("reason"), str):
                raise
            frame = Refused(reason=raw["reason"])
        if isinstance(frame, Refused):
            self.refused = True
            raise ProtocolError(f"sender 0 (the hub) refused this rank: {frame.reason}")
        return frame

    def report(self, exc: BaseException) -> None:
        """Tell the hub this rank failed (unless the failure came from the hub, or the hub refused it)."""
        if isinstance(exc, RemoteError) or self.refused:
            return
        kind = COLLECTIVE if self.reported is not None else "local"
        try:
            self.send(Error(sync=None, kind=kind, message=cut(f"{type(exc).__name__}: {exc}")))
        except (zmq.ZMQError, ProtocolError):
            pass

    def close(self) -> None:
        """Close the socket and the context; safe to call twice."""
        self._watch.close()
        _close(self._sock, self._ctx)
