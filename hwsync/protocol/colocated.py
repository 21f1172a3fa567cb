"""Frames of the same-host path (hwsync.colocated), and the Welcome, Refused, Error and Abort frames both paths share.

    receiver                              sender
    Ready {token, proto, report, ...}  ->
                                      <-  Welcome {pid, host}  (at once; or Refused {reason}: not served)
                                      <-  Offer {geometry, handles, manifest, first, doorbell, rank}
    Accept (or Error: refused)        ->
                                      <-  Bucket {seq, buf, nbytes, entries}  (a frame, or a doorbell descriptor)
    Release {buf, seq}                ->  (the sender refills buf only after every receiver released it)
                                      <-  Refs {segments, refs, device_segments, device_refs}  (tensors read in
                                          place from shared parameter segments or the trainer's device memory,
                                          interleaved with the buckets; no release: they are the trainer's own
                                          memory, left alone until the sync's Complete)
                                      <-  Done {buckets, tensors, bytes}
    Complete {stats}                  ->  (a receiver that stages: staged and checked, nothing applied yet)
                                      <-  Apply  (receivers that stage, once every receiver sent Complete)
    Applied {stats}                   ->  (the engine holds the version)

  A sync that fails ends early: Error from a receiver, Abort from the sender to every receiver, and each
  receiver that had not sent Complete, Applied or Error answers the Abort with Stopped once its reads of the
  sender's memory ended. The sender's send() raises only after that (or the receiver's exit, or its timeout):
  its trainer may then step on memory no receiver reads.
"""

from __future__ import annotations

from dataclasses import field

from hwsync.protocol.delta import DeltaField, check_delta
from hwsync.protocol.fields import BadFrame, Count, Frame, Map, frame
from hwsync.protocol.layout import (
    DeviceRef,
    DeviceSegment,
    Entry,
    Ref,
    SegmentSpec,
    check_doorbell_handle,
    check_shm_handles,
    device_refs_within,
    entries_within,
    refs_within,
)
from hwsync.sync.report import ReceiverReport
from hwsync.sync.spec import TensorSpec


@frame("ready")
class Ready(Frame):
    """A receiver is ready for the next sync; `report` is what the sender plans from (hwsync.sync.report)."""

    token: str
    proto: int
    pid: Count
    host: str
    report: ReceiverReport
    doorbell: bool
    into: bool
    #: the receiver's backend and the transports it can open: the sender refuses one that lacks its own
    backend: str
    transports: list[str]
    #: a random id of the WeightReceiver, the same on each connection it makes (it reconnects after a failure)
    instance: str
    #: the receiver stages: its Complete means staged and checked, and it applies only on the sender's Apply
    stage: bool = False
    #: the sync whose plan this receiver holds (hwsync.colocated.replay; whether `into` still gives its destinations
    #: is checked once a replay is offered); 0: none
    plan: Count = 0


@frame("welcome")
class Welcome(Frame):
    """The sender took a receiver's Ready (sent at once): the receiver can watch this process from now on."""

    pid: Count
    host: str


@frame("refused")
class Refused(Frame):
    """The sender will not serve this receiver (beyond num_receivers, another protocol, a missing transport).

    Its shape never changes between protocol versions, so a receiver of any version can read why.
    """

    reason: str


@frame("gone")
class Gone(Frame):
    """A receiver that said Ready gave up before an offer came: skip it."""


@frame("accept")
class Accept(Frame):
    """The receiver checked the offer (protocol, transport, manifest) and mapped the buffers."""

    sync: Count
    #: to an offer of a replay: the receiver holds that plan and `into` still gives each of its destinations
    replay: bool = False


@frame("replay")
class Replay(Frame):
    """To an offer of a replay, once every receiver accepted: `go`, the sync is the plan's replay (every receiver
    said it can run it); else one could not, and the sync is sent as any other (a new plan)."""

    sync: Count
    go: bool


@frame("release")
class Release(Frame):
    """The receiver is done with bucket `seq` in buffer `buf` (and every bucket before it)."""

    sync: Count
    buf: Count
    seq: Count


@frame("complete")
class Complete(Frame):
    """The receiver loaded the whole sync; `stats` are its own figures."""

    sync: Count
    stats: Map


@frame("stopped")
class Stopped(Frame):
    """The receiver heard the sync's Abort and reads none of the sender's memory any more (its queued copies
    ended): the sender's send() may raise, and its trainer step, only once every receiver said this (or exited)."""

    sync: Count


@frame("apply")
class Apply(Frame):
    """Every receiver of the sync staged it: apply it now (to receivers that stage)."""

    sync: Count


