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
from collections.abc import Iterable

import torch
import zmq

from hwsync.bucket import ALIGN
from hwsync.casting import EngineDtypes
from hwsync.colocated.buffer_pool import BufferPool
from hwsync.colocated.doorbell import Doorbell, doorbell_supported
from hwsync.colocated.geometry import bucket_geometry
from hwsync.colocated.links import BucketLink, DoorbellLink, FrameLink
from hwsync.colocated.mapped import MappedSources
from hwsync.colocated.peers import Peer
from hwsync.colocated.sender_control import SenderControl, SyncReceivers
from hwsync.colocated.stream import BucketStream
from hwsync.control import Lifetime, new_token, private_ipc_dir, remove_ipc_dir
from hwsync.delta.sender import Prepared, SenderDeltas
from hwsync.interfaces import Backend, SendBuffers, Transport
from hwsync.manifest import TensorSpec
from hwsync.offload import onload_during
from hwsync.planner import TrainerModel, resolve_source
from hwsync.protocol import PROTOCOL_VERSION, Accept, Complete, Done, Offer, encode
from hwsync.protocol.limits import MAX_SENDER_FRAME_BYTES, check_size
from hwsync.registry import get_backend
from hwsync.shared_params import live_segments
from hwsync.sizes import DEFAULT_NUM_BUFFERS, MIN_NUM_BUFFERS
from hwsync.source import TensorSource
from hwsync.stats import SyncStats
from hwsync.timing import DEFAULT_TIMEOUT_S

log = logging.getLogger("hwsync")


