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
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from hwsync.bucket import ALIGN, as_bytes
from hwsync.control import new_token
from hwsync.disaggregated.hub import Hub, Link, PeerInfo, this_process
from hwsync.disaggregated.plan import CollectivePlan, make_plan
from hwsync.disaggregated.worker import CollectiveWorker, Result
from hwsync.errors import SyncError
from hwsync.interfaces import Backend, Communicator
from hwsync.manifest import TensorSpec
from hwsync.protocol import Commit, Go, Joined, PlanAccept, PlanFrame, RankComplete, Sent, Setup
from hwsync.registry import get_backend
from hwsync.source import NamedTensors, TensorSource, checked_items, with_manifest
from hwsync.sizes import DEFAULT_BUCKET_BYTES, DEFAULT_NUM_BUFFERS, MIN_NUM_BUFFERS
from hwsync.stats import SyncStats
from hwsync.timing import DEFAULT_TIMEOUT_S, FAILED_JOIN_S, WORKER_JOIN_S

log = logging.getLogger("hwsync")


def default_host() -> str:
    """This host's address as the resolver gives it; pass group_host where that is not the right NIC."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def pick_port(host: str) -> int:
    """A TCP port free on `host` right now (the group's store binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class CrossNodeSender:
    """One trainer rank's sender; rank 0 also runs the control hub that the other ranks connect to."""

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
        num_buffers: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backend: Backend | None = None,
        secret_key: str | None = None,
    ) -> None:
        if not 0 <= rank < num_senders:
            raise ValueError(f"rank {rank} is outside num_senders={num_senders}")
        if num_receivers < 1:
            raise ValueError(f"num_receivers={num_receivers} must be at least 1")
        if num_buffers < 1:
            raise ValueError(f"num_buffers={num_buffers}: use 2 or more (1 is stop-and-wait, for comparison only)")
        self.rank = rank
        self.num_senders = num_senders
        self.num_receivers = num_receivers
        self.group_host = group_host or default_host()
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
        self._comm: Communicator | None = None
        self._worker: CollectiveWorker | None = None
        self._epoch: int | None = None
        self._buffers: list[torch.Tensor] = []
        self._inflight: list[int | None] = []
        self._failed: str | None = None

    @property
    def endpoint(self) -> str:
        """Sender 0's control endpoint (with token): pass it to every other sender and receiver."""
        if self._hub is None:
            raise ValueError("only sender rank 0 has the endpoint; the other ranks connect to it")
        return self._hub.endpoint

    @property
    def group_epoch(self) -> int | None:
        """Id of this rank's group (changes only when it is rebuilt), or None."""
        return self._epoch if self._comm is not None else None

    def send(self, named_tensors: TensorSource, *, version: int, manifest: list[TensorSpec] | None = None
             ) -> SyncStats:
        """Send one sync; returns when every receiver confirmed `version`, raises SyncError otherwise."""
        start = time.perf_counter()
        stats = SyncStats(version=version, num_buffers=self.num_buffers, transport=f"collective/{self.backend.name}")
        try:
            if self._hub is not None:
                self._lead(named_tensors, version, manifest, stats)
            else:
                self._follow(named_tensors, version, stats)
        except BaseException as exc:
            if self._hub is not None:
                self._hub.abort(f"{type(exc).__name__}: {exc}")
            elif self._link is not None:
                self._link.report(exc)
            self._drop_group(failed=True)
            raise
        stats.total_s = time.perf_counter() - start
        log.info("hwsync collective sender %d sent %s", self.rank, stats)
        return stats

    # -- sender rank 0 ---------------------------------------------------------------------------

    def _lead(self, named_tensors: TensorSource, version: int, manifest: list[TensorSpec] | None,
              stats: SyncStats) -> None:
        hub = self._hub
        assert hub is not None
        t0 = time.perf_counter()
        peers = hub.gather(self.num_senders - 1, self.num_receivers)
        stats.wait_s += time.perf_counter() - t0
        receivers = [p for p in peers if p.role == "receiver"]
        followers = [p for p in peers if p.role == "sender"]
        source = named_tensors(receivers[0].state) if callable(named_tensors) else named_tensors
        source, manifest = with_manifest(source, manifest, "sender 0 plans the buckets before the first tensor "
                                                           "is produced")
        if self._comm is None or any(p.epoch != self._epoch for p in peers):
            self._setup(hub, peers, followers)
        t0 = time.perf_counter()
        plan = make_plan(manifest, self.bucket_bytes, self.num_senders)
        stats.plan_s = time.perf_counter() - t0
        # the receivers' state travels with the plan: a callable source is called with it on every sender rank
        assert self._epoch is not None
        hub.send(plan.frame(**this_process(), epoch=self._epoch, version=version, state=receivers[0].state))
        hub.wait_for(PlanAccept, receivers, "waiting for the receivers to accept the plan")
        hub.send(Go())
        self._stream(plan, source, stats, hub.pump_until)
        t0 = time.perf_counter()
        hub.wait_for(RankComplete, receivers, f"waiting for the receivers to confirm version {version}",
                     also=lambda: all(f.key in hub.replied(Sent) for f in followers))
        stats.wait_s += time.perf_counter() - t0
        for key, frame in hub.replied(RankComplete).items():
            if frame.version != version:  # a receiver confirming another version is a protocol bug
                raise SyncError(f"{key[0]} {key[1]} confirmed version {frame.version}, not {version}")
        hub.send(Commit(version=version))
        reports = [hub.replied(RankComplete)[p.key].stats for p in receivers]
        stats.peer = {"receivers": reports}
        stats.load_s = max((r.get("load_s", 0.0) for r in reports), default=0.0)

    def _setup(self, hub: Hub, peers: list[PeerInfo], followers: list[PeerInfo]) -> None:
        """Announce one group address per sender and build this rank's group while the others join."""
        self._drop_group()
        epoch = hub.sync  # unique and increasing: no rank can mistake an old group for the new one
        addresses = [self._candidate_address()] + [str(f.address) for f in followers]
        hub.send(Setup(**this_process(), epoch=epoch, addresses=addresses, num_receivers=self.num_receivers))
        self._build(addresses[0], epoch, 1 + self.num_receivers, hub)
        hub.wait_for(Joined, peers, f"waiting for every rank to join the groups at {addresses}",
                     also=lambda: self._comm is not None)

    # -- sender ranks 1.. ------------------------------------------------------------------------

    def _follow(self, named_tensors: TensorSource, version: int, stats: SyncStats) -> None:
        link = self._link
        assert link is not None
        t0 = time.perf_counter()
        link.ready("sender", self.rank, self._epoch if self._comm is not None else None,
                   address=self._candidate_address())
        frame = link.wait((Setup, PlanFrame), "waiting for sender 0's plan")
        if isinstance(frame, Setup):
            if self.rank >= len(frame.addresses):
                raise SyncError(f"sender rank {self.rank} is outside the {len(frame.addresses)} senders sender 0 "
                                "expects; give each sender a distinct rank below num_senders")
            self._drop_group()
            self._build(frame.addresses[self.rank], frame.epoch, 1 + frame.num_receivers, link)
            link.wait((), f"joining the group at {frame.addresses[self.rank]}", done=lambda: self._comm is not None)
            link.send(Joined())
            frame = link.wait((PlanFrame,), "waiting for sender 0's plan")
        assert isinstance(frame, PlanFrame)
        if frame.epoch != self._epoch:
            raise SyncError(f"sender 0 planned for group epoch {frame.epoch} but this rank has {self._epoch}")
        link.wait((Go,), "waiting for the receivers to accept the plan")
        stats.wait_s += time.perf_counter() - t0
        plan = CollectivePlan.from_frame(frame)
        source = named_tensors(frame.state) if callable(named_tensors) else named_tensors
        # a follower whose own group failed stops waiting on it: sender 0 may be inside the source's
        # collective (FSDP's full_tensor()) waiting for this rank, so this rank walks the source on
        self._stream(plan, source, stats, lambda done, what: link.wait((), what, lambda: done() or bool(self._failed)))
        if self._failed is not None:
            link.wait((Commit,), f"waiting for sender 0 to name the rank at fault (this rank's broadcast failed: "
                                 f"{self._failed})")
            raise SyncError(f"sender {self.rank}'s broadcast failed ({self._failed}), yet sender 0 committed "
                            f"version {version}: a protocol bug, report it")
        link.send(Sent())
        t0 = time.perf_counter()
        link.wait((Commit,), f"waiting for the receivers to confirm version {version}")
        stats.wait_s += time.perf_counter() - t0

    # -- both ------------------------------------------------------------------------------------

    def _candidate_address(self) -> str:
        return f"tcp://{self.group_host}:{self.group_port or pick_port(self.group_host)}"

    def _build(self, address: str, epoch: int, world: int, control: Hub | Link) -> None:
        """Start building this rank's group on a fresh worker (group rank 0, receivers 1..R)."""
        worker = CollectiveWorker(f"hwsync-send-{self.rank}", self.backend.device())

        def build() -> Communicator:
            return self.backend.communicator(address, 0, world, self.timeout_s)

        self._worker, self._epoch, self._failed = worker, epoch, None
        control.workers = [worker]
        control.on_result = self._on_result
        worker.submit(("build",), build)

    def _on_result(self, result: Result) -> None:
        tag, value, error = result
        if error is not None:
            self._failed = error  # its slot stays busy: the control plane ends the sync and names the culprit
        elif tag[0] == "build":
            self._comm = value
        elif tag[0] == "bcast":
            self._inflight[tag[2]] = None

    def _stream(self, plan: CollectivePlan, source: NamedTensors, stats: SyncStats,
                pump: Callable[[Callable[[], bool], str], Any]) -> None:
        """Pack this rank's buckets from the source and broadcast each as soon as it is full."""
        owned = plan.owned_by(self.rank)
        remaining = {k: len(plan.buckets[k].entries) for k in owned}
        order = {k: i for i, k in enumerate(owned)}
        pieces = plan.pieces()
        buffers = self._ensure_buffers(plan.bucket_bytes)
        slots: dict[int, int] = {}
        t_start, waited, count = time.perf_counter(), 0.0, 0

        def slot(k: int) -> int | None:
            """The buffer for bucket k, or None once this rank's group failed (a follower's pump returns then)."""
            nonlocal waited
            if k not in slots:
                j = order[k] % self.num_buffers
                t0 = time.perf_counter()
                pump(lambda: self._inflight[j] is None, f"waiting for this rank's broadcast from buffer {j}")
                waited += time.perf_counter() - t0
                if self._inflight[j] is not None:
                    return None
                slots[k], self._inflight[j] = j, k
            return slots[k]

        broken = False  # this rank's group failed: walk the rest of the source without sending
        for position, _name, tensor in checked_items(source, plan.manifest):
            count += 1
            mine = [] if broken else [(k, e) for k, e in pieces[position] if k in remaining]
            if not mine and not hasattr(tensor, "full_tensor"):
                continue
            flat = as_bytes(tensor)  # a DTensor is gathered on every rank, in order, even where another sends it
            for k, e in mine:
                j = slot(k)
                if j is None:
                    broken = True
                    break
                buffers[j][e.offset : e.offset + e.chunk_bytes].copy_(flat[e.chunk_offset : e.chunk_offset + e.chunk_bytes])
                remaining[k] -= 1
                if remaining[k] == 0:
                    self._launch(k, j, plan.buckets[k].nbytes)
        t0 = time.perf_counter()
        pump(lambda: all(k is None for k in self._inflight), "waiting for this rank's last broadcasts")
        waited += time.perf_counter() - t0
        stats.pack_s += time.perf_counter() - t_start - waited
        stats.wait_s += waited
        stats.bytes, stats.tensors, stats.buckets = plan.total_bytes, len(plan.manifest), len(plan.buckets)
        stats.bucket_bytes = plan.bucket_bytes
        stats.notes.update(sent_buckets=len(owned), sent_bytes=sum(plan.buckets[k].nbytes for k in owned),
                           num_senders=plan.num_senders)

    def _launch(self, k: int, j: int, nbytes: int) -> None:
        if nbytes == 0:  # only empty tensors: nothing to move, and receivers post nothing either
            self._inflight[j] = None
            return
        comm, worker = self._comm, self._worker
        assert comm is not None and worker is not None
        view = self._buffers[j][:nbytes]
        worker.submit(("bcast", k, j), lambda: comm.broadcast(view, 0))

    def _ensure_buffers(self, bucket_bytes: int) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() != bucket_bytes:
            device = self.backend.device().torch_device()
            self._buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
                             for _ in range(self.num_buffers)]
        self._inflight = [None] * self.num_buffers
        return self._buffers

    def _drop_group(self, failed: bool = False) -> None:
        """Tear this rank's group down (a stuck broadcast is woken by the shutdown, or abandoned).

        After a failed sync the collective thread gets only FAILED_JOIN_S: one stuck on the failed peer
        ends at the group's timeout, and the caller must hear of the failure within its own."""
        comm, worker = self._comm, self._worker
        self._comm, self._worker, self._epoch = None, None, None
        self._inflight = [None] * self.num_buffers
        for control in (self._hub, self._link):
            if control is not None:
                control.workers = []
        if comm is not None:
            try:
                comm.destroy()
            except Exception as exc:  # noqa: BLE001 - a broken group may fail to shut down; it is dropped anyway
                log.debug("hwsync: destroying a failed group raised %s", exc)
        if worker is not None and not worker.stop(FAILED_JOIN_S if failed else WORKER_JOIN_S):
            log.warning("hwsync: sender %d left a collective thread stuck in a dead group; it ends at the "
                        "group's timeout", self.rank)

    def release_buffers(self) -> None:
        """Free the bucket buffers until the next send (the group is kept), e.g. to give device memory back."""
        self._buffers = []
        self._inflight = [None] * self.num_buffers
        self.backend.device().empty_cache()

    def close(self) -> None:
        """Tear down the group, buffers and control socket; safe to call twice."""
        self._drop_group()
        self._buffers = []
        for control in (self._hub, self._link):
            if control is not None:
                control.close()

    def __enter__(self) -> "CrossNodeSender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
