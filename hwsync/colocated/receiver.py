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
from typing import Any

import torch
import zmq

from hwsync.backend.devices import wait_for_queued
from hwsync.backend.interfaces import Backend, Handles, ReceiveBuffers
from hwsync.backend.memory import local_memory
from hwsync.backend.owners import sweep_dead_owners
from hwsync.backend.registry import get_backend
from hwsync.colocated.doorbell import Doorbell, doorbell_supported, spin_wait
from hwsync.colocated.receiver_control import ReceiverControl
from hwsync.colocated.refs import SharedReader
from hwsync.control.endpoints import Endpoint, Lifetime, peer_alive, remove_ipc_dir
from hwsync.errors import ProtocolError, SyncError
from hwsync.protocol import (
    PROTOCOL_VERSION,
    Accept,
    Applied,
    Apply,
    Bucket,
    Complete,
    Done,
    Frame,
    Offer,
    Ready,
    Refs,
    Release,
    Replay,
    decode,
)
from hwsync.sync.bucket import BucketReader, IntoFn, LoadFn, host_moves, replay_bucket
from hwsync.sync.collector import hold_collector
from hwsync.sync.delta_receiver import ReceiverDeltas
from hwsync.sync.loader import Hooks, Loader
from hwsync.sync.report import ReceiverReport, ReceiverState
from hwsync.sync.staging import StageOptions, StagingArea
from hwsync.sync.stats import DeltaStats, StageStats, SyncStats
from hwsync.timing import CLOSE_LINGER_S, DEFAULT_TIMEOUT_S, ERROR_LINGER_S

log = logging.getLogger("hwsync")

