"""The receiver's side of a one-copy sync: tensors read in place from the sender's shared parameter segments.

A Refs frame names whole tensors by (segment, offset, dtype, shape). Each segment is mapped
read-only (only ever a parameter segment of the sender's own pid, by name in /dev/shm: hwsync.backend.shm's
SharedSegment.open), once, and kept across syncs (pinned for device copies where the backend can), and unmapped
when the sender's offer no longer lists it, when the receiver fails, and at close. Tensors go
straight `into` the caller's destinations (one memmove on the host, one host-to-device copy on
an accelerator) or to `load` as views of the shared memory, valid during that call only. The
sender's trainer leaves the memory alone until this receiver's Complete, so every copy and
every queued device read finishes (`finish`) before Complete is sent.

Device references in the same frames (the trainer's own device memory) are mapped_reader.py's:
mapped once per segment, kept across syncs, unmapped when an offer stops listing them.

Host-to-host copies are memmoves on the data pointers, cut into COPY_CHUNK_BYTES pieces and
queued on `copy_threads` threads (2 by default, free of any core their creator was bound to:
host_threads.py) that run across batches: during a one-copy sync the sender has nothing to do,
so the receiver may use the core the packed path would have spent packing (ctypes releases the
GIL for memmove); `load` is called with the cores free for the same reason. Nothing waits per
batch: a thread slowed by another process hands its share to the other, and `finish` waits for
the queue before Complete.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hwsync.backend.devices import wait_for_queued
from hwsync.backend.interfaces import Device, Transport
from hwsync.backend.shm import SHM_DIR, SharedSegment
from hwsync.colocated.mapped_reader import MappedReader
from hwsync.colocated.replay import ReadPlan
from hwsync.errors import ProtocolError
from hwsync.protocol import Offer, Refs, SegmentSpec
from hwsync.protocol.layout import SHARED_SEGMENT_NAME
from hwsync.sync import host_copy
from hwsync.sync.bucket import IntoFn, LoadFn, copy_bytes, flat_bytes, matching_destination
from hwsync.sync.host_copy import Moves
from hwsync.sync.host_threads import copy_pool, host_cores_free
from hwsync.sync.spec import dtype_from_name
from hwsync.sync.stats import SyncStats

log = logging.getLogger("hwsync")

#: threads copying a batch of host tensors (see the module doc)
COPY_THREADS = 2
#: a batch smaller than this is copied by the calling thread alone
_PARALLEL_BYTES = 32 << 20
#: the piece of a copy one thread takes at a time: small enough to balance the threads, large enough
#: that queueing it costs nothing next to copying it
COPY_CHUNK_BYTES = 16 << 20


def chunk_copies(jobs: list[tuple[int, int, int]], chunk: int) -> list[Moves]:
    """(dst, src, nbytes) copies cut into batches of about `chunk` bytes each (a copy is cut where it must)."""
    out, current, room = [], [], chunk
    for dst, src, nbytes in jobs:
        while nbytes:
            take = min(nbytes, room)
            current.append((dst, src, take))
            dst, src, nbytes, room = dst + take, src + take, nbytes - take, room - take
            if not room:
                out.append(Moves(current))
                current, room = [], chunk
    return out + ([Moves(current)] if current else [])


class SharedReader:
    """The sender's shared segments as this receiver maps them, and the copies out of them."""

    def __init__(self, device: Device, copy_threads: int = COPY_THREADS) -> None:
        self.device = device
        self.copy_threads = max(1, copy_threads)
        self._pool: ThreadPoolExecutor | None = None
        #: host copies queued on the pool this sync (waited for by finish(), and before any unmap)
        self._copies: list[Future] = []
        self._mapped: dict[str, SharedSegment] = {}
        self._pinned: dict[str, torch.Tensor] = {}
        #: devices this sync's copies were queued on (waited for by finish())
        self._queued: set[torch.device] = set()
        #: the sender's device segments, mapped in place
        self.device_segments = MappedReader(device)
        #: the plan this receiver can replay (replay.py), and the one being recorded this sync (None: this sync
        #: makes none: a bucket, a device reference or a tensor for `load` came)
        self.plan: ReadPlan | None = None
        self._recording: ReadPlan | None = None

    def retain(self, segments: list[SegmentSpec], device_segments: list[int] | None = None,
               transport: Transport | None = None) -> None:
        """Keep only the mappings of segments the sender still has (its offer lists them, host and device ones);
        `transport`, the offer's, maps device segments exported later."""
        if self.device_segments.retain(device_segments or [], transport):
            self.drop_plan()  # its views of an unmapped segment would keep the mapping
        keep = {s.name for s in segments}
        for name in [n for n in self._mapped if n not in keep]:
            self._unmap(name)

    def _segment(self, spec: SegmentSpec, sender_pid: int | None) -> SharedSegment:
        if spec.pid != sender_pid:
            raise ProtocolError(f"the sender (pid {sender_pid}) referenced segment {spec.name} of process "
                                f"{spec.pid}; a sender sends references into its own segments only")
        mapped = self._mapped.get(spec.name)
        if mapped is not None and mapped.size >= spec.size:
            return mapped
        if mapped is not None:
            self._unmap(spec.name)
        try:  # read-only: this side only ever reads the trainer's parameters
            mapped = SharedSegment.open(spec.name, spec.size, owner_pid=sender_pid, pattern=SHARED_SEGMENT_NAME)
        except (ValueError, ProtocolError) as exc:  # a name or file no sender of ours makes: refused
            raise ProtocolError(f"refused the sender's shared segment {spec.name} ({spec.size} bytes): {exc}") from None
        except OSError as exc:
            raise ProtocolError(f"cannot map the sender's shared segment {spec.name} ({spec.size} bytes): {exc}; "
                                "sender and receiver must share /dev/shm (same host, same IPC namespace)") from None
        self._mapped[spec.name] = mapped
        if self.device.torch_type != "cpu" and self.device.pin_host_memory(mapped.tensor, read_only=True):
            self._pinned[spec.name] = mapped.tensor  # host-to-device copies from it run at full speed
        return mapped

    def read(self, frame: Refs, sender_pid: int | None, into: IntoFn | None) -> list[tuple[str, torch.Tensor]]:
        """Copy every referenced tensor `into` names; the others as views of shared memory, for `load`."""
        self.device_segments.map(frame.device_segments)  # first: an export is mapped or released, never left
        segments = [self._segment(spec, sender_pid).tensor for spec in frame.segments]
        out: list[tuple[str, torch.Tensor]] = []
        host_copies: list[tuple[int, int, int]] = []  # (dst, src, nbytes) on data pointers
        recording = self._recording
        bases = [segment.data_ptr() for segment in segments]
        for ref in frame.refs:
            dtype = dtype_from_name(ref.dtype)
            given = None if into is None else into(ref.name, dtype, ref.shape)
            dest = matching_destination(ref.name, dtype, ref.shape, given)
            if dest is not None and dest.is_cpu:  # a host copy needs only the addresses (dest is contiguous)
                if ref.nbytes:
                    host_copies.append((dest.data_ptr(), bases[ref.segment] + ref.offset, ref.nbytes))
                if recording is not None:
                    recording.add_destination(ref.name, dtype, ref.shape, dest)
                continue
            recording = None
            source = segments[ref.segment]
            if dest is not None:
                copy_bytes(flat_bytes(dest), 0, source, ref.offset, ref.nbytes)  # queued on the device
                self._queued.add(dest.device)
            elif ref.nbytes:
                out.append((ref.name, source[ref.offset: ref.offset + ref.nbytes].view(dtype).view(ref.shape)))
            else:
                out.append((ref.name, torch.empty(ref.shape, dtype=dtype)))
        if recording is not None:
            recording.copies += host_copies
            recording.nbytes += sum(n for _, _, n in host_copies)
        self._copy(host_copies)
        lent, recorded = self.device_segments.read(frame.device_refs, into, recording)
        if recording is None or not recorded:
            self._recording = None
        return out + lent

    # -- plans (replay.py) ------------------------------------------------------------------------------------
    def record(self, sender_pid: int, sync: int) -> None:
        """Record this sync's copies as a plan (kept by `keep_plan` once the sync completed)."""
        self._recording = ReadPlan(sender_pid, sync, [], [], 0, data_ptr=self.device.data_ptr)

    @property
    def recording(self) -> ReadPlan | None:
        """The plan this sync is recording (the bucket reader notes its copies in it too), or None."""
        return self._recording

    def not_a_plan(self) -> None:
        """This sync is not a pure one-copy sync into host tensors: it makes no plan."""
        self._recording = None

    def keep_plan(self) -> None:
        """The sync completed: what it recorded, if anything, is the plan now (else the old one is dropped)."""
        recorded, self._recording = self._recording, None
        self.plan = recorded if recorded is not None and recorded.destinations and not recorded.unidentified else None
        if self.plan is not None:
            self.plan.merge_launches()
            self.plan.nbytes += sum(n for _, pieces in self.plan.buckets for *_, n in pieces)
            host_copy.warm(len(self.plan.copies) + sum(len(pieces) for _, pieces in self.plan.buckets))

    def drop_plan(self) -> None:
        """Forget every plan (a failed sync, a segment unmapped)."""
        self.plan = self._recording = None

    def can_replay(self, offer: Offer, into: IntoFn | None) -> bool:
        """Whether this receiver can run the replay `offer` proposes: it holds that plan, from that sender, the sync
        is no delta, and `into` still gives each of the plan's destinations (else the plan is dropped)."""
        plan = self.plan
        if plan is None or into is None or offer.delta is not None or plan.sync != offer.replay \
                or plan.sender_pid != offer.pid:
            return False
        if not plan.holds(into):
            self.plan = None
            return False
        return True

    def replay(self, stats: SyncStats) -> None:
        """Run the plan's copies again (the sender offered it as a replay): they read what the tensors hold now."""
        plan = self.plan
        assert plan is not None
        t0 = time.perf_counter()
        self.device_segments.replay(plan)
        if plan.pieces is None:  # cut once: the plan's copies are the same every replay
            plan.pieces = self._pieces(plan.copies, sum(n for _, _, n in plan.copies))
        self._run(plan.pieces)
        stats.load_s += time.perf_counter() - t0
        stats.tensors += len(plan.destinations)
        stats.bytes += plan.nbytes

    def _copy(self, jobs: list[tuple[int, int, int]]) -> None:
        """Run host memmoves: a small batch here, a large one queued in pieces on the copy threads."""
        self._run(self._pieces(jobs, sum(n for _, _, n in jobs)))

    def _pieces(self, jobs: list[tuple[int, int, int]], nbytes: int) -> list[Moves]:
        """The copies as one batch (run here) or as batches of about COPY_CHUNK_BYTES (for the copy threads)."""
        if self.copy_threads == 1 or nbytes < _PARALLEL_BYTES:
            return [Moves(jobs)]
        return chunk_copies(jobs, COPY_CHUNK_BYTES)

    def _run(self, pieces: list[Moves]) -> None:
        if len(pieces) == 1:
            pieces[0].move_out()
            return
        if self._pool is None:
            self._pool = copy_pool(self.copy_threads, "hwsync-copy")  # unbound: host_threads.py
        self._copies += [self._pool.submit(part.move_out) for part in pieces]

    def _wait_copies(self) -> None:
        """Wait for every queued host copy; raise the first one's error after all have ended."""
        copies, self._copies = self._copies, []
        errors = [exc for exc in (c.exception() for c in copies) if exc is not None]
        if errors:
            raise errors[0]

    def receive(self, frame: Refs, sender_pid: int | None, load: LoadFn | None, into: IntoFn | None,
                stats: SyncStats) -> bool:
        """Copy or load one Refs batch (counted in `stats`); whether load was handed views of shared memory."""
        t0 = time.perf_counter()
        tensors = self.read(frame, sender_pid, into)
        if tensors:
            if load is None:
                raise ValueError(f"into() returned None for {tensors[0][0]!r} and no load was given; return "
                                 "a destination for every tensor or pass load")
            with host_cores_free():  # a one-copy sync's sender waits meanwhile: load's copies may take its core
                load(tensors)
        stats.load_s += time.perf_counter() - t0
        stats.tensors += len(frame.refs) + len(frame.device_refs)
        stats.bytes += sum(r.nbytes for r in frame.refs) + sum(r.nbytes for r in frame.device_refs)
        return bool(tensors)

    def finish(self, loaded_views: bool, stats: SyncStats | None = None) -> None:
        """Wait for this sync's queued device reads of shared memory (copies here, and `load`'s when it had
        views): after this, the sender's trainer may change it. The wait counts as load time in `stats`."""
        t0 = time.perf_counter()
        try:
            self._finish(loaded_views)
        finally:
            if stats is not None:
                stats.load_s += time.perf_counter() - t0

    def _finish(self, loaded_views: bool) -> None:
        try:
            self._wait_copies()
        finally:  # a host copy that failed does not spare the wait for the device's queued ones
            if loaded_views and self.device.torch_type != "cpu":
                self._queued.add(self.device.torch_device())
            for where in self._queued:
                wait_for_queued(self.device, where)
            self._queued.clear()
            self.device_segments.finish()

    def _unmap(self, name: str) -> None:
        self.drop_plan()  # its copies may read this mapping
        if self._copies:  # a failed sync's copies may still read the mapping: never unmap under them
            try:
                self._wait_copies()
            except Exception:  # noqa: BLE001 - that sync has failed already; its error was reported
                pass
        pinned = self._pinned.pop(name, None)
        if pinned is not None:
            self.device.unpin_host_memory(pinned)
        del pinned
        self._mapped.pop(name).close()

    def close(self, dead_sender: int | None = None) -> None:
        """Unmap everything; with `dead_sender` (a pid that exited), also unlink its segments it left behind."""
        self.drop_plan()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        try:  # a failed sync may have device copies from the mappings still queued (load's too): never unmap under
            self._finish(True)  # them, nor say this receiver stopped reading before they end
        except Exception as exc:  # noqa: BLE001 - the mappings go anyway; the failure was the sync's
            log.warning("hwsync: waiting for device copies before unmapping shared segments failed: %s", exc)
        self.device_segments.close()
        for name in list(self._mapped):
            self._unmap(name)
            if dead_sender is not None and SegmentSpec(name, 0).pid == dead_sender:
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                    log.warning("hwsync: removed shared segment %s of the dead sender %d", name, dead_sender)
                except FileNotFoundError:
                    pass  # its resource tracker was first
