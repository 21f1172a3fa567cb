"""Mapped sources, the sender's side: device tensors read in place by receivers, from the trainer's own memory.

The host one-copy path (refs.py, hwsync.sync.shared_params) taken onto the device. A trainer's parameters
stay where its allocator put them across steps (optimizer steps update them in place), and the
allocator hands memory out in segments; so a segment that holds tensors of a sync is exported once
per receiver process (the backend's IPC: hwsync.backend.interfaces.DeviceSegments; counted as torch counts
IPC consumers: hwsync.backend.exports.SegmentExports), each receiver maps it once and keeps the mapping
across syncs, and every tensor in it travels as a reference (segment id, offset, dtype, shape) that
the receiver copies once, straight into its destination. What is decided here:

- which tensors: a contiguous, non-empty device tensor of the backend's type that lies in a segment
  the backend can export, and that something besides the sync keeps alive (a Parameter; a
  state_dict() entry, which shares its parameter's storage: DeviceSegments.held_elsewhere). A cast,
  a gathered full tensor (FSDP's full_tensor()), any tensor made for the sync and freed by the
  source's next step goes packed in the same sync. Every referenced tensor is also held here until
  every receiver's Complete, so memory a receiver reads is never freed and reused under it;
- when segments are exported: the first time a receiver is sent a reference into one, in the
  same Refs frame (each receiver its own), so new segments are exported as they appear;
- how mappings die: a segment is known through one block in it, held weakly (its anchor). A block
  that receivers map stays allocated when the trainer frees it (torch's IPC limbo); at the next
  sync the sender finds the anchor dead (a parameter replaced: `param.data = ...`), leaves its id
  out of the offer, and each receiver unmaps it before accepting; collect() after the sync then
  frees the block, so nothing stays parked. After a failed sync its receivers unmap everything and
  the exports that sync made are released here (a frame carrying one may never have been read);
  the exports of receivers that died are released for them;
- the trainer's own queued writes (its optimizer step) land before any receiver reads: the
  sender waits for its stream before each Refs frame with device references.

The trainer must not change a referenced tensor until send() returns: not between syncs only (it
does not step during one), but also not from inside the source (a generator that unmerges an
adapter in place right after yielding a merged weight, a staging buffer refilled for the next tensor)
must be sent with WeightSender(stable_sources=False): its tensors are then copied as they come, none
referenced. Views hwsync itself lends to a `load` call (a LocalForwarder's) are never referenced.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from hwsync.backend.devices import wait_for_queued
from hwsync.backend.exports import SegmentExports
from hwsync.backend.interfaces import Device, DeviceSegments, SegmentPlace, Transport
from hwsync.colocated.sender_control import Peer
from hwsync.protocol.layout import DeviceSegment


@dataclass
class _Segment:
    id: int
    key: Hashable
    size: int
    #: a weak reference to the block the segment was found through (DeviceSegments.anchor)
    anchor: Any
    device: torch.device


class MappedSources:
    """The device segments one WeightSender shares with its receivers, across its syncs."""

    def __init__(self, transport: Transport, device: Device, enabled: bool = True) -> None:
        self.device = device
        self.segments: DeviceSegments | None = transport.device_segments() if enabled else None
        self._exports = SegmentExports(self.segments.release_export) if self.segments is not None else None
        self._by_key: dict[Hashable, _Segment] = {}
        self._by_id: dict[int, _Segment] = {}
        self._next_id = 1  # ids are never reused in a session: a receiver's stale id can never name another segment
        #: this sync's referenced tensors, kept alive until every receiver's Complete
        self._held: list[torch.Tensor] = []
        #: devices whose queued writes the next Refs frame waits for
        self._touched: set[torch.device] = set()

    def usable_for(self, peers: list[Peer]) -> bool:
        """Whether this sync's receivers can map device segments: the transport shares them and every receiver is
        another process on this host (CUDA cannot open its own process's handles)."""
        here, me = socket.gethostname(), os.getpid()
        return self.segments is not None and all(p.host == here and p.pid != me for p in peers)

    def shared_ids(self) -> list[int]:
        """The ids still shared, for the offer; segments whose anchor died since the last sync are dropped first."""
        if self._exports is None:
            return []
        self._exports.release_dead()  # receivers killed since the last sync never unmap theirs
        for segment in [s for s in self._by_id.values() if not self.segments.alive(s.anchor)]:  # type: ignore[union-attr]
            self._forget(segment)
        return sorted(self._by_id)

    def _forget(self, segment: _Segment) -> None:
        del self._by_id[segment.id]
        if self._by_key.get(segment.key) is segment:
            del self._by_key[segment.key]
        assert self._exports is not None
        self._exports.drop(segment.id)

    def place(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(segment id, byte offset) of a tensor receivers may read in place, now held until Complete; None: pack it."""
        segments = self.segments
        if segments is None or tensor.device.type != self.device.torch_type or not tensor.numel():
            return None
        if hasattr(tensor, "full_tensor") or not tensor.is_contiguous():  # a DTensor gathers a copy; strided: packed
            return None
        if not segments.held_elsewhere(tensor):  # first: cheaper than finding its segment
            return None
        where = segments.locate(tensor)
        if where is None:
            return None
        segment = self._by_key.get(where.key)
        if segment is None or segment.size != where.size or not segments.alive(segment.anchor):
            # new, or an anchor freed during this sync: a fresh id (the old one is dropped at the next offer)
            segment = _Segment(self._next_id, where.key, where.size, segments.anchor(tensor), tensor.device)
            self._next_id += 1
            self._by_key[where.key] = self._by_id[segment.id] = segment
        self._held.append(tensor)
        self._touched.add(tensor.device)
        return segment.id, where.offset

    def hold(self, tensors: list[torch.Tensor]) -> None:
        """Hold a replayed sync's device tensors until Complete, and wait for the trainer's writes to them now."""
        here = self.device.torch_type
        held = [t for t in tensors if t.device.type == here]
        self._held += held
        self._touched |= {t.device for t in held}
        self.ready_to_read()

    def ready_to_read(self) -> None:
        """Wait for this process's queued writes to the referenced tensors (the trainer's step) on their streams."""
        for where in self._touched:
            wait_for_queued(self.device, where)
        self._touched.clear()

    def ids_for(self, peer: Peer, shared: list[int]) -> list[int]:
        """Of the ids still `shared` (shared_ids()), those this receiver maps as far as the sender knows: what its
        offer lists, so that the receiver unmaps the rest. After a failed sync the sender released (or orphaned) the
        exports of its receivers that did not complete it, and a receiver that did not complete may still map some
        (it unmaps on its own failure): unlisted, they go, and a later export of the same id meets no old mapping."""
        if self._exports is None:
            return []
        held = self._exports.held_by(peer.identity.hex())
        return [ident for ident in shared if ident in held]

    def exports_for(self, peer: Peer, ids: list[int]) -> list[DeviceSegment]:
        """The exports of segments `ids` this receiver does not have yet, made now (one per receiver process)."""
        assert self.segments is not None and self._exports is not None
        out = []
        for ident in ids:
            segment = self._by_id[ident]
            record = self._exports.record_for(peer.identity.hex(), peer.pid, peer.host, ident,
                                              functools.partial(self._export, segment))
            if record is not None:
                out.append(DeviceSegment(ident, segment.size, record))
        return out

    def _export(self, segment: _Segment) -> dict[str, Any]:
        assert self.segments is not None
        place = SegmentPlace(segment.key, segment.size, 0)
        current = self.device.current_index()
        if segment.device.index is None or segment.device.index == current:
            return self.segments.export(segment.anchor, place)
        self.device.set_index(segment.device.index)  # exported on its own device, as torch's device guard does
        try:
            return self.segments.export(segment.anchor, place)
        finally:
            self.device.set_index(current)

    def exports_alive(self) -> int:
        """Exports the sender holds for receivers now."""
        return 0 if self._exports is None else self._exports.count()

    def complete(self) -> None:
        """Every receiver completed the sync: its exports are mapped; let the sync's tensors go; collect."""
        if self._exports is not None:
            self._exports.confirm()
        self._end()

    def abort(self, receivers: list[Peer], completed: Collection[bytes] = ()) -> None:
        """The sync failed: those of its receivers that did not complete it unmap all (release what it exported to
        them); those that did keep theirs; collect."""
        if self._exports is not None:
            self._exports.release_unconfirmed([p.identity.hex() for p in receivers], {i.hex() for i in completed})
            self._exports.release_dead()
        self._end()

    def _end(self) -> None:
        self._held.clear()
        self._touched.clear()
        if self.segments is not None:
            self.segments.collect()  # blocks of dropped segments that every receiver has now unmapped

    def close(self) -> None:
        """The sender is closing: release dead receivers' exports; live ones unmap when they see it gone."""
        if self._exports is not None:
            self._exports.release_dead()
        self._by_key.clear()
        self._by_id.clear()
        self._end()
