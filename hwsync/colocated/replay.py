"""Plan once, replay after: a sync whose tensors are the ones of the last is sent without describing them again.

From one training step to the next a trainer's tensors are the same: same names, same storage, same offsets, and
the engine's destinations are the same too. A full sync whose every tensor went by reference (into the sender's
shared parameter segments: refs.py; into its own device segments: mapped.py) or into dense buckets for `into`
receivers, read from the tensor's own memory, leaves both sides a plan: the sender keeps each tensor's identity
and each bucket's copies (`SentPlan`), each receiver its copies (host memmoves; device copies merged into one launch
per device and element width; each bucket's copies out of it) and the destinations `into` gave (`ReadPlan`).

The next sync whose tensors all match is offered as a replay of that plan (Offer.replay). Each receiver asks `into`
for the plan's destinations and answers in its Accept whether they are all the same; the sender's Replay frame says
whether every receiver could. In a replay no Refs frame is sent and buckets carry no entries: the sender refills
them with its recorded copies, each receiver runs its own, which read what the tensors hold now.

A plan holds only while nothing it was built from changed. The sender proposes a replay only when every tensor of
the source is the same memory, of the same type, read with the same shape, strides and dtype, in the same order,
its segments (host and device) are all still live, its buffers were not reopened, the sync is no delta, and every
receiver of the sync said it holds this very plan (Ready.plan) and took part in the sync that made it. A receiver
drops its plan when a sync fails, when a segment it reads is unmapped, when a destination changed, and whenever a
sync is not wholly taken `into` its destinations (a tensor for `load`, a reassembled one, staging). Anything else
is planned and sent as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

import torch

from hwsync.sync.bucket import IntoFn
from hwsync.sync.host_copy import Moves
from hwsync.sync.spec import TensorSpec

#: what one sent tensor was: its name, and its data pointer, shape, strides and dtype at the time (the bytes a
#: receiver reads follow from these alone while the segment holding them lives: a new tensor object, as
#: `state_dict()` makes each call, over the same memory replays too)
SentTensor = tuple[str, type, int, torch.Size, tuple[int, ...], torch.dtype]


@dataclass
class SentPlan:
    """The sender's side: the tensors of the last sync sent wholly by reference, and who holds it."""

    tensors: list[SentTensor]
    #: the shared segments they lie in (by name): a plan whose segment was freed never replays
    segments: frozenset[str]
    nbytes: int
    #: the trainer's device segments they lie in (mapped.py's ids): a plan one of which died never replays
    device_segments: frozenset[int] = frozenset()
    #: the sync's counts by kind ("shared", "mapped": SyncStats.notes), which a replay reports alike
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the packed buckets, in order: each one's used bytes and its copies (offset in the buffer, the tensor's flat
    #: bytes, offset in them, bytes); a replay refills the buckets with these and posts them without entries
    buckets: list[tuple[int, list[tuple[int, torch.Tensor, int, int]]]] = field(default_factory=list)
    #: each bucket's copies as host memmoves (made at the first replay; None where a tensor is on a device)
    moves: list[Moves | None] | None = None
    #: the manifest the sync was checked against (a replay skips the check: only under the same one)
    manifest: list[TensorSpec] | None = None
    #: the sync that made it (what receivers report in Ready.plan), and the receivers (instances) that took it
    sync: int = 0
    instances: frozenset[str] = field(default_factory=frozenset)

    def match(self, items: Iterable[tuple[str, torch.Tensor]]) -> tuple[bool, Iterator[tuple[str, torch.Tensor]]]:
        """Whether `items` are this plan's tensors as they were; and the items: all of them when they are, else
        those read so far first, then the rest, to send as a fresh sync."""
        it = iter(items)
        seen: list[tuple[str, torch.Tensor]] = []
        keep = seen.append
        for planned in self.tensors:  # one tuple compared per tensor: this loop is a replay's whole check
            item = next(it, None)
            if item is None:
                return False, iter(seen)
            keep(item)
            try:
                name, tensor = item
                same = sent_tensor(name, tensor) == planned
            except (TypeError, ValueError, AttributeError, RuntimeError):
                same = False  # malformed, or no memory of its own: what is wrong, the fresh sync names
            if not same:
                return False, chain(seen, it)
        extra = next(it, None)
        if extra is not None:
            return False, chain(seen, [extra], it)
        return True, iter(seen)


def sent_tensor(name: str, tensor: torch.Tensor) -> SentTensor:
    """One tensor as a plan records it (and as a replay compares it: equal only if it is the same memory, read as
    the same layout)."""
    # every field: `param.data = ...` keeps the object and changes its storage, shape or strides; the type, because
    # a subclass may read its memory otherwise (a DTensor's data_ptr is its local shard's)
    return (name, type(tensor), tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)


@dataclass
class ReadPlan:
    """A receiver's side: the destinations and copies of the last sync it read wholly from the sender's segments
    (host memmoves from shared parameter segments, device copies from its mapped device segments)."""

    #: the sender (pid) and its sync that made the plan
    sender_pid: int
    sync: int
    #: per tensor: name, dtype, shape, and the destination into() gave (its data pointer checked again each time)
    destinations: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor, int]]
    #: the copies as (destination, source, bytes) on data pointers
    copies: list[tuple[int, int, int]]
    nbytes: int
    #: the copies as the copy threads take them (cut at the first replay)
    pieces: list[Moves] | None = None
    #: device copies from the sender's mapped segments, as (destinations, sources) views: one launch each, merged
    #: per device and width when the plan is kept
    launches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)
    #: the devices those copies run on (waited for before Complete)
    devices: set[torch.device] = field(default_factory=set)
    #: the packed buckets, in order: each one's used bytes and its copies out of the buffer (destination's flat
    #: bytes, offset in them, offset in the buffer, bytes)
    buckets: list[tuple[int, list[tuple[torch.Tensor, int, int, int]]]] = field(default_factory=list)
    #: each bucket's copies as host memmoves (made at the first replay; None where a tensor is on a device)
    moves: list[Moves | None] | None = None

    def merge_launches(self) -> None:
        """One launch per device and element width for the whole sync (the frames' launches joined)."""
        merged: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for dsts, srcs in self.launches:
            into_dsts, into_srcs = merged.setdefault((dsts[0].device, dsts[0].dtype), ([], []))
            into_dsts += dsts
            into_srcs += srcs
        self.launches = list(merged.values())

    def holds(self, into: IntoFn) -> bool:
        """Whether `into` still gives every destination the plan copies into (then the plan can replay)."""
        destinations = self.destinations
        for i, (name, dtype, shape, dest, ptr) in enumerate(destinations):
            now = into(name, dtype, shape)
            if now is dest and now.data_ptr() == ptr:  # (the same tensor given new storage, `.data = ...`, is not)
                continue
            if (now is None or now is dest or now.device != dest.device or now.dtype != dtype
                    or tuple(now.shape) != shape or not now.is_contiguous() or now.data_ptr() != ptr):
                return False
            destinations[i] = (name, dtype, shape, now, ptr)
        return True
