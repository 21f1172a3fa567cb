"""WeightReceiver: the engine's side of a sync.

It follows whatever geometry the sender announces (bucket size, buffers, transport, doorbell
or frames), so nothing has to be configured alike on both sides. `load` sees complete tensors,
once per bucket; whole tensors are zero-copy views of the shared buffer, valid during the call
only, and tensors reassembled from chunks are valid until the next sync (their memory is
reused). `into` names the caller's own tensors to copy straight into, chunk by chunk: the
fastest way for a receiver that owns preallocated destinations. Tensors the sender keeps in
shared parameter memory arrive as references (refs.py): copied once, straight `into` their
destination, or handed to `load` as views of that memory, valid during the call only.
A failure is reported to the sender as an error frame carrying the message, and leaves the
receiver marked as holding an incomplete update until the next complete sync. A sender that
exits or closes is noticed at once, between syncs too: the connection's monitor sees it go
(and a same-host sender's pid, from its Welcome, is checked as well). A sender that refuses
this receiver says why, and receive() raises ProtocolError with the reason.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import zmq

from hwsync.bucket import BucketReader, IntoFn, LoadFn
from hwsync.colocated.doorbell import Doorbell, doorbell_supported, spin_wait
from hwsync.colocated.refs import SharedReader
from hwsync.control import Endpoint, Lifetime, peer_alive, raise_if_exited, receive_frame, remove_ipc_dir
from hwsync.devices import synchronize_for
from hwsync.errors import ProtocolError, RemoteError, SyncError
from hwsync.interfaces import Backend, Handles, ReceiveBuffers
from hwsync.manifest import TensorSpec
from hwsync.memory import local_memory
from hwsync.protocol import PROTOCOL_VERSION, TO_RECEIVER, Abort, Accept, BadFrame, Bucket, Complete, Done, Error, \
    Frame, Gone, Offer, Ready, Refs, Refused, Release, Welcome, decode, encode, peek
from hwsync.protocol.limits import MAX_PEER_FRAME_BYTES, check_size, cut
from hwsync.registry import get_backend
from hwsync.sockets import ConnectionWatch, connect_control
from hwsync.stats import SyncStats
from hwsync.timing import CLOSE_LINGER_S, DEFAULT_TIMEOUT_S, ERROR_LINGER_S

log = logging.getLogger("hwsync")


class WeightReceiver:
    """Connects to a WeightSender's endpoint and receives syncs into a `load` callback."""

    def __init__(self, endpoint: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, backend: Backend | None = None) -> None:
        self._endpoint = Endpoint.parse(endpoint)
        self.timeout_s = timeout_s
        self._backend = backend
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._watch: ConnectionWatch | None = None
        #: this receiver's id, the same on every connection it makes (the sender tells reconnections apart)
        self._instance = secrets.token_hex(8)
        self._lifetime = Lifetime("WeightReceiver", self._release)
        #: the sender refused this receiver: no Gone follows (it is not the sender's peer)
        self._refused = False
        self._buffers: ReceiveBuffers | None = None
        self._handles: Handles | None = None
        self._doorbell: Doorbell | None = None
        #: the sender's Done frame, and Refs frames, that arrived while reading from the doorbell
        self._done: Done | None = None
        self._refs: list[Refs] = []
        self._shared: SharedReader | None = None
        #: last version received completely, or None
        self.version: int | None = None
        #: True when a sync broke after some bucket was loaded: the model holds a mix
        self.incomplete = False
        self._reader = BucketReader()
        #: id of the last offer seen on this socket: older frames are stale
        self._last_sync = 0
        #: (pid, host) of the sender, from its Welcome or last offer
        self._sender: tuple[int | None, str | None] = (None, None)

    @property
    def backend(self) -> Backend:
        """The backend used to open the sender's transport (selected on first use)."""
        if self._backend is None:
            self._backend = get_backend()
        return self._backend

    def receive(
        self,
        load: LoadFn | None = None,
        *,
        into: IntoFn | None = None,
        on_done: Callable[[], None] | None = None,
        check_manifest: Callable[[list[TensorSpec]], None] | None = None,
        state: dict[str, Any] | None = None,
    ) -> SyncStats:
        """Receive one sync; `state` is reported to the sender (e.g. the engine's sleep level).

        `into(name, dtype, shape)` may return the caller's own contiguous tensor of that dtype
        and shape: the tensor's bytes are copied straight into it (no reassembly, no `load`).
        Tensors it returns None for go to `load`.
        """
        if load is None and into is None:
            raise ValueError("receive() needs load (called with each bucket's tensors), into (naming "
                             "destination tensors), or both")
        with self._lifetime.call("receive"):
            return self._receive(load, into, on_done, check_manifest, state)

    def _receive(self, load: LoadFn | None, into: IntoFn | None, on_done: Callable[[], None] | None,
                 check_manifest: Callable[[list[TensorSpec]], None] | None, state: dict[str, Any] | None
                 ) -> SyncStats:
        start = time.perf_counter()
        stats, sync = SyncStats(), None
        self._done, self._refs = None, []
        try:
            self._connect()
            self._send(Ready(token=self._endpoint.token, proto=PROTOCOL_VERSION, pid=os.getpid(),
                             host=socket.gethostname(), state=self._state(state), doorbell=doorbell_supported(),
                             into=into is not None, backend=self.backend.name,
                             transports=sorted(self.backend.transports()), instance=self._instance))
            offer = self._await(Offer, None, "waiting for the sender's offer", stats)
            assert isinstance(offer, Offer)
            sync = offer.sync
            self._last_sync = sync
            self._sender = (offer.pid, offer.host)
            self._accept(offer, check_manifest, stats)
            self._receive_buckets(offer, load, into, stats)
            if on_done is not None:
                t0 = time.perf_counter()
                on_done()
                stats.load_s += time.perf_counter() - t0
            self.version = offer.version
            self.incomplete = False
            stats.total_s = time.perf_counter() - start
            self._send(Complete(sync=sync, stats=stats.to_dict()))
        except BaseException as exc:
            self._fail(sync, exc)
            raise
        return stats

    def _state(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """The caller's state plus this device's memory, which a sender may size buckets from."""
        out = dict(state or {})
        if "memory" not in out:
            try:
                out["memory"] = asdict(local_memory(self.backend.device()))
            except Exception as exc:  # memory is advisory: never fail a sync over it
                log.debug("hwsync: no memory figures for the sender: %s", exc)
        return out

    def _accept(self, offer: Offer, check_manifest: Callable | None, stats: SyncStats) -> None:
        if offer.proto != PROTOCOL_VERSION:
            raise ProtocolError(
                f"the sender speaks hwsync protocol {offer.proto} and this receiver speaks "
                f"{PROTOCOL_VERSION}; install the same hwsync version on both sides"
            )
        transports = self.backend.transports()
        if offer.transport not in transports:
            raise ProtocolError(
                f"the sender uses transport {offer.transport!r} of backend {offer.backend!r}, which this "
                f"receiver's backend {self.backend.name!r} lacks ({sorted(transports)}); set HWSYNC_BACKEND alike"
            )
        if offer.handles != self._handles:  # the geometry changed (or first sync): follow the sender
            self._close_buffers()
            self._buffers = transports[offer.transport].open_receiver(offer.handles)
            self._handles = offer.handles
        bell = offer.doorbell
        if not bell or (self._doorbell is not None and self._doorbell.handle() != bell):
            self._close_doorbell()  # frames this time, or another doorbell: unmap the old one
        if bell and self._doorbell is None:
            self._doorbell = Doorbell.attach(bell)
        if self._shared is None:
            self._shared = SharedReader(self.backend.device())
        self._shared.retain(offer.segments)  # unmap what the sender no longer has
        if offer.manifest is not None and check_manifest is not None:
            check_manifest(offer.manifest)
        stats.version = offer.version
        stats.bucket_bytes = offer.bucket_bytes
        stats.num_buffers = offer.num_buffers
        stats.transport = offer.transport
        self._send(Accept(sync=offer.sync))

    def _receive_buckets(self, offer: Offer, load: LoadFn | None, into: IntoFn | None, stats: SyncStats) -> None:
        assert self._buffers is not None
        sync, reader, seq, rank = offer.sync, self._reader, offer.first, offer.rank
        bell = self._doorbell if offer.doorbell else None
        reader.begin(self.backend.device().torch_device())  # reassemble on this receiver's own device
        views, shared = False, self._shared  # views: whether load was handed the sender's shared memory
        assert shared is not None
        while True:
            what = f"waiting for bucket {stats.buckets}"
            if self._lifetime.signal.is_set():  # close() from another thread: checked per bucket, the waits check too
                self._lifetime.signal.check(what)
            if bell is None:
                frame = self._await((Bucket, Done, Refs), sync, what, stats)
            else:
                frame = self._ring_next(bell, seq, sync, what, stats)
            if isinstance(frame, Done):
                if reader.pending():
                    raise SyncError(f"the sync ended with tensors incomplete: {reader.pending()[:5]}")
                shared.finish(views, stats)  # queued reads of shared memory end before our Complete
                return
            if isinstance(frame, Refs):
                self.incomplete = True
                views = shared.receive(frame, offer.pid, load, into, stats) or views
                continue
            assert isinstance(frame, Bucket)
            if frame.sync != sync or frame.seq != seq:
                raise ProtocolError(f"bucket {seq} of sync {sync} was announced as {frame.seq} of sync "
                                    f"{frame.sync}; the sender and receiver are out of step")
            if frame.nbytes > offer.bucket_bytes or frame.buf >= offer.num_buffers:
                raise ProtocolError(f"bucket {seq} claims {frame.nbytes} bytes in buffer {frame.buf}, outside the "
                                    f"offered {offer.num_buffers} buffers of {offer.bucket_bytes} bytes")
            t0 = time.perf_counter()
            self.incomplete = True
            view = self._buffers.view(frame.buf, frame.nbytes)
            where = view.device
            tensors = reader.read(view, frame.entries, into)
            del view  # no view may outlive the buffer's release
            early = not reader.aliases_view  # only reassembled tensors: the sender may refill now
            if early:
                self._release_bucket(sync, frame.buf, seq, bell, rank, where)
            if tensors:
                if load is None:
                    raise ValueError(f"into() returned None for {tensors[0][0]!r} and no load was given; return "
                                     "a destination for every tensor or pass load")
                load(tensors)
            del tensors
            if not early:
                self._release_bucket(sync, frame.buf, seq, bell, rank, where)
            stats.load_s += time.perf_counter() - t0
            stats.buckets += 1
            stats.tensors += sum(1 for e in frame.entries if e.is_last)
            stats.bytes += sum(e.chunk_bytes for e in frame.entries)
            seq += 1

    def _ring_next(self, bell: Doorbell, seq: int, sync: int, what: str, stats: SyncStats) -> Frame:
        """The next bucket's descriptor from the doorbell, a Refs frame, or the sender's Done frame."""
        t0 = time.perf_counter()
        try:
            while True:
                if bell.posted > seq:
                    return decode(bell.read(seq), {Bucket.T: Bucket})
                if self._refs:  # each came before Done on the socket
                    return self._refs.pop(0)
                if self._done is not None:  # "done" follows the last post: nothing more will come
                    return self._done
                spin_wait(lambda: bell.posted > seq or self._done is not None or bool(self._refs),
                          lambda: self._poll_sender(sync, what), timeout_s=self.timeout_s, what=what,
                          endpoint=str(self._endpoint.address))
        finally:
            stats.wait_s += time.perf_counter() - t0

    def _poll_sender(self, sync: int, what: str) -> None:
        """While spinning on the doorbell: take Done, raise on Abort, close() or a sender that went away."""
        assert self._sock is not None and self._watch is not None
        self._lifetime.signal.check(what)
        while self._sock.poll(0, zmq.POLLIN):
            frame = self._decode(self._sock.recv_multipart())
            if getattr(frame, "sync", None) != sync:
                continue
            if isinstance(frame, Abort):
                raise RemoteError(f"sender aborted the sync: {frame.message}")
            if isinstance(frame, Done):
                self._done = frame
            if isinstance(frame, Refs):
                self._refs.append(frame)
        self._watch.check(what)  # after the frames: an abort sent just before the sender closed comes first
        raise_if_exited([self._sender], what=what, endpoint=str(self._endpoint.address))

    def _decode(self, parts: list[bytes]) -> Frame:
        """The sender's frame; a Welcome is noted, a Refused raises its reason (in any protocol version)."""
        if len(parts) != 1:
            raise ProtocolError(f"the sender sent a message of {len(parts)} parts; expected one frame")
        try:
            frame = decode(parts[0], TO_RECEIVER)
        except BadFrame:
            raw = peek(parts[0])
            if raw is None or raw.get("t") != Refused.T or not isinstance(raw.get("reason"), str):
                raise
            frame = Refused(reason=raw["reason"])
        if isinstance(frame, Refused):
            self._refused = True
            raise ProtocolError(f"the sender refused this receiver: {frame.reason}")
        if isinstance(frame, Welcome):
            self._sender = (frame.pid, frame.host)
        return frame

    def _release_bucket(self, sync: int, buf: int, seq: int, bell: Doorbell | None, rank: int,
                        where: torch.device) -> None:
        assert self._buffers is not None
        # this process's device reads of the buffer (reassembly, into=, load) may still be queued
        synchronize_for(self.backend.device(), where)
        self._buffers.release(buf)
        if bell is not None:
            bell.release(rank, seq)
        else:
            self._send(Release(sync=sync, buf=buf, seq=seq))

    def _await(self, kinds: type[Frame] | tuple[type[Frame], ...], sync: int | None, what: str,
               stats: SyncStats) -> Frame:
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                assert self._sock is not None and self._watch is not None
                frame = self._decode(receive_frame(
                    self._sock, self.timeout_s, what=what, endpoint=str(self._endpoint.address), peers=[self._sender],
                    watches=[self._lifetime.signal, self._watch], deadline=deadline))
                if isinstance(frame, Welcome):
                    continue
                frame_sync = getattr(frame, "sync", None)
                if sync is not None and frame_sync != sync:
                    continue  # a frame of an earlier, abandoned sync
                if sync is None and frame_sync is not None and frame_sync <= self._last_sync:
                    continue  # e.g. an abort for a sync this receiver had already completed
                if isinstance(frame, Abort):
                    raise RemoteError(f"sender aborted the sync: {frame.message}")
                if isinstance(frame, kinds):
                    return frame
        finally:
            stats.wait_s += time.perf_counter() - t0

    def _connect(self) -> None:
        if self._sock is None:
            self._sock, self._watch = connect_control(self._ctx, self._endpoint)
            self._refused = False

    def _send(self, frame: Frame) -> None:
        assert self._sock is not None
        self._sock.send(check_size(encode(frame), MAX_PEER_FRAME_BYTES, f"this receiver's {frame.T} frame"))

    def _fail(self, sync: int | None, exc: BaseException) -> None:
        """Report the failure to the sender (unless it came from there), then drop buffers and socket."""
        if self._sock is not None:
            try:
                if sync is None and not self._refused:  # no offer came: withdraw our Ready so send() skips us
                    self._send(Gone())
                elif sync is not None and not isinstance(exc, RemoteError):
                    kind = "protocol" if isinstance(exc, ProtocolError) else "load"
                    self._send(Error(sync=sync, kind=kind, message=cut(f"{type(exc).__name__}: {exc}")))
            except (zmq.ZMQError, ProtocolError):
                pass
        log.warning("hwsync receive failed: %s", exc)
        dead = self._sender[0] is not None and not peer_alive(*self._sender)
        if dead:  # the sender died without cleaning up: its private ipc directory is ours to remove
            remove_ipc_dir(self._endpoint.address)
        if self._shared is not None:  # unmapped, and a dead sender's segments unlinked: none stays alive
            self._shared.close(dead_sender=self._sender[0] if dead else None)
        self._close_buffers()
        self._close_socket(ERROR_LINGER_S)
        self._last_sync = 0  # a new socket sees no frame of earlier syncs

    def _close_socket(self, linger_s: float) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._sock is not None:
            self._sock.close(linger=int(linger_s * 1000))
            self._sock = None

    def _close_doorbell(self) -> None:
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None

    def _close_buffers(self) -> None:
        self._close_doorbell()
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None
            self._handles = None

    def close(self) -> None:
        """Detach from buffers and close the socket; safe to call twice, and from any thread.

        A receive() running in another thread ends at once, telling the sender; every later call
        raises ClosedError.
        """
        self._lifetime.close()

    def _release(self) -> None:
        if self._shared is not None:
            self._shared.close()
        self._close_buffers()
        self._reader.clear()  # reassembly scratch may live in device memory
        self._close_socket(CLOSE_LINGER_S)
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
