"""The cross-node carriers: a sync's bytes broadcast over each sender rank's process group.

Each of the S sender ranks owns a group of its own over the backend's collective library (gloo, NCCL,
HCCL): itself as group rank 0 and the R receivers as ranks 1..R, rendezvousing at an address it picks.
Sender rank 0 (`HubCarrier`) is also the hub of the ZeroMQ control plane: it gathers every rank, announces
the groups' addresses, computes the bucket plan from the manifest (which bucket each sender broadcasts) and
announces it, collects each receiver's confirmation of the sync's version and commits or aborts the sync on
every rank. The other sender ranks (`RankCarrier`) take the plan from it, with the receivers' states, and
broadcast their own buckets. Groups are built on the first sync and kept; any failure tears them down
everywhere and the next sync builds new ones.

Every sender rank iterates the whole source in the same order (an FSDP DTensor's full_tensor() is a
collective over the trainer's ranks, so all of them must call it) and copies only the chunks of its own
buckets. Its broadcasts run on a worker thread, so packing bucket k+1 into one buffer overlaps the broadcast
of bucket k from another. A delta is sent by sender 0 alone, group by group, its encodes running ahead of
the wire.
"""

from __future__ import annotations

import time

from hwsync.backend.interfaces import Backend
from hwsync.control.endpoints import CloseSignal, new_token
from hwsync.disaggregated.addresses import choose_group_host, endpoint_host, pick_port, routed_host, unreachable_hint
from hwsync.disaggregated.group import SenderGroup
from hwsync.disaggregated.hub import Hub
from hwsync.disaggregated.link import Link
from hwsync.disaggregated.plan import CollectivePlan, delta_groups, make_plan
from hwsync.disaggregated.roster import PeerInfo, this_process
from hwsync.errors import SyncError, SyncTimeoutError
from hwsync.protocol import Commit, Go, Joined, Listening, PlanAccept, PlanFrame, RankComplete, Sent, Setup
from hwsync.protocol.delta import DeltaField
from hwsync.sizes import DEFAULT_BUCKET_BYTES, DEFAULT_NUM_BUFFERS
from hwsync.sync.options import CrossNodeOptions
from hwsync.sync.prepared import Prepared
from hwsync.sync.report import ReceiverReport
from hwsync.sync.stats import SyncStats


def receiver_states(frame: PlanFrame) -> list[ReceiverReport]:
    """The receivers' reports a PlanFrame carries (sender 0 planned from them; so does every rank)."""
    return list(frame.receivers)


class _RankBase:
    """What both kinds of sender rank hold: the group's address, its buffers, and the group."""

    def __init__(self, rank: int, backend: Backend, endpoint: str | None, group_host: str | None,
                 options: CrossNodeOptions) -> None:
        self.rank, self.backend, self.options = rank, backend, options
        self.group_host = choose_group_host(group_host, rank, endpoint)
        self.group_port = options.group_port
        self.bucket_bytes = options.bucket_bytes if isinstance(options.bucket_bytes, int) else DEFAULT_BUCKET_BYTES
        self.num_buffers = DEFAULT_NUM_BUFFERS if options.num_buffers is None else options.num_buffers
        self.timeout_s = options.timeout_s
        self._group: SenderGroup | None = None

    @property
    def group(self) -> SenderGroup:
        assert self._group is not None
        return self._group

    def candidate_address(self) -> str:
        """Where this rank's group would rendezvous (a free port unless options.group_port names one)."""
        return f"tcp://{self.group_host}:{self.group_port or pick_port(self.group_host)}"

    def new_stats(self, version: int) -> SyncStats:
        """This sync's stats: the collective and this rank's buffers."""
        return SyncStats(version=version, num_buffers=self.num_buffers, transport=f"collective/{self.backend.name}")

    def release_buffers(self) -> None:
        """Free the bucket buffers until the next send (the group is kept)."""
        self.group.release_buffers()


