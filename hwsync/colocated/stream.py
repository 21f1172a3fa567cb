"""Packing one sync's tensors into buckets and posting them: the sender's inner loop.

Where each byte goes is BucketPacker's rule (hwsync.sync.bucket): whole tensors stay whole and
split tensors' tails end their bucket, or, when every receiver copies straight into its own
tensors (receive(into=...)), buckets are packed dense. A buffer is taken only when the first
byte goes into it, and only once the bucket it held before has been released.

Tensors that lie whole in this process's shared parameter segments (hwsync.sync.shared_params), and
device tensors that lie in the trainer's own allocator segments (mapped.py: a model's parameters),
are not packed at all: they are sent as references, batched into Refs frames, which receivers read
in place (one copy per byte). A batch goes out before the next packed tensor, when it holds
REFS_BATCH_BYTES of tensors or REFS_BATCH_WIRE_BYTES of frame, and at the end of the sync; a batch
that exports device segments to a receiver for the first time goes to each receiver as its own frame.

The copies into one device bucket are launched together when it is posted (bucket.CopyBatch: one
foreach copy, not one launch per tensor). Both read a tensor after the source has moved past it, which
holds for a model's tensors and for tensors made for the sync (held here until then), not for memory
the source reuses or changes once it is asked for the next item: a view hwsync lent to a `load` call
(bucket.lent: LocalForwarder's) is copied at once and never referenced, and so is every tensor of a
sender built with stable_sources=False.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from ctypes import memmove
from typing import Any, Protocol

import torch

from hwsync.backend.devices import PLAIN_TENSOR_TYPES
from hwsync.backend.interfaces import SendBuffers
from hwsync.colocated.doorbell import DESCRIPTOR_BYTES, Doorbell, spin_wait
from hwsync.colocated.mapped import MappedSources
from hwsync.colocated.replay import SentPlan, SentTensor, sent_tensor
from hwsync.colocated.sender_control import SyncReceivers
from hwsync.control.endpoints import CloseSignal
from hwsync.protocol import Bucket, Frame, Ref, Refs, Release, SegmentSpec, encode
from hwsync.protocol.layout import DeviceRef
from hwsync.sync.bucket import BucketPacker, Closed, CopyBatch, as_bytes, entry_wire_bytes, host_moves, lent
from hwsync.sync.shared_params import LIVE, SegmentIndex
from hwsync.sync.spec import NamedTensors, TensorSpec, checked_items, dtype_name
from hwsync.sync.stats import SyncStats
from hwsync.timing import PACKING_CHECK_S

#: room kept in a descriptor for the frame's own fields besides the entries
_FRAME_OVERHEAD = 1024
#: a Refs batch is sent once it references this many bytes (receivers start copying early)...
REFS_BATCH_BYTES = 256 << 20
#: ...or its frame reaches this size (well inside the receivers' frame limit)
REFS_BATCH_WIRE_BYTES = 1 << 20
#: room counted in a batch's frame for one device segment's export (a CUDA IPC record is ~250 bytes)
_EXPORT_WIRE_BYTES = 1024


class BucketStream:
    """Streams one sync's (name, tensor) pairs through the buffers; `run` returns the next sequence number."""

    def __init__(self, link: BucketLink, buffers: SendBuffers, pool: BufferPool, bucket_bytes: int, sync: int,
                 first_seq: int, stats: SyncStats, dense: bool = False, refs_to: SyncReceivers | None = None,
                 mapped: MappedSources | None = None, stable: bool = True, closing: CloseSignal | None = None,
                 data_ptr: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr) -> None:
        self.link, self.buffers, self.pool, self.sync, self.stats = link, buffers, pool, sync, stats
        #: close() on the sender: read before each tensor (a flag), so that a source that closes its own sender ends
        #: the sync at its next item, before any Done (the link's own check runs only every PACKING_CHECK_S)
        self.closing = closing
        self.seq = first_seq
        self.packer = BucketPacker(bucket_bytes, dense=dense, max_wire_bytes=DESCRIPTOR_BYTES - _FRAME_OVERHEAD)
        self.current: int | None = None  # the buffer being filled
        #: who Refs batches go to; None: pack every tensor (receivers cannot map our segments)
        self.refs_to = refs_to
        self._segments: list[SegmentSpec] = []
        self._segment_at: dict[SegmentSpec, int] = {}  # each one's position in _segments
        self._shared: SegmentIndex | None = None  # this process's shared segments, taken at the sync's start
        self._refs: list[Ref] = []
        self._refs_bytes = self._refs_wire = 0
        #: the trainer's device segments (None: device tensors go packed)
        self.mapped = mapped if refs_to is not None else None
        self._device_refs: list[DeviceRef] = []
        self._device_ref_segments: set[int] = set()  # the segments the batch's device refs name (a set: batches of
        # thousands of refs were checked against every earlier ref, quadratic)
        #: the open bucket's device copies, launched together when it is posted
        self._copies = CopyBatch()
        #: whether the source leaves each tensor as it was until the sync ends (see the module doc)
        self.stable = stable
        #: this sync's tensors as a replay plan records them, while every one went by reference into shared
        #: segments (None once one did not: replay.py)
        self._planned: list[SentTensor] | None = [] if stable else None
        self._planned_segments: set[str] = set()
        self._planned_device_segments: set[int] = set()
        self._planned_buckets: list[tuple[int, list[tuple[int, torch.Tensor, int, int]]]] = []
        self._planned_pieces: list[tuple[int, torch.Tensor, int, int]] = []  # the open bucket's
        #: buckets are replayed only when packed dense (every receiver copies into its own tensors)
        self._dense = dense
        #: how a plan reads its tensors' addresses (the backend's Device.data_ptr)
        self._data_ptr = data_ptr

    @property
    def plan(self) -> SentPlan | None:
        """The plan this sync makes (once `run` returned): every tensor went by reference into shared segments."""
        if not self._planned:
            return None
        return SentPlan(self._planned, frozenset(self._planned_segments), self.stats.bytes,
                        frozenset(self._planned_device_segments), buckets=self._planned_buckets,
                        data_ptr=self._data_ptr)

    def replay(self, plan: SentPlan, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Refill and post the plan's buckets (`tensors`, the matched source, stay alive meanwhile); the next
        sequence number."""
        self.pool.begin_sync()
        if plan.moves is None:  # host tensors into host buffers: plain memmoves on the addresses
            plan.moves = [host_moves([(flat, at, offset, n) for offset, flat, at, n in pieces])
                          if self.buffers.buffer(0).device.type == "cpu" else None for _, pieces in plan.buckets]
        for (nbytes, pieces), moves in zip(plan.buckets, plan.moves):
            self.link.check("replaying a bucket")
            self.current = self._take()
            buffer = self.buffers.buffer(self.current)
            t0 = time.perf_counter()
            if moves is not None:
                moves.move_in(buffer.data_ptr())
            else:
                for offset, flat, chunk_offset, chunk_bytes in pieces:
                    if flat.dtype is not torch.uint8 or flat.dim() != 1:  # a host tensor packed on its address
                        flat = as_bytes(flat)
                    self._copies.add(buffer, offset, flat, chunk_offset, chunk_bytes, non_blocking=True)
            self.stats.pack_s += time.perf_counter() - t0
            self._post(Closed(nbytes, []))
        del tensors
        return self.seq

    def run(self, source: NamedTensors, manifest: list[TensorSpec] | None) -> int:
        """Pack and post every tensor of `source`, checking it against `manifest` when given."""
        stats = self.stats
        self.pool.begin_sync()
        self._shared = SegmentIndex() if LIVE and self.refs_to is not None else None
        next_check = time.perf_counter() + PACKING_CHECK_S
        closing = self.closing
        host_buffers = self.buffers.buffer(0).device.type == "cpu"
        for _position, name, tensor in checked_items(source, manifest):
            if closing is not None:
                closing.check(f"packing tensor {name!r}")
            if time.perf_counter() >= next_check:  # a long bucket (or a slow source) still hears failures
                self.link.check(f"packing tensor {name!r}")
                next_check = time.perf_counter() + PACKING_CHECK_S
            nbytes = tensor.numel() * tensor.element_size()
            volatile = not self.stable or lent(tensor)
            if self.refs_to is not None and self._add_ref(name, tensor, nbytes, volatile):
                continue
            if volatile or not self._dense:
                self._planned = None
            flat = None
            for step in self.packer.place(name, dtype_name(tensor.dtype), tuple(tensor.shape), nbytes):
                if isinstance(step, Closed):
                    self._post(step)
                    continue
                if flat is None:
                    if host_buffers and type(tensor) in PLAIN_TENSOR_TYPES and tensor.is_cpu and tensor.is_contiguous():
                        flat = tensor  # its address is all a memmove needs: no flat byte view made (issue 50)
                    else:
                        flat = as_bytes(tensor)  # only now: a DTensor gathers here, one at a time
                        if self._planned is not None and (hasattr(tensor, "full_tensor")
                                                          or self._data_ptr(flat) != self._data_ptr(tensor)):
                            self._planned = None  # a copy made for this sync (strided, gathered): nothing to replay
                if self.current is None:
                    self.current = self._take()
                entry = step.entry
                t0 = time.perf_counter()
                if flat is tensor:  # host to host: the packer keeps each chunk within the tensor's bytes
                    memmove(self.buffers.buffer(self.current).data_ptr() + entry.offset,
                            tensor.data_ptr() + entry.chunk_offset, entry.chunk_bytes)
                else:  # publish() waits for the device before a receiver hears of the bucket
                    self._copies.add(self.buffers.buffer(self.current), entry.offset, flat, entry.chunk_offset,
                                     entry.chunk_bytes, non_blocking=True)
                stats.pack_s += time.perf_counter() - t0
                if self._planned is not None:
                    self._planned_pieces.append((entry.offset, flat, entry.chunk_offset, entry.chunk_bytes))
            if volatile:  # its memory changes once we ask for the next item: the copies are queued now
                t0 = time.perf_counter()
                self._copies.flush()
                stats.pack_s += time.perf_counter() - t0
            if self._planned is not None:
                self._plan(name, tensor)
            stats.tensors += 1
            stats.bytes += nbytes
        last = self.packer.close()
        if last is not None:
            self._post(last)
        self._flush_refs()
        return self.seq

    def _add_ref(self, name: str, tensor: torch.Tensor, nbytes: int, volatile: bool) -> bool:
        """Batch a reference to `tensor` if receivers can read it in place; else send the batch (it goes packed)."""
        found = None if self._shared is None else self._shared.find(tensor, nbytes)
        placed = None if found is not None or self.mapped is None or volatile else self.mapped.place(tensor)
        if found is None and placed is None:
            self._flush_refs()  # receivers copy the batch while this tensor is packed
            return False
        dtype = dtype_name(tensor.dtype)
        if found is not None:
            segment, offset = found
            index = self._segment_at.get(segment)
            if index is None:
                index = self._segment_at[segment] = len(self._segments)
                self._segments.append(segment)
            self._refs.append(Ref(name, dtype, tuple(tensor.shape), index, offset, nbytes))
            kind = "shared"
            if self._planned is not None and not volatile:
                self._plan(name, tensor)
                self._planned_segments.add(segment.name)
            else:
                self._planned = None
        else:
            assert placed is not None
            ident, offset = placed
            if ident not in self._device_ref_segments:
                self._device_ref_segments.add(ident)
                self._refs_wire += _EXPORT_WIRE_BYTES  # it may carry the segment's export
            self._device_refs.append(DeviceRef(name, dtype, tuple(tensor.shape), ident, offset))
            kind = "mapped"
            if self._planned is not None:
                self._plan(name, tensor)
                self._planned_device_segments.add(ident)
        self._refs_bytes += nbytes
        self._refs_wire += entry_wire_bytes(name, tensor.dim())
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        counts = self.stats.notes.setdefault(kind, {"tensors": 0, "bytes": 0})
        counts["tensors"], counts["bytes"] = counts["tensors"] + 1, counts["bytes"] + nbytes
        if self._refs_bytes >= REFS_BATCH_BYTES or self._refs_wire >= REFS_BATCH_WIRE_BYTES:
            self._flush_refs()
        return True

    def _plan(self, name: str, tensor: torch.Tensor) -> None:
        """Note the tensor in this sync's plan; a tensor with no address to check it by leaves the sync without one."""
        assert self._planned is not None
        planned = sent_tensor(name, tensor, self._data_ptr)
        if planned is None:
            self._planned = None
        else:
            self._planned.append(planned)

    def _flush_refs(self) -> None:
        receivers = self.refs_to
        if receivers is not None and self._device_refs:
            assert self.mapped is not None
            self.mapped.ready_to_read()  # the trainer's queued writes land before any receiver reads
            ids = list(dict.fromkeys(r.segment for r in self._device_refs))
            exports = [self.mapped.exports_for(peer, ids) for peer in receivers.peers]
            if any(exports):
                for peer, new in zip(receivers.peers, exports):  # each receiver its own exports
                    receivers.control.send_to(peer, encode(Refs(
                        sync=self.sync, segments=self._segments, refs=self._refs, device_segments=new,
                        device_refs=self._device_refs)))
                mapped = self.stats.notes["mapped"]
                mapped["exports"] = mapped.get("exports", 0) + sum(len(e) for e in exports)
            else:
                receivers.broadcast(Refs(sync=self.sync, segments=self._segments, refs=self._refs,
                                         device_segments=[], device_refs=self._device_refs))
        elif receivers is not None and self._refs:
            receivers.broadcast(Refs(sync=self.sync, segments=self._segments, refs=self._refs, device_segments=[],
                                     device_refs=[]))
        self._segments, self._refs, self._device_refs, self._refs_bytes, self._refs_wire = [], [], [], 0, 0
        self._segment_at = {}
        self._device_ref_segments = set()

    def _take(self) -> int:
        index, previous = self.pool.take(self.seq)
        if previous >= 0:
            self.stats.wait_s += timed_wait(self.link, previous, f"waiting for receivers to release buffer {index}")
        return index

    def _post(self, bucket: Closed) -> None:
        """Publish the bucket being filled and tell the receivers."""
        assert self.current is not None
        stats = self.stats
        t0 = time.perf_counter()
        self._copies.flush()  # the bucket's device copies, in one launch
        stats.pack_s += time.perf_counter() - t0
        self.buffers.publish(self.current, bucket.nbytes)
        if self._planned is not None and bucket.entries:
            self._planned_buckets.append((bucket.nbytes, self._planned_pieces))
        self._planned_pieces = []
        self.link.post(self.seq, Bucket(sync=self.sync, index=stats.buckets, seq=self.seq, buf=self.current,
                                        nbytes=bucket.nbytes, entries=bucket.entries))
        self.pool.filled(bucket.nbytes)
        self.seq += 1
        stats.buckets += 1
        self.current = None


# -- links: how a sender tells receivers a bucket is ready, and learns they released it ---------------------
class BucketLink(Protocol):
    """What the sender's stream needs from either way of signalling."""

    def post(self, seq: int, frame: Bucket) -> None:
        """Make bucket `seq` (described by `frame`) available to every receiver."""

    def wait_released(self, seq: int, what: str) -> None:
        """Return once every receiver has released bucket `seq`."""

    def check(self, what: str) -> None:
        """Raise if a receiver failed or went away, or close() was called (cheap: called while packing too)."""


class FrameLink:
    """One ZeroMQ frame per bucket out, one release frame per bucket back."""

    def __init__(self, receivers: SyncReceivers, first: int) -> None:
        self._receivers = receivers
        self._released = {identity: first for identity in receivers.identities}

    def post(self, seq: int, frame: Bucket) -> None:
        """Send the bucket frame to every receiver."""
        self._receivers.broadcast(frame)

    def wait_released(self, seq: int, what: str) -> None:
        """Read release frames until every receiver is past `seq`."""
        while min(self._released.values()) <= seq:
            self._note(*self._receivers.recv(what))

    def _note(self, identity: bytes, frame: Frame) -> None:
        """Count a receiver's release."""
        if isinstance(frame, Release) and identity in self._released:
            self._released[identity] = max(self._released[identity], frame.seq + 1)

    def check(self, what: str) -> None:
        """Read what is queued without waiting (releases are counted), raising on failures."""
        for identity, frame in self._receivers.poll(what):
            self._note(identity, frame)


class DoorbellLink:
    """Descriptors and counters in the doorbell segment; ZeroMQ is only polled for failures."""

    def __init__(self, doorbell: Doorbell, receivers: SyncReceivers) -> None:
        self._bell = doorbell
        self._receivers = receivers
        self._ranks = len(receivers.peers)

    def post(self, seq: int, frame: Bucket) -> None:
        """Write the descriptor and ring."""
        self._bell.post(seq, encode(frame))

    def wait_released(self, seq: int, what: str) -> None:
        """Spin on the receivers' counters until all are past `seq`."""
        control = self._receivers.control
        spin_wait(lambda: self._bell.min_released(self._ranks) > seq, lambda: self.check(what),
                  timeout_s=control.timeout_s, what=what, endpoint=control.address)

    def check(self, what: str) -> None:
        """Poll ZeroMQ for failures (the counters need no reading until a buffer is wanted)."""
        self._receivers.poll(what)


def timed_wait(link: BucketLink, seq: int, what: str) -> float:
    """wait_released, returning the seconds it took."""
    t0 = time.perf_counter()
    link.wait_released(seq, what)
    return time.perf_counter() - t0


# -- the buffer pool: which buffer the next bucket takes, and when the receivers released it ------------------
#: windows in the preferred mode before the other one is tried again: doubles from the first
#: figure each time the other loses again, back to the first when a mode is left for being slow
RETRY_FIRST, RETRY_MOST = 4, 32
HOT, COLD = "hot", "cold"
#: a try ends early once its cost per byte exceeds the other mode's by this factor
LOSING = 1.5


class BufferPool:
    """Chooses buffers for consecutive buckets; a buffer's previous bucket must be released first."""

    def __init__(self, num_buffers: int, bucket_bytes: int, hot_buffers: int = 2, window_buckets: int = 16) -> None:
        self.num_buffers = num_buffers
        self.hot_buffers = min(hot_buffers, num_buffers)
        self.adaptive = num_buffers > self.hot_buffers
        self._lru: deque[int] = deque(range(num_buffers))  # least recently used first
        #: the sequence number of the bucket each buffer last held (-1: never used)
        self.holder = [-1] * num_buffers
        self.mode = HOT if self.adaptive else COLD
        #: measured seconds per byte of each mode (None: not measured yet)
        self.cost: dict[str, float | None] = {HOT: None, COLD: None}
        self._window_bytes = window_buckets * bucket_bytes
        self._probe_bytes = max(2, window_buckets // 4) * bucket_bytes
        #: windows scored so far (tries included)
        self.windows = 0
        self._window_start = 0.0
        self._window_filled = 0
        self._windows_in_mode = 0
        self._retry_every = RETRY_FIRST
        self._trying = False
        self._try_buckets = 0

    def begin_sync(self) -> None:
        """Start timing afresh: the gap between syncs is not transfer time."""
        self._window_start = time.perf_counter()
        self._window_filled = 0

    def take(self, seq: int) -> tuple[int, int]:
        """(buffer for bucket `seq`, the bucket it held before, which must be released first; -1: none)."""
        if self.mode == HOT:
            # the least recently used of the `hot_buffers` most recently used
            index = self._lru[self.num_buffers - self.hot_buffers]
        else:
            index = self._lru[0]
        self._lru.remove(index)
        self._lru.append(index)
        previous = self.holder[index]
        self.holder[index] = seq
        return index, previous

    def filled(self, nbytes: int) -> None:
        """Account a posted bucket; at the end of a window, score the mode and maybe switch."""
        if not self.adaptive:
            return
        self._window_filled += nbytes
        if not self._trying:
            if self._window_filled < self._window_bytes:
                return
            now = time.perf_counter()
        else:
            now = time.perf_counter()
            self._try_buckets += 1
            if self._try_buckets == 1:  # the switch's own bucket: time the try from here
                self._window_start, self._window_filled = now, 0
                return
            rival = self.cost[COLD if self.mode == HOT else HOT]
            losing = rival is not None and (now - self._window_start) / self._window_filled > LOSING * rival
            if self._window_filled < self._probe_bytes and not losing:
                return
        cost = (now - self._window_start) / self._window_filled
        self._window_start, self._window_filled = now, 0
        self.windows += 1
        self.cost[self.mode] = cost
        self._windows_in_mode += 1
        other = COLD if self.mode == HOT else HOT
        other_cost = self.cost[other]
        if self._trying:  # this window was a try of this mode: keep it only if it won
            self._trying = False
            if other_cost is not None and other_cost < cost:
                self._retry_every = min(self._retry_every * 2, RETRY_MOST)
                self._switch(other)
            else:
                self._retry_every = RETRY_FIRST
        elif other_cost is None or self._windows_in_mode >= self._retry_every:
            self._switch(other)
            self._trying = True
            self._try_buckets = 0
        elif other_cost < cost:  # this mode got slower: the machine changed, and may change back soon
            self._switch(other)
            self._retry_every = RETRY_FIRST

    def _switch(self, mode: str) -> None:
        self.mode = mode
        self._windows_in_mode = 0

    def to_dict(self) -> dict[str, Any]:
        """The current choice and what each mode measured, in GB/s."""
        rate = {m: (round(1e-9 / c, 2) if c else None) for m, c in self.cost.items()}
        return {"mode": self.mode, "hot_buffers": self.hot_buffers, "buffers": self.num_buffers, "gbps": rate}
