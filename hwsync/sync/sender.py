"""One pipeline runs every sync, whichever the path, and a Sender runs it: what both senders share.

The steps, in order: gather the receivers' reports (the carrier), resolve the source (a TrainerModel is
planned against what every engine reports, a callable is called with the first receiver's report), onload
the parameters the caller named, prepare (cast each tensor to the dtype the engines hold; then, only when
the sync is a delta, encode it against the baseline), stream through the carrier, wait until every receiver
confirmed and commit (the carrier), and only then move the delta baseline. A failure at any step aborts the
carrier (every receiver hears it) and leaves the baseline as it was. A full sync of a sender that never asked
for a delta enters no delta code: the delta policy is made at the first sync that asks for one.

Two carriers implement `Carrier`: shared buffers on one host (hwsync.colocated.carrier) and collectives across
nodes (hwsync.disaggregated.carrier). `Sender` owns the calls around the pipeline: one at a time, close() from
any thread (a running sync ends at once and its receivers hear it), the delta baseline, buffer release.
`WeightSender` (same host) and `CrossNodeSender` (across nodes) are both a Sender over a carrier;
`SenderProtocol` states the contract they share, for code that takes either.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, Self

import torch

from hwsync.backend.interfaces import Backend, Device
from hwsync.control.endpoints import CloseSignal, Lifetime
from hwsync.errors import HwsyncError, SupersededError
from hwsync.sync.collector import collector_held
from hwsync.sync.options import SenderOptions
from hwsync.sync.planner import TrainerModel, plan_for_engines
from hwsync.sync.prepared import Prepared
from hwsync.sync.report import EngineDtypes, ReceiverReport
from hwsync.sync.spec import NamedTensors, Source, TensorSource, TensorSpec, with_manifest
from hwsync.sync.stats import PlanStats, SyncStats

if TYPE_CHECKING:  # made at the first sync that asks for a delta: a full sync never imports it
    from hwsync.sync.delta_sender import SenderDeltas

log = logging.getLogger("hwsync")


# -- the pipeline: the steps every sync runs, over a carrier that moves its bytes -----------------------------


class Carrier(Protocol):
    """How one sync's bytes reach the receivers: the contract both carriers implement."""

    #: True: a delta's tensors are encoded as the stream asks for them, each group's headers with its payloads
    #: (across nodes: the encode overlaps the wire); False: all are encoded before the offer, which announces them
    streams_deltas: bool
    #: whether the carrier plans from the manifest before the first tensor is produced (a lazy source needs one)
    needs_manifest: bool
    #: bytes a bucket holds (a same-host carrier chooses it at its first sync where the options left it open)
    bucket_bytes: int
    #: buckets in flight (across nodes: per sender rank)
    num_buffers: int
    #: whether `commit` may come long after `confirm` (a trainer's step between them: stage(), then commit())
    commits_apart: bool

    def new_stats(self, version: int) -> SyncStats:
        """This sync's stats, with what the carrier knows before it starts (its transport, its buffers)."""
        ...

    def gather(self, stats: SyncStats) -> list[ReceiverReport]:
        """Wait until every receiver (and every other sender rank) is ready; each receiver's report."""
        ...

    def stream(self, sync: Prepared, version: int, stats: SyncStats) -> None:
        """Announce the sync to every receiver and move its bytes (the tensors, or a delta's payloads)."""
        ...

    def confirm(self, version: int, stats: SyncStats) -> None:
        """Wait until every receiver holds `version` complete and checked (receivers that stage: staged)."""
        ...

    def commit(self, version: int, stats: SyncStats) -> None:
        """Commit `version` on every rank: receivers that stage apply it now; the sync ends."""
        ...

    def fail(self, exc: BaseException) -> None:
        """The sync failed: tell every receiver (one that failed first ignores it) and release what it held."""
        ...

    def release_buffers(self) -> None:
        """Free the bucket buffers until the next sync (the connections are kept)."""
        ...

    def close(self) -> None:
        """Release everything: buffers, groups, sockets."""
        ...


