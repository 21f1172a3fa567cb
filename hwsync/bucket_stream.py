"""Packing one sync's tensors into buckets and posting them: the sender's inner loop.

A tensor that fits a bucket is never split, so receivers get it as a zero-copy view; a larger
one is cut over consecutive buckets, and its tail ends its bucket (that bucket then holds no
views, so receivers release it before loading the reassembled tensor). When every receiver
copies straight into its own tensors (receive(into=...)), nothing is reassembled and nothing is
viewed, so buckets are packed dense instead: every bucket full, tensors cut wherever it ends.
A buffer is taken only when the first byte goes into it, and only once the bucket it held
before has been released.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from hwsync.bucket import BucketWriter, copy_bytes
from hwsync.buffer_pool import BufferPool
from hwsync.doorbell import DESCRIPTOR_BYTES
from hwsync.errors import ManifestError
from hwsync.interfaces import SendBuffers
from hwsync.manifest import TensorSpec
from hwsync.sender_links import BucketLink, timed_wait
from hwsync.stats import SyncStats

#: room kept in a descriptor for the frame's own fields besides the entries
_FRAME_OVERHEAD = 1024


class BucketStream:
    """Streams one sync's (name, tensor) pairs through the buffers; `run` returns the next sequence number."""

    def __init__(self, link: BucketLink, buffers: SendBuffers, pool: BufferPool, bucket_bytes: int, sync: int,
                 first_seq: int, stats: SyncStats, dense: bool = False) -> None:
        self.link, self.buffers, self.pool, self.sync, self.stats = link, buffers, pool, sync, stats
        self.bucket_bytes = bucket_bytes
        self.dense = dense
        self.seq = first_seq
        self.writer = BucketWriter(bucket_bytes, max_wire_bytes=DESCRIPTOR_BYTES - _FRAME_OVERHEAD)
        self.current: int | None = None  # the buffer being filled

    def run(self, source: Iterable[tuple[str, torch.Tensor]], manifest: list[TensorSpec] | None) -> int:
        """Pack and post every tensor of `source`, checking it against `manifest` when given."""
        writer, stats = self.writer, self.stats
        seen: set[str] = set()
        self.pool.begin_sync()
        for position, (name, tensor) in enumerate(source):
            check_item(position, name, tensor, manifest, seen)
            nbytes = tensor.numel() * tensor.element_size()
            room = writer.has_room(name, tensor.dim())  # raises for a name no descriptor can hold
            if writer.entries and (writer.full or not room or (
                    not self.dense and not writer.fits_whole(nbytes) and nbytes <= self.bucket_bytes)):
                self.flush()  # a tensor that fits a bucket is never split (unless dense)
            pieces = 0
            for pieces, (flat, entry) in enumerate(writer.chunks(name, tensor), 1):
                if self.current is None:
                    self.current = self._take()
                t0 = time.perf_counter()
                copy_bytes(self.buffers.buffer(self.current), entry.offset, flat, entry.chunk_offset,
                           entry.chunk_bytes)
                stats.pack_s += time.perf_counter() - t0
                if writer.full:
                    self.flush()
            if pieces > 1 and not self.dense:
                self.flush()  # a split tensor's tail ends its bucket
            stats.tensors += 1
            stats.bytes += nbytes
        if manifest is not None and stats.tensors != len(manifest):
            raise ManifestError(f"the manifest announced {len(manifest)} tensors but the source yielded "
                                f"{stats.tensors}; the next expected was {manifest[stats.tensors].name!r}")
        self.flush()
        return self.seq

    def _take(self) -> int:
        index, previous = self.pool.take(self.seq)
        if previous >= 0:
            self.stats.wait_s += timed_wait(self.link, previous, f"waiting for receivers to release buffer {index}")
        return index

    def flush(self) -> None:
        """Post the bucket being filled, if any."""
        if self.current is None:
            return
        writer, stats = self.writer, self.stats
        self.buffers.publish(self.current, writer.used)
        self.link.post(self.seq, {"t": "bucket", "sync": self.sync, "index": stats.buckets, "seq": self.seq,
                                  "buf": self.current, "nbytes": writer.used, "entries": writer.wire_entries()})
        self.pool.filled(writer.used)
        self.seq += 1
        stats.buckets += 1
        writer.reset()
        self.current = None


def check_item(position: int, name: str, tensor: torch.Tensor, manifest: list[TensorSpec] | None,
               seen: set[str]) -> None:
    """Raise ManifestError for a repeated name or a tensor that strays from the announced manifest."""
    if name in seen:
        raise ManifestError(f"tensor {name!r} was yielded twice in one sync")
    seen.add(name)
    if manifest is None:
        return
    if position >= len(manifest):
        raise ManifestError(f"tensor {name!r} is beyond the {len(manifest)} tensors the manifest announced")
    spec, actual = manifest[position], TensorSpec.of(name, tensor)
    if spec != actual:
        raise ManifestError(f"tensor #{position} strays from the announced manifest: announced {spec}, "
                            f"got {actual}")
