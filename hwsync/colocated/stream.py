"""Packing one sync's tensors into buckets and posting them: the sender's inner loop.

Where each byte goes is BucketPacker's rule (hwsync.bucket): whole tensors stay whole and
split tensors' tails end their bucket, or, when every receiver copies straight into its own
tensors (receive(into=...)), buckets are packed dense. A buffer is taken only when the first
byte goes into it, and only once the bucket it held before has been released.

Tensors that lie whole in this process's shared parameter segments (hwsync.shared_params) are
not packed at all: they are sent as references, batched into Refs frames, which receivers read
in place (one copy per byte). A batch goes out before the next packed tensor, when it holds
REFS_BATCH_BYTES of tensors or REFS_BATCH_WIRE_BYTES of frame, and at the end of the sync.
"""

from __future__ import annotations

import time

import torch

from hwsync.bucket import BucketPacker, Closed, as_bytes, copy_bytes, entry_wire_bytes
from hwsync.colocated.buffer_pool import BufferPool
from hwsync.colocated.doorbell import DESCRIPTOR_BYTES
from hwsync.colocated.links import BucketLink, timed_wait
from hwsync.colocated.sender_control import SyncReceivers
from hwsync.interfaces import SendBuffers
from hwsync.manifest import TensorSpec, dtype_name
from hwsync.protocol import Bucket, Ref, Refs, SegmentSpec
from hwsync.shared_params import find_shared
from hwsync.source import NamedTensors, checked_items
from hwsync.stats import SyncStats
from hwsync.timing import PACKING_CHECK_S

#: room kept in a descriptor for the frame's own fields besides the entries
_FRAME_OVERHEAD = 1024
#: a Refs batch is sent once it references this many bytes (receivers start copying early)...
REFS_BATCH_BYTES = 256 << 20
#: ...or its frame reaches this size (well inside the receivers' frame limit)
REFS_BATCH_WIRE_BYTES = 1 << 20


class BucketStream:
    """Streams one sync's (name, tensor) pairs through the buffers; `run` returns the next sequence number."""

    def __init__(self, link: BucketLink, buffers: SendBuffers, pool: BufferPool, bucket_bytes: int, sync: int,
                 first_seq: int, stats: SyncStats, dense: bool = False, refs_to: SyncReceivers | None = None) -> None:
        self.link, self.buffers, self.pool, self.sync, self.stats = link, buffers, pool, sync, stats
        self.seq = first_seq
        self.packer = BucketPacker(bucket_bytes, dense=dense, max_wire_bytes=DESCRIPTOR_BYTES - _FRAME_OVERHEAD)
        self.current: int | None = None  # the buffer being filled
        #: who Refs batches go to; None: pack every tensor (receivers cannot map our segments)
        self.refs_to = refs_to
        self._segments: list[SegmentSpec] = []
        self._refs: list[Ref] = []
        self._refs_bytes = self._refs_wire = 0

    def run(self, source: NamedTensors, manifest: list[TensorSpec] | None) -> int:
        """Pack and post every tensor of `source`, checking it against `manifest` when given."""
        stats = self.stats
        self.pool.begin_sync()
        next_check = time.perf_counter() + PACKING_CHECK_S
        for _position, name, tensor in checked_items(source, manifest):
            if time.perf_counter() >= next_check:  # a long bucket (or a slow source) still hears failures
                self.link.check(f"packing tensor {name!r}")
                next_check = time.perf_counter() + PACKING_CHECK_S
            nbytes = tensor.numel() * tensor.element_size()
            if self.refs_to is not None and self._add_ref(name, tensor, nbytes):
                continue
            flat = None
            for step in self.packer.place(name, dtype_name(tensor.dtype), tuple(tensor.shape), nbytes):
                if isinstance(step, Closed):
                    self._post(step)
                    continue
                if flat is None:
                    flat = as_bytes(tensor)  # only now: a DTensor gathers here, one at a time
                if self.current is None:
                    self.current = self._take()
                entry = step.entry
                t0 = time.perf_counter()
                # publish() waits for the device before a receiver hears of the bucket
                copy_bytes(self.buffers.buffer(self.current), entry.offset, flat, entry.chunk_offset,
                           entry.chunk_bytes, non_blocking=True)
                stats.pack_s += time.perf_counter() - t0
            stats.tensors += 1
            stats.bytes += nbytes
        last = self.packer.close()
        if last is not None:
            self._post(last)
        self._flush_refs()
        return self.seq

    def _add_ref(self, name: str, tensor: torch.Tensor, nbytes: int) -> bool:
        """Batch a reference to `tensor` if it lies in a shared segment; else send the batch (it goes packed)."""
        found = find_shared(tensor)
        if found is None:
            self._flush_refs()  # receivers copy the batch while this tensor is packed
            return False
        segment, offset = found
        if segment not in self._segments:
            self._segments.append(segment)
        self._refs.append(Ref(name, dtype_name(tensor.dtype), tuple(tensor.shape), self._segments.index(segment),
                              offset, nbytes))
        self._refs_bytes += nbytes
        self._refs_wire += entry_wire_bytes(name, tensor.dim())
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        shared = self.stats.notes.setdefault("shared", {"tensors": 0, "bytes": 0})
        shared["tensors"], shared["bytes"] = shared["tensors"] + 1, shared["bytes"] + nbytes
        if self._refs_bytes >= REFS_BATCH_BYTES or self._refs_wire >= REFS_BATCH_WIRE_BYTES:
            self._flush_refs()
        return True

    def _flush_refs(self) -> None:
        if self._refs and self.refs_to is not None:
            self.refs_to.broadcast(Refs(sync=self.sync, segments=self._segments, refs=self._refs))
        self._segments, self._refs, self._refs_bytes, self._refs_wire = [], [], 0, 0

    def _take(self) -> int:
        index, previous = self.pool.take(self.seq)
        if previous >= 0:
            self.stats.wait_s += timed_wait(self.link, previous, f"waiting for receivers to release buffer {index}")
        return index

    def _post(self, bucket: Closed) -> None:
        """Publish the bucket being filled and tell the receivers."""
        assert self.current is not None
        stats = self.stats
        self.buffers.publish(self.current, bucket.nbytes)
        self.link.post(self.seq, Bucket(sync=self.sync, index=stats.buckets, seq=self.seq, buf=self.current,
                                        nbytes=bucket.nbytes, entries=bucket.entries))
        self.pool.filled(bucket.nbytes)
        self.seq += 1
        stats.buckets += 1
        self.current = None
