"""CrossNodeReceiver: an engine rank's side of a sync from trainer ranks on other nodes.

The receiver knows only sender 0's control endpoint and its own rank among the receivers;
everything else (the senders' group addresses, the bucket plan and which sender broadcasts
each bucket) is announced by sender 0. It joins one group per sender (as group rank 1+rank),
posts each sender's broadcasts ahead (`num_buffers` buckets deep per sender), and hands
buckets to `load` in plan order, so a tensor chunked over buckets of different senders is
reassembled exactly as on the same-node path.

Every group's collectives run on one worker thread, in the order the plan gives, identical on
every receiver. On NCCL and HCCL a collective waits for the device's current stream and
`wait()` makes that stream wait for it, so collectives of two groups issued from two threads are
ordered through the shared stream: receivers whose threads raced into different orders would
each wait for the other forever. `load` sees complete
tensors; whole ones are zero-copy views of a receive buffer, valid during the call only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hwsync.backend.communicator import open_communicator, parse_rendezvous
from hwsync.backend.interfaces import Backend, Communicator
from hwsync.backend.owners import sweep_dead_owners
from hwsync.backend.registry import get_backend
from hwsync.control.nic import Nic, nic_towards
from hwsync.delta.header import WORDS_PER_HEADER, pad8
from hwsync.disaggregated.link import Link
from hwsync.disaggregated.plan import CollectivePlan
from hwsync.disaggregated.progress import rate, size
from hwsync.disaggregated.worker import CollectiveWorker
from hwsync.errors import SyncError, SyncTimeoutError
from hwsync.protocol import Commit, Go, Joined, PlanAccept, PlanFrame, Progress, RankComplete, Setup
from hwsync.sizes import DEFAULT_NUM_BUFFERS, MIN_NUM_BUFFERS
from hwsync.sync.bucket import BucketReader, IntoFn, LoadFn
from hwsync.sync.collector import hold_collector
from hwsync.sync.delta_receiver import ApplyDelta, Applying, ReceiverDeltas
from hwsync.sync.loader import Hooks, Loader
from hwsync.sync.report import ReceiverReport, ReceiverState
from hwsync.sync.staging import StageOptions, StagingArea
from hwsync.sync.stats import DeltaStats, StageStats, SyncStats
from hwsync.timing import DEFAULT_TIMEOUT_S, FAILED_JOIN_S, WORKER_JOIN_S

log = logging.getLogger("hwsync")


class CrossNodeReceiver:
    """The cross-node path's receiver: one engine rank, connected to sender 0's endpoint, fed over the senders'
    groups."""

    def __init__(self, endpoint: str, *, rank: int, num_buffers: int = DEFAULT_NUM_BUFFERS,
                 timeout_s: float = DEFAULT_TIMEOUT_S, backend: Backend | None = None,
                 stage: StageOptions | bool | None = None) -> None:
        if rank < 0:
            raise ValueError(f"rank={rank}: receiver ranks count from 0")
        if num_buffers < MIN_NUM_BUFFERS:
            raise ValueError(f"num_buffers={num_buffers}: at least {MIN_NUM_BUFFERS} are needed to overlap "
                             "receiving with loading")
        sweep_dead_owners()  # what killed hwsync processes of this host left behind (once per process)
        self.rank = rank
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.backend = backend or get_backend()
        self._link = Link(endpoint, timeout_s, self.backend.name)
        self._comms: list[Communicator | None] = []
        self._worker: CollectiveWorker | None = None
        self._epoch: int | None = None
        self._buffers: list[list[torch.Tensor]] = []
        #: buckets whose broadcast landed: bucket -> (sender, buffer)
        self._arrived: dict[int, tuple[int, int]] = {}
        #: a delta sync's descriptors and payloads that landed: ("words" | "data", group)
        self._groups_in: set[tuple[str, int]] = set()
        #: what this receiver holds of sender 0's baseline, and the copies it keeps to apply deltas on
        self._deltas = ReceiverDeltas()
        #: last version received completely, or None
        self.version: int | None = None
        #: True when a sync broke after some bucket was loaded: the model holds a mix
        self.incomplete = False
        #: the current sync's data phase: when it began, bytes loaded, bytes in all (for a timeout's message)
        self._data: list[float] = []
        #: stage=: each sync is staged while the engine serves, and applied only once sender 0 commits it (every
        #: rank staged it)
        options = StageOptions.of(stage)
        self._staging = StagingArea(self.backend.device(), options) if options is not None else None
        #: the version staged and awaiting the commit, or None
        self.staged: int | None = None

    def receive(self, loader: Loader | LoadFn | None = None, *, into: IntoFn | None = None,
                state: ReceiverState | dict[str, Any] | None = None) -> SyncStats:
        """Receive one sync; returns once every rank confirmed it, raises SyncError naming a failed rank.

        The same arguments as WeightReceiver.receive: a Loader (or a load function) that gets each bucket's
        complete tensors and may `accept(version, manifest)` before any byte moves (a LocalForwarder is one),
        `into(name, dtype, shape)` naming the caller's own tensors to copy straight into; `state` is what sender 0
        plans from (a TrainerModel, or a callable source).
        """
        hooks = Hooks.of(loader, into)
        if hooks.commit is not None and self._staging is not None:
            raise TypeError(f"{type(loader).__name__} stages on its own (it has commit() and abandon()) and this "
                            "receiver was made with stage=: pick one (a plain loader with stage=, or a staging "
                            "loader without)")
        load, into = hooks.load, hooks.into
        start = time.perf_counter()
        stats = SyncStats(transport=f"collective/{self.backend.name}")
        link = self._link
        began = committing = False
        landed: dict[str, torch.Tensor] | None = None  # where a staged sync's tensors went in the engine
        release_collector = None
        try:
            self._data = []
            said = ReceiverState.of(state)
            link.ready("receiver", self.rank, self.group_epoch,
                       report=ReceiverReport(said.engine, said.dtypes, self._deltas.held, None, said.extra))
            frame = link.next((Setup, PlanFrame), "waiting for sender 0's plan")
            if isinstance(frame, Setup):
                self._join(frame)
                frame = link.next((PlanFrame,), "waiting for sender 0's plan", self._worker)
            assert isinstance(frame, PlanFrame)
            # the engine waits for this sync (one that stages serves meanwhile): the collector is held (collector.py)
            if self._staging is None and hooks.commit is None:
                release_collector = hold_collector()
            if frame.epoch != self._epoch:
                raise SyncError(f"sender 0 planned for group epoch {frame.epoch} but this rank has {self._epoch}")
            plan = CollectivePlan.from_frame(frame)
            version = frame.version
            targets = plan.manifest  # a delta sync's too: its payloads stream in groups of these, not in buckets
            began = True  # from here a staging area may hold part of this sync
            self._deltas.begin(frame.delta, targets)  # a delta only on what this receiver holds
            if self._deltas.is_delta:
                stats.delta = DeltaStats("delta", check=self._deltas.check)
            staging = self._staging
            if staging is not None:  # what staging will hold, checked before a byte moves
                stats.stage = StageStats(receivers=1, new_bytes=staging.begin(
                    targets, version, delta_mode=frame.delta is not None, delta_sync=self._deltas.is_delta))
                load, into = None, staging.for_sync(hooks.into)  # a delta applies on the engine's tensor if named
            if hooks.accept is not None:  # the engine checks the manifest and begins: no byte has moved
                hooks.accept(version, targets)
            stats.version, stats.bucket_bytes, stats.num_buffers = version, plan.bucket_bytes, self.num_buffers
            link.send(PlanAccept())
            link.next((Go,), "waiting for sender 0's go", self._worker)
            load, into = self._deltas.intake(load, into, self.backend.device())
            if isinstance(load, ApplyDelta) and frame.delta is not None:
                assert frame.delta.groups is not None  # a delta plan streams groups (checked on decode)
                self._stream_groups(plan, frame.delta.groups, load, stats)
            else:
                self._stream(plan, load, into, stats)
            if staging is None:
                self._done(hooks, stats)  # a loader that stages on its own: staged and verified when it returns
                if hooks.commit is None:
                    self.version, self.incomplete = version, False
                else:
                    stats.stage = StageStats(receivers=1)
            if stats.stage is not None:  # a full sync in delta mode: its digests now, not beside the engine's next step
                self._deltas.digest_staged()
            stats.total_s = time.perf_counter() - start
            if stats.stage is not None:
                stats.stage.stage_s, self.staged = stats.total_s, version
                if staging is not None:
                    stats.stage.held_bytes = staging.held_bytes
            link.send(RankComplete(version=version, stats=stats.to_dict()))
            link.next((Commit,), f"waiting for every rank to confirm version {version}", self._worker)
            if staging is not None:  # committed: every rank staged it; apply inside the engine's pause
                self.staged, self.incomplete = None, True
                applied = staging.apply(hooks, self._deltas.pool())
                landed = applied.landed
                assert stats.stage is not None
                stats.stage.apply_s = applied.apply_s
                stats.load_s += applied.apply_s  # done() ran inside the pause, with the apply
                self.version, self.incomplete = version, False
            elif hooks.commit is not None:  # committed: every rank staged it; the loader applies what it staged
                assert stats.stage is not None
                self.staged, self.incomplete, committing = None, True, True
                t0 = time.perf_counter()
                hooks.commit()
                stats.stage.apply_s = time.perf_counter() - t0
                self.version, self.incomplete = version, False
            self._deltas.complete(landed)  # committed everywhere: this receiver holds sender 0's new baseline
        except BaseException as exc:
            link.report(exc)
            log.warning("hwsync cross-node receive failed on receiver %d: %s", self.rank, exc)
            self.staged = None
            if self._staging is not None and began:  # nothing staged is applied: the engine keeps its version
                self._staging.release()
                self._deltas.clear()  # the staging area was its base
            if began and hooks.abandon is not None and not committing:  # whatever it staged of this sync goes
                self._abandon(hooks.abandon)
            self._drop_groups(failed=True)
            if isinstance(exc, SyncTimeoutError) and self._data:
                raise SyncTimeoutError(f"{exc}. {self._progress()}") from exc
            raise
        finally:
            if release_collector is not None:
                release_collector()
        stats.total_s = time.perf_counter() - start
        return stats

    def _abandon(self, abandon: Callable[[], None]) -> None:
        """Have a loader that stages on its own drop this sync: its engine keeps the version it serves."""
        try:
            abandon()
        except Exception as exc:  # noqa: BLE001 - the sync's own error is the one raised
            log.warning("hwsync: receiver %d's loader failed to drop the uncommitted sync: %s", self.rank, exc)

    @staticmethod
    def _done(hooks: Hooks, stats: SyncStats) -> None:
        if hooks.done is not None:
            t0 = time.perf_counter()
            hooks.done()
            stats.load_s += time.perf_counter() - t0

    @property
    def group_epoch(self) -> int | None:
        """Id of the groups this rank holds (changes only when they are rebuilt), or None."""
        return self._epoch if self._groups_ready() else None

    def _groups_ready(self) -> bool:
        return bool(self._comms) and all(c is not None for c in self._comms)

    def _join(self, frame: Setup) -> None:
        """Join every sender's group at once (each sender blocks until all its receivers arrive)."""
        self._drop_groups()
        addresses, world = frame.addresses, 1 + frame.num_receivers
        if self.rank + 1 >= world:
            raise SyncError(f"receiver rank {self.rank} is outside the {world - 1} receivers sender 0 expects; "
                            "give each receiver a distinct rank below num_receivers")
        self._comms = [None] * len(addresses)
        self._worker = worker = CollectiveWorker(f"hwsync-recv-{self.rank}", self.backend.device())
        self._epoch = frame.epoch
        for s, address in enumerate(addresses):  # in sender order on every receiver
            worker.submit(("build", s, address), self._build, address, world)
        while not self._groups_ready():
            self._pump(f"joining the senders' groups at {addresses}")
        self._link.send(Joined())

    def _build(self, address: str, world: int) -> tuple[Communicator, Nic | None, str]:
        """Join the group at `address` on the interface whose route reaches it (on the collective thread)."""
        nic = nic_towards(parse_rendezvous(address)[0])
        comm, note = open_communicator(self.backend, address, 1 + self.rank, world, self.timeout_s, nic)
        return comm, nic, note

    def _pump(self, what: str) -> None:
        """One slice of the link, with the collective thread's results taken (a failure is the link's to report)."""
        for tag, value, error in self._link.pump(what, self._worker):
            if error is not None:
                continue  # the link has reported it; the hub names the culprit and aborts
            if tag[0] == "build":
                self._comms[tag[1]], nic, note = value
                log.info("hwsync: receiver %d joined sender %d's group at %s (epoch %s) from %s: %s", self.rank,
                         tag[1], tag[2], self._epoch, nic or "an interface it could not tell", note)
            elif tag[0] == "recv":
                self._arrived[tag[1]] = (tag[2], tag[3])
            elif tag[0] == "group":
                self._groups_in.add(tag[1])

    def _post(self, plan: CollectivePlan, queue: list[int], free: list[int], s: int) -> None:
        """Post sender `s`'s next broadcasts into its free buffers."""
        while queue and free:
            k, j = queue.pop(0), free.pop(0)
            nbytes = plan.buckets[k].nbytes
            if nbytes == 0:  # only empty tensors: the sender posts nothing either
                self._arrived[k] = (s, j)
                continue
            comm = self._comms[s]
            assert comm is not None and self._worker is not None
            self._worker.submit(("recv", k, s, j), comm.broadcast, self._buffers[s][j][:nbytes], 0)

    def _ensure_buffers(self, plan: CollectivePlan) -> list[list[torch.Tensor]]:
        """`num_buffers` receive buffers of a bucket per sender of the plan, kept while the geometry holds."""
        if not self._buffers or self._buffers[0][0].numel() != plan.bucket_bytes or \
                len(self._buffers) != plan.num_senders:
            device = self.backend.device().torch_device()
            self._buffers = [[torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
                              for _ in range(self.num_buffers)] for _ in range(plan.num_senders)]
        return self._buffers

    def _stream(self, plan: CollectivePlan, load: LoadFn | None, into: IntoFn | None, stats: SyncStats) -> None:
        """Post each sender's broadcasts ahead and load buckets in plan order as they land."""
        if plan.num_senders != len(self._comms):
            raise SyncError(f"the plan has {plan.num_senders} senders but this rank joined {len(self._comms)} groups")
        self._ensure_buffers(plan)
        queues = [plan.owned_by(s) for s in range(plan.num_senders)]
        free = [list(range(self.num_buffers)) for _ in range(plan.num_senders)]
        self._arrived = {}
        self._data = [time.monotonic(), 0.0, float(plan.total_bytes)]
        reader = BucketReader()
        reader.begin(self._buffers[0][0].device)  # reassemble beside the receive buffers, on this rank's device
        for s in range(plan.num_senders):
            self._post(plan, queues[s], free[s], s)
        for k, bucket in enumerate(plan.buckets):
            t0 = time.perf_counter()
            while k not in self._arrived:
                self._pump(f"waiting for bucket {k} of {len(plan.buckets)} from sender {bucket.owner}")
            stats.wait_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            s, j = self._arrived.pop(k)
            view = self._buffers[s][j][: bucket.nbytes]
            tensors = reader.read(view, list(bucket.entries), into)
            self.incomplete = self.incomplete or self._staging is None  # staging: the engine is untouched
            if tensors:
                if load is None:
                    raise ValueError(f"into() returned None for {tensors[0][0]!r} and no load was given; return "
                                     "a destination for every tensor or pass load")
                load(tensors)
            del tensors, view  # the views must not outlive the buffer's reuse
            free[s].append(j)
            self._post(plan, queues[s], free[s], s)
            self._link.send(Progress(k=k))
            stats.load_s += time.perf_counter() - t0
            stats.buckets += 1
            stats.tensors += sum(1 for e in bucket.entries if e.is_last)
            stats.bytes += sum(e.chunk_bytes for e in bucket.entries)
            self._data[1] += bucket.nbytes
        if reader.pending():
            raise SyncError(f"the sync ended with tensors incomplete: {reader.pending()[:5]}")

    def _stream_groups(self, plan: CollectivePlan, groups: list[int], apply: ApplyDelta, stats: SyncStats) -> None:
        """A delta sync from sender 0: per group its descriptor, then its payloads, applied while the next group
        arrives (the next descriptor is posted right behind the payloads, on the same collective thread)."""
        if len(self._comms) < 1:
            raise SyncError("a delta sync comes from sender 0, but this rank joined no group")
        device = self.backend.device().torch_device()
        slots = self._ensure_buffers(plan)[0]  # sender 0's, kept across syncs: no fresh pages to fault in per sync
        applying: list[Applying] = []
        self._groups_in = set()
        self._data = [time.monotonic(), 0.0, float(plan.total_bytes)]
        words = [torch.empty(WORDS_PER_HEADER * n, dtype=torch.int64, device=device) for n in groups]
        if groups:
            self._post_group(("words", 0), [words[0]])
        try:
            self._receive_groups(plan, groups, apply, stats, slots, words, applying)
        except BaseException:
            # the applies run on the device's stream behind the broadcasts posted for the next group, which never
            # end once sender 0 is gone (as an NCCL kernel waits): abort them first, or the wait below lasts
            # until the group's timeout, and this receiver hears of the failure that late
            self._drop_groups(failed=True)
            raise
        finally:  # failed or not, no apply may still read a buffer the next sync receives into
            for pending in applying:
                pending.wait()
        t0 = time.perf_counter()
        while applying:
            applying.pop(0).finish()
        stats.load_s += time.perf_counter() - t0

    def _receive_groups(self, plan: CollectivePlan, groups: list[int], apply: ApplyDelta, stats: SyncStats,
                        slots: list[torch.Tensor], words: list[torch.Tensor], applying: list[Applying]) -> None:
        """Each group's descriptor, then its payloads, then its applies started (`applying`, in group order)."""
        device = slots[0].device
        starts = [sum(groups[:g]) for g in range(len(groups) + 1)]
        for g, n in enumerate(groups):
            t0 = time.perf_counter()
            self._await(("words", g), f"waiting for the descriptor of delta group {g} of {len(groups)}")
            specs = plan.manifest[starts[g]:starts[g + 1]]
            headers = self._deltas.announce(specs, words[g].cpu())
            sizes = [pad8(header.nbytes) for header in headers]
            total = sum(sizes)
            while len(applying) >= len(slots):  # the buffer about to be reused: its group's applies end first
                applying.pop(0).finish()
            # a group larger than a bucket (a dense tensor of more than a bucket) gets a buffer of its own
            buffer = slots[g % len(slots)] if total <= plan.bucket_bytes else \
                torch.empty(total, dtype=torch.uint8, device=device)
            step = plan.bucket_bytes
            pieces = [buffer[a:min(a + step, total)] for a in range(0, total, step)]
            later = (words[g + 1],) if g + 1 < len(groups) else ()
            self._post_group(("data", g), pieces, later)
            self._await(("data", g), f"waiting for the payloads of delta group {g} of {len(groups)} ({size(total)})")
            stats.wait_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            at, payloads = 0, []
            for spec, header, nbytes in zip(specs, headers, sizes):
                payloads.append((spec.name, buffer[at:at + header.nbytes]))
                at += nbytes
            self.incomplete = self.incomplete or self._staging is None  # staging: the engine is untouched
            applying.append(apply.submit(payloads))
            del payloads
            self._link.send(Progress(k=g))
            stats.load_s += time.perf_counter() - t0
            stats.buckets += 1
            stats.tensors += n
            stats.bytes += total + words[g].numel() * words[g].element_size()
            self._data[1] += sum(spec.nbytes for spec in specs)

    def _post_group(self, key: tuple[str, int], pieces: list[torch.Tensor],
                    then: tuple[torch.Tensor, ...] = ()) -> None:
        """Receive `pieces` and then `then` (the next group's descriptor) from sender 0, on the collective thread."""
        comm, worker = self._comms[0], self._worker
        assert comm is not None and worker is not None
        worker.submit(("group", key), _broadcast_all, comm, pieces)
        if then:
            worker.submit(("group", ("words", key[1] + 1)), _broadcast_all, comm, list(then))

    def _await(self, key: tuple[str, int], what: str) -> None:
        """Pump the link until the collective thread reports `key` received."""
        while key not in self._groups_in:
            self._pump(what)
        self._groups_in.discard(key)

    def _progress(self) -> str:
        """'This receiver loaded 3.1 MB of 8.4 MB in the 2.9 s since the data began (8.6 Mbit/s (1.1 MB/s))'."""
        start, done, total = self._data
        elapsed = max(time.monotonic() - start, 1e-3)
        speed = f" ({rate(done / elapsed)})" if done else ""
        return f"This receiver loaded {size(done)} of {size(total)} in the {elapsed:.1f} s since the data began{speed}"

    def _drop_groups(self, failed: bool = False) -> None:
        """Tear the groups down; a worker stuck in a dead group's broadcast is abandoned (after a failed
        sync at once: FAILED_JOIN_S, as the sender does)."""
        comms, worker = self._comms, self._worker
        self._comms, self._worker, self._epoch, self._arrived = [], None, None, {}
        for comm in comms:
            if comm is not None:
                try:
                    comm.destroy()
                except Exception as exc:  # noqa: BLE001 - a broken group may fail to shut down; dropped anyway
                    log.debug("hwsync: destroying a failed group raised %s", exc)
        if worker is not None and not worker.stop(FAILED_JOIN_S if failed else WORKER_JOIN_S):
            log.warning("hwsync: receiver %d left a collective thread stuck in a dead group; it ends at the "
                        "group's timeout", self.rank)

    def release_buffers(self) -> None:
        """Free the receive buffers until the next sync (the groups are kept), e.g. to give device memory back."""
        self._buffers = []
        self.backend.device().empty_cache()

    def close(self) -> None:
        """Tear down groups, buffers and the control socket; safe to call twice."""
        self._drop_groups()
        self._buffers = []
        self._deltas.clear()
        if self._staging is not None:
            self._staging.release()
        self._link.close()

    def __enter__(self) -> "CrossNodeReceiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _broadcast_all(comm: Communicator, pieces: list[torch.Tensor]) -> None:
    """Receive each piece of sender 0's broadcast in turn (on the collective thread)."""
    for piece in pieces:
        comm.broadcast(piece, 0)