class WeightSender:
    """The same-host path's sender: binds a control endpoint and sends named tensors to one or more WeightReceivers."""

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
        delta: bool = False,
        delta_on_device: bool = False,
        stable_sources: bool = True,
    ) -> None:
        #: neither size given: the transport's defaults, chosen at the first send from how receivers take tensors
        self._default_geometry = bucket_bytes is None and num_buffers is None
        num_buffers = DEFAULT_NUM_BUFFERS if num_buffers is None else num_buffers
        if num_buffers < MIN_NUM_BUFFERS:
            raise ValueError(f"num_buffers={num_buffers}: at least {MIN_NUM_BUFFERS} are needed to overlap packing "
                             "with loading")
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be at least 1")
        self.backend = backend or get_backend()
        self.transport = self._resolve_transport(transport)
        if bucket_bytes not in (None, "auto") and not isinstance(bucket_bytes, int):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a byte count, None (the transport's "
                             "default) or 'auto' (from the least free memory of sender and receivers)")
        #: "auto" until the first send sizes it from the memory the peers report
        self._auto_bucket = bucket_bytes == "auto"
        self.bucket_bytes = bucket_bytes if isinstance(bucket_bytes, int) else self.transport.default_bucket_bytes
        if self.bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is below the minimum of {ALIGN} bytes")
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.num_receivers = num_receivers
        self._owns_ipc_dir = endpoint is None
        address = f"ipc://{private_ipc_dir()}/control" if endpoint is None else endpoint
        if not address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint {endpoint!r} must start with ipc:// or tcp://")
        #: close() from another thread: the running sync ends and aborts its receivers
        self._lifetime = Lifetime("WeightSender", self._release)
        self._ctx = zmq.Context()
        try:
            self._control = SenderControl(self._ctx, address, new_token(), num_receivers=num_receivers,
                                          backend=self.backend.name, transport=self.transport.name,
                                          timeout_s=timeout_s, closing=self._lifetime.signal)
        except BaseException:
            self._lifetime.signal.close()
            self._ctx.term()
            if self._owns_ipc_dir:
                remove_ipc_dir(address)
            raise
        self._buffers: SendBuffers | None = None
        self._doorbell: Doorbell | None = None
        self._pool: BufferPool | None = None
        #: sequence number of the next bucket; grows across the syncs of one set of buffers
        self._seq = 0
        self._syncs = 0
        #: whether every receiver accepted the current offer (and so maps the buffers it was given)
        self._accepted = False
        #: False: sources reuse or change a tensor's memory after yielding it, so each is copied at once, none mapped
        self.stable_sources = stable_sources
        #: device segments receivers read in place (mapped sources)
        self._mapped = MappedSources(self.transport, self.backend.device(), enabled=stable_sources)
        #: send only what changed since what every receiver holds (a per-sync `send(delta=...)` overrides it)
        self.delta = delta
        self._deltas = SenderDeltas(self.backend.device(), on_device=delta_on_device, stable_sources=stable_sources)

    def _resolve_transport(self, transport: str | Transport | None) -> Transport:
        if isinstance(transport, Transport):
            return transport
        if transport is None:
            return self.backend.default_transport()
        available = self.backend.transports()
        if transport not in available:
            raise ValueError(f"backend {self.backend.name!r} has no transport {transport!r}; it has "
                             f"{sorted(available)}")
        return available[transport]

    @property
    def endpoint(self) -> str:
        """What a WeightReceiver connects to: address, token and (tcp://) CURVE public key. A secret: never log it."""
        return self._control.endpoint

    @property
    def address(self) -> str:
        """The bound address alone (no token, no key): what logs and errors name."""
        return self._control.address

    @property
    def delta_baseline_bytes(self) -> int:
        """Memory the delta baseline holds (host memory, or the device's with delta_on_device=True)."""
        return self._deltas.baseline_bytes

    def drop_delta_baseline(self) -> int:
        """Free the delta baseline between syncs; returns the bytes freed (hwsync.delta.sender.SenderDeltas.drop).

        The next sync asking for a delta is then full and says why; none is kept until one asks.
        """
        with self._lifetime.call("drop_delta_baseline"):
            return self._deltas.drop()

    def send(
        self,
        source: TensorSource | TrainerModel,
        *,
        version: int,
        manifest: list[TensorSpec] | None = None,
        onload: torch.nn.Module | Iterable[torch.Tensor] | None = None,
        delta: bool | None = None,
    ) -> SyncStats:
        """Send one sync; returns when every receiver has loaded it, raises SyncError otherwise.

        `source`: (name, tensor) pairs, a function of the first receiver's reported state returning
        them, or a TrainerModel, planned against every receiver's state. `manifest` announces the
        tensors before any byte moves. `onload`: parameters to bring from host memory to the device
        for the sync, and back. Tensors in shared parameter memory (hwsync.SharedParameters), and device
        tensors a module keeps (its parameters: colocated/mapped.py), go as references that receivers read in
        place: they are done with them when this returns. A tensor the source yielded must stay as it was
        until then (WeightSender(stable_sources=False) for a source that reuses a staging buffer).
        `delta`: for this sync, send only what changed (None: the sender's setting); it is a delta only
        where every receiver holds the sender's baseline, else full, and stats.notes["delta"] says why.
        Tensors go in the dtype the receivers' engines hold them in, where they report it (hwsync.casting).
        """
        with self._lifetime.call("send"):
            return self._send(source, version, manifest, onload, self.delta if delta is None else delta)

    def _send(self, source: TensorSource | TrainerModel, version: int, manifest: list[TensorSpec] | None,
              onload: torch.nn.Module | Iterable[torch.Tensor] | None, delta: bool) -> SyncStats:
        start = time.perf_counter()
        self._syncs += 1
        stats = SyncStats(version=version, num_buffers=self.num_buffers, transport=self.transport.name)
        receivers: SyncReceivers | None = None
        try:
            receivers = SyncReceivers(self._control, self._control.await_ready(self.num_receivers, stats), self._syncs)
            states = [p.state for p in receivers.peers]
            pairs, manifest = resolve_source(source, states, manifest, stats)
            with onload_during(onload, self.backend.device(), stats):
                sync = self._deltas.prepare(pairs, manifest, EngineDtypes(states), delta, states, stats)
                self._stream(receivers, version, sync, stats)
            self._finish(receivers, stats)
            self._deltas.commit()
        except BaseException as exc:
            self._deltas.abort()
            self._fail(receivers, exc)
            raise
        finally:
            self._control.end_sync(failed=sys.exc_info()[0] is not None)
        stats.total_s = time.perf_counter() - start
        log.info("hwsync sent %s", stats)
        return stats

    def _stream(self, receivers: SyncReceivers, version: int, sync: Prepared, stats: SyncStats) -> None:
        """Offer the sync to every receiver, then stream its tensors through the buffers."""
        if self._buffers is None:
            self._open_buffers(receivers.peers, stats)
        stats.bucket_bytes = self.bucket_bytes
        link = self._offer(receivers, version, sync, stats)
        assert self._buffers is not None and self._pool is not None
        here = socket.gethostname()  # references into our segments only for receivers that can map them
        stream = BucketStream(link, self._buffers, self._pool, self.bucket_bytes, receivers.sync, self._seq, stats,
                              dense=all(p.into for p in receivers.peers),
                              refs_to=receivers if all(p.host == here for p in receivers.peers) else None,
                              mapped=self._mapped if self._mapped.usable_for(receivers.peers) else None,
                              stable=self.stable_sources)
        assert sync.source is not None  # the same-host path announces a delta's headers: never streamed
        self._seq = stream.run(sync.source, sync.stream_manifest)

    def _open_buffers(self, peers: list[Peer], stats: SyncStats) -> None:
        """Size the buckets (by how receivers take tensors, or "auto": the least free memory) and open the buffers."""
        self.bucket_bytes, self.num_buffers = bucket_geometry(
            self.transport, self.backend.device(), peers, stats, self.bucket_bytes, self.num_buffers,
            default=self._default_geometry, auto=self._auto_bucket)
        self._buffers = self.transport.open_sender(self.bucket_bytes, self.num_buffers)
        self._pool = BufferPool(self.num_buffers, self.bucket_bytes)
        self._seq = 0
        if doorbell_supported():
            self._doorbell = Doorbell.create(self.num_receivers, self.num_buffers)

    def _offer(self, receivers: SyncReceivers, version: int, sync: Prepared, stats: SyncStats) -> BucketLink:
        """Announce the sync's geometry to each receiver (its rank, the signalling way) and await the accepts."""
        assert self._buffers is not None
        here = socket.gethostname()
        bell = self._doorbell if self._doorbell is not None and all(
            p.doorbell and p.host == here for p in receivers.peers) else None
        offer = Offer(
            sync=receivers.sync, proto=PROTOCOL_VERSION, backend=self.backend.name, transport=self.transport.name,
            handles={}, bucket_bytes=self.bucket_bytes, num_buffers=self.num_buffers,
            version=version, pid=os.getpid(), host=here, manifest=sync.targets,
            tensors=None if sync.stream_manifest is None else len(sync.stream_manifest),
            total_bytes=None if sync.stream_manifest is None else sum(s.nbytes for s in sync.stream_manifest),
            first=self._seq, doorbell=None if bell is None else bell.handle(), rank=0, segments=live_segments(),
            device_segments=self._mapped.shared_ids(), delta=sync.wire)
        self._accepted = False
        for rank, peer in enumerate(receivers.peers):
            # each receiver its own handles: shared device memory is exported once per receiver process
            handles = self._buffers.handles_for(peer.identity.hex(), peer.pid, peer.host)
            mapped = self._mapped.ids_for(peer, offer.device_segments)  # each receiver the segments it maps
            data = check_size(encode(dataclasses.replace(offer, rank=rank, handles=handles, device_segments=mapped)),
                              MAX_SENDER_FRAME_BYTES, f"the offer of {len(sync.targets or [])} tensors")
            self._control.send_to(peer, data)
        receivers.await_each(Accept, "waiting for receivers to accept the offer", stats)
        self._accepted = True
        if bell is None:
            return FrameLink(receivers, self._seq)
        bell.start_sync(len(receivers.peers), self._seq)
        return DoorbellLink(bell, receivers)

    def _finish(self, receivers: SyncReceivers, stats: SyncStats) -> None:
        receivers.broadcast(Done(sync=receivers.sync, buckets=stats.buckets, tensors=stats.tensors, bytes=stats.bytes))
        replies = receivers.await_each(Complete, "waiting for receivers to finish loading", stats)
        self._mapped.complete()  # every receiver's copies from our device memory have run
        reports = [r.stats for r in replies]
        if self._pool is not None and self._pool.adaptive:
            stats.notes["pool"] = self._pool.to_dict()
        stats.peer = reports[0] if len(reports) == 1 else {"receivers": reports}
        stats.load_s = max((r.get("load_s", 0.0) for r in reports), default=0.0)

    def _fail(self, receivers: SyncReceivers | None, exc: BaseException) -> None:
        """Abort every receiver (one that failed first ignores it), then release the buffers.

        The bound socket stays: it is the session's address, and a receiver reconnecting after
        the failure must find it. Frames of the failed sync are told apart by their sync id.
        """
        self._mapped.abort(receivers.peers if receivers is not None else [])
        if receivers is not None:
            receivers.abort(exc)
            if self._buffers is not None and not self._accepted:  # some never mapped what they were offered
                for peer in receivers.peers:
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
        self._deltas.close()
        self._mapped.close()
        self._close_buffers()
        self._control.close()
        if not self._ctx.closed:
            self._ctx.term()
        if self._owns_ipc_dir:
            remove_ipc_dir(self.address)
            self._owns_ipc_dir = False

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at garbage collection nothing can be told any more
            pass
