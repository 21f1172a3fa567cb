"""A non-hub rank's connection to sender 0's hub (hwsync.disaggregated.hub): its frames in, pings answered.

The rank's main thread pumps it while it waits (for the hub's next frame, a group to form, a bucket
to arrive); each slice also watches the rank's collective thread, whose results it hands back and
whose failure it reports to the hub, which names the rank at fault. The hub sends Alive frames
while a sync runs and Waiting frames while it gathers the ranks (naming the ones it still waits
for), so a rank times out only when the hub itself goes silent.

The sync id is the hub's: each ready is numbered (its attempt), and the rank takes the sync the
hub's Start for that attempt names; before it, no frame of any sync is taken, after it only that
sync's (hwsync.protocol.disaggregated says why this survives a timeout on either side).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections import deque
from typing import Any

import zmq

from hwsync.control.endpoints import CloseSignal, Endpoint, peer_alive
from hwsync.control.sockets import connect_control
from hwsync.disaggregated.hub import COLLECTIVE, close_socket
from hwsync.disaggregated.worker import CollectiveWorker, Result
from hwsync.errors import ProtocolError, RemoteError, SyncError, SyncTimeoutError
from hwsync.protocol import (
    MAX_PEER_FRAME_BYTES,
    PROTOCOL_VERSION,
    TO_RANK,
    Abort,
    Alive,
    BadFrame,
    Error,
    Frame,
    Ping,
    PlanFrame,
    Pong,
    RankReady,
    Refused,
    Setup,
    Start,
    Waiting,
    Welcome,
    check_size,
    cut,
    decode,
    encode,
    refused_reason,
)
from hwsync.sync.report import ReceiverReport
from hwsync.timing import CONTROL_SLICE_S

log = logging.getLogger("hwsync")


class Link:
    """A non-hub rank's DEALER socket to the hub: replies to pings, notices aborts and hub silence."""

    def __init__(self, endpoint: str, timeout_s: float, backend: str = "", closing: CloseSignal | None = None) -> None:
        self.endpoint = Endpoint.parse(endpoint)
        #: set by close() from another thread: every wait here wakes and ends the sync with ClosedError
        self.closing = closing
        self.timeout_s = timeout_s
        self.backend = backend
        self._ctx = zmq.Context()
        self._sock, self._watch = connect_control(self._ctx, self.endpoint)
        self.refused = False  # the hub refused this rank: it is told nothing more
        self.attempt = 0  # readies sent on this connection: the hub's Start names the one it took
        self.sync: int | None = None  # the hub's id of the sync this rank is in; None until its Start comes
        #: whom the hub said it still waits for (its last Waiting frame), for this rank's own timeout message
        self.hub_waits_for: str | None = None
        self.hub: tuple[int | None, str | None] = (None, None)  # the hub's pid and host, once known
        self.reported: str | None = None  # a collective failure already reported to the hub
        #: frames of this sync from the hub not yet asked for (Setup, PlanFrame, Go, Commit), in arrival order
        self._inbox: deque[Frame] = deque()
        #: when the hub (or this rank's collective thread) was last heard from: the hub sends Alive meanwhile
        self._heard = time.monotonic()

    def send(self, frame: Frame) -> None:
        """Send a frame, tagged with the sync this rank is in (the hub's Start named it)."""
        if self.sync is None:
            raise ProtocolError(f"a {frame.T} frame before sender 0 started this rank in a sync: a bug in hwsync")
        self._send(dataclasses.replace(frame, sync=self.sync))  # type: ignore[type-var]  # frames are dataclasses

    def _send(self, frame: Frame) -> None:
        self._sock.send(check_size(encode(frame), MAX_PEER_FRAME_BYTES, f"this rank's {frame.T} frame"))

    def ready(self, role: str, rank: int, epoch: int | None, *, address: str | None = None,
              report: ReceiverReport | None = None) -> None:
        """Announce this rank for the next sync (a new attempt: every frame of an earlier one is stale from here on)."""
        self.reported, self.refused, self.hub_waits_for = None, False, None
        self._inbox.clear()
        self._heard = time.monotonic()
        self.attempt += 1
        self.sync = None  # until the hub's Start for this attempt names the sync
        self._send(RankReady(token=self.endpoint.token, proto=PROTOCOL_VERSION, backend=self.backend, role=role,
                             rank=rank, epoch=epoch, pid=os.getpid(), host=socket.gethostname(), address=address,
                             report=report or ReceiverReport(), attempt=self.attempt))

    def next(self, kinds: tuple[type[Frame], ...], what: str, worker: CollectiveWorker | None = None) -> Any:
        """The next frame of `kinds` from the hub (others are dropped); raises on abort or silence.

        `worker`, this rank's collective thread, is watched meanwhile: its failure is reported to the hub.
        """
        while True:
            while self._inbox:
                frame = self._inbox.popleft()
                if isinstance(frame, kinds):
                    return frame
            self.pump(what, worker)

    def pump(self, what: str, worker: CollectiveWorker | None = None) -> list[Result]:
        """One slice: answer pings, keep the hub's frames, report and return `worker`'s results; raise on an
        abort, a hub that exited or went silent past the timeout."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._watch.fileno_or_socket(), zmq.POLLIN)
        if worker is not None:
            poller.register(worker, zmq.POLLIN)
        if self.closing is not None:
            poller.register(self.closing.fileno_or_socket(), zmq.POLLIN)
        ready = dict(poller.poll(int(CONTROL_SLICE_S * 1000)))
        if self.closing is not None:
            self.closing.check(what)
        results = [] if worker is None else worker.results()
        for result in results:
            if result[2] is None:  # a collective that completed: the sync moves. A failed one is no sign of the hub,
                self._heard = time.monotonic()  # whose verdict is awaited at most timeout_s from its last word
            elif self.reported is None:
                # the hub finds out who is to blame; meanwhile keep answering its pings
                self.reported = result[2]
                self.send(Error(sync=None, kind=COLLECTIVE, message=result[2]))
        while self._sock in ready and self._sock.poll(0, zmq.POLLIN):
            self._take(self._decode(self._sock.recv()))  # only the hub reaches this socket
        self._watch.check(what)  # the hub's connection closed: it exited or was closed
        if not peer_alive(*self.hub):
            raise SyncError(f"sender 0 (the hub, pid {self.hub[0]}) exited while {what}; restart the trainer")
        if time.monotonic() - self._heard > self.timeout_s:
            waits = "" if self.hub_waits_for is None else \
                f"; when last heard it was waiting for {self.hub_waits_for} to call send()/receive()"
            raise SyncTimeoutError(f"timed out after {self.timeout_s:.1f}s {what}: sender 0 (the hub, "
                                   f"{self.endpoint.address}) went silent{waits}: it died or stalled, it is not in "
                                   "send(), or the network between this host and it is down. Check its log and the "
                                   "network, or raise timeout_s; calling this again joins the next sync")
        return results

    def _take(self, frame: Frame) -> None:
        """Note a Welcome, a Waiting or this attempt's Start; answer a Ping, raise an Abort; keep the rest of this
        sync's frames for next(). Any frame shows the hub is alive; frames of another sync are dropped."""
        self._heard = time.monotonic()
        if isinstance(frame, Welcome):
            self.hub = (frame.pid, frame.host)
            return
        if isinstance(frame, (Start, Waiting)):
            if frame.attempt != self.attempt:
                return  # the answer to a ready this rank gave up on: its newer ready is on its way to the hub
            if isinstance(frame, Waiting):
                if frame.missing != self.hub_waits_for:
                    log.info("hwsync: sender 0 (the hub) has this rank's ready and waits for %s", frame.missing)
                self.hub_waits_for = frame.missing
            elif self.sync is None:
                self.sync = frame.sync
            return
        if self.sync is None or getattr(frame, "sync", None) != self.sync:
            return  # a frame of a sync this rank is not in (an earlier one, or one its newer ready replaces)
        if isinstance(frame, (Setup, PlanFrame)):
            self.hub = (frame.pid, frame.host)
        if isinstance(frame, Abort):
            raise RemoteError(f"the sync was aborted: {frame.message}")
        if isinstance(frame, Ping):
            self.send(Pong(n=frame.n))
        elif not isinstance(frame, Alive):
            self._inbox.append(frame)

    def _decode(self, data: bytes) -> Frame:
        """A frame from the hub; a Refused (of any protocol version) raises its reason."""
        try:
            frame = decode(data, TO_RANK)
        except BadFrame:
            reason = refused_reason(data)
            if reason is None:
                raise
            frame = Refused(reason=reason)
        if isinstance(frame, Refused):
            self.refused = True
            raise ProtocolError(f"sender 0 (the hub) refused this rank: {frame.reason}")
        return frame

    def report(self, exc: BaseException) -> None:
        """Tell the hub this rank failed (unless the failure came from the hub, or the hub refused it)."""
        if isinstance(exc, RemoteError) or self.refused or self.sync is None:
            return  # the hub's own verdict, a refused rank, or no sync yet: a newer ready supersedes this one
        kind = COLLECTIVE if self.reported is not None else "local"
        try:
            self.send(Error(sync=None, kind=kind, message=cut(f"{type(exc).__name__}: {exc}")))
        except (zmq.ZMQError, ProtocolError):
            pass

    def close(self) -> None:
        """Close the socket and the context; safe to call twice."""
        self._watch.close()
        close_socket(self._sock, self._ctx)
