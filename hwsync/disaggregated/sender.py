"""CrossNodeSender: a trainer rank's side of a sync to engines on other nodes.

Each of the S sender ranks owns a group of its own over the backend's collective library
(gloo, NCCL, HCCL): itself as group rank 0 and the R receivers as ranks 1..R, rendezvousing at
an address it picks. Sender rank 0 is also the hub of the ZeroMQ control plane: it gathers
every rank, announces the groups' addresses, computes the bucket plan from the manifest (which
bucket each sender broadcasts) and announces it, collects each receiver's confirmation of the
sync's version and commits or aborts the sync on every rank. Groups are built on the first
sync and kept; any failure tears them down everywhere and the next sync builds new ones.

Every sender rank iterates the whole source in the same order (an FSDP DTensor's
full_tensor() is a collective over the trainer's ranks, so all of them must call it) and
copies only the chunks of its own buckets. Its broadcasts run on a worker thread, so packing
bucket k+1 into one buffer overlaps the broadcast of bucket k from another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from hwsync.bucket import ALIGN
from hwsync.casting import EngineDtypes
from hwsync.control import new_token
from hwsync.delta.sender import SenderDeltas
from hwsync.disaggregated.addresses import (
    choose_group_host,
    default_host,
    endpoint_host,
    pick_port,
    routed_host,
    unreachable_hint,
)
from hwsync.disaggregated.group import SenderGroup
from hwsync.disaggregated.hub import Hub
from hwsync.disaggregated.link import Link
from hwsync.disaggregated.plan import CollectivePlan, delta_groups, make_plan
from hwsync.disaggregated.roster import PeerInfo, this_process
from hwsync.errors import SyncError, SyncTimeoutError
from hwsync.interfaces import Backend
from hwsync.manifest import TensorSpec
from hwsync.offload import onload_during
from hwsync.planner import TrainerModel, resolve_source
from hwsync.protocol import Commit, Go, Joined, Listening, PlanAccept, PlanFrame, RankComplete, Sent, Setup
from hwsync.registry import get_backend
from hwsync.sizes import DEFAULT_BUCKET_BYTES, DEFAULT_NUM_BUFFERS, MIN_NUM_BUFFERS
from hwsync.source import TensorSource, with_manifest
from hwsync.stats import SyncStats
from hwsync.timing import DEFAULT_TIMEOUT_S

log = logging.getLogger("hwsync")

__all__ = ["CrossNodeSender", "choose_group_host", "default_host", "endpoint_host", "pick_port", "receiver_states"]


def receiver_states(frame: PlanFrame) -> list[dict]:
    """The receivers' reported states a PlanFrame carries (sender 0 planned from them; so does every rank)."""
    states = frame.state.get("receivers")
    if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
        raise SyncError("sender 0's plan carries no list of receiver states; run the same hwsync on every rank")
    return states


