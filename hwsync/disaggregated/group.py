"""One sender rank's group: its collective thread, its bucket buffers, and the broadcasts in flight.

The group is the sender rank (group rank 0) and every receiver (ranks 1..R), built on a
CollectiveWorker so no main thread ever blocks in a collective. While it waits (for a free
buffer, for the group to form) the main thread pumps the control plane, the hub on sender 0 or
the link elsewhere, which also hands back the worker's results: nothing here is called back.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

import torch

from hwsync.backend.communicator import open_communicator, parse_rendezvous
from hwsync.backend.interfaces import Backend, Communicator
from hwsync.control.nic import Nic, listening, nic_owning
from hwsync.delta.diff import Delta
from hwsync.delta.header import headers_to_words, pad8
from hwsync.delta.host import copy_into
from hwsync.disaggregated.hub import Hub
from hwsync.disaggregated.link import Link
from hwsync.disaggregated.plan import CollectivePlan
from hwsync.disaggregated.worker import CollectiveWorker
from hwsync.errors import ManifestError
from hwsync.sync.bucket import as_bytes
from hwsync.sync.spec import NamedTensors, TensorSpec, checked_items
from hwsync.sync.stats import SyncStats
from hwsync.timing import FAILED_JOIN_S, WORKER_JOIN_S

#: how long a rank looks for its new group's store to listen before it also pumps its control plane meanwhile (the
#: store listens within milliseconds of the build's start; a pump waits up to a control slice)
STORE_SPIN_S = 0.5

log = logging.getLogger("hwsync")


class SenderGroup:
    """A sender rank's process group over the backend's collective library, and the buffers it broadcasts from."""

    def __init__(self, rank: int, backend: Backend, control: Hub | Link, num_buffers: int, timeout_s: float) -> None:
        self.rank = rank
        self.backend = backend
        self.control = control
        self.num_buffers = num_buffers
        self.timeout_s = timeout_s
        self.comm: Communicator | None = None
        self.worker: CollectiveWorker | None = None
        #: id of the group being built or held (sender 0 names it), or None
        self.epoch: int | None = None
        #: this rank's collective failed (its message): its buffers stay busy, the hub names the culprit
        self.failed: str | None = None
        #: the interface the group binds (the one that holds its address), once known
        self.nic: Nic | None = None
        self._address = ""  # where the group being built or held rendezvous
        self._buffers: list[torch.Tensor] = []
        #: the bucket each buffer's broadcast is sending, or None when the buffer is free
        self._inflight: list[int | None] = [None] * num_buffers

    def build(self, address: str, epoch: int, world: int) -> None:
        """Start building the group on a fresh worker (group rank 0, receivers 1..R); pump() until `comm` is set."""
        self.drop()
        self.worker = CollectiveWorker(f"hwsync-send-{self.rank}", self.backend.device())
        self.epoch, self.failed = epoch, None
        self.nic = nic_owning(parse_rendezvous(address)[0])
        self.worker.submit(("build", address), self._make_group, address, world, self.nic)
        self._address = address

    def wait_listening(self, what: str) -> None:
        """Return once the group being built has its store listening, so its address may be announced.

        A receiver that connects before then is refused and retries, and torch's retry looks up the host name of
        the address (seconds, on a host whose resolver cannot be reached). Off Linux (no /proc) it cannot tell and
        returns at once; a build that fails is the control plane's to report.
        """
        port = parse_rendezvous(self._address)[1]
        spin_until = time.monotonic() + STORE_SPIN_S
        while self.comm is None and self.failed is None and listening(port) is False:
            if time.monotonic() < spin_until:
                time.sleep(0.002)
            else:
                self.pump(what)

    def _make_group(self, address: str, world: int, nic: Nic | None) -> tuple[Communicator, str]:
        return open_communicator(self.backend, address, 0, world, self.timeout_s, nic)

    def pump(self, what: str) -> None:
        """One slice of the control plane, with this rank's collective results taken."""
        for tag, value, error in self.control.pump(what, self.worker):
            if error is not None:
                self.failed = error  # its buffer stays busy: the control plane ends the sync and names the culprit
            elif tag[0] == "build":
                self.comm, note = value
                log.info("hwsync: sender %d built its group at %s (epoch %s) on %s: %s", self.rank, tag[1], self.epoch,
                         self.nic or "an interface it could not tell", note)
            elif tag[0] == "bcast":
                self._inflight[tag[2]] = None

    def _wait(self, busy: list[int], what: str) -> float:
        """Seconds spent until the buffers in `busy` are free (a follower whose group failed stops waiting)."""
        t0 = time.perf_counter()
        while any(self._inflight[j] is not None for j in busy) and not (isinstance(self.control, Link) and self.failed):
            self.pump(what)
        return time.perf_counter() - t0

    @staticmethod
    def walk(source: NamedTensors) -> None:
        """Take every tensor of the source without sending any (a delta sync: sender 0 sends every payload); a
        DTensor is still gathered, in order, as sender 0 gathers it (FSDP's full_tensor() is a collective)."""
        for item in source:
            tensor = item[1] if isinstance(item, (tuple, list)) and len(item) == 2 else None
            if hasattr(tensor, "full_tensor"):
                as_bytes(tensor)

    def stream(self, plan: CollectivePlan, source: NamedTensors, stats: SyncStats) -> None:
        """Pack this rank's buckets from the source and broadcast each as soon as it is full.

        A follower whose own group failed walks the rest of the source without sending: sender 0 may be
        inside the source's collective (FSDP's full_tensor()) waiting for this rank.
        """
        owned = plan.owned_by(self.rank)
        remaining = {k: len(plan.buckets[k].entries) for k in owned}
        order = {k: i for i, k in enumerate(owned)}
        pieces = plan.pieces()
        buffers = self._ensure_buffers(plan.bucket_bytes)
        slots: dict[int, int] = {}  # bucket -> the buffer it is packed into
        t_start, waited, broken = time.perf_counter(), 0.0, False
        for position, _name, tensor in checked_items(source, plan.manifest):
            mine = [] if broken else [(k, e) for k, e in pieces[position] if k in remaining]
            if not mine and not hasattr(tensor, "full_tensor"):
                continue
            flat = as_bytes(tensor)  # a DTensor is gathered on every rank, in order, even where another sends it
            for k, e in mine:
                if k not in slots:
                    j = order[k] % self.num_buffers
                    waited += self._wait([j], f"waiting for this rank's broadcast from buffer {j}")
                    if self._inflight[j] is not None:
                        broken = True
                        break
                    slots[k], self._inflight[j] = j, k
                j = slots[k]
                buffers[j][e.offset:e.offset + e.chunk_bytes].copy_(flat[e.chunk_offset:e.chunk_offset + e.chunk_bytes])
                remaining[k] -= 1
                if remaining[k] == 0:
                    self._launch(k, j, plan.buckets[k].nbytes)
        waited += self._wait(list(range(self.num_buffers)), "waiting for this rank's last broadcasts")
        stats.pack_s += time.perf_counter() - t_start - waited
        stats.wait_s += waited
        stats.bytes, stats.tensors, stats.buckets = plan.total_bytes, len(plan.manifest), len(plan.buckets)
        stats.bucket_bytes = plan.bucket_bytes
        stats.notes.update(sent_buckets=len(owned), sent_bytes=sum(plan.buckets[k].nbytes for k in owned),
                           num_senders=plan.num_senders)

    def stream_groups(self, groups: list[int], encoded: Iterator[tuple[TensorSpec, Delta]], bucket_bytes: int,
                      stats: SyncStats) -> None:
        """Sender 0 of a delta sync: per group, its descriptor and then its payloads (in pieces of at most
        `bucket_bytes`), each group broadcast while the next one is encoded.

        A payload is packed at an 8-byte aligned offset of its group's buffer, in target order; the receivers
        compute the same offsets from the descriptor, so nothing else goes on the wire.
        """
        device = self.backend.device().torch_device()
        buffers = self._ensure_buffers(bucket_bytes)  # kept across syncs: no fresh pages to fault in per sync
        held: list[torch.Tensor | None] = list(buffers)  # a group larger than a bucket gets a buffer of its own
        t_start, waited, sent, broken = time.perf_counter(), 0.0, 0, False
        for g, n in enumerate(groups):
            items = list(itertools.islice(encoded, n))
            if len(items) != n:
                raise ManifestError(f"the source ended after {sum(groups[:g]) + len(items)} tensors, the manifest "
                                    f"announced {sum(groups)}")
            words = headers_to_words([delta.header for _, delta in items]).to(device)
            sizes = [pad8(delta.payload.numel()) for _, delta in items]
            j = g % self.num_buffers
            waited += self._wait([j], f"waiting for this rank's broadcast from buffer {j}")
            if self._inflight[j] is not None:
                broken = True
                break  # this rank's broadcast failed: the control plane ends the sync
            buffer = held[j] if sum(sizes) <= bucket_bytes else None
            if buffer is None:
                buffer = held[j] = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            at = 0
            for (_, delta), nbytes in zip(items, sizes):
                copy_into(buffer[at:at + delta.payload.numel()], delta.payload)  # on this thread, not a team's
                at += nbytes
            pieces = [words] + [buffer[a:min(a + bucket_bytes, at)] for a in range(0, at, bucket_bytes)]
            assert self.comm is not None and self.worker is not None
            self._inflight[j] = g
            self.worker.submit(("bcast", g, j), self._broadcast_all, pieces)
            sent += at + words.numel() * words.element_size()
        if not broken and next(encoded, None) is not None:
            raise ManifestError(f"the source has more tensors than the {sum(groups)} the manifest announced")
        waited += self._wait(list(range(self.num_buffers)), "waiting for this rank's last broadcasts")
        stats.pack_s += time.perf_counter() - t_start - waited
        stats.wait_s += waited
        stats.bytes, stats.tensors, stats.buckets, stats.bucket_bytes = sent, sum(groups), len(groups), bucket_bytes
        stats.notes.update(sent_buckets=len(groups), sent_bytes=sent, num_senders=1, groups=len(groups))

    def _broadcast_all(self, pieces: list[torch.Tensor]) -> None:
        """Broadcast each piece in turn (on the collective thread)."""
        assert self.comm is not None
        for piece in pieces:
            self.comm.broadcast(piece, 0)

    def _launch(self, k: int, j: int, nbytes: int) -> None:
        if nbytes == 0:  # only empty tensors: nothing to move, and receivers post nothing either
            self._inflight[j] = None
            return
        assert self.comm is not None and self.worker is not None
        self.worker.submit(("bcast", k, j), self.comm.broadcast, self._buffers[j][:nbytes], 0)

    def _ensure_buffers(self, bucket_bytes: int) -> list[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() != bucket_bytes:
            device = self.backend.device().torch_device()
            self._buffers = [torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
                             for _ in range(self.num_buffers)]
        self._inflight = [None] * self.num_buffers
        return self._buffers

    def drop(self, failed: bool = False) -> None:
        """Tear the group down (a stuck broadcast is woken by the shutdown, or abandoned).

        After a failed sync the collective thread gets only FAILED_JOIN_S: one stuck on the failed peer
        ends at the group's timeout, and the caller must hear of the failure within its own."""
        comm, worker = self.comm, self.worker
        self.comm, self.worker, self.epoch = None, None, None
        self._inflight = [None] * self.num_buffers
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
        """Drop the group and the buffers."""
        self.drop()
        self._buffers = []
