"""Mapped sources, the receiver's side: the sender's device segments mapped once, and each tensor copied once.

A Refs frame may export device segments of the sender to this receiver (hwsync.colocated.mapped says
which and when): each is mapped at once, on this thread's current device (the backend's IPC:
Transport.device_segments), and kept across syncs, until an offer no longer lists its id, the receiver
fails or closes; an export that cannot be mapped is released, so the sender's block is never parked
for it. Device references are copied straight `into` the caller's destinations, the copies of one
frame launched together (bucket.CopyBatch), or handed to `load` as views of the mapping, valid during
the call only. The sender's trainer leaves the memory alone until this receiver's Complete, so before
Complete `finish` waits for every copy queued from it: an event on the stream that ran them, not a
device-wide synchronize.
"""

from __future__ import annotations

import logging

import torch

from hwsync.backend.devices import wait_for_queued
from hwsync.backend.interfaces import Device, DeviceSegments, Transport
from hwsync.colocated.replay import ReadPlan
from hwsync.errors import ProtocolError
from hwsync.protocol.layout import DeviceRef, DeviceSegment
from hwsync.sync.bucket import CopyBatch, IntoFn, checked_destination, launch, lend
from hwsync.sync.spec import dtype_from_name

log = logging.getLogger("hwsync")


class MappedReader:
    """The sender's device segments as this receiver maps them, by the sender's ids."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._segments: DeviceSegments | None = None
        self._mapped: dict[int, torch.Tensor] = {}
        #: devices this sync's copies (and `load`'s reads of views) were queued on
        self._queued: set[torch.device] = set()

    @property
    def mapped(self) -> int:
        """Segments mapped now."""
        return len(self._mapped)

    def retain(self, ids: list[int], transport: Transport | None) -> bool:
        """Keep only the segments the sender still shares (its offer lists them); `transport` opens new ones.
        Whether any was unmapped (a plan's views of it must go too, or the mapping stays)."""
        if transport is not None:
            self._segments = transport.device_segments()
        keep = set(ids)
        gone = [i for i in self._mapped if i not in keep]
        for ident in gone:
            del self._mapped[ident]  # unmapped once no view is left; finish() waited for this process's reads
        return bool(gone)

    def map(self, exports: list[DeviceSegment]) -> None:
        """Map each newly exported segment; an export that cannot be mapped is released (so is every later one)."""
        for position, segment in enumerate(exports):
            try:
                if self._segments is None:
                    raise ProtocolError("the sender exported device memory to this receiver, whose transport "
                                        "cannot map it; run both sides with the same backend")
                if segment.id in self._mapped:
                    raise ProtocolError(f"the sender exported device segment {segment.id} again while this receiver "
                                        "maps it; the sender and receiver are out of step")
                mapping = self._segments.open(segment.export, segment.size)
                if mapping.numel() < segment.size or mapping.dtype != torch.uint8:
                    found = f"{mapping.numel()} {mapping.dtype} elements"
                    del mapping  # unmapped here and now, which takes its counter down: the release below skips it
                    raise ProtocolError(f"device segment {segment.id} maps {found}, not the {segment.size} bytes "
                                        "announced")
                self._mapped[segment.id] = mapping
            except BaseException:
                # this export and every later one are never mapped here; releases skip a counter already taken
                # down (hwsync.backend.ipc_counters: torch holds a block whose counter went below 0 until exit)
                self._release(exports[position:])
                raise

    def _release(self, exports: list[DeviceSegment]) -> None:
        for segment in exports:
            try:
                if self._segments is not None:
                    self._segments.release_export(segment.export)
            except Exception as exc:  # noqa: BLE001 - releasing is best effort, as torch's own is
                log.warning("hwsync: could not release the export of device segment %d: %s", segment.id, exc)

    def read(self, refs: list[DeviceRef], into: IntoFn | None,
             recording: ReadPlan | None = None) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """Copy every reference `into` names (launched together); the others as views of the mapping, for `load`;
        and whether `recording` (a plan being made) took every copy (a view for `load` makes no plan)."""
        batch = CopyBatch()
        out: list[tuple[str, torch.Tensor]] = []
        for ref in refs:
            mapping = self._mapped.get(ref.segment)
            if mapping is None:
                raise ProtocolError(f"tensor {ref.name!r} refers to device segment {ref.segment}, which the sender "
                                    "never exported to this receiver (or dropped)")
            nbytes = ref.nbytes
            if ref.offset + nbytes > mapping.numel():
                raise ProtocolError(f"tensor {ref.name!r} ends at byte {ref.offset + nbytes} of device segment "
                                    f"{ref.segment}, past its {mapping.numel()} bytes")
            dtype = dtype_from_name(ref.dtype)
            given = None if into is None else into(ref.name, dtype, ref.shape)
            dest = checked_destination(ref.name, dtype, ref.shape, given)
            if dest is not None and dest.device == mapping.device:
                batch.add(dest, 0, mapping, ref.offset, nbytes)
                self._queued.add(dest.device)
                if recording is not None:
                    assert given is not None
                    recording.add_destination(ref.name, dtype, tuple(ref.shape), given)
                    recording.nbytes += nbytes
            elif dest is not None:  # another device: a copy of its own, not replayed
                batch.add(dest, 0, mapping, ref.offset, nbytes)
                self._queued.add(dest.device)
                recording = None
            else:
                recording = None
                # the trainer may change it once this receiver completes: lent for the load call only
                out.append((ref.name, lend(mapping[ref.offset: ref.offset + nbytes].view(dtype).view(ref.shape))))
        launches = batch.flush()
        if out:
            self._queued.add(out[0][1].device)  # load may queue reads of the views
        if recording is not None:
            recording.launches += launches
            recording.devices |= {dsts[0].device for dsts, _ in launches}
        return out, recording is not None

    def replay(self, plan: ReadPlan) -> None:
        """Launch a plan's device copies again (one launch per device and width)."""
        for dsts, srcs in plan.launches:
            launch(dsts, srcs)
        self._queued |= plan.devices

    def finish(self) -> None:
        """Wait until every copy queued from the mappings this sync has run (then the sender may step)."""
        queued, self._queued = self._queued, set()
        for where in queued:
            wait_for_queued(self.device, where)

    def close(self) -> None:
        """Wait for queued reads (best effort: a failed sync's), then unmap every segment."""
        try:
            self.finish()
        except Exception as exc:  # noqa: BLE001 - the mappings go anyway
            log.warning("hwsync: waiting for device copies before unmapping the sender's segments failed: %s", exc)
        self._mapped.clear()
