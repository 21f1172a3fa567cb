"""The disaggregated path's control plane: sender rank 0 is the hub, every other rank holds a Link to it.

No main thread ever calls a collective (each group's calls run on a CollectiveWorker, see
worker.py), so the main threads stay free to answer the hub's pings, to notice aborts, and to
name the rank that died or stalled. The frames are hwsync.protocol's (TO_HUB, TO_RANK).

Failure detection, all on the hub (sender rank 0):
- a peer on the same host whose process is gone is named at once;
- an error frame names its sender; a peer whose collective failed ("collective" errors) does
  not know who is to blame, so the hub pings everyone and names those that do not answer;
- when nothing has happened for half the timeout the hub pings too; at the timeout it gives up.
The hub sends Alive frames meanwhile, and while it gathers the ranks of the next sync it sends
each waiting rank a Waiting frame naming the ranks it still waits for, so the other ranks time
out only when it goes silent, and know whom it was waiting for.

Sync ids are the hub's: it answers the ready it took from each rank (the rank numbers them) with a
Start naming the sync. A rank of the running sync that readies again gave up on the ready the hub
took (its call timed out, or failed): if it has sent nothing in this sync yet and its new ready
still fits (roster.restart_refusal), the hub starts it again in this sync and replays the sync's
frames so far to it; otherwise the sync ends, naming it, and its new ready waits for the next
sync. Either way the next sync completes with every live rank.

Who may talk to the hub is its Gate's (hwsync.control.sockets): a rank presents the token in its
RankReady, which binds its connection; the hub answers Welcome, or Refused with the reason (a
role or rank this sync has no place for, another protocol version, another backend). A Link
notices at once when the hub's connection goes (its monitor), and the hub's pid from Welcome.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import zmq

from hwsync.control.endpoints import CloseSignal, Endpoint, peer_alive
from hwsync.control.nic import Nic
from hwsync.control.sockets import ConnectionLog, Gate, bind_control, peer_address, reply_on
from hwsync.disaggregated.progress import SyncProgress
from hwsync.disaggregated.roster import Key, PeerInfo, Roster, describe, restart_refusal, this_process, wanted
from hwsync.disaggregated.worker import CollectiveWorker, Result
from hwsync.errors import ProtocolError, RemoteError, SyncError, SyncTimeoutError
from hwsync.protocol import (
    MAX_SENDER_FRAME_BYTES,
    TO_HUB,
    Abort,
    Alive,
    Error,
    Frame,
    Ping,
    Pong,
    Progress,
    RankReady,
    Setup,
    Start,
    Waiting,
    check_size,
    cut,
    encode,
)
from hwsync.timing import CONTROL_SLICE_S, ERROR_LINGER_S

log = logging.getLogger("hwsync")

#: error kind a rank reports when its own collective failed and it cannot tell who is at fault
COLLECTIVE = "collective"
#: the longest the hub stays quiet towards a rank that waits on it (Alive, Waiting; a quarter of its own timeout_s
#: if that is less): a rank whose timeout_s is shorter than the hub's must hear from it in time too
KEEPALIVE_S = 1.0

__all__ = ["COLLECTIVE", "Hub", "PeerInfo", "close_socket", "describe", "this_process"]


def close_socket(sock: zmq.Socket, ctx: zmq.Context) -> None:
    """Close a socket (a short linger lets a last error frame out) and its context; idempotent."""
    if not sock.closed:
        sock.close(linger=int(ERROR_LINGER_S * 1000))
    if not ctx.closed:
        ctx.term()




class Hub:
    """Sender rank 0's ROUTER socket: gathers the other ranks, collects their replies, names failures."""

    def __init__(self, address: str, token: str, timeout_s: float, *, num_senders: int = 1, num_receivers: int = 1,
                 backend: str = "", secret_key: str | None = None, closing: CloseSignal | None = None) -> None:
        self.token = token
        #: set by close() from another thread: every wait here wakes and ends the sync with ClosedError
        self.closing = closing
        self.timeout_s = timeout_s
        self.num_senders, self.num_receivers, self.backend = num_senders, num_receivers, backend
        self._ctx = zmq.Context()
        self._sock, self.address, self.server_key = bind_control(self._ctx, address, secret_key)
        self._sock.setsockopt(zmq.LINGER, int(ERROR_LINGER_S * 1000))  # lets a final abort reach live peers
        self.gate = Gate(token, RankReady, TO_HUB, reply_on(self._socket), names=("rank", "hub"))
        self._connections = ConnectionLog(self._sock, "the hub")
        self.roster = Roster()  # the ready ranks for the next sync, and the last ready seen of each
        self.peers: list[PeerInfo] = []
        self.sync = 0
        #: a sync is running (from a complete gather until the next gather): a ready of one of its peers is a retry
        self.active = False
        #: this sync's frames so far (encoded) and to whom (None: every peer): what a rank started again is sent
        self._sent: list[tuple[bytes, frozenset[Key] | None]] = []
        #: peers that sent a frame in this sync: one that readies again cannot simply be started again
        self._acted: set[Key] = set()
        #: this sync announced new groups (a Setup): a rank started again may hold any epoch, it joins them
        self._announced = False
        self._keepalive_s = min(timeout_s / 4, KEEPALIVE_S)
        self.replies: dict[type[Frame], dict[tuple[str, int], Any]] = {}
        self._by_identity: dict[bytes, PeerInfo] = {}
        self._suspect: str | None = None
        self._ping_deadline = 0.0
        self._pings = 0
        self._last_alive = 0.0
        self.last_event = time.monotonic()
        #: the current sync's data phase (begin_data), which the errors of a stuck or slow sync describe
        self.progress: SyncProgress | None = None
        self._peer_ip: str | None = None  # where the frame being admitted came from

    def _socket(self) -> zmq.Socket:
        return self._sock

    @property
    def endpoint(self) -> str:
        """What the other ranks pass as `endpoint` (address, token and, for tcp://, the CURVE key)."""
        return str(Endpoint(self.address, self.token, self.server_key))

    def gather(self, followers: int, receivers: int) -> list[PeerInfo]:
        """Wait for every other rank's RankReady (telling the ready ones whom it still waits for), then start a sync
        with them: each gets a Start naming the sync and the ready it answers."""
        keys = wanted(followers, receivers)
        self._by_identity = {}  # late frames of the previous sync are ignored from here on
        self.active = False
        deadline = time.monotonic() + self.timeout_s
        told = 0.0
        while True:
            refusal = self.gate.take_fatal()
            if refusal is not None:
                raise ProtocolError(f"a rank was refused: {refusal}")
            missing = self.roster.missing(keys)
            if not missing:
                break
            now = time.monotonic()
            if now > deadline:
                raise SyncTimeoutError(f"timed out after {self.timeout_s:.1f}s waiting for "
                                       f"{self.roster.describe_missing(missing)} to call send()/receive() (endpoint "
                                       f"{self.address}); start them, or raise timeout_s. The ranks that are ready "
                                       "stay ready for the next send()")
            if now - told >= self._keepalive_s:
                text = cut(self.roster.describe_missing(missing, ages=False))
                for peer in self.roster.waiting.values():
                    self._to(peer, Waiting(attempt=peer.attempt, missing=text))
                told = now
            self._poll_once(None)
            if self.closing is not None:
                self.closing.check("waiting for every rank to call send()/receive()")
        self.sync += 1
        self.peers = self.roster.take(keys)
        self._by_identity = {p.identity: p for p in self.peers}
        self.active = True
        self.replies = {}
        self.progress = None
        self._sent, self._acted, self._announced = [], set(), False
        self._suspect, self._pings = None, 0
        self.last_event = self._last_alive = time.monotonic()
        for peer in self.peers:
            self._to(peer, Start(attempt=peer.attempt, sync=self.sync))
        return self.peers

    def _to(self, peer: PeerInfo, frame: Frame) -> None:
        """One frame to one peer, as it is (no sync id filled in)."""
        self._sock.send_multipart([peer.identity, check_size(encode(frame), MAX_SENDER_FRAME_BYTES,
                                                             f"the hub's {frame.T} frame")])

    def send(self, frame: Frame, peers: list[PeerInfo] | None = None) -> None:
        """Send a frame of the current sync to `peers` (all of this sync's peers by default)."""
        data = check_size(encode(dataclasses.replace(frame, sync=self.sync)),  # type: ignore[type-var]
                          MAX_SENDER_FRAME_BYTES,
                          f"the hub's {frame.T} frame")
        if not isinstance(frame, (Alive, Ping, Abort)):  # the sync's own steps: what a rank started again must get
            self._sent.append((data, None if peers is None else frozenset(p.key for p in peers)))
            self._announced = self._announced or isinstance(frame, Setup)
        for peer in self.peers if peers is None else peers:
            self._sock.send_multipart([peer.identity, data])

    def begin_data(self, bucket_bytes: list[int], nic: Nic | None) -> None:
        """The buckets (sizes in plan order) start moving now, from this host's interface `nic`."""
        receivers = sum(1 for p in self.peers if p.role == "receiver")
        self.progress = SyncProgress(bucket_bytes, receivers, self.timeout_s, nic)

    def progress_note(self, advise: bool = True) -> str:
        """' In the 3.1 s since the data began, …' (how far the data got, and with `advise` the timeout_s a link
        that slow needs), or '' before the data began."""
        if self.progress is None:
            return ""
        frames = self.replied(Progress)
        loaded = {f"receiver {p.rank} ({p.ip or p.host})": getattr(frames.get(p.key), "k", None)
                  for p in self.peers if p.role == "receiver"}
        text = self.progress.describe(loaded, advise)
        return f" {text[0].upper()}{text[1:]}."

    def replied(self, kind: type[Frame]) -> dict[tuple[str, int], Any]:
        """Frames of `kind` received in this sync, by (role, rank)."""
        return self.replies.setdefault(kind, {})

    def all_replied(self, kind: type[Frame], peers: list[PeerInfo]) -> bool:
        """Whether every peer in `peers` sent a `kind` frame in this sync."""
        replied = self.replied(kind)
        return all(p.key in replied for p in peers)

    def wait_for(self, kind: type[Frame], peers: list[PeerInfo], what: str) -> None:
        """Pump until every peer in `peers` sent a `kind` frame (no collective of this rank runs meanwhile)."""
        while not self.all_replied(kind, peers):
            self.pump(what)

    def pump(self, what: str, worker: CollectiveWorker | None = None) -> list[Result]:
        """One slice: process frames and `worker`'s results (returned); raise SyncError naming any failed rank."""
        results = self._poll_once(worker)
        if self.closing is not None:
            self.closing.check(what)
        self._check(what)
        return results

    def _poll_once(self, worker: CollectiveWorker | None) -> list[Result]:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._connections.fileno_or_socket(), zmq.POLLIN)
        if worker is not None:
            poller.register(worker, zmq.POLLIN)
        if self.closing is not None:
            poller.register(self.closing.fileno_or_socket(), zmq.POLLIN)
        ready = dict(poller.poll(int(CONTROL_SLICE_S * 1000)))
        self._connections.check()
        if self._sock in ready:
            while self._sock.poll(0, zmq.POLLIN):
                parts = self._sock.recv_multipart(copy=False)
                self._peer_ip = peer_address(parts[-1]) or None
                got = self.gate.admit(parts)
                if got is not None:
                    self._on_frame(*got)
        results = [] if worker is None else worker.results()
        for result in results:
            self.last_event = time.monotonic()
            if result[2] is not None and self._suspect is None:
                self._start_round(f"sender 0's own collective failed: {result[2]}")
        return results

    def _on_frame(self, identity: bytes, frame: Frame) -> None:
        if isinstance(frame, RankReady):
            self._on_ready(identity, frame)
            return
        peer = self._by_identity.get(identity)
        if peer is None or getattr(frame, "sync", None) != self.sync:
            return  # a frame of an earlier sync, or of a rank outside this one
        self.last_event = time.monotonic()
        self._acted.add(peer.key)
        if isinstance(frame, Error):
            if frame.kind != COLLECTIVE:
                raise RemoteError(f"{peer} failed: {frame.message}")
            if self._suspect is None:
                self._start_round(f"{peer} reported: {frame.message}")
        self.replied(type(frame))[peer.key] = frame

    def _on_ready(self, identity: bytes, frame: RankReady) -> None:
        """Take a rank for the next sync (bound and welcomed), start a rank of this sync again, or refuse it with the
        reason."""
        places = {"sender": range(1, self.num_senders), "receiver": range(self.num_receivers)}
        if frame.role not in places or frame.rank not in places[frame.role]:
            limits = f"num_senders={self.num_senders}, num_receivers={self.num_receivers}"
            self.gate.refuse(identity, f"{frame.role} {frame.rank} (pid {frame.pid} on {frame.host}) has no place in "
                                       f"this sync ({limits}; sender ranks 1.., receiver ranks 0..): give each rank a "
                                       "distinct rank below those counts", fatal=False)
            return
        if frame.backend != self.backend:
            self.gate.refuse(identity, f"{frame.role} {frame.rank} (pid {frame.pid} on {frame.host}) runs backend "
                                       f"{frame.backend!r} and sender 0 runs {self.backend!r}: their collectives "
                                       "cannot meet; set HWSYNC_BACKEND alike on every rank", fatal=True)
            return
        peer = PeerInfo(frame.role, frame.rank, identity, frame.pid, frame.host, frame.epoch, frame.address,
                        frame.report, self._peer_ip, frame.attempt)
        current = next((p for p in self.peers if p.key == peer.key), None) if self.active else None
        if current is not None:
            self._again(current, peer)
            return
        old = self.roster.add(peer)  # a later ready (a retry, a restarted rank) replaces an earlier one
        if old is not None and old.identity != identity and old.identity not in self._by_identity:
            self.gate.unbind(old.identity)  # a restarted rank: its old connection is gone
        self.gate.bind(identity)

    def _again(self, current: PeerInfo, peer: PeerInfo) -> None:
        """`current`, a rank of this sync, readied again as `peer`: it gave up on the ready the hub took. Start it
        again in this sync, replaying the sync's frames so far; or end the sync, its new ready kept for the next."""
        refusal = restart_refusal(current, peer, acted=current.key in self._acted,
                                  groups_announced=self._announced)
        if current.identity != peer.identity:
            self.gate.unbind(current.identity)  # a restarted process: its old connection is gone
            self._by_identity.pop(current.identity, None)
        self.gate.bind(peer.identity)
        if refusal is not None:
            self.roster.add(peer)
            raise SyncError(f"{peer} called send()/receive() again while this sync ran with its earlier call, which "
                            f"it gave up on (it timed out or failed): {refusal}. It is ready for the next sync")
        log.info("hwsync: %s readied again (attempt %d) before taking part in sync %d: started again in it", peer,
                 peer.attempt, self.sync)
        for name in dataclasses.fields(peer):  # in place: the sync's lists of peers hold this object
            setattr(current, name.name, getattr(peer, name.name))
        self.roster.known[peer.key] = current
        self._by_identity[current.identity] = current
        self._to(current, Start(attempt=current.attempt, sync=self.sync))
        for data, audience in self._sent:
            if audience is None or current.key in audience:
                self._sock.send_multipart([current.identity, data])
        if self._suspect is not None:  # a round of pings is on: it must answer this one too
            self.send(Ping(n=self._pings), [current])
        self.last_event = time.monotonic()

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
        if now - self._last_alive > self._keepalive_s:
            self.send(Alive())
            self._last_alive = now
        if self._suspect is not None and now > self._ping_deadline:
            pongs = self.replied(Pong)
            silent = [p for p in self.peers if getattr(pongs.get(p.key), "n", None) != self._pings]
            reason = f" ({self._suspect})" if self._suspect else ""
            if silent:
                figures = self.progress_note(advise=False)
                raise SyncError(f"{describe(silent)} stopped answering while {what}{reason}: it died, stalled "
                                f"or lost its network for over {self.timeout_s / 4:.1f}s.{figures} "
                                "Check its log and its host's network; the next sync rebuilds the group")
            if self._suspect:
                raise SyncError(f"the collective failed while {what}{reason}, though every rank still answers; "
                                f"check the network between the ranks.{self.progress_note()}")
            self._suspect = None
        idle = now - self.last_event
        if idle > self.timeout_s:
            raise SyncTimeoutError(f"nothing moved for {self.timeout_s:.1f}s while {what}, though every rank answers "
                                   f"pings: the collective is stuck or the link is slow.{self.progress_note()}"
                                   + ("" if self.progress is not None else " Raise timeout_s for slow links"))
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
        close_socket(self._sock, self._ctx)