class HubCarrier(_RankBase):
    """Sender rank 0's carrier: the hub of the control plane, the plan, and its own group."""

    streams_deltas = True  # a delta is encoded as the stream asks for it, its headers with each group
    needs_manifest = True  # the bucket plan is made before the first tensor is produced
    commits_apart = False  # the other sender ranks wait in their send() for the Commit: it follows the confirm

    def __init__(self, backend: Backend, endpoint: str | None, num_senders: int, num_receivers: int,
                 group_host: str | None, options: CrossNodeOptions, closing: CloseSignal) -> None:
        super().__init__(0, backend, endpoint, group_host, options)
        self.num_senders, self.num_receivers = num_senders, num_receivers
        #: where the group host came from (for the errors of groups that did not form); None: the hub is bound to a
        #: wildcard address and nothing named it, so each build takes the address its routes to the receivers leave
        #: from (addresses.routed_host)
        self._host_from = "group_host=" if group_host else "the hub's address" if endpoint_host(endpoint or "") \
            else None
        # ADDRESS, ADDRESS#TOKEN to choose the token, or ADDRESS#TOKEN#KEY with the secret_key of KEY (an endpoint
        # announced before it is bound); otherwise a tcp:// endpoint's CURVE key is made here
        address, _, rest = (endpoint or f"tcp://{self.group_host}:0").partition("#")
        token, _, key = rest.partition("#")
        if key and options.secret_key is None:
            raise ValueError(f"endpoint {address}#...#{key[:8]}... names a CURVE key: pass CrossNodeOptions("
                             "secret_key=...) (the secret half of hwsync.control.sockets.curve_key_pair()), or leave "
                             "the key out to have one made")
        self.hub = Hub(address, token or new_token(), options.timeout_s, num_senders=num_senders,
                       num_receivers=num_receivers, backend=backend.name, secret_key=options.secret_key,
                       closing=closing)
        if key and self.hub.server_key != key:
            self.hub.close()
            raise ValueError(f"secret_key does not belong to the endpoint's CURVE key {key[:8]}...: pass the pair "
                             "curve_key_pair() made")
        self._group = SenderGroup(0, backend, self.hub, self.num_buffers, options.timeout_s)
        self._peers: list[PeerInfo] = []

    def gather(self, stats: SyncStats) -> list[ReceiverReport]:
        """Every other rank's ready (senders and receivers); the receivers' reports."""
        t0 = time.perf_counter()
        self._peers = self.hub.gather(self.num_senders - 1, self.num_receivers)
        stats.wait_s += time.perf_counter() - t0
        return [p.report for p in self._receivers()]

    def _receivers(self) -> list[PeerInfo]:
        return [p for p in self._peers if p.role == "receiver"]

    def _followers(self) -> list[PeerInfo]:
        return [p for p in self._peers if p.role == "sender"]

    def stream(self, sync: Prepared, version: int, stats: SyncStats) -> None:
        """Groups built where needed, the plan announced and accepted, then every bucket (or delta group) broadcast."""
        hub, group, receivers = self.hub, self.group, self._receivers()
        if group.comm is None or any(p.epoch != group.epoch for p in self._peers):
            self._setup()
        t0 = time.perf_counter()
        groups: list[int] | None = None
        if sync.encoded is not None:  # a delta: sender 0 encodes and sends it group by group
            assert sync.targets is not None
            groups = delta_groups(sync.targets, self.bucket_bytes)
            plan = CollectivePlan(self.bucket_bytes, self.num_senders, sync.targets, [])
            sizes = [sum(spec.nbytes for spec in sync.targets[sum(groups[:g]):sum(groups[:g + 1])])
                     for g in range(len(groups))]
        else:
            assert sync.stream_manifest is not None
            plan = make_plan(sync.stream_manifest, self.bucket_bytes, self.num_senders)
            sizes = [b.nbytes for b in plan.buckets]
        stats.plan_s += time.perf_counter() - t0
        wire = None if sync.wire is None else DeltaField(sync.wire.base if groups else None, sync.wire.next,
                                                         groups=groups)
        # the receivers' states travel with the plan: every sender rank resolves its source from them alike
        assert group.epoch is not None
        hub.send(plan.frame(**this_process(), epoch=group.epoch, version=version,
                            receivers=[p.report for p in receivers], delta=wire))
        hub.wait_for(PlanAccept, receivers, "waiting for the receivers to accept the plan")
        hub.send(Go())
        hub.begin_data(sizes, group.nic)
        if sync.encoded is not None and groups is not None:
            group.stream_groups(groups, sync.encoded, self.bucket_bytes, stats)
        else:
            assert sync.source is not None
            group.stream(plan, sync.source, stats)

    def _setup(self) -> None:
        """Build new groups: this rank's store listens first, then the other senders' (told first), and only then
        are their addresses announced to the receivers, who join them all."""
        hub, group, receivers, followers = self.hub, self.group, self._receivers(), self._followers()
        epoch = hub.sync  # unique and increasing: no rank can mistake an old group for the new one
        if self._host_from is None:  # the hub is bound to a wildcard address and nothing named the group's
            self.group_host = routed_host(receivers, self.group_host)
        addresses = [self.candidate_address()] + [str(f.address) for f in followers]
        setup = Setup(**this_process(), epoch=epoch, addresses=addresses, num_receivers=self.num_receivers)
        group.build(addresses[0], epoch, 1 + self.num_receivers)
        try:
            group.wait_listening(f"starting this rank's group store at {addresses[0]}")
            if followers:
                hub.send(setup, followers)
                while not hub.all_replied(Listening, followers):
                    group.pump(f"waiting for the other senders' group stores at {addresses[1:]} to listen")
            hub.send(setup, receivers)
            what = f"waiting for every rank to join the groups at {addresses}"
            while not (hub.all_replied(Joined, self._peers) and group.comm is not None):
                group.pump(what)
        except (SyncError, SyncTimeoutError) as exc:
            hint = unreachable_hint(addresses, self.group_host, self._host_from, receivers)
            raise type(exc)(f"{exc}. {hint}") from exc

    def confirm(self, version: int, stats: SyncStats) -> None:
        """Every receiver's confirmation of `version` and every sender's Sent (then `commit`)."""
        hub, receivers = self.hub, self._receivers()
        t0 = time.perf_counter()
        what = f"waiting for the receivers to confirm version {version}"
        while not (hub.all_replied(RankComplete, receivers) and hub.all_replied(Sent, self._followers())):
            self.group.pump(what)
        stats.wait_s += time.perf_counter() - t0
        for key, frame in hub.replied(RankComplete).items():
            if frame.version != version:  # a receiver confirming another version is a protocol bug
                raise SyncError(f"{key[0]} {key[1]} confirmed version {frame.version}, not {version}")
        reports = [hub.replied(RankComplete)[p.key].stats for p in receivers]
        stats.peer = {"receivers": reports}
        stats.load_s = max((r.get("load_s", 0.0) for r in reports), default=0.0)

    def commit(self, version: int, stats: SyncStats) -> None:
        """Commit to every rank: receivers that stage apply it now."""
        self.hub.send(Commit(version=version))

    def fail(self, exc: BaseException) -> None:
        """Abort the sync on every rank, and drop the groups (the next sync builds new ones)."""
        try:
            self.hub.abort(f"{type(exc).__name__}: {exc}")
        finally:
            self.group.drop(failed=True)

    def close(self) -> None:
        """Tear down the group, buffers and the hub's socket."""
        self.group.close()
        self.hub.close()