class WeightReceiver:
    """The same-host path's receiver: connects to a WeightSender's endpoint and receives syncs into `load` or `into`."""

    def __init__(self, endpoint: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, backend: Backend | None = None,
                 stage: StageOptions | bool | None = None) -> None:
        sweep_dead_owners()  # what killed hwsync processes of this host left behind (once per process)
        self.timeout_s = timeout_s
        self._backend = backend
        self._ctx = zmq.Context()
        #: this receiver's id, the same on every connection it makes (the sender tells reconnections apart)
        self._instance = secrets.token_hex(8)
        self._lifetime = Lifetime("WeightReceiver", self._release)
        self._control = ReceiverControl(self._ctx, Endpoint.parse(endpoint), timeout_s, self._lifetime.signal)
        self._buffers: ReceiveBuffers | None = None
        self._handles: Handles | None = None
        self._doorbell: Doorbell | None = None
        self._shared: SharedReader | None = None
        #: last version received completely, or None
        self.version: int | None = None
        #: True when a sync broke after some bucket was loaded: the model holds a mix
        self.incomplete = False
        self._reader = BucketReader()
        #: what this receiver holds of its sender's baseline, and the copies it keeps to apply deltas on
        self._deltas = ReceiverDeltas()
        #: stage=: each sync is staged while the engine keeps serving, and applied only on the sender's Apply
        self._stage_options = StageOptions.of(stage)
        self._staging: StagingArea | None = None
        #: the version staged and awaiting the sender's Apply, or None
        self.staged: int | None = None
        #: this sync is a replay of the plan this receiver holds (hwsync.colocated.replay)
        self._replaying = False

    @property
    def backend(self) -> Backend:
        """The backend used to open the sender's transport (selected on first use)."""
        if self._backend is None:
            self._backend = get_backend()
        return self._backend

    def receive(self, loader: Loader | LoadFn | None = None, *, into: IntoFn | None = None,
                state: ReceiverState | dict[str, Any] | None = None) -> SyncStats:
        """Receive one sync; raises SyncError (the sender is told) if it fails.

        `loader`: a Loader (hwsync.sync.loader: `load(pairs)` with each bucket's complete tensors; optionally
        `into`, `accept(version, manifest)` before any byte moves, raising to refuse the sync, `done()` after the
        last tensor, and `pause()`, a context manager a staging receiver applies inside), or a plain load function.
        A receiver made with `stage=` receives into its staging area while the engine keeps serving, and applies
        (copies `into`, or calls `load`) only once the sender says every receiver staged the sync; with a sender in
        delta mode it also calls `into` during the stage, to read the engine's tensor as a delta's base (it must
        return the tensor the engine serves and change nothing), and holds only the delta's payloads. `into(name,
        dtype, shape)` may return the caller's own contiguous tensor of that dtype and shape: the bytes are copied
        straight into it; tensors it returns None for go to `load`. `state` (a ReceiverState, or a dict of the
        caller's own values) is reported to the sender, which plans from it.
        """
        hooks = Hooks.of(loader, into)
        if hooks.commit is not None:
            raise TypeError(f"{type(loader).__name__} stages on its own (it has commit() and abandon()), which "
                            "CrossNodeReceiver drives; on the same host make the WeightReceiver with stage=True "
                            "and give it a plain loader")
        with self._lifetime.call("receive"):
            return self._receive(hooks, state)

    def _receive(self, hooks: Hooks, state: ReceiverState | dict[str, Any] | None) -> SyncStats:
        load, into = hooks.load, hooks.into
        start = time.perf_counter()
        stats, sync, control = SyncStats(), None, self._control
        self._replaying = False
        staging = self._staging_area()
        release_collector = None
        try:
            # everything the Ready needs first (the device's memory figures may start its runtime): the connection
            # and the Ready then go out back to back, so the sender learns who connected almost at once
            plan = None if self._shared is None or staging is not None or into is None else self._shared.plan
            ready = Ready(token=control.endpoint.token, proto=PROTOCOL_VERSION, pid=os.getpid(),
                          host=socket.gethostname(), report=self._report(state), doorbell=doorbell_supported(),
                          into=into is not None or staging is not None, backend=self.backend.name,
                          transports=sorted(self.backend.transports()), instance=self._instance,
                          stage=staging is not None, plan=0 if plan is None else plan.sync)
            control.connect()
            control.send(ready)
            offer = control.await_frame(Offer, None, "waiting for the sender's offer", stats)
            assert isinstance(offer, Offer)
            sync = control.last_sync = offer.sync
            if control.sender[0] is not None and offer.pid != control.sender[0]:
                raise ProtocolError(f"the offer names process {offer.pid} as its sender, but the sender that welcomed "
                                    f"this receiver is process {control.sender[0]}; refused")
            control.sender = (offer.pid, offer.host)
            if staging is None:  # the engine waits for this sync (a staging one serves meanwhile): collector.py
                release_collector = hold_collector()
            self._accept(offer, stats)
            if staging is not None:  # what staging will hold, checked before a byte moves
                headers = offer.delta.headers if offer.delta is not None else None
                stats.stage = StageStats(receivers=1, new_bytes=staging.begin(
                    offer.manifest, offer.version, delta_mode=offer.delta is not None, delta_sync=self._deltas.is_delta,
                    headers=None if headers is None or offer.manifest is None else
                    {spec.name: header for spec, header in zip(offer.manifest, headers)}))
            if hooks.accept is not None:  # the engine checks the manifest and begins: no byte has moved
                hooks.accept(offer.version, offer.manifest)
            assert self._shared is not None
            replay = bool(offer.replay) and staging is None and self._shared.can_replay(offer, into)
            control.send(Accept(sync=offer.sync, replay=replay))
            if offer.replay:  # the sender says whether every receiver could: else a fresh sync, for all
                word = control.await_frame(Replay, offer.sync, "waiting for the sender's word on the replay", stats)
                assert isinstance(word, Replay)
                if word.go and not replay:
                    raise ProtocolError(f"the sender replays the plan of its sync {offer.replay}, which this "
                                        "receiver said it cannot run; refused")
                replay = word.go
            self._replaying = replay
            landed: dict[str, torch.Tensor] | None = None  # where a staged sync's tensors went in the engine
            if replay:  # the tensors of the plan it holds: its copies again
                self._replay(offer, stats)
            elif staging is None:
                self._shared.record(offer.pid, offer.sync) if offer.delta is None else self._shared.not_a_plan()
                self._receive_buckets(offer, *self._deltas.intake(load, into, self.backend.device()), stats)
            else:  # every tensor into the staging area (a delta applies and is checked there)
                self._shared.not_a_plan()
                into = staging.for_sync(hooks.into)  # a delta's base: the engine's own tensor where it names one
                self._receive_buckets(offer, *self._deltas.intake(None, into, self.backend.device()), stats)
                landed = self._await_apply(offer, staging, hooks, start, stats)
            if hooks.done is not None and staging is None:  # a staging receiver's ran inside the pause (apply)
                t0 = time.perf_counter()
                hooks.done()
                stats.load_s += time.perf_counter() - t0
            self._deltas.complete(landed)
            self.version = offer.version
            self.incomplete = False
            stats.total_s = time.perf_counter() - start
            control.send(Complete(sync=sync, stats=stats.to_dict()) if staging is None else
                         Applied(sync=sync, stats=stats.to_dict()))
            if not replay:
                self._shared.keep_plan()  # what this sync recorded, if it made a plan
        except BaseException as exc:
            self._fail(sync, exc)
            raise
        finally:
            if release_collector is not None:
                release_collector()
        return stats

    def _staging_area(self) -> StagingArea | None:
        if self._stage_options is not None and self._staging is None:
            self._staging = StagingArea(self.backend.device(), self._stage_options)
        return self._staging

    def _await_apply(self, offer: Offer, staging: StagingArea, hooks: Hooks, start: float,
                     stats: SyncStats) -> dict[str, torch.Tensor]:
        """Staged and checked: say so, wait for the sender's Apply (every receiver staged), then apply inside the
        engine's pause; returns the engine's tensors the staged ones landed in. An Abort instead (another receiver
        failed) raises: nothing was applied."""
        assert stats.stage is not None
        self._deltas.digest_staged()  # a full sync in delta mode: its digests now, not beside the engine's next step
        stats.stage.stage_s = time.perf_counter() - start
        stats.stage.held_bytes = staging.held_bytes
        self.staged = offer.version
        self._control.send(Complete(sync=offer.sync, stats=stats.to_dict()))
        t0 = time.perf_counter()
        self._control.await_frame(Apply, offer.sync, "waiting for the sender's commit (every receiver staged)", stats,
                                  timeout_s=staging.options.commit_timeout_s)
        stats.wait_s -= time.perf_counter() - t0  # waiting for the trainer's commit is no transfer wait
        self.staged = None
        self.incomplete = True  # until every staged tensor is in the engine
        result = staging.apply(hooks, self._deltas.pool())
        stats.stage.apply_s = result.apply_s
        stats.load_s += result.apply_s
        return result.landed

    def _report(self, state: ReceiverState | dict[str, Any] | None) -> ReceiverReport:
        """What the Ready reports: the caller's state, the delta baseline held, and this device's memory (which a
        sender may size "auto" buckets from)."""
        said = ReceiverState.of(state)
        try:
            memory = local_memory(self.backend.device())
        except Exception as exc:  # noqa: BLE001 - memory is advisory: never fail a sync over it
            log.debug("hwsync: no memory figures for the sender: %s", exc)
            memory = None
        return ReceiverReport(said.engine, said.dtypes, self._deltas.held, memory, said.extra)

    def _accept(self, offer: Offer, stats: SyncStats) -> None:
        """Check the offer and map what it names (buffers, doorbell, shared segments); the Accept is sent after."""
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
            self._buffers = transports[offer.transport].open_receiver(offer.handles, owner_pid=offer.pid)
            self._handles = offer.handles
        bell = offer.doorbell
        if not bell or (self._doorbell is not None and self._doorbell.handle() != bell):
            self._close_doorbell()  # frames this time, or another doorbell: unmap the old one
        if bell and self._doorbell is None:
            self._doorbell = Doorbell.attach(bell, owner_pid=offer.pid, rank=offer.rank)
        if self._shared is None:
            self._shared = SharedReader(self.backend.device())
        # unmap what the sender no longer has (host and device segments); device ones it exports later map by this
        self._shared.retain(offer.segments, offer.device_segments, transports[offer.transport])
        self._deltas.begin(offer.delta, offer.manifest)  # a delta only on what this receiver holds
        if self._deltas.is_delta:
            stats.delta = DeltaStats("delta", check=self._deltas.check)
        stats.version = offer.version
        stats.bucket_bytes = offer.bucket_bytes
        stats.num_buffers = offer.num_buffers
        stats.transport = offer.transport

    def _receive_buckets(self, offer: Offer, load: LoadFn | None, into: IntoFn | None, stats: SyncStats) -> None:
        assert self._buffers is not None and self._shared is not None
        sync, seq, bell = offer.sync, offer.first, self._doorbell if offer.doorbell else None
        self._reader.begin(self.backend.device().torch_device())  # reassemble on this receiver's own device
        views = False  # whether load was handed the sender's shared memory
        pending: list[Done | Refs] = []  # frames that came on the socket while reading the doorbell
        while True:
            what = f"waiting for bucket {stats.buckets}"
            self._lifetime.signal.check(what)  # close() from another thread: checked per bucket, the waits check too
            if bell is None:
                frame = self._control.await_frame((Bucket, Done, Refs), sync, what, stats)
            else:
                frame = self._ring_next(bell, seq, sync, what, pending, stats)
            if isinstance(frame, Done):
                if self._reader.pending():
                    raise SyncError(f"the sync ended with tensors incomplete: {self._reader.pending()[:5]}")
                self._shared.finish(views, stats)  # queued reads of shared memory end before our Complete
                # an abort that came while the copies ran: the sender's send() raised then, and its trainer may have
                # trained on the memory they read (a receiver that completed would hold torn bytes); fail instead
                self._control.poll(sync, "checking for an abort after the sync's copies")
                return
            if self._staging is None:  # a staging receiver's engine is untouched until the Apply
                self.incomplete = True
            if isinstance(frame, Refs):
                if self._replaying:
                    raise ProtocolError("the sender sent references in a sync it offered as a replay; refused")
                views = self._shared.receive(frame, offer.pid, load, into, stats) or views
                continue
            assert isinstance(frame, Bucket)
            self._read_bucket(offer, frame, seq, bell, load, into, stats)
            seq += 1

    def _replay(self, offer: Offer, stats: SyncStats) -> None:
        """A replayed sync: the plan's copies run again, its buckets are copied out as recorded, then the sender's
        Done (no Refs frame comes)."""
        assert self._shared is not None and self._shared.plan is not None
        self.incomplete = True
        self._shared.replay(stats)
        if self._shared.plan.buckets:  # and its buckets, each copied out as the plan says
            self._receive_buckets(offer, None, None, stats)
        else:
            self._control.await_frame(Done, offer.sync, "waiting for the end of a replayed sync", stats)
            self._shared.finish(False, stats)
            self._control.poll(offer.sync, "checking for an abort after the sync's copies")  # as _receive_buckets
        stats.notes["replay"] = offer.replay

    def _read_bucket(self, offer: Offer, frame: Bucket, seq: int, bell: Doorbell | None, load: LoadFn | None,
                     into: IntoFn | None, stats: SyncStats) -> None:
        """Hand one bucket's tensors to `load` (or copy them `into`), and release its buffer as early as is safe."""
        assert self._buffers is not None
        if frame.sync != offer.sync or frame.seq != seq:
            raise ProtocolError(f"bucket {seq} of sync {offer.sync} was announced as {frame.seq} of sync "
                                f"{frame.sync}; the sender and receiver are out of step")
        if frame.nbytes > offer.bucket_bytes or frame.buf >= offer.num_buffers:
            raise ProtocolError(f"bucket {seq} claims {frame.nbytes} bytes in buffer {frame.buf}, outside the "
                                f"offered {offer.num_buffers} buffers of {offer.bucket_bytes} bytes")
        assert self._shared is not None
        t0 = time.perf_counter()
        view = self._buffers.view(frame.buf, frame.nbytes)
        where = view.device
        replay = self._shared.plan if self._replaying else None
        if replay is not None:  # a replayed sync's bucket: its recorded copies out of it, again
            if frame.index >= len(replay.buckets) or replay.buckets[frame.index][0] != frame.nbytes:
                raise ProtocolError(f"the sender replayed bucket {frame.index} of {frame.nbytes} bytes, which the "
                                    f"plan of its sync {offer.replay} does not hold as such")
            if replay.moves is None:
                replay.moves = [host_moves(pieces) if view.device.type == "cpu" else None
                                for _, pieces in replay.buckets]
            moves = replay.moves[frame.index]
            if moves is not None:
                moves.move_out(view.data_ptr())
            else:
                replay_bucket(view, replay.buckets[frame.index][1])
            tensors = []
        else:
            recording = self._shared.recording
            tensors = self._reader.read(view, frame.entries, into, recording)
            if recording is not None and len(recording.buckets[-1][1]) != len(frame.entries):
                self._shared.not_a_plan()  # a tensor went to load (or was reassembled): no replay of this sync
        del view  # no view may outlive the buffer's release
        early = not self._reader.aliases_view  # only reassembled tensors: the sender may refill now
        if early:
            self._release_bucket(offer, frame.buf, seq, bell, where)
        if tensors:
            if load is None:
                raise ValueError(f"into() returned None for {tensors[0][0]!r} and no load was given; return "
                                 "a destination for every tensor or pass load")
            load(tensors)
        del tensors
        if not early:
            self._release_bucket(offer, frame.buf, seq, bell, where)
        stats.load_s += time.perf_counter() - t0
        stats.buckets += 1
        stats.tensors += sum(1 for e in frame.entries if e.is_last)  # a replay counts the plan's (SharedReader)
        stats.bytes += sum(e.chunk_bytes for e in frame.entries)

    def _ring_next(self, bell: Doorbell, seq: int, sync: int, what: str, pending: list[Done | Refs],
                   stats: SyncStats) -> Frame:
        """The next bucket's descriptor from the doorbell, or the next frame that came on the socket meanwhile.

        Refs frames come before Done on the socket, and Done follows the last post: nothing comes after it. The
        spin watches the socket too: a frame waits for no liveness check (those run every few ms).
        """
        t0 = time.perf_counter()
        control = self._control
        try:
            while True:
                if bell.posted > seq:
                    return decode(bell.read(seq), {Bucket.T: Bucket})
                if pending:
                    return pending.pop(0)
                if control.frame_waiting():
                    pending.extend(control.poll(sync, what))
                    continue  # the doorbell first again: a bucket posted before the frame was sent comes before it
                spin_wait(lambda: bell.posted > seq or bool(pending) or control.frame_waiting(),
                          lambda: pending.extend(control.poll(sync, what)), timeout_s=self.timeout_s, what=what,
                          endpoint=control.address)
        finally:
            stats.wait_s += time.perf_counter() - t0

    def _release_bucket(self, offer: Offer, buf: int, seq: int, bell: Doorbell | None, where: torch.device) -> None:
        assert self._buffers is not None
        # this process's device reads of the buffer (reassembly, into=, load) may still be queued: an event on the
        # stream that runs them, not a device-wide synchronize (which would also wait for the engine's other work)
        wait_for_queued(self.backend.device(), where)
        self._buffers.release(buf)
        if bell is not None:
            bell.release(offer.rank, seq)
        else:
            self._control.send(Release(sync=offer.sync, buf=buf, seq=seq))

    def _fail(self, sync: int | None, exc: BaseException) -> None:
        """End every read of the sender's memory (queued copies included) and unmap it, then tell the sender (an
        error frame, or Stopped to its Abort: its send() waits for that before its trainer steps), then close the
        socket. What was staged goes: the engine keeps the version it serves, and the next sync is whole. A sync
        that failed before its offer staged nothing: the staging area still holds what the engine does (a delta's
        base), and is kept."""
        self.staged = None
        if self._staging is not None and sync is not None:
            self._staging.release()
            self._deltas.clear()  # the staging area was its base
        log.warning("hwsync receive failed: %s", exc)
        sender = self._control.sender
        dead = sender[0] is not None and not peer_alive(*sender)
        if dead:  # the sender died without cleaning up: its private ipc directory is ours to remove
            remove_ipc_dir(self._control.address, owner_pid=sender[0])
        if self._shared is not None:  # its copies waited for, unmapped, a dead sender's segments unlinked
            self._shared.close(dead_sender=sender[0] if dead else None)
        self._close_buffers()
        self._control.report_failure(sync, exc)
        self._control.close(ERROR_LINGER_S)

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
        self._deltas.clear()
        if self._staging is not None:
            self._staging.release()
        self._control.close(CLOSE_LINGER_S)
        if not self._ctx.closed:
            self._ctx.term()

    def __enter__(self) -> "WeightReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
