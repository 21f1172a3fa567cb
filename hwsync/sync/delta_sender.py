"""A sender's side of delta syncs: the baseline it keeps, whether a sync may be a delta, and what it then sends.

The baseline is what every receiver holds after the last committed sync, per tensor in the dtype
it travels in (the engine's: hwsync.sync.report, EngineDtypes), under an id (`<sender>:<n>`) that receivers report
back. A sync is a delta from the baseline only when every receiver of the sync reports that id as
what it holds, completely (a receiver tracks it itself, and drops it at the start of any sync until
that sync completes and checks out), its engine says it kept its weights, and the sender still has
the baseline; otherwise the sync is full, and its reason is in the stats. A delta sync encodes every
tensor (hwsync.delta.encode: the smallest of same, dense, block, bitmap, step; each with the digest
of the new tensor that receivers check after applying) on the encode threads: up front on the same
host (the payloads are announced with the offer and stream as byte tensors), or ahead of the stream
across nodes (hwsync.sync.encode_ahead: each group's headers travel with it). The baseline moves only once
every receiver completed the sync (`commit`): a failed delta leaves it as it was, a failed full sync
drops it (it was overwritten as the sync streamed).
The baseline owns its bytes before send() returns (hwsync.sync.delta_baseline); with `stable_sources=False` each
tensor is also copied as it is taken from the source, before any encode reads it.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hwsync.backend.devices import DeviceOwner
from hwsync.backend.interfaces import Device
from hwsync.delta import warm
from hwsync.delta.diff import Delta, encode, to_engine_dtype
from hwsync.delta.digest import tensor_digest
from hwsync.delta.header import DENSE, DeltaHeader
from hwsync.delta.patch import advance
from hwsync.delta.room import RESERVE_SHARE, PayloadRoom
from hwsync.errors import DuplicateTensorError, ManifestError
from hwsync.protocol.delta import DeltaField
from hwsync.sync.delta_baseline import Baseline
from hwsync.sync.encode_ahead import EncodeAhead, Job
from hwsync.sync.prepared import Prepared
from hwsync.sync.report import EngineDtypes, ReceiverReport
from hwsync.sync.spec import NamedTensors, TensorSpec, dtype_from_name, dtype_name, named_tensor
from hwsync.sync.stats import DeltaStats, SyncStats

log = logging.getLogger("hwsync")

def dense(tensor: torch.Tensor, dtype: torch.dtype) -> Delta:
    """The whole tensor in `dtype` as a dense delta (its digest computed)."""
    engine = to_engine_dtype(tensor, dtype).contiguous()
    header = DeltaHeader(DENSE, dtype_name(dtype), engine.numel(), engine.numel(), tensor_digest(engine))
    return Delta(header, engine.view(-1).view(torch.uint8), None)


class SenderDeltas:
    """The baseline of one sender (or sender rank: each keeps the tensors it sends) and its syncs' deltas."""

    def __init__(self, device: Device, *, on_device: bool = False, stable_sources: bool = True) -> None:
        self._device = device
        self.baseline = Baseline(device, on_device=on_device)
        #: False: a source may reuse or change a tensor's memory once it yielded the next, so each tensor is copied
        #: as it is taken, before any encode reads it
        self.stable_sources = stable_sources
        self._prefix = secrets.token_hex(6)
        self._count = 0
        self.base_id: str | None = None
        #: the stats note of the sync running (what owning the caller's bytes cost goes in at commit)
        self._note: DeltaStats | None = None
        #: why the next sync cannot be a delta though every receiver may hold the baseline
        self._lost = "the first sync: no baseline yet"
        #: threads that encode tensors side by side (the trainer waits for the sync meanwhile)
        self.threads = max(1, min(4, os.cpu_count() or 1))
        self._pending: Prepared | None = None
        self._next = ""  # the id this sync makes (set at each prepare)
        #: a sync asked for a delta: from then on the sender keeps a baseline
        self.active = False
        #: the thread that writes a committed sync's changes into the baseline, and its last job
        self._advancer: ThreadPoolExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        #: the thread that scans a large tensor's pieces from its end beside its encode thread (hwsync.delta.scan)
        self._helper: ThreadPoolExecutor | None = None
        self._pool_index: int | None = None
        self._settling: Future[None] | None = None
        #: host memory the payloads of a delta sync are written into, reused by the next (hwsync.delta.room)
        self.room = PayloadRoom()

    @property
    def on_device(self) -> bool:
        """Whether the baseline lives on the trainer's device (else in host memory)."""
        return self.baseline.on_device

    @property
    def baseline_bytes(self) -> int:
        """Memory the baseline holds: its tensors, and the spares the next dense copies are written into."""
        self.settle()
        return self.baseline.held_bytes + self.baseline.spare_bytes

    def decide(self, reports: Sequence[ReceiverReport]) -> tuple[bool, str]:
        """(whether this sync is a delta, why), from every receiver's report."""
        if self.base_id is None:
            return False, self._lost
        for rank, report in enumerate(reports):
            held = report.held
            if held != self.base_id:
                why = "reports no complete sync of this sender (restarted, or its last sync failed)" if held is None \
                    else f"holds {held!r}, not this sender's baseline {self.base_id!r}"
                return False, f"receiver {rank} {why}"
            engine = report.engine
            if engine is not None and engine.base_discarded:
                return False, f"receiver {rank}'s engine freed its weights in a level-2 sleep"
            if engine is not None and engine.base_intact is False:
                return False, f"receiver {rank}'s engine found its weights changed since its last sync"
        return True, f"every receiver holds {self.base_id} complete"

    def prepare(self, pairs: NamedTensors, manifest: list[TensorSpec] | None, dtypes: EngineDtypes,
                delta: bool, reports: Sequence[ReceiverReport], stats: SyncStats, *, streamed: bool = False
                ) -> Prepared:
        """This sync's stream, manifest and wire announcement: a delta when `delta` and every receiver allows it.

        `streamed`: a delta's tensors are encoded as the stream asks for them (`Prepared.encoded`), their headers
        sent with them (the cross-node path), rather than all up front with the announcement (same host).

        Once a sync asked for a delta, the sender keeps a baseline: a sync that then asks for none is full and
        renews it (so the next may be a delta again).
        """
        self.settle()
        self.room.reset()  # the last sync's payloads are spent: settle() waited for the baseline to take them
        self.baseline.begin()
        self._note = None
        self._count += 1
        self._next = f"{self._prefix}:{self._count}"
        self.active = self.active or delta
        if self.active:
            warm.start()  # the codec's compiled kernels load on a thread of their own; torch ops serve until then
        if not self.active:
            self._pending = Prepared(dtypes.pairs(pairs), dtypes.manifest(manifest), dtypes.manifest(manifest), None)
            return self._pending
        use, reason = self.decide(reports) if delta else (False, "this sync asked for a full sync (delta=False)")
        note = DeltaStats("delta" if use else "full", reason, self.base_id if use else None)
        stats.delta = self._note = note
        if not use:
            self.base_id, self.baseline.digests = None, {}  # overwritten while this full sync streams
            self._lost = "the last full sync did not complete, and the baseline was overwritten while it streamed"
            targets = dtypes.manifest(manifest)
            self._pending = Prepared(self._keep(pairs, dtypes), targets, targets, DeltaField(None, self._next))
        else:
            self._pending = self._encode(pairs, dtypes, manifest, note, streamed)
        note.baseline_bytes = self.baseline_bytes  # with the spares
        note.room_bytes = self.room.held_bytes
        note.spare_bytes = self.baseline.spare_bytes
        return self._pending

    def _keep(self, pairs: Iterable[tuple[str, torch.Tensor]], dtypes: EngineDtypes
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """A full sync's pairs, each cast into the baseline as it is taken (the loader's op: `copy_`).

        Where a cast is needed and the baseline is on the tensor's device, the baseline tensor itself is what
        streams: the cast writes once into memory that stays resident across syncs, not into a fresh tensor
        whose pages fault in at every sync (on the host that costs more than the cast). Uncast tensors stream
        as themselves (a module's parameters may go by reference: colocated/mapped.py).
        """
        for position, item in enumerate(pairs):
            name, tensor = named_tensor(position, item)
            dtype = dtypes.target(name, tensor.dtype)
            kept = self.baseline.keep(name, tensor, dtype)
            cast_here = dtype != tensor.dtype and kept.device == tensor.device
            yield name, kept if cast_here else dtypes.cast(name, tensor)

    def _encode(self, pairs: NamedTensors, dtypes: EngineDtypes, manifest: list[TensorSpec] | None,
                note: DeltaStats, streamed: bool) -> Prepared:
        """Every tensor against the baseline: up front (payloads, their manifest and headers announced before the
        stream), or `streamed` (the encodes run as the stream asks for them; headers travel with their group)."""
        if streamed:
            targets = dtypes.manifest(manifest)
            if targets is None:
                raise ValueError("a streamed delta sync needs the manifest before the first tensor")
            prepared = Prepared(None, None, targets, DeltaField(self.base_id, self._next))
            prepared.encoded = self._ahead(pairs, dtypes, note, prepared, targets)  # the encodes start now
            return prepared
        prepared = Prepared(None, [], [], None)
        found = list(self._ahead(pairs, dtypes, note, prepared, None))
        assert prepared.stream_manifest is not None and prepared.targets is not None
        prepared.source = [(spec.name, delta.payload) for spec, delta in found]
        prepared.stream_manifest += [TensorSpec(spec.name, "uint8", (delta.payload.numel(),)) for spec, delta in found]
        prepared.targets += [spec for spec, _ in found]
        prepared.wire = DeltaField(self.base_id, self._next, [delta.header for _, delta in found])
        return prepared

    def _ahead(self, pairs: NamedTensors, dtypes: EngineDtypes, note: DeltaStats, prepared: Prepared,
               targets: list[TensorSpec] | None) -> EncodeAhead:
        """Each tensor's (target, delta) in source order, the encodes started now and run ahead of the reader."""
        return EncodeAhead(self._jobs(pairs, dtypes, targets), self._encoders(), prepared.deltas, note,
                           expected=None if targets is None else len(targets), min_jobs=2 * self.threads)

    def _jobs(self, pairs: NamedTensors, dtypes: EngineDtypes, targets: list[TensorSpec] | None) -> Iterator[Job]:
        """Each tensor's encode, taken from the source as the encodes ask for it (on the calling thread: a DTensor
        gathers here); the host kernel and torch's ops release the GIL, so the encodes run side by side."""
        seen: set[str] = set()
        for position, item in enumerate(pairs):
            name, tensor = named_tensor(position, item)
            if name in seen:  # two encodes of one name would race for its baseline
                raise DuplicateTensorError(f"item #{position} of the source repeats the name {name!r}; a delta sync "
                                           "sends each tensor once: yield each name once")
            seen.add(name)
            fresh = False
            if hasattr(tensor, "full_tensor"):  # an FSDP DTensor: gathered here, in source order (a collective)
                tensor, fresh = tensor.full_tensor(), True
            if not self.stable_sources and not fresh:
                # the source may refill this memory once it yields the next tensor, while the encodes still read it
                tensor, fresh = self.baseline.copy_of_source(tensor), True
            spec = self._target_spec(position, name, tensor, dtypes, targets)
            base = self.baseline.tensors.get(name)
            target_dtype = dtype_from_name(spec.dtype)
            if base is None or base.shape != tensor.shape or base.dtype != target_dtype:
                # new to the baseline, or another shape or dtype than it holds: the whole tensor, no patch
                yield spec, self._dense_job, (name, tensor, target_dtype, fresh)
            else:
                yield spec, self._encode_job, (name, tensor, base, fresh)

    def _encoders(self) -> ThreadPoolExecutor:
        """The encode threads, kept across syncs (each keeps its chunk buffers: no fresh pages per sync), on the
        calling thread's device."""
        owner = DeviceOwner(self._device)  # a new thread starts on device 0: each takes this thread's device
        if self._pool is not None and self._pool_index != owner.index:
            for pool in (self._pool, self._helper):
                if pool is not None:
                    pool.shutdown()
            self._pool = self._helper = None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hwsync-delta", initializer=owner.enter)
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="hwsync-delta-helper", initializer=owner.enter)
            self._pool_index = owner.index
        return self._pool

    @staticmethod
    def _target_spec(position: int, name: str, tensor: torch.Tensor, dtypes: EngineDtypes,
                     targets: list[TensorSpec] | None) -> TensorSpec:
        """The tensor as receivers will hold it; a streamed sync checks it against the announced target."""
        spec = TensorSpec(name, dtype_name(dtypes.target(name, tensor.dtype)), tuple(tensor.shape))
        if targets is not None:
            announced = targets[position] if position < len(targets) else None
            if announced is None or announced.name != name or announced.shape != spec.shape:
                said = "nothing" if announced is None else f"{announced.name!r} of shape {list(announced.shape)}"
                raise ManifestError(f"tensor {position} of the source is {name!r} of shape {list(spec.shape)}, but "
                                    f"the manifest announced {said} there; a delta sync sends the announced tensors "
                                    "in their order")
        return spec

    def _dense_job(self, name: str, tensor: torch.Tensor, dtype: torch.dtype, fresh: bool) -> Delta:
        """The whole tensor as a dense delta, and its copy that becomes the baseline (an encode thread's job)."""
        found = dense(tensor, dtype)
        self.baseline.successor(name, found.payload.view(dtype).view(tensor.shape), fresh or dtype != tensor.dtype
                                or not tensor.is_contiguous())
        return found

    def _encode_job(self, name: str, tensor: torch.Tensor, base: torch.Tensor, fresh: bool) -> Delta:
        """One tensor against its baseline; a dense result's copy becomes the baseline (an encode thread's job)."""
        found = encode(tensor, base, base_digest=self.baseline.digests.get(name), name=name, helper=self._helper,
                       room=self.room)
        if found.header.code == DENSE:
            self.baseline.successor(name, found.payload.view(base.dtype).view(base.shape), fresh
                                    or base.dtype != tensor.dtype or not tensor.is_contiguous())
        return found

    def commit(self) -> None:
        """Every receiver completed the sync: the baseline is what they hold now."""
        pending, self._pending = self._pending, None
        if pending is None or pending.wire is None:
            return
        shapes = {spec.name: spec for spec in pending.targets or []}
        if self._note is not None:  # what owning the caller's bytes cost this sync (bench delta prints it)
            self._note.owned_bytes, self._note.owned_s = self.baseline.owned
        baseline = self.baseline
        moves, strays = [], []
        for name, found in pending.deltas.items():
            baseline.digests[name] = found.header.digest
            if baseline.take_successor(name):  # dense: its copy, taken before send() returned, is the baseline now
                continue
            spec, kept = shapes[name], baseline.tensors.get(name)
            if kept is None or tuple(kept.shape) != spec.shape or dtype_name(kept.dtype) != spec.dtype:
                strays.append(name)  # cannot happen (another spec always goes dense); if it does, start over
                continue
            moves.append((name, kept, found))
        if strays:
            self.drop(f"the last sync's deltas of {strays[:3]} did not match the baseline's tensors (a bug: report it)")
            self.active = True
            return
        # the changes are written, or after a full sync each tensor digested (the next delta's digests then follow
        # from its changes alone), after send() returns, while the trainer goes on; the next use waits for it
        todo = [] if pending.deltas else [name for name in baseline.tensors if name not in baseline.digests]
        if moves or todo:
            if self._advancer is None:
                owner = DeviceOwner(self._device)
                self._advancer = ThreadPoolExecutor(1, thread_name_prefix="hwsync-baseline", initializer=owner.enter)
            reserve = 0 if pending.deltas or self.on_device else int(RESERVE_SHARE * baseline.held_bytes)
            self._settling = self._advancer.submit(_advance_all, moves, baseline.tensors, todo, baseline.digests,
                                                   self.room, reserve)
        first = self.base_id is None
        self.base_id = self._next
        if first:
            # the size without waiting for the writes just submitted (that would put them inside send())
            log.info("hwsync: delta baseline %s: %.1f MB of %s memory for %d tensors", self.base_id,
                     baseline.held_bytes / 1e6, "device" if self.on_device else "host", len(baseline.tensors))

    def settle(self) -> None:
        """Wait for the last commit's baseline writes; if they failed, drop the baseline (the next sync is full)."""
        settling, self._settling = self._settling, None
        if settling is None:
            return
        error = settling.exception()
        if error is not None:
            log.warning("hwsync: moving the delta baseline failed (%s: %s); the next sync is full",
                        type(error).__name__, error)
            self.drop(f"moving the baseline to the last sync failed: {type(error).__name__}: {error}")
            self.active = True  # still in delta mode: the next sync makes a new baseline

    def abort(self) -> None:
        """The sync failed: a delta leaves the baseline as it was (a full sync already dropped it)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.encoded is not None:
            pending.encoded.close()  # its encoding threads end here
        self.baseline.begin()  # its dense copies go back to being spares

    def close(self) -> None:
        """End the encode and baseline threads (the baseline's last writes finish first); the baseline stays."""
        if self._settling is not None:
            self._settling.exception()
            self._settling = None
        for pool in (self._pool, self._helper, self._advancer):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._pool = self._helper = self._advancer = None

    def drop(self, reason: str = "the baseline was dropped to free its memory (drop_delta_baseline)") -> int:
        """Free the baseline (and the payloads' room) and keep none until a sync asks for a delta again; returns the
        baseline's bytes.

        That sync is full (it makes a new baseline), with `reason` in its stats; syncs that ask for no
        delta meanwhile keep no baseline, and receivers drop their kept copies at the first of them.
        """
        if self._settling is not None:
            self._settling.exception()  # the writes in flight end before their memory goes
            self._settling = None
        self.room.clear()  # the payloads' memory goes with it (a few percent of the baseline's)
        freed = self.baseline.clear()
        self.base_id, self._lost = None, reason
        self.active = False
        if freed:
            log.info("hwsync: delta baseline dropped: %.1f MB freed", freed / 1e6)
        return freed


def _advance_all(moves: list[tuple[str, torch.Tensor, Delta]], tensors: Mapping[str, torch.Tensor],
                 todo: list[str], digests: dict[str, int], room: PayloadRoom, reserve: int) -> None:
    """Write each committed delta into its baseline tensor (the changes only), digest the tensors in `todo` (a full
    sync's) into `digests`, and make `reserve` bytes of payload room ready for the first delta."""
    for name, kept, found in moves:
        advance(kept, found.header, found.payload, name=name)
    for name in todo:
        digests[name] = tensor_digest(tensors[name])
    room.reserve(reserve)