class CrossNodeSender:
    """The cross-node path's sender: one trainer rank; rank 0 also runs the control hub the other ranks connect to."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        rank: int = 0,
        num_senders: int = 1,
        num_receivers: int = 1,
        group_host: str | None = None,
        group_port: int = 0,
        bucket_bytes: int | None = None,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backend: Backend | None = None,
        secret_key: str | None = None,
        delta: bool = False,
        delta_on_device: bool = False,
        stable_sources: bool = True,
    ) -> None:
        """A trainer rank's sender; rank 0 binds the control endpoint (its `.endpoint` goes to every other rank).

        `group_host`: the address this rank's group binds, which every receiver must reach (see choose_group_host;
        sender 0 left without it and bound to a wildcard address takes the one its route to the receivers leaves
        from). `delta`: send only what changed (sender 0 decides; `send(delta=...)` overrides), its baseline on the
        device with `delta_on_device`. `stable_sources` (as WeightSender's): True, each tensor a source yields
        keeps its memory until send() returns; False, the source may reuse a tensor's memory once it yields the
        next (a gather into one staging buffer), so nothing may read it after that.
        """
        if not 0 <= rank < num_senders:
            raise ValueError(f"rank {rank} is outside num_senders={num_senders}")
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be at least 1")
        if num_buffers < MIN_NUM_BUFFERS:
            raise ValueError(f"num_buffers={num_buffers}: at least {MIN_NUM_BUFFERS} are needed to overlap packing "
                             "with broadcasting")
        self.rank = rank
        self.num_senders = num_senders
        self.num_receivers = num_receivers
        self.group_host = choose_group_host(group_host, rank, endpoint)
        #: where sender 0's group host came from (for the errors of groups that did not form); None: the hub is bound
        #: to a wildcard address and nothing named it, so each build takes the address its routes to the receivers
        #: leave from (addresses.routed_host)
        self._host_from = "group_host=" if group_host else \
            "the hub's address" if rank == 0 and endpoint_host(endpoint or "") else None
        self.group_port = group_port
        self.bucket_bytes = int(bucket_bytes or DEFAULT_BUCKET_BYTES)
        if self.bucket_bytes < ALIGN:
            raise ValueError(f"bucket_bytes={self.bucket_bytes} is below the minimum of {ALIGN} bytes")
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.backend = backend or get_backend()
        self._hub: Hub | None = None
        self._link: Link | None = None
        if rank == 0:
            # ADDRESS, ADDRESS#TOKEN to choose the token, or ADDRESS#TOKEN#KEY with the secret_key of KEY (an
            # endpoint announced before it is bound); otherwise a tcp:// endpoint's CURVE key is made here
            address, _, rest = (endpoint or f"tcp://{self.group_host}:0").partition("#")
            token, _, key = rest.partition("#")
            if key and secret_key is None:
                raise ValueError(f"endpoint {address}#...#{key[:8]}... names a CURVE key: pass secret_key= (the secret "
                                 "half of hwsync.sockets.curve_key_pair()), or leave the key out to have one made")
            self._hub = Hub(address, token or new_token(), timeout_s, num_senders=num_senders,
                            num_receivers=num_receivers, backend=self.backend.name, secret_key=secret_key)
            if key and self._hub.server_key != key:
                self._hub.close()
                raise ValueError(f"secret_key does not belong to the endpoint's CURVE key {key[:8]}...: pass the pair "
                                 "curve_key_pair() made")
        elif endpoint is None or "#" not in endpoint:
            raise ValueError(f"sender rank {rank} needs endpoint=<sender 0's .endpoint> (tcp://HOST:PORT#TOKEN#KEY)")
        else:
            self._link = Link(endpoint, timeout_s, self.backend.name)
        control = self._hub if self._hub is not None else self._link
        assert control is not None
        self._group = SenderGroup(rank, self.backend, control, num_buffers, timeout_s)
        #: send only what changed since what every receiver holds (sender 0 decides; `send(delta=...)` overrides)
        self.delta = delta
        self._deltas = SenderDeltas(self.backend.device(), on_device=delta_on_device, stable_sources=stable_sources)

    @property
    def endpoint(self) -> str:
        """Sender 0's control endpoint (address, token, CURVE key): pass it to every other rank. A secret: never
        log it."""
        if self._hub is None:
            raise ValueError("only sender rank 0 has the endpoint; the other ranks connect to it")
        return self._hub.endpoint

    @property
    def group_epoch(self) -> int | None:
        """Id of this rank's group (changes only when it is rebuilt), or None."""
        return self._group.epoch if self._group.comm is not None else None

    @property
    def delta_baseline_bytes(self) -> int:
        """Memory the delta baseline holds (sender 0 keeps it), as WeightSender.delta_baseline_bytes."""
        return self._deltas.baseline_bytes

    def drop_delta_baseline(self) -> int:
        """Free the delta baseline between syncs (sender 0), as WeightSender.drop_delta_baseline; bytes freed."""
        return self._deltas.drop()

    def send(
        self,
        source: TensorSource | TrainerModel,
        *,
        version: int,
        manifest: list[TensorSpec] | None = None,
        onload: torch.nn.Module | Iterable[torch.Tensor] | None = None,
        delta: bool | None = None,
    ) -> SyncStats:
        """Send one sync; returns when every receiver confirmed `version`, raises SyncError otherwise.

        `source`: (name, tensor) pairs, a function of the first receiver's reported state returning
        them, or a TrainerModel, planned against every receiver's state; every rank walks the same
        source in the same order. Sender 0 needs the manifest before the first tensor (given, or from
        the TrainerModel, or the pairs as a list). `onload`: parameters to bring from host memory to
        the device for the sync, and back. `delta` (sender 0; None: its setting): send only what changed since
        what every receiver holds, as WeightSender does; sender 0 then sends every payload and keeps the baseline.
        """
        start = time.perf_counter()
        stats = SyncStats(version=version, num_buffers=self.num_buffers, transport=f"collective/{self.backend.name}")
        try:
            if self._hub is not None:
                self._lead(source, version, manifest, onload, self.delta if delta is None else delta, stats)
            else:
                self._follow(source, version, onload, stats)
        except BaseException as exc:
            self._deltas.abort()
            if self._hub is not None:
                self._hub.abort(f"{type(exc).__name__}: {exc}")
            elif self._link is not None:
                self._link.report(exc)
            self._group.drop(failed=True)
            raise
        stats.total_s = time.perf_counter() - start
        log.info("hwsync cross-node sender %d sent %s", self.rank, stats)
        return stats

    # -- sender rank 0 ---------------------------------------------------------------------------

    def _lead(self, source: TensorSource | TrainerModel, version: int, manifest: list[TensorSpec] | None,
              onload: torch.nn.Module | Iterable[torch.Tensor] | None, delta: bool, stats: SyncStats) -> None:
        hub = self._hub
        assert hub is not None
        t0 = time.perf_counter()
        peers = hub.gather(self.num_senders - 1, self.num_receivers)
        stats.wait_s += time.perf_counter() - t0
        receivers = [p for p in peers if p.role == "receiver"]
        followers = [p for p in peers if p.role == "sender"]
        states = [p.state for p in receivers]
        pairs, manifest = resolve_source(source, states, manifest, stats)
        pairs, manifest = with_manifest(pairs, manifest, "sender 0 plans the buckets before the first tensor is "
                                                         "produced")
        if self._group.comm is None or any(p.epoch != self._group.epoch for p in peers):
            self._setup(hub, peers, followers)
        with onload_during(onload, self.backend.device(), stats):
            sync = self._deltas.prepare(pairs, manifest, EngineDtypes(states), delta, states, stats, streamed=True)
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
            wire = None if sync.wire is None else {"base": sync.wire["base"] if groups else None,
                                                   "next": sync.wire["next"], "groups": groups}
            # the receivers' states travel with the plan: every sender rank resolves its source from them alike
            assert self._group.epoch is not None
            hub.send(plan.frame(**this_process(), epoch=self._group.epoch, version=version, state={"receivers": states},
                                delta=wire))
            hub.wait_for(PlanAccept, receivers, "waiting for the receivers to accept the plan")
            hub.send(Go())
            hub.begin_data(sizes, self._group.nic)
            if sync.encoded is not None and groups is not None:
                self._group.stream_groups(groups, sync.encoded, self.bucket_bytes, stats)
            else:
                assert sync.source is not None
                self._group.stream(plan, sync.source, stats)
        t0 = time.perf_counter()
        what = f"waiting for the receivers to confirm version {version}"
        while not (hub.all_replied(RankComplete, receivers) and hub.all_replied(Sent, followers)):
            self._group.pump(what)
        stats.wait_s += time.perf_counter() - t0
        for key, frame in hub.replied(RankComplete).items():
            if frame.version != version:  # a receiver confirming another version is a protocol bug
                raise SyncError(f"{key[0]} {key[1]} confirmed version {frame.version}, not {version}")
        hub.send(Commit(version=version))
        self._deltas.commit()
        reports = [hub.replied(RankComplete)[p.key].stats for p in receivers]
        stats.peer = {"receivers": reports}
        stats.load_s = max((r.get("load_s", 0.0) for r in reports), default=0.0)

    def _setup(self, hub: Hub, peers: list[PeerInfo], followers: list[PeerInfo]) -> None:
        """Build new groups: this rank's store listens first, then the other senders' (told first), and only then
        are their addresses announced to the receivers, who join them all."""
        epoch = hub.sync  # unique and increasing: no rank can mistake an old group for the new one
        receivers = [p for p in peers if p.role == "receiver"]
        if self._host_from is None:  # the hub is bound to a wildcard address and nothing named the group's
            self.group_host = routed_host(receivers, self.group_host)
        addresses = [self._candidate_address()] + [str(f.address) for f in followers]
        setup = Setup(**this_process(), epoch=epoch, addresses=addresses, num_receivers=self.num_receivers)
        self._group.build(addresses[0], epoch, 1 + self.num_receivers)
        try:
            self._group.wait_listening(f"starting this rank's group store at {addresses[0]}")
            if followers:
                hub.send(setup, followers)
                while not hub.all_replied(Listening, followers):
                    self._group.pump(f"waiting for the other senders' group stores at {addresses[1:]} to listen")
            hub.send(setup, receivers)
            what = f"waiting for every rank to join the groups at {addresses}"
            while not (hub.all_replied(Joined, peers) and self._group.comm is not None):
                self._group.pump(what)
        except (SyncError, SyncTimeoutError) as exc:
            hint = unreachable_hint(addresses, self.group_host, self._host_from, receivers)
            raise type(exc)(f"{exc}. {hint}") from exc

    # -- sender ranks 1.. ------------------------------------------------------------------------

    def _follow(self, source: TensorSource | TrainerModel, version: int,
                onload: torch.nn.Module | Iterable[torch.Tensor] | None, stats: SyncStats) -> None:
        link = self._link
        assert link is not None
        t0 = time.perf_counter()
        group = self._group
        link.ready("sender", self.rank, self.group_epoch,
                   address=self._candidate_address())
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
        plan = CollectivePlan.from_frame(frame)
        states = receiver_states(frame)
        pairs, _ = resolve_source(source, states, None, stats)
        with onload_during(onload, self.backend.device(), stats):
            if frame.delta is not None and frame.delta.get("groups") is not None:
                self._group.walk(pairs)  # sender 0 sends every payload of a delta sync
            else:  # each tensor cast as sender 0 announced it (the receivers' engines' dtypes)
                self._group.stream(plan, EngineDtypes(states).pairs(pairs), stats)
        if group.failed is not None:
            link.next((Commit,), f"waiting for sender 0 to name the rank at fault (this rank's broadcast failed: "
                                 f"{group.failed})")
            raise SyncError(f"sender {self.rank}'s broadcast failed ({group.failed}), yet sender 0 committed "
                            f"version {version}: a protocol bug, report it")
        link.send(Sent())
        t0 = time.perf_counter()
        link.next((Commit,), f"waiting for the receivers to confirm version {version}", group.worker)
        stats.wait_s += time.perf_counter() - t0

    # -- both ------------------------------------------------------------------------------------

    def _candidate_address(self) -> str:
        return f"tcp://{self.group_host}:{self.group_port or pick_port(self.group_host)}"

    def release_buffers(self) -> None:
        """Free the bucket buffers until the next send (the group is kept), e.g. to give device memory back."""
        self._group.release_buffers()

    def close(self) -> None:
        """Tear down the group, buffers, control socket and delta threads; safe to call twice."""
        self._group.close()
        self._deltas.close()
        for control in (self._hub, self._link):
            if control is not None:
                control.close()

    def __enter__(self) -> "CrossNodeSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
