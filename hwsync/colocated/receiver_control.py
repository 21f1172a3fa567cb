"""The receiver's control socket to its sender: connect, frames out, the sender's frames in, checked and waited for.

A Welcome is noted (the sender's pid and host: the receiver watches that process from then on);
a Refused raises ProtocolError with the sender's reason, in any protocol version; an Abort of
the sync being waited for raises RemoteError; frames of earlier syncs are skipped. Errors name
the sender's address, never the endpoint string (that carries the token).
"""

from __future__ import annotations

import time

import zmq

from hwsync.control.endpoints import CloseSignal, Endpoint, raise_if_exited, receive_frame
from hwsync.control.sockets import ConnectionWatch, connect_control
from hwsync.errors import ProtocolError, RemoteError
from hwsync.protocol import (
    MAX_PEER_FRAME_BYTES,
    TO_RECEIVER,
    Abort,
    BadFrame,
    Done,
    Error,
    Frame,
    Gone,
    Refs,
    Refused,
    Stopped,
    Welcome,
    check_size,
    cut,
    decode,
    encode,
    refused_reason,
)
from hwsync.sync.stats import SyncStats


class ReceiverControl:
    """A WeightReceiver's DEALER socket to its sender, made on first use and again after a failure."""

    def __init__(self, ctx: zmq.Context, endpoint: Endpoint, timeout_s: float, closing: CloseSignal) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._closing = closing
        self._sock: zmq.Socket | None = None
        self._watch: ConnectionWatch | None = None
        #: the sender refused this receiver: no Gone follows (it is not the sender's peer)
        self.refused = False
        #: id of the last offer seen on this socket: older frames are stale
        self.last_sync = 0
        #: (pid, host) of the sender, from its Welcome or last offer
        self.sender: tuple[int | None, str | None] = (None, None)
        #: the sync whose Abort this receiver heard (it answers with Stopped once its reads ended), if any
        self.aborted: int | None = None

    @property
    def address(self) -> str:
        """The sender's address alone: what errors and logs name."""
        return self.endpoint.address

    def connect(self) -> None:
        """Connect if not connected (the first sync, or the first after a failure)."""
        if self._sock is None:
            self._sock, self._watch = connect_control(self._ctx, self.endpoint)
            self.refused = False
            self.aborted = None

    def send(self, frame: Frame) -> None:
        """One frame to the sender."""
        assert self._sock is not None
        self._sock.send(check_size(encode(frame), MAX_PEER_FRAME_BYTES, f"this receiver's {frame.T} frame"))

    def decode(self, parts: list[bytes]) -> Frame:
        """The sender's frame; a Welcome is noted, a Refused raises its reason (in any protocol version)."""
        if len(parts) != 1:
            raise ProtocolError(f"the sender sent a message of {len(parts)} parts; expected one frame")
        try:
            frame = decode(parts[0], TO_RECEIVER)
        except BadFrame:
            reason = refused_reason(parts[0])
            if reason is None:
                raise
            frame = Refused(reason=reason)
        if isinstance(frame, Refused):
            self.refused = True
            raise ProtocolError(f"the sender refused this receiver: {frame.reason}")
        if isinstance(frame, Welcome):
            self.sender = (frame.pid, frame.host)
        return frame

    def await_frame(self, kinds: type[Frame] | tuple[type[Frame], ...], sync: int | None, what: str,
                    stats: SyncStats, timeout_s: float | None = None) -> Frame:
        """The next frame of `kinds` of sync `sync` (None: of a sync newer than the last seen); the wait is wait_s.
        `timeout_s`: the longest wait (None: the receiver's timeout)."""
        t0 = time.perf_counter()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                assert self._sock is not None and self._watch is not None
                frame = self.decode(receive_frame(
                    self._sock, timeout_s, what=what, endpoint=self.address, peers=[self.sender],
                    watches=[self._closing, self._watch], deadline=deadline))
                if isinstance(frame, Welcome):
                    continue
                frame_sync = getattr(frame, "sync", None)
                if sync is not None and frame_sync != sync:
                    continue  # a frame of an earlier, abandoned sync
                if sync is None and frame_sync is not None and frame_sync <= self.last_sync:
                    continue  # e.g. an abort for a sync this receiver had already completed
                if isinstance(frame, Abort):
                    raise self._aborted(frame)
                if isinstance(frame, kinds):
                    return frame
        finally:
            stats.wait_s += time.perf_counter() - t0

    def frame_waiting(self) -> bool:
        """Whether a frame can be read now: cheap enough (one ZMQ_EVENTS read) to ask while spinning on the doorbell."""
        assert self._sock is not None
        return bool(int(self._sock.get(zmq.EVENTS)) & zmq.POLLIN)

    def poll(self, sync: int, what: str) -> list[Done | Refs]:
        """Without waiting (while reading the doorbell): this sync's Done and Refs frames queued now; raise on an
        Abort, close(), or a sender that went away."""
        assert self._sock is not None and self._watch is not None
        self._closing.check(what)
        frames: list[Done | Refs] = []
        while self._sock.poll(0, zmq.POLLIN):
            frame = self.decode(self._sock.recv_multipart())
            if getattr(frame, "sync", None) != sync:
                continue
            if isinstance(frame, Abort):
                raise self._aborted(frame)
            if isinstance(frame, (Done, Refs)):
                frames.append(frame)
        self._watch.check(what)  # after the frames: an abort sent just before the sender closed comes first
        raise_if_exited([self.sender], what=what, endpoint=self.address)
        return frames

    def _aborted(self, frame: Abort) -> RemoteError:
        """The error an Abort raises; its sync is noted, to be answered with Stopped (report_failure)."""
        self.aborted = frame.sync
        return RemoteError(f"sender aborted the sync: {frame.message}")

    def report_failure(self, sync: int | None, exc: BaseException) -> None:
        """Tell the sender, once this receiver's reads of its memory ended: Stopped to its Abort, our Ready withdrawn
        when no offer came, else an error frame."""
        if self._sock is None:
            return
        if sync is None and isinstance(exc, BadFrame) and exc.sync is not None:
            sync = exc.sync  # a malformed offer: refused with the reason, as its sender can match it to the sync
        try:
            if isinstance(exc, RemoteError):
                if self.aborted is not None:  # the sender's send() raises only once every receiver said this
                    self.send(Stopped(sync=self.aborted))
            elif sync is None and not self.refused:
                # no offer came: withdraw our Ready so send() skips us (an abort means the sender forgot us already)
                self.send(Gone())
            elif sync is not None:
                kind = "protocol" if isinstance(exc, ProtocolError) else "load"
                self.send(Error(sync=sync, kind=kind, message=cut(f"{type(exc).__name__}: {exc}")))
        except (zmq.ZMQError, ProtocolError):
            pass

    def close(self, linger_s: float) -> None:
        """Close the watch and the socket; the next connect() makes new ones (and sees no frame of earlier syncs)."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._sock is not None:
            self._sock.close(linger=int(linger_s * 1000))
            self._sock = None
        self.last_sync = 0
