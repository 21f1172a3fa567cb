"""SharedBuffers: the same-host carrier, a sync's bytes through buffers every receiver maps.

One carrier is one session: its socket and buffers are set up once and serve every sync. A sync streams
the prepared (name, tensor) pairs into the transport's buffers, bucket after bucket; while receivers load
bucket k the sender packs bucket k+1 into another buffer, and a buffer is refilled only after every receiver
has released it. Which buffer comes next is the BufferPool's choice; buckets are signalled through the shared
doorbell where it works, else by a ZeroMQ frame each (links). The frames are hwsync.protocol's; who may send
them is the peer table's (peers.py). Any failure tears the buffers down (segments unlinked; the bound socket
stays) and the next sync builds them again. A close() from another thread (the sender's close signal, which
every wait here watches) ends a running sync with an abort every receiver hears at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import torch
import zmq

from hwsync.backend.interfaces import Backend, Device, SendBuffers, Transport
from hwsync.backend.memory import MemoryReport, choose_bucket_bytes, local_memory
from hwsync.colocated.doorbell import Doorbell, doorbell_supported
from hwsync.colocated.mapped import MappedSources
from hwsync.colocated.replay import SentPlan
from hwsync.colocated.sender_control import Peer, SenderControl, SyncReceivers
from hwsync.colocated.stream import BucketLink, BucketStream, BufferPool, DoorbellLink, FrameLink
from hwsync.control.endpoints import CloseSignal, new_token, private_ipc_dir, remove_ipc_dir
from hwsync.errors import NotAppliedError, PartlyAppliedError, SyncError
from hwsync.protocol import (
    MAX_SENDER_FRAME_BYTES,
    PROTOCOL_VERSION,
    Accept,
    Applied,
    Apply,
    Complete,
    Done,
    Offer,
    Replay,
    check_size,
    encode,
)
from hwsync.sizes import DEFAULT_NUM_BUFFERS
from hwsync.sync import host_copy
from hwsync.sync.options import SenderOptions
from hwsync.sync.prepared import Prepared
from hwsync.sync.report import ReceiverReport
from hwsync.sync.shared_params import LIVE, live_segments
from hwsync.sync.stats import StageStats, SyncStats


class SharedBuffers:
    """The same-host carrier: a bound control endpoint, and buffers its receivers map (hwsync.sync.pipeline.Carrier)."""

    streams_deltas = False  # a delta's payloads are encoded up front and announced with the offer
    needs_manifest = False  # tensors are checked against it as they stream, when there is one
    commits_apart = True  # receivers that stage wait for the Apply as long as this sender lives

    def __init__(self, backend: Backend, transport: Transport, endpoint: str | None, num_receivers: int,
                 options: SenderOptions, closing: CloseSignal) -> None:
        self.backend, self.transport, self.num_receivers = backend, transport, num_receivers
        self.timeout_s = options.timeout_s
        #: neither size given: the transport's defaults, chosen at the first send from how receivers take tensors
        self._default_geometry = options.bucket_bytes is None and options.num_buffers is None
        #: "auto" until the first send sizes it from the memory the peers report
        self._auto_bucket = options.bucket_bytes == "auto"
        self.bucket_bytes = options.bucket_bytes if isinstance(options.bucket_bytes, int) \
            else transport.default_bucket_bytes
        self.num_buffers = DEFAULT_NUM_BUFFERS if options.num_buffers is None else options.num_buffers
        self._owns_ipc_dir = endpoint is None
        address = f"ipc://{private_ipc_dir()}/control" if endpoint is None else endpoint
        if not address.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint {endpoint!r} must start with ipc:// or tcp://")
        self._ctx = zmq.Context()
        try:
            self._control = SenderControl(self._ctx, address, new_token(), num_receivers=num_receivers,
                                          backend=backend.name, transport=transport.name, timeout_s=self.timeout_s,
                                          closing=closing)
        except BaseException:
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
        self._receivers: SyncReceivers | None = None
        #: each receiver's figures from its Complete (rank order), until the commit
        self._reports: list[dict] = []
        #: the one-copy plan every receiver of the last sync holds (replay.py), and the one this sync makes or replays
        self._plan: SentPlan | None = None
        self._made: SentPlan | None = None
        self.stable_sources = options.stable_sources
        #: device segments receivers read in place (mapped sources)
        #: None where the transport shares no device segments (the host) or sources are not stable
        self._mapped = MappedSources(transport, backend.device()) \
            if options.stable_sources and transport.device_segments() is not None else None

    @property
    def endpoint(self) -> str:
        """What a WeightReceiver connects to: address, token and (tcp://) CURVE public key. A secret: never log it."""
        return self._control.endpoint

    @property
    def address(self) -> str:
        """The bound address alone (no token, no key): what logs and errors name."""
        return self._control.address

    def new_stats(self, version: int) -> SyncStats:
        """This sync's stats: its transport and buffers."""
        return SyncStats(version=version, num_buffers=self.num_buffers, transport=self.transport.name)

    def gather(self, stats: SyncStats) -> list[ReceiverReport]:
        """The receivers of this sync, once every one said Ready; their reports."""
        self._syncs += 1
        self._receivers = SyncReceivers(self._control, self._control.await_ready(self.num_receivers, stats),
                                        self._syncs)
        return [p.report for p in self._receivers.peers]

    def stream(self, sync: Prepared, version: int, stats: SyncStats) -> None:
        """Offer the sync to every receiver, then stream its tensors through the buffers."""
        receivers = self._receivers
        assert receivers is not None
        if self._buffers is None:
            self._open_buffers(receivers.peers, stats)
        stats.bucket_bytes = self.bucket_bytes
        with applied_by_none([p for p in receivers.peers if p.stage], version):
            self._stream(receivers, sync, version, stats)

    def _stream(self, receivers: SyncReceivers, sync: Prepared, version: int, stats: SyncStats) -> None:
        assert sync.source is not None  # the same-host path announces a delta's headers: never streamed
        source, replay = sync.source, self._replayable(receivers, sync)
        if replay is not None:  # its first tensor is looked at before receivers are asked to check theirs
            opens, source = replay.opens(source)
            if not opens:
                replay = self._plan = None
        bell = self._offer(receivers, version, sync, replay=0 if replay is None else replay.sync)
        same, matched = False, list[tuple[str, torch.Tensor]]()
        if replay is not None:  # the tensors are matched while the receivers check their destinations: both at once
            # the offer is on its way only once ZeroMQ's I/O thread runs: the kernel wakes it on this thread's core,
            # where the match would keep it waiting for a time slice (measured: the offer reached the receiver 3-5
            # ms after the send, 0.1-0.5 ms with the yield)
            _yield_core()
            same, source = replay.match(source)
            if same:
                matched = list(source)  # held until the buckets are refilled from them
        link, accepts = self._await_accepts(receivers, bell, stats)
        if replay is not None:  # a tensor or a receiver's destination changed: a fresh sync, for all
            go = same and all(a.replay for a in accepts)
            if go and replay.device_segments:  # receivers read the trainer's memory once told: its writes first
                assert self._mapped is not None
                self._mapped.hold([t for _, t in matched])
            receivers.broadcast(Replay(sync=receivers.sync, go=go))
            if not go:
                replay = self._plan = None
                if same:
                    source = iter(matched)
        self._made = replay
        assert self._buffers is not None and self._pool is not None
        here = socket.gethostname()  # references into our segments only for receivers that can map them
        mapped = self._mapped if self._mapped is not None and self._mapped.usable_for(receivers.peers) else None
        stream = BucketStream(link, self._buffers, self._pool, self.bucket_bytes, receivers.sync, self._seq, stats,
                              dense=all(p.into for p in receivers.peers),
                              refs_to=receivers if all(p.host == here for p in receivers.peers) else None,
                              mapped=mapped,
                              stable=self.stable_sources, closing=self._control.closing,
                              data_ptr=self.backend.device().data_ptr)
        if replay is not None:  # every receiver runs the plan's copies again: only its buckets are sent
            self._seq = stream.replay(replay, matched)
            stats.tensors, stats.bytes = len(replay.tensors), replay.nbytes
            stats.notes.update({kind: dict(counts) for kind, counts in replay.kinds.items()}, replay=replay.sync)
            return
        self._seq = stream.run(source, sync.stream_manifest)
        plan = stream.plan
        self._made = None if plan is None else replace(plan, manifest=sync.stream_manifest, kinds={
            kind: {k: v for k, v in stats.notes[kind].items() if k != "exports"}
            for kind in ("shared", "mapped") if kind in stats.notes})

    def _replayable(self, receivers: SyncReceivers, sync: Prepared) -> SentPlan | None:
        """The plan this sync may replay, if its tensors match it (checked by the caller): a full sync, no receiver
        staging, every receiver holding this plan from the sync that made it, every segment it reads still live."""
        plan = self._plan
        if plan is None or sync.wire is not None or sync.stream_manifest != plan.manifest or not receivers.peers:
            return None
        if not all(p.plan == plan.sync and p.instance in plan.instances and not p.stage for p in receivers.peers):
            return None
        if plan.device_segments and (self._mapped is None or not self._mapped.usable_for(receivers.peers)
                                     or not plan.device_segments <= set(self._mapped.shared_ids())):
            return None  # a device segment the plan reads died (its anchor: `param.data = ...`)
        return plan if plan.segments <= {s.name for s in live_segments()} else None

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

    def _offer(self, receivers: SyncReceivers, version: int, sync: Prepared, replay: int = 0) -> Doorbell | None:
        """Announce the sync's geometry to each receiver (its rank, the signalling way); the doorbell its buckets
        ring, if they ring one."""
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
            first=self._seq, doorbell=None if bell is None else bell.handle(), rank=0,
            segments=live_segments() if LIVE else [], device_segments=self._mapped.shared_ids() if self._mapped else [],
            delta=sync.wire, replay=replay)
        self._accepted = False
        for rank, peer in enumerate(receivers.peers):
            # each receiver its own handles: shared device memory is exported once per receiver process
            handles = self._buffers.handles_for(peer.identity.hex(), peer.pid, peer.host)
            # each receiver the device segments it maps (a failed sync's receivers unmap what the sender released)
            mapped = [] if self._mapped is None else self._mapped.ids_for(peer, offer.device_segments)
            data = check_size(encode(dataclasses.replace(offer, rank=rank, handles=handles, device_segments=mapped)),
                              MAX_SENDER_FRAME_BYTES, f"the offer of {len(sync.targets or [])} tensors")
            self._control.send_to(peer, data)
        return bell

    def _await_accepts(self, receivers: SyncReceivers, bell: Doorbell | None,
                       stats: SyncStats) -> tuple[BucketLink, list[Accept]]:
        """The link, once every receiver accepted the offer, and the accepts."""
        accepts = receivers.await_each(Accept, "waiting for receivers to accept the offer", stats)
        self._accepted = True
        if bell is None:
            return FrameLink(receivers, self._seq), accepts
        bell.start_sync(len(receivers.peers), self._seq)
        return DoorbellLink(bell, receivers), accepts

    def confirm(self, version: int, stats: SyncStats) -> None:
        """Done to every receiver, and their Completes (each one's stats): loaded, or for receivers that stage,
        staged and checked."""
        receivers = self._receivers
        assert receivers is not None
        receivers.broadcast(Done(sync=receivers.sync, buckets=stats.buckets, tensors=stats.tensors, bytes=stats.bytes))
        stagers = [p for p in receivers.peers if p.stage]
        with applied_by_none(stagers, version):
            replies = receivers.await_each(Complete, "waiting for receivers to finish loading" if not stagers else
                                           "waiting for receivers to stage and check the sync", stats)
        if self._mapped is not None:
            self._mapped.complete()  # every receiver's copies from our device memory have run
        self._reports = [r.stats for r in replies]
        if self._pool is not None and self._pool.adaptive:
            stats.notes["pool"] = self._pool.to_dict()

    def commit(self, version: int, stats: SyncStats) -> None:
        """Receivers that stage apply the sync (Apply, then their Applied); the sync ends."""
        receivers = self._receivers
        assert receivers is not None
        reports = self._reports
        stagers = [p for p in receivers.peers if p.stage]
        if stagers:
            with applied_by_none(stagers, version):  # one that died or failed since it staged: none applies
                receivers.poll("before sending the Apply")
            reports = self._commit(receivers, stagers, reports, stats, version)
        made, self._made = self._made, None
        if stagers or made is None:
            self._plan = None
        elif made is not self._plan:  # a new plan: every receiver of this sync holds it now
            self._plan = replace(made, sync=receivers.sync, instances=frozenset(p.instance for p in receivers.peers))
            host_copy.warm(sum(len(pieces) for _, pieces in made.buckets))
        stats.peer = reports[0] if len(reports) == 1 else {"receivers": reports}
        stats.load_s = max((r.get("load_s", 0.0) for r in reports), default=0.0)
        self._control.end_sync(failed=False)
        self._receivers = None

    def _commit(self, receivers: SyncReceivers, stagers: list[Peer], reports: list[dict], stats: SyncStats,
                version: int) -> list[dict]:
        """Every receiver staged the sync: Apply to those that stage, and their Applied (with their figures)."""
        t0 = time.perf_counter()
        data = encode(Apply(sync=receivers.sync))
        for peer in stagers:
            self._control.send_to(peer, data)
        try:
            applied = receivers.await_each(Applied, "waiting for receivers to apply the staged sync", stats,
                                           peers=stagers)
        except SyncError as exc:  # past the point of no return: every receiver that stays up applies the version
            raise PartlyAppliedError(f"version {version} was committed: every receiver "
                                     "had staged it and was sent the Apply, so each one still running applies it; "
                                     f"then {type(exc).__name__}: {exc}. The receiver that failed holds no known "
                                     "version: its next sync is full") from exc
        staged = dict(zip([p.identity for p in stagers], applied))
        merged = [report if peer.identity not in staged else {**report, **staged[peer.identity].stats}
                  for peer, report in zip(receivers.peers, reports)]
        each = [StageStats.from_dict(r.get("stage")) for r in merged if isinstance(r.get("stage"), dict)]
        stats.stage = StageStats(receivers=len(stagers), held_bytes=max((s.held_bytes for s in each), default=0),
                                 new_bytes=max((s.new_bytes for s in each), default=0),
                                 stage_s=max((s.stage_s for s in each), default=0.0),
                                 apply_s=max((s.apply_s for s in each), default=0.0),
                                 commit_s=time.perf_counter() - t0)
        return merged

    def fail(self, exc: BaseException) -> None:
        """Abort every receiver and wait until none reads the sync's memory (SyncReceivers.abort), then release
        the exports and buffers.

        The bound socket stays: it is the session's address, and a receiver reconnecting after
        the failure must find it. Frames of the failed sync are told apart by their sync id.
        """
        receivers, self._receivers = self._receivers, None
        self._plan = self._made = None  # what a failed sync's receivers hold is unknown: the next one plans afresh
        try:
            if receivers is not None:
                reading = receivers.abort(exc)
                if reading:
                    said = (f"{', '.join(map(str, reading))} did not say within {self._control.timeout_s:g} s that it "
                            "stopped reading this sync's memory: changing the tensors now may still reach its copies "
                            "(it fails its sync then: it looks for the abort once its copies end)")
                    log.warning("hwsync: %s", said)
                    exc.add_note(said)
            if self._mapped is not None:  # only now: a receiver's copies may read the exports until it stopped
                self._mapped.abort(receivers.peers if receivers is not None else [],
                                   receivers.completed if receivers is not None else ())
            if receivers is not None:
                if self._buffers is not None and not self._accepted:  # some never mapped what they were offered
                    for peer in receivers.peers:
                        self._buffers.release_for(peer.identity.hex())
            self._close_buffers()
        finally:
            self._control.end_sync(failed=True)

    def release_buffers(self) -> None:
        """Unlink the buffers until the next sync (receivers map the new ones it offers)."""
        self._close_buffers()

    def _close_buffers(self) -> None:
        self._plan = None  # its buckets were laid out for these buffers
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None
        self._pool = None

    def close(self) -> None:
        """Release the mapped sources, buffers, socket and the private ipc directory."""
        if self._mapped is not None:
            self._mapped.close()
        self._close_buffers()
        self._control.close()
        if not self._ctx.closed:
            self._ctx.term()
        if self._owns_ipc_dir:
            remove_ipc_dir(self.address)
            self._owns_ipc_dir = False