def resolve_source(source: TensorSource | TrainerModel, reports: Sequence[ReceiverReport],
                   manifest: list[TensorSpec] | None, stats: SyncStats) -> tuple[NamedTensors, list[TensorSpec] | None]:
    """What one sync sends, for either sender: a TrainerModel is planned against every receiver's report (its
    reason in stats.plan), another Source is asked for a fresh iteration and its manifest, a callable is called with
    the first receiver's report (ReceiverReport), anything else is the (name, tensor) pairs themselves; with the
    manifest that announces them (the caller's wins)."""
    if isinstance(source, TrainerModel):
        t0 = time.perf_counter()
        plan = plan_for_engines([r.engine for r in reports] or [None], source)
        stats.plan_s = time.perf_counter() - t0
        summary = plan.to_dict()
        stats.plan = PlanStats(summary["send"], summary["mode"], summary["reason"], summary["engine"])
        log.info("hwsync plan: %s", plan.reason)
        return plan.tensors(), plan.manifest() if manifest is None else manifest
    if isinstance(source, Source):
        return source.tensors(), source.manifest() if manifest is None else manifest
    if callable(source):
        return source(reports[0] if reports else ReceiverReport()), manifest
    return source, manifest



class SyncPipeline:
    """The steps of every sync, over one carrier; the delta policy it keeps across syncs (made when first asked)."""

    def __init__(self, carrier: Carrier, device: Device, options: SenderOptions) -> None:
        self.carrier, self.device, self.options = carrier, device, options
        self._deltas: SenderDeltas | None = None
        #: a sync confirmed (staged) and not yet committed: its version and stats
        self.pending: tuple[int, SyncStats] | None = None

    @property
    def deltas(self) -> SenderDeltas | None:
        """The delta policy and baseline, once a sync asked for a delta (None before)."""
        return self._deltas

    def run(self, source: TensorSource | TrainerModel, version: int, manifest: list[TensorSpec] | None,
            onload: torch.nn.Module | Iterable[torch.Tensor] | None, delta: bool, stats: SyncStats,
            commit: bool = True) -> None:
        """One sync, start to commit (`commit=False`: to confirmed, the commit left `pending`); raises (after aborting
        the carrier) if any step fails."""
        try:
            with collector_held():  # a sync's per-tensor objects die before any collection moves them (collector.py)
                reports = self.carrier.gather(stats)
                pairs, manifest = resolve_source(source, reports, manifest, stats)
                if self.carrier.needs_manifest:  # the collective carrier plans its buckets before the first tensor
                    pairs, manifest = with_manifest(pairs, manifest, "sender 0 plans the buckets before the first "
                                                                     "tensor is produced")
                with self._onload(onload, stats):
                    sync = self._prepare(pairs, manifest, EngineDtypes(reports), delta, reports, stats)
                    self.carrier.stream(sync, version, stats)
                self.carrier.confirm(version, stats)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.pending = (version, stats)
        if commit:
            self.commit()

    def commit(self) -> SyncStats:
        """Commit the pending sync (receivers that stage apply it); raises (after aborting) if that fails."""
        assert self.pending is not None
        (version, stats), self.pending = self.pending, None
        try:
            self.carrier.commit(version, stats)
        except BaseException as exc:
            self._fail(exc)
            raise
        if self._deltas is not None:
            self._deltas.commit()
        return stats

    def abandon(self, exc: BaseException) -> None:
        """Abort the pending sync (no receiver applies it; each keeps its version); the baseline stays."""
        if self.pending is not None:
            self.pending = None
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._deltas is not None:
            self._deltas.abort()
        self.carrier.fail(exc)

    def _onload(self, onload: torch.nn.Module | Iterable[torch.Tensor] | None,
                stats: SyncStats) -> contextlib.AbstractContextManager[None]:
        if onload is None:
            return contextlib.nullcontext()
        from hwsync.sync.offload import onload_during

        return onload_during(onload, self.device, stats)

    def _prepare(self, pairs: Iterable[tuple[str, torch.Tensor]], manifest: list[TensorSpec] | None,
                 dtypes: EngineDtypes, delta: bool, reports: list[ReceiverReport], stats: SyncStats) -> Prepared:
        """Cast for the engines; a delta (or, once deltas were asked for, a full sync that renews the baseline)
        goes through the delta policy."""
        if not delta and self._deltas is None:
            targets = dtypes.manifest(manifest)
            return Prepared(dtypes.pairs(pairs), targets, targets, None, uncast=pairs)
        return self.delta_policy().prepare(pairs, manifest, dtypes, delta, reports, stats,
                                           streamed=self.carrier.streams_deltas)

    def delta_policy(self) -> SenderDeltas:
        """The delta policy and baseline (made now if no sync asked for one yet)."""
        if self._deltas is None:
            from hwsync.sync.delta_sender import SenderDeltas

            self._deltas = SenderDeltas(self.device, on_device=self.options.delta_on_device,
                                        stable_sources=self.options.stable_sources)
        return self._deltas

    def close(self) -> None:
        """End the delta threads (the baseline's last writes finish first)."""
        if self._deltas is not None:
            self._deltas.close()


