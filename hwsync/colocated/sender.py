"""WeightSender: the trainer's side of a sync.

One sender is one session: its socket and buffers are set up once and serve every sync. A
sync streams the caller's (name, tensor) iterable into the transport's buffers, bucket after
bucket; while receivers load bucket k the sender packs bucket k+1 into another buffer, and a
buffer is refilled only after every receiver has released it. Which buffer comes next is the
BufferPool's choice; buckets are signalled through the shared doorbell where it works, else by
a ZeroMQ frame each (links). The frames are hwsync.protocol's; who may send them is the peer
table's (peers.py). Any failure tears the session down (segments unlinked; the bound socket
stays) and the next send() builds it again. close() from another thread ends a running sync
with an abort every receiver hears at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import zmq

from hwsync.bucket import ALIGN
from hwsync.colocated.buffer_pool import BufferPool
from hwsync.colocated.doorbell import Doorbell, doorbell_supported
from hwsync.colocated.links import BucketLink, DoorbellLink, FrameLink
from hwsync.colocated.geometry import bucket_geometry
from hwsync.colocated.peers import Peer, PeerTable
from hwsync.colocated.stream import BucketStream
from hwsync.control import Endpoint, Lifetime, new_token, private_ipc_dir, raise_if_exited, receive_frame, \
    remove_ipc_dir
from hwsync.errors import ClosedError, ProtocolError, RemoteError
from hwsync.gate import reply_on
from hwsync.interfaces import Backend, SendBuffers, Transport
from hwsync.manifest import TensorSpec
from hwsync.offload import onload as onload_params
from hwsync.planner import TrainerModel, plan_for_engines
from hwsync.protocol import PROTOCOL_VERSION, Abort, Accept, Complete, Done, Error, Frame, Offer, encode
from hwsync.protocol.limits import MAX_SENDER_FRAME_BYTES, check_size, cut
from hwsync.registry import get_backend
from hwsync.shared_params import live_segments
from hwsync.sockets import ConnectionLog, bind_control
from hwsync.source import NamedTensors, TensorSource
from hwsync.stats import SyncStats
from hwsync.timing import CLOSE_LINGER_S, DEFAULT_TIMEOUT_S

log = logging.getLogger("hwsync")


class WeightSender:
    """Binds a control endpoint and sends named tensors to one or more WeightReceivers."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        bucket_bytes: int | str | None = None,
        num_buffers: int | None = None,
        transport: str | Transport | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        num_receivers: int = 1,
        backend: Backend | None = None,
    ) -> None:
        #: neither size given: the transport's defaults, chosen at the first send from how receivers take tensors
        self._default_geometry = bucket_bytes is None and num_buffers is None
        num_buffers = 2 if num_buffers is None else num_buffers
        if num_buffers < 2:
            raise ValueError(f"num_buffers={num_buffers}: at least 2 are needed to overlap packing with loading")
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be at least 1")
        self.backend = backend or get_backend()
        self.transport = self._resolve_transport(transport)
        if bucket_bytes not in (None, "auto") and not isinstance(bucket_bytes, int):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a byte count, None (the transport's "
                             "default) or 'auto' (from the least free memory of sender and receivers)")
        #: "auto" until the first send sizes it from the memory the peers report
        self._auto_bucket = bucket_bytes == "auto"
        self.bucket_bytes = self.transport.default_bucket_bytes if bucket_bytes in (None, "auto") else bucket_bytes
        if self.bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is below the minimum of {ALIGN} bytes")
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.num_receivers = num_receivers
        self._token = new_token()
        self._owns_ipc_dir = endpoint is None
        self._address = f"ipc://{private_ipc_dir()}/control" if endpoint is None else endpoint
        if not self._address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint {endpoint!r} must start with ipc:// or tcp://")
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None
        try:
            self._sock, self._address, self._server_key = bind_control(self._ctx, self._address)
        except BaseException:
            self._ctx.term()
            if self._owns_ipc_dir:
                remove_ipc_dir(self._address)
            raise
        self._connections = ConnectionLog(self._sock, "the sender")
        self._peers = PeerTable(self._token, num_receivers, self.backend.name, self.transport.name,
                                reply_on(lambda: self._sock))
        self._buffers: SendBuffers | None = None
        self._doorbell: Doorbell | None = None
        self._pool: BufferPool | None = None
        #: sequence number of the next bucket; grows across the syncs of one set of buffers
        self._seq = 0
        self._syncs = 0
        #: close() from another thread: the running sync ends and aborts its receivers
        self._lifetime = Lifetime("WeightSender", self._release)
        self._closing = self._lifetime.signal
        #: whether every receiver accepted the current offer (and so maps the buffers it was given)
        self._accepted = False

    def _resolve_transport(self, transport: str | Transport | None) -> Transport:
        if isinstance(transport, Transport):
            return transport
        if transport is None:
            return self.backend.default_transport()
        available = self.backend.transports()
        if transport not in available:
            raise ValueError(f"backend {self.backend.name!r} has no transport {transport!r}; it has {sorted(available)}")
        return available[transport]

    @property
    def endpoint(self) -> str:
        """What a WeightReceiver connects to: address, token and (tcp://) the CURVE public key."""
        return str(Endpoint(self._address, self._token, self._server_key))

    def send(
        self,
        named_tensors: TensorSource | TrainerModel,
        *,
        version: int,
        manifest: list[TensorSpec] | None = None,
        onload: torch.nn.Module | Iterable[torch.Tensor] | None = None,
    ) -> SyncStats:
        """Send one sync; returns when every receiver has loaded it, raises SyncError otherwise.

        Tensors that lie in shared parameter memory (hwsync.SharedParameters) are sent as
        references that receivers read in place: they are done with them when this returns.

        `named_tensors` is an iterable of (name, tensor), a function of the receiver's reported
        state returning one, or a TrainerModel, which is planned against the engines' state.
        `onload`: parameters to bring from host memory to the device for the sync, and back.
        """
        with self._lifetime.call("send"):
            return self._send(named_tensors, version, manifest, onload)

    def _send(self, named_tensors: TensorSource | TrainerModel, version: int, manifest: list[TensorSpec] | None,
              onload: torch.nn.Module | Iterable[torch.Tensor] | None) -> SyncStats:
        start = time.perf_counter()
        self._syncs += 1
        sync = self._syncs
        stats = SyncStats(version=version, num_buffers=self.num_buffers, transport=self.transport.name)
        peers: list[Peer] = []
        try:
            peers = self._await_ready(stats)
            source, manifest = self._source(named_tensors, peers, stats, manifest)
            if self._buffers is None:
                self._size_buckets(peers, stats)
                self._open_buffers()
            stats.bucket_bytes = self.bucket_bytes
            link = self._offer(peers, sync, version, manifest, stats)
            assert self._buffers is not None and self._pool is not None
            here = socket.gethostname()  # references into our segments only for receivers that can map them
            refs = (lambda frame: self._broadcast(peers, frame)) if all(p.host == here for p in peers) else None
            stream = BucketStream(link, self._buffers, self._pool, self.bucket_bytes, sync, self._seq, stats,
                                  dense=all(p.into for p in peers), send_refs=refs)
            if onload is None:
                self._seq = stream.run(source, manifest)
            else:
                with onload_params(onload, backend_device=self.backend.device()) as moved:
                    self._seq = stream.run(source, manifest)
                stats.onload_s, stats.offload_s = moved.onload_s, moved.offload_s
                stats.notes["onload"] = moved.to_dict()
            self._finish(peers, sync, stats)
        except BaseException as exc:
            self._fail(peers, sync, exc)
            raise
        finally:
            self._peers.end_sync(failed=sys.exc_info()[0] is not None)
        stats.total_s = time.perf_counter() - start
        log.info("hwsync sent %s", stats)
        return stats

    def _source(self, named_tensors: TensorSource | TrainerModel, peers: list[Peer], stats: SyncStats,
                manifest: list[TensorSpec] | None) -> tuple[NamedTensors, list[TensorSpec] | None]:
        """The tensors to send and their manifest; a TrainerModel is planned, and announces what its plan sends."""
        if isinstance(named_tensors, TrainerModel):
            t0 = time.perf_counter()
            plan = plan_for_engines([p.state.get("engine") for p in peers], named_tensors)
            stats.plan_s = time.perf_counter() - t0
            stats.notes["plan"] = plan.to_dict()
            log.info("hwsync plan: %s", plan.reason)
            return plan.tensors(), plan.manifest() if manifest is None else manifest
        return (named_tensors(peers[0].state) if callable(named_tensors) else named_tensors), manifest

    def _size_buckets(self, peers: list[Peer], stats: SyncStats) -> None:
        """Default sizes: by how receivers take tensors; "auto": by the least free memory of all sides."""
        self.bucket_bytes, self.num_buffers = bucket_geometry(
            self.transport, self.backend.device(), peers, stats, self.bucket_bytes, self.num_buffers,
            default=self._default_geometry, auto=self._auto_bucket)

    def _open_buffers(self) -> None:
        self._buffers = self.transport.open_sender(self.bucket_bytes, self.num_buffers)
        self._pool = BufferPool(self.num_buffers, self.bucket_bytes)
        self._seq = 0
        if doorbell_supported():
            self._doorbell = Doorbell.create(self.num_receivers, self.num_buffers)

    def _await_ready(self, stats: SyncStats) -> list[Peer]:
        """Receivers ready for this sync; the peer table answers (and refuses) each Ready as it comes."""
        t0 = time.perf_counter()
        what, deadline = "waiting for receivers to call receive()", time.monotonic() + self.timeout_s
        while True:
            self._drain()  # a receiver that gave up says "gone" right after its "ready": read all that is queued
            refusal = self._peers.gate.take_fatal()
            if refusal is not None:
                raise ProtocolError(f"a receiver was refused: {refusal}")
            if self._peers.ready_count() >= self.num_receivers:
                break
            self._take(receive_frame(self._socket(), self.timeout_s, what=what, endpoint=self.endpoint,
                                     watches=[self._closing, self._connections], deadline=deadline, copy=False))
        stats.wait_s += time.perf_counter() - t0
        return self._peers.start_sync()

    def _take(self, parts: list[zmq.Frame]) -> tuple[bytes, Frame] | None:
        """A checked frame of one of this sync's receivers, or None (handled, dropped, or another peer's)."""
        got = self._peers.take(parts)
        if got is None or self._peers.sync_peer(got[0]) is None:
            return None
        return got

    def _drain(self) -> list[tuple[bytes, Frame]]:
        """Every message queued now, taken; the frames of this sync's receivers among them."""
        sock, frames = self._socket(), []
        self._connections.check()
        while sock.poll(0, zmq.POLLIN):
            got = self._take(sock.recv_multipart(copy=False))
            if got is not None:
                frames.append(got)
        return frames

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            raise ClosedError("this WeightSender is closed; make a new one to send again")
        return self._sock

    def _offer(self, peers: list[Peer], sync: int, version: int, manifest: list[TensorSpec] | None,
               stats: SyncStats) -> BucketLink:
        """Announce the sync's geometry to each receiver (its rank, the signalling way) and await the accepts."""
        assert self._buffers is not None
        link, bell = self._link(peers, sync)
        offer = Offer(
            sync=sync, proto=PROTOCOL_VERSION, backend=self.backend.name, transport=self.transport.name,
            handles={}, bucket_bytes=self.bucket_bytes, num_buffers=self.num_buffers,
            version=version, pid=os.getpid(), host=socket.gethostname(), manifest=manifest,
            tensors=None if manifest is None else len(manifest),
            total_bytes=None if manifest is None else sum(s.nbytes for s in manifest),
            first=self._seq, doorbell=None if bell is None else bell.handle(), rank=0, segments=live_segments())
        self._accepted = False
        for rank, peer in enumerate(peers):
            # each receiver its own handles: shared device memory is exported once per receiver process
            handles = self._buffers.handles_for(peer.identity.hex(), peer.pid, peer.host)
            data = check_size(encode(dataclasses.replace(offer, rank=rank, handles=handles)), MAX_SENDER_FRAME_BYTES,
                              f"the offer of {len(manifest or [])} tensors")
            self._socket().send_multipart([peer.identity, data])
        self._await_each(peers, sync, Accept, "waiting for receivers to accept the offer", stats)
        self._accepted = True
        return link

    def _link(self, peers: list[Peer], sync: int) -> tuple[BucketLink, Doorbell | None]:
        """The doorbell when every receiver shares this host and can use it, else a frame per bucket."""
        here = socket.gethostname()
        if self._doorbell is not None and all(p.doorbell and p.host == here for p in peers):
            self._doorbell.start_sync(len(peers), self._seq)
            poll = lambda what: self._poll_failures(peers, sync, what)  # noqa: E731
            return DoorbellLink(self._doorbell, len(peers), poll, self.timeout_s, self.endpoint), self._doorbell
        link = FrameLink([p.identity for p in peers], self._seq, lambda frame: self._broadcast(peers, frame),
                         lambda what: self._recv(what, [(p.pid, p.host) for p in peers]),
                         lambda frame: self._raise_if_error(frame, sync),
                         lambda what: self._poll_failures(peers, sync, what, link.note))
        return link, None

    def _poll_failures(self, peers: list[Peer], sync: int, what: str,
                       note: Callable[[bytes, Frame], None] | None = None) -> None:
        """While packing or spinning: raise on close(), an error frame or a receiver that exited.

        Every frame queued now is read (a Ready of another receiver is answered at once); `note`
        takes this sync's receivers' frames (the frame link counts releases).
        """
        self._closing.check(what)
        for identity, frame in self._drain():
            self._raise_if_error(frame, sync)
            if note is not None:
                note(identity, frame)
        raise_if_exited([(p.pid, p.host) for p in peers], what=what, endpoint=self.endpoint)

    def _finish(self, peers: list[Peer], sync: int, stats: SyncStats) -> None:
        self._broadcast(peers, Done(sync=sync, buckets=stats.buckets, tensors=stats.tensors, bytes=stats.bytes))
        replies = self._await_each(peers, sync, Complete, "waiting for receivers to finish loading", stats)
        reports = [r.stats for r in replies]
        if self._pool is not None and self._pool.adaptive:
            stats.notes["pool"] = self._pool.to_dict()
        stats.peer = reports[0] if len(reports) == 1 else {"receivers": reports}
        stats.load_s = max((r.get("load_s", 0.0) for r in reports), default=0.0)

    def _await_each(self, peers: list[Peer], sync: int, kind: type[Accept] | type[Complete], what: str,
                    stats: SyncStats) -> list[Any]:
        t0 = time.perf_counter()
        replies: dict[bytes, Any] = {}
        while len(replies) < len(peers):
            identity, frame = self._recv(what, [(p.pid, p.host) for p in peers])
            self._raise_if_error(frame, sync)
            if isinstance(frame, kind) and frame.sync == sync:
                replies[identity] = frame
        stats.wait_s += time.perf_counter() - t0
        return [replies[p.identity] for p in peers]

    @staticmethod
    def _raise_if_error(frame: Frame, sync: int) -> None:
        if isinstance(frame, Error) and frame.sync in (sync, None):
            cls = ProtocolError if frame.kind == "protocol" else RemoteError
            raise cls(f"receiver failed: {frame.message}")

    def _recv(self, what: str, peers: list[tuple[int | None, str | None]]) -> tuple[bytes, Frame]:
        """The next frame of one of this sync's receivers; anything else that arrives meanwhile is handled."""
        deadline = time.monotonic() + self.timeout_s  # one deadline, however many other frames arrive
        while True:
            got = self._take(receive_frame(self._socket(), self.timeout_s, what=what, endpoint=self.endpoint,
                                           peers=peers, watches=[self._closing, self._connections], deadline=deadline,
                                           copy=False))
            if got is not None:
                return got

    def _broadcast(self, peers: list[Peer], frame: Frame) -> None:
        data, sock = encode(frame), self._socket()
        for peer in peers:
            sock.send_multipart([peer.identity, data])

    def _fail(self, peers: list[Peer], sync: int, exc: BaseException) -> None:
        """Abort every receiver (one that failed first ignores it), then release the buffers.

        The bound socket stays: it is the session's address, and a receiver reconnecting after
        the failure must find it. Frames of the failed sync are told apart by their sync id.
        """
        if peers and self._sock is not None:
            try:
                self._broadcast(peers, Abort(sync=sync, message=cut(f"{type(exc).__name__}: {exc}")))
            except zmq.ZMQError:
                pass
        if self._buffers is not None and not self._accepted:  # some never mapped what they were offered
            for peer in peers:
                self._buffers.release_for(peer.identity.hex())
        self._close_buffers()

    def _close_buffers(self) -> None:
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None
        self._pool = None

    def close(self) -> None:
        """Release buffers, socket and the private ipc directory; safe to call twice, and from any thread.

        A sync running in another thread ends at once: it aborts its receivers and raises
        ClosedError there. Every later call raises ClosedError.
        """
        self._lifetime.close()

    def _release(self) -> None:
        self._close_buffers()
        self._connections.close()
        if self._sock is not None:
            self._sock.close(linger=int(CLOSE_LINGER_S * 1000))
            self._sock = None
        if not self._ctx.closed:
            self._ctx.term()
        if self._owns_ipc_dir:
            remove_ipc_dir(self._address)
            self._owns_ipc_dir = False

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