def _yield_core() -> None:
    """Let another thread runnable on this core (ZeroMQ's I/O thread, just woken by a send) run first."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()


@contextlib.contextmanager
def applied_by_none(stagers: list[Peer], version: int) -> Iterator[None]:
    """A receiver's failure before Apply went out (died, refused, timed out): where receivers stage, NotAppliedError
    says none of them applied `version`. The sender's own errors (its source, close()) pass as they are."""
    try:
        yield
    except SyncError as exc:
        if not stagers:
            raise
        raise NotAppliedError(f"version {version} was applied by no receiver that stages "
                              f"({', '.join(map(str, stagers))}); each keeps its previous version. "
                              f"{type(exc).__name__}: {exc}") from exc


# -- bucket geometry: what the transport prefers for how receivers take tensors, or what memory allows -----
log = logging.getLogger("hwsync")


def bucket_geometry(transport: Transport, device: Device, peers: list[Peer], stats: SyncStats, bucket_bytes: int,
                    num_buffers: int, *, default: bool, auto: bool) -> tuple[int, int]:
    """(bucket bytes, buffers) for these receivers; `default`: neither was given, `auto`: size from memory."""
    geometry = transport.into_geometry
    if default:  # decided afresh whenever buffers are opened: receivers may have changed
        if geometry and all(p.into for p in peers):
            bucket_bytes, num_buffers = geometry
            stats.bucket_reason = (f"{geometry[0] >> 20} MiB x {geometry[1]} buffers: every receiver copies "
                                     f"into its own tensors, the {transport.name} transport's geometry for that")
        else:
            bucket_bytes, num_buffers = transport.default_bucket_bytes, 2
        stats.num_buffers = num_buffers
    if not auto:
        return bucket_bytes, num_buffers
    rows = [local_memory(device, rank=0)] + [
        replace(p.report.memory, rank=i + 1) for i, p in enumerate(peers) if p.report.memory is not None]
    choice = choose_bucket_bytes(MemoryReport.from_rows(device.torch_type, rows), num_buffers)
    stats.bucket_reason = choice.reason
    log.info("hwsync bucket size: %s", choice.reason)
    return choice.bucket_bytes, num_buffers