class RankCarrier(_RankBase):
    """The carrier of sender ranks 1..: sender 0's plan (with the receivers' states), and this rank's buckets."""

    streams_deltas = False  # sender 0 sends every payload of a delta sync; this rank walks the source alongside
    needs_manifest = False  # the plan comes with sender 0's
    commits_apart = False

    def __init__(self, rank: int, backend: Backend, endpoint: str, group_host: str | None, options: CrossNodeOptions,
                 closing: CloseSignal) -> None:
        super().__init__(rank, backend, endpoint, group_host, options)
        self.link = Link(endpoint, options.timeout_s, backend.name, closing=closing)
        self._group = SenderGroup(rank, backend, self.link, self.num_buffers, options.timeout_s)
        self._frame: PlanFrame | None = None

    @property
    def epoch(self) -> int | None:
        """Id of this rank's group (changes only when it is rebuilt), or None."""
        return self.group.epoch if self.group.comm is not None else None

    def gather(self, stats: SyncStats) -> list[ReceiverReport]:
        """Ready to sender 0; join new groups where it announces them; its plan and the receivers' reports."""
        link, group = self.link, self.group
        t0 = time.perf_counter()
        link.ready("sender", self.rank, self.epoch, address=self.candidate_address())
        frame = link.next((Setup, PlanFrame), "waiting for sender 0's plan")
        if isinstance(frame, Setup):
            if self.rank >= len(frame.addresses):
                raise SyncError(f"sender rank {self.rank} is outside the {len(frame.addresses)} senders sender 0 "
                                "expects; give each sender a distinct rank below num_senders")
            address = frame.addresses[self.rank]
            group.build(address, frame.epoch, 1 + frame.num_receivers)
            group.wait_listening(f"starting this rank's group store at {address}")
            link.send(Listening())  # sender 0 announces the address to the receivers only now
            while group.comm is None:
                group.pump(f"waiting for the receivers to join the group at {address}")
            link.send(Joined())
            frame = link.next((PlanFrame,), "waiting for sender 0's plan", group.worker)
        assert isinstance(frame, PlanFrame)
        if frame.epoch != group.epoch:
            raise SyncError(f"sender 0 planned for group epoch {frame.epoch} but this rank has {group.epoch}")
        link.next((Go,), "waiting for the receivers to accept the plan", group.worker)
        stats.wait_s += time.perf_counter() - t0
        self._frame = frame
        return receiver_states(frame)

    def stream(self, sync: Prepared, version: int, stats: SyncStats) -> None:
        """This rank's buckets of sender 0's plan (each tensor cast as sender 0 announced it); only a walk of the
        source for a delta, which sender 0 sends alone."""
        frame = self._frame
        assert frame is not None and sync.source is not None and sync.uncast is not None
        if frame.delta is not None and frame.delta.groups is not None:
            self.group.walk(sync.uncast)
        else:
            self.group.stream(CollectivePlan.from_frame(frame), sync.source, stats)

    def confirm(self, version: int, stats: SyncStats) -> None:
        """Sent to sender 0; its Commit once every receiver confirmed."""
        link, group = self.link, self.group
        if group.failed is not None:
            link.next((Commit,), f"waiting for sender 0 to name the rank at fault (this rank's broadcast failed: "
                                 f"{group.failed})")
            raise SyncError(f"sender {self.rank}'s broadcast failed ({group.failed}), yet sender 0 committed "
                            f"version {version}: a protocol bug, report it")
        link.send(Sent())
        t0 = time.perf_counter()
        link.next((Commit,), f"waiting for the receivers to confirm version {version}", group.worker)
        stats.wait_s += time.perf_counter() - t0

    def commit(self, version: int, stats: SyncStats) -> None:
        """Nothing: sender 0's Commit ended this rank's confirm."""

    def fail(self, exc: BaseException) -> None:
        """Tell sender 0 (it names the rank at fault to every rank), and drop the group."""
        try:
            self.link.report(exc)
        finally:
            self.group.drop(failed=True)

    def close(self) -> None:
        """Tear down the group, buffers and the link's socket."""
        self.group.close()
        self.link.close()
