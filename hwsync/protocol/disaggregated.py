"""Frames of the cross-node path (hwsync.disaggregated): every rank talks to sender 0's hub.

    rank (sender s > 0, or receiver r)      hub (sender 0)
    RankReady {token, role, rank, epoch,
               attempt}                  ->
                                         <-  Welcome {pid, host}  (at once; or Refused {reason}: not served)
                                         <-  Waiting {attempt, missing}  (while it gathers the other ranks)
                                         <-  Start {attempt, sync}  (this ready is in sync `sync`)
                                         <-  Setup {epoch, addresses}     (only when groups are (re)built:
    Listening (sender ranks)             ->   to the sender ranks first, to the receivers once every
                                              sender's store listens)
    Joined                               ->
                                         <-  PlanFrame {manifest, buckets, owners}
    PlanAccept (receivers)               ->
                                         <-  Go
    Progress {k} / Sent                  ->  (buckets move over the collective library meanwhile)
    RankComplete {version, stats}        ->
                                         <-  Commit {version}
    Ping {n} <-> Pong {n}, Alive: who is still there. Welcome, Refused, Error and Abort are the
    same-host path's frames.

Sync ids are the hub's alone. A rank numbers its readies (`attempt`, one count per connection) and
waits for the Start that answers its latest one; from then on it takes only frames of that Start's
sync. A Start that answers an earlier ready (one the rank gave up on) is dropped, and the rank's
newer ready reaches the hub behind it, which then starts the rank again in the sync it is in, or
ends that sync and keeps the ready for the next. So a timeout on either side, in any order, never
leaves the two counting different syncs.
"""

from __future__ import annotations

from hwsync.protocol.delta import DeltaField, check_plan_delta
from hwsync.protocol.fields import BadFrame, Count, Frame, Map, frame
from hwsync.protocol.layout import BucketSpec
from hwsync.sync.report import ReceiverReport
from hwsync.sync.spec import TensorSpec


@frame("ready")
class RankReady(Frame):
    """A sender rank > 0 or a receiver is ready; `epoch` names the groups it still holds."""

    token: str
    proto: int
    backend: str
    role: str
    rank: Count
    epoch: Count | None
    pid: Count
    host: str
    address: str | None
    #: a receiver's report (hwsync.sync.report); a sender rank's is empty
    report: ReceiverReport
    #: this connection's count of readies (1, 2, ...): the hub's Start names the one it took
    attempt: Count


@frame("start")
class Start(Frame):
    """The hub took this rank's ready `attempt` into sync `sync`: the frames of that sync carry that id."""

    attempt: Count
    sync: Count


@frame("waiting")
class Waiting(Frame):
    """The hub holds this rank's ready `attempt` and still waits for the ranks `missing` names (a keep-alive)."""

    attempt: Count
    missing: str


@frame("listening")
class Listening(Frame):
    """This sender rank's group store listens: the hub may announce its address to the receivers."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("joined")
class Joined(Frame):
    """This rank has built its groups."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("accept")
class PlanAccept(Frame):
    """A receiver checked the plan's manifest."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("progress")
class Progress(Frame):
    """A receiver loaded bucket `k`."""

    k: Count
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("sent")
class Sent(Frame):
    """A sender rank > 0 broadcast all its buckets."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("complete")
class RankComplete(Frame):
    """A receiver loaded `version` completely; `stats` are its own figures."""

    version: int
    stats: Map
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("pong")
class Pong(Frame):
    """The answer to ping `n`."""

    n: Count
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("setup")
class Setup(Frame):
    """Build new groups: sender s's group rendezvous at `addresses[s]`, with `num_receivers` receivers."""

    pid: Count
    host: str
    epoch: Count
    addresses: list[str]
    num_receivers: Count
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("plan")
class PlanFrame(Frame):
    """The sync's plan: which bytes go in which bucket and which sender broadcasts it."""

    pid: Count
    host: str
    epoch: Count
    version: int
    bucket_bytes: Count
    num_senders: Count
    manifest: list[TensorSpec]
    buckets: list[BucketSpec]
    #: the receivers' reports, in rank order: every sender rank resolves its source from them as sender 0 did
    receivers: list[ReceiverReport]
    #: a sender in delta mode (hwsync.protocol.delta): a delta sync has groups of the manifest's tensors instead of
    #: buckets, streamed by sender 0
    delta: DeltaField | None = None
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0

    def validate(self) -> None:
        """Owners are sender ranks, buckets fit the bucket size, the delta field is whole."""
        for bucket in self.buckets:
            if bucket.owner >= self.num_senders or bucket.nbytes > self.bucket_bytes:
                raise BadFrame(f"planned bucket of owner {bucket.owner} and {bucket.nbytes} bytes does not fit "
                               f"{self.num_senders} senders of {self.bucket_bytes}-byte buckets")
        if self.delta is not None:
            check_plan_delta(self.delta, list(self.manifest), len(self.buckets))


@frame("go")
class Go(Frame):
    """Every receiver accepted the plan: start broadcasting."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("commit")
class Commit(Frame):
    """Every receiver confirmed `version`."""

    version: int
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("ping")
class Ping(Frame):
    """Answer with Pong(n): the hub is finding out who is still alive."""

    n: Count
    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0


@frame("alive")
class Alive(Frame):
    """The hub is alive (sent while a sync is quiet)."""

    #: the hub's sync id (Hub.send and Link.send fill it in)
    sync: Count = 0