@frame("applied")
class Applied(Frame):
    """The receiver applied the staged sync: its engine holds the version; `stats` are its figures."""

    sync: Count
    stats: Map


@frame("error")
class Error(Frame):
    """A side failed; `kind` is "protocol", "load", "collective" or "local"; `message` says why."""

    sync: Count | None
    kind: str
    message: str


@frame("offer")
class Offer(Frame):
    """One sync's geometry, buffers and announced tensors, for receiver `rank`."""

    sync: Count
    proto: int
    backend: str
    transport: str
    handles: Map
    bucket_bytes: Count
    num_buffers: Count
    version: int
    pid: Count
    host: str
    manifest: list[TensorSpec] | None
    tensors: Count | None
    total_bytes: Count | None
    first: Count
    doorbell: Map | None
    rank: Count
    #: the sender's shared parameter segments now: a receiver unmaps any other it had mapped from this sender
    segments: list[SegmentSpec]
    #: a sender in delta mode: the baseline this sync applies on and makes, and each tensor's delta header
    #: (hwsync.protocol.delta); the manifest then names the tensors as receivers hold them, the buckets
    #: carry their payloads
    delta: DeltaField | None
    #: ids of the device segments the sender still shares and knows this receiver maps (hwsync.colocated.mapped):
    #: the receiver unmaps the others (those of a failed sync too, which the sender released)
    device_segments: list[Count] = field(default_factory=list)
    #: this sync's tensors are those of the plan made by sync `replay`, which every receiver said it holds; each
    #: says in its Accept whether it can run it, and the Replay frame says whether the sync is one (then no Refs
    #: frame follows and buckets carry no entries: hwsync.colocated.replay); 0: none
    replay: Count = 0

    def validate(self) -> None:
        """Every segment the offer names is the sender's own (`pid`), by a name that can only be one in /dev/shm.

        The core shm transport's handles (kind "shm"), the doorbell and the shared parameter segments
        are checked here; other transports' handles are their own (CUDA / NPU IPC handles name no file).
        """
        for spec in self.segments:
            if spec.pid != self.pid:
                raise BadFrame(f"the sender (pid {self.pid}) names shared segment {spec.name} of process {spec.pid}; "
                               "a sender only ever names segments it created")
        if self.handles.get("kind") == "shm":
            names, size = check_shm_handles(self.handles, self.pid)
            if len(names) != self.num_buffers or size < self.bucket_bytes:
                raise BadFrame(f"the offer's {self.num_buffers} buffers of {self.bucket_bytes} bytes do not match its "
                               f"{len(names)} shm segments of {size} bytes")
        if self.doorbell is not None:
            check_doorbell_handle(self.doorbell, self.pid, self.rank)
        if self.delta is not None:
            check_delta(self.delta, self.manifest)


@frame("bucket")
class Bucket(Frame):
    """Bucket `seq` (the `index`-th of this sync) is in buffer `buf`: `nbytes` used, laid out as `entries`."""

    sync: Count
    index: Count
    seq: Count
    buf: Count
    nbytes: Count
    entries: list[Entry]

    def validate(self) -> None:
        """Every entry lies inside the bucket's used bytes."""
        entries_within(self.entries, self.nbytes)


@frame("refs")
class Refs(Frame):
    """Whole tensors of this sync that lie in the sender's shared parameter segments (host memory) or in its own
    device allocator segments: read them in place.

    The sender's trainer leaves that memory alone until every receiver's Complete, so a receiver
    may copy from it (or hand out views of it) until it sends Complete, and not after.
    `device_segments` are exported to this receiver alone (each receiver gets its own frame when
    they differ): it maps each once and keeps it until an offer no longer lists its id.
    """

    sync: Count
    segments: list[SegmentSpec]
    refs: list[Ref]
    #: exported to this receiver alone, and tensors read in place from the sender's device memory
    device_segments: list[DeviceSegment] = field(default_factory=list)
    device_refs: list[DeviceRef] = field(default_factory=list)

    def validate(self) -> None:
        """Every reference lies inside a segment of this frame (device ones: or one exported before), and every
        host segment is one process's."""
        refs_within(self.refs, self.segments)
        device_refs_within(self.device_refs, self.device_segments)
        if len({s.pid for s in self.segments}) > 1:
            raise BadFrame(f"a Refs frame names segments of several processes: {[s.name for s in self.segments]}")


@frame("done")
class Done(Frame):
    """The sender posted every bucket of the sync."""

    sync: Count
    buckets: Count
    tensors: Count
    bytes: Count


@frame("abort")
class Abort(Frame):
    """The sync failed on the sending side (or the hub); `message` says why."""

    sync: Count | None
    message: str


# across nodes: ranks -> hub (sender 0)