# -- the sender: one call at a time over its pipeline ---------------------------------------------------------
class SenderProtocol(Protocol):
    """The calls every hwsync sender answers alike (WeightSender, CrossNodeSender)."""

    def send(self, source: TensorSource | TrainerModel, *, version: int, manifest: list[TensorSpec] | None = None,
             onload: torch.nn.Module | Iterable[torch.Tensor] | None = None, delta: bool | None = None
             ) -> SyncStats:
        """Send one sync; returns once every receiver holds `version`, raises SyncError otherwise."""
        ...

    @property
    def delta_baseline_bytes(self) -> int:
        """Memory the delta baseline holds (0 when there is none)."""
        ...

    def drop_delta_baseline(self) -> int:
        """Free the delta baseline between syncs; the bytes freed."""
        ...

    def release_buffers(self) -> None:
        """Free the bucket buffers until the next send."""
        ...

    def close(self) -> None:
        """Release everything; a sync running in another thread ends at once with ClosedError."""
        ...


class Sender:
    """A sender over one carrier: the pipeline runs each sync; this class owns the calls and their lifetime."""

    def __init__(self, backend: Backend, options: SenderOptions, carrier: Callable[[CloseSignal], Carrier]) -> None:
        """`carrier` makes the carrier, given the signal that close() from another thread sets (its waits watch it)."""
        self.backend = backend
        self.options = options
        lifetime = Lifetime(type(self).__name__, self._release)
        try:
            made = carrier(lifetime.signal)
        except BaseException:
            lifetime.signal.close()
            raise
        self._pipeline = SyncPipeline(made, backend.device(), options)
        self._lifetime = lifetime

    @property
    def delta(self) -> bool:
        """Whether a send() that does not say sends a delta (`options.delta`)."""
        return self.options.delta

    @property
    def bucket_bytes(self) -> int:
        """Bytes a bucket holds (chosen at the first send where the options left it to the transport or "auto")."""
        return self._pipeline.carrier.bucket_bytes

    @property
    def num_buffers(self) -> int:
        """Buckets in flight (across nodes: per sender rank)."""
        return self._pipeline.carrier.num_buffers

    @property
    def timeout_s(self) -> float:
        """Seconds any wait may take (options.timeout_s)."""
        return self.options.timeout_s

    @property
    def stable_sources(self) -> bool:
        """Whether sources keep each tensor's memory until send() returns (options.stable_sources)."""
        return self.options.stable_sources

    @property
    def delta_baseline_bytes(self) -> int:
        """Memory the delta baseline holds: host memory, or the device's with delta_on_device (0 without one)."""
        deltas = self._pipeline.deltas
        return 0 if deltas is None else deltas.baseline_bytes

    def drop_delta_baseline(self) -> int:
        """Free the delta baseline between syncs; returns the bytes freed.

        The next sync asking for a delta is then full and says why; none is kept until one asks."""
        with self._lifetime.call("drop_delta_baseline"):
            deltas = self._pipeline.deltas
            return 0 if deltas is None else deltas.drop()

    def release_buffers(self) -> None:
        """Free the bucket buffers until the next send (the connections are kept), e.g. to give memory back."""
        with self._lifetime.call("release_buffers"):
            self._pipeline.carrier.release_buffers()

    def send(self, source: TensorSource | TrainerModel, *, version: int, manifest: list[TensorSpec] | None = None,
             onload: torch.nn.Module | Iterable[torch.Tensor] | None = None, delta: bool | None = None
             ) -> SyncStats:
        """Send one sync; returns when every receiver has it, raises SyncError otherwise.

        `source`: (name, tensor) pairs (any lazy iterable), a function of the first receiver's report
        (hwsync.ReceiverReport) returning them, a Source (asked for its manifest and a fresh iteration), or a
        TrainerModel, planned against every receiver's report.
        `manifest` announces the tensors before any byte moves. `onload`: parameters to bring from host memory to
        the device for the sync, and back. A tensor the source yielded must stay as it was until this returns
        (`stable_sources=False` for a source that reuses a staging buffer); the caller's tensors are its own again
        once it returns. `delta`: for this sync, send only what changed (None: `options.delta`); it is a delta only
        where every receiver holds the sender's baseline, else full, and `stats.delta` says why. Tensors go in the
        dtype the receivers' engines hold them in, where they report it (hwsync.sync.report: EngineDtypes).
        """
        with self._lifetime.call("send"):
            return self._send(source, version, manifest, onload, delta, commit=True)

    def stage(self, source: TensorSource | TrainerModel, *, version: int, manifest: list[TensorSpec] | None = None,
              onload: torch.nn.Module | Iterable[torch.Tensor] | None = None, delta: bool | None = None
              ) -> SyncStats:
        """send() up to the commit: returns once every receiver staged (or, one that does not stage, loaded)
        `version`; `commit()` then applies it everywhere. A stage not yet committed is superseded by the next
        stage() or send(): its receivers drop it and apply nothing. The same arguments as send(), whose rule on
        the source's tensors holds until stage() returns. Same-host senders only (WeightSender)."""
        with self._lifetime.call("stage"):
            if not self._pipeline.carrier.commits_apart:
                raise HwsyncError(f"{type(self).__name__} stages and commits in one send(); stage() and commit() "
                                  "apart are WeightSender's (its other sender ranks would wait for the commit)")
            return self._send(source, version, manifest, onload, delta, commit=False)

    def commit(self) -> SyncStats:
        """Apply the staged version on every receiver (each inside its engine's pause); the stats of the whole sync.
        Raises NotAppliedError, and no receiver applies it, if one failed or went away since it staged."""
        with self._lifetime.call("commit"):
            if self._pipeline.pending is None:
                raise HwsyncError("commit() without a staged sync: call stage() first (send() commits by itself)")
            start = time.perf_counter()
            stats = self._pipeline.commit()
            stats.total_s += time.perf_counter() - start
            log.info("hwsync %s committed %s", type(self).__name__, stats)
            return stats

    def abandon(self, reason: str = "") -> None:
        """Drop the version stage() left: its receivers apply nothing and keep the version they serve."""
        with self._lifetime.call("abandon"):
            pending = self._pipeline.pending
            if pending is not None:
                self._pipeline.abandon(SupersededError(f"version {pending[0]} was staged and dropped without a "
                                                       f"commit{': ' + reason if reason else ''}"))

    @property
    def staged_version(self) -> int | None:
        """The version stage() left for commit(), or None."""
        pending = self._pipeline.pending
        return None if pending is None else pending[0]

    def _send(self, source: TensorSource | TrainerModel, version: int, manifest: list[TensorSpec] | None,
              onload: torch.nn.Module | Iterable[torch.Tensor] | None, delta: bool | None, *,
              commit: bool) -> SyncStats:
        pending = self._pipeline.pending
        if pending is not None:  # a newer version supersedes the one staged: its receivers drop it
            self._pipeline.abandon(SupersededError(f"version {pending[0]} was staged and never committed; version "
                                                   f"{version} supersedes it"))
        start = time.perf_counter()
        stats = self._pipeline.carrier.new_stats(version)
        self._pipeline.run(source, version, manifest, onload, self._delta_for(delta), stats, commit=commit)
        stats.total_s = time.perf_counter() - start
        log.info("hwsync %s %s %s", type(self).__name__, "sent" if commit else "staged", stats)
        return stats

    def _delta_for(self, delta: bool | None) -> bool:
        """Whether this sync asks for a delta (None: `options.delta`)."""
        return self.options.delta if delta is None else delta

    def close(self) -> None:
        """Release buffers, sockets and threads; safe to call twice, and from any thread.

        A sync running in another thread ends at once: it aborts its receivers and raises ClosedError there.
        Every later call raises ClosedError."""
        self._lifetime.close()

    def _release(self) -> None:
        self._pipeline.close()
        self._pipeline.carrier.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not hasattr(self, "_lifetime"):  # made only once the carrier was
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at garbage collection nothing can be told any more
            pass
