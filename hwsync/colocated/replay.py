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

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice, starmap
from typing import Any

import torch

from hwsync.backend.devices import identified
from hwsync.sync.bucket import IntoFn
from hwsync.sync.host_copy import Moves
from hwsync.sync.spec import TensorSpec

#: what one sent tensor was: its name, and its data pointer, shape, strides and dtype at the time (the bytes a
#: receiver reads follow from these alone while the segment holding them lives: a new tensor object, as
#: `state_dict()` makes each call, over the same memory replays too)
SentTensor = tuple[str, type, int, torch.Size, tuple[int, ...], torch.dtype]

_data_ptr, _is_contiguous = torch.Tensor.data_ptr, torch.Tensor.is_contiguous


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
    #: how the tensors' addresses were read (the backend's Device.data_ptr), and are read again to match them
    data_ptr: Callable[[torch.Tensor], int] = _data_ptr

    #: the plan's tensors by field, each a list in order (made at the first match: `match` walks them beside the
    #: items, instead of building a tuple per tensor)
    _columns: _Columns | None = field(default=None, init=False, repr=False, compare=False)

    def opens(self, items: Iterable[tuple[str, torch.Tensor]]) -> tuple[bool, Iterator[tuple[str, torch.Tensor]]]:
        """Whether the first of `items` is this plan's first tensor as it was (a look at one item, before a replay
        is proposed: a trainer whose tensors are new each step never has receivers check their destinations for
        nothing); and the items, all of them (an error reading the first is raised where they are read next)."""
        it = iter(items)
        try:
            first = next(it)
        except StopIteration:
            return False, it
        except Exception as exc:  # noqa: BLE001 - the source's own error: raised where the sync reads its items
            return False, _raising(exc)
        # the match's own comparison, over a plan of the first tensor alone (strides compared if it is strided)
        return _Columns(self.tensors[:1], self.data_ptr).same([first], 0), chain([first], it)

    def match(self, items: Iterable[tuple[str, torch.Tensor]]) -> tuple[bool, Iterator[tuple[str, torch.Tensor]]]:
        """Whether `items` are this plan's tensors as they were; and the items: all of them when they are, else
        those read so far first, then the rest, to send as a fresh sync."""
        if self._columns is None:
            self._columns = _Columns(self.tensors, self.data_ptr)
        columns, it = self._columns, iter(items)
        seen: list[tuple[str, torch.Tensor]] = []
        start, size, total = 0, 1, len(self.tensors)
        while start < total:  # in runs that grow 1, 8, 64, ...: a lazy source that differs is read one item past it
            run = list(islice(it, min(size, total - start)))
            seen += run
            if not run or not columns.same(run, start):
                return False, chain(seen, it)
            start += len(run)
            size = min(size * 8, _MOST_PER_RUN)
        extra = next(it, _END)
        if extra is not _END:  # one more (even None: the fresh sync names what is wrong with it)
            return False, chain(seen, [extra], it)
        return True, iter(seen)


def _raising(exc: Exception) -> Iterator[tuple[str, torch.Tensor]]:
    """An iterator that raises `exc` when first read."""
    raise exc
    yield  # a generator: the raise waits for the first next()


#: the most items `SentPlan.match` compares in one run (bounds the lists it makes)
_MOST_PER_RUN = 4096
_END: Any = object()  # no item left


class _Columns:
    """A plan's tensors field by field: what `SentPlan.match` compares a run of items against.

    Every field of `sent_tensor` is compared (name, type, data pointer, shape, dtype) except the strides: where every
    planned tensor was contiguous (as every tensor sent by reference or packed from its own memory is), a tensor that
    is contiguous with the same shape has the same strides wherever they matter (dimensions longer than 1), so
    `is_contiguous()` stands for them; a plan holding one that was not compares strides too.
    """

    def __init__(self, tensors: list[SentTensor], data_ptr: Callable[[torch.Tensor], int]) -> None:
        self.data_ptr = data_ptr
        self.names = [t[0] for t in tensors]
        self.types = [t[1] for t in tensors]
        self.ptrs = [t[2] for t in tensors]
        self.shapes = [t[3] for t in tensors]
        self.dtypes = [t[5] for t in tensors]
        self.strides = None if all(_contiguous(t[3], t[4]) for t in tensors) else [t[4] for t in tensors]

    def same(self, run: list[tuple[str, torch.Tensor]], start: int) -> bool:
        """Whether `run` are the plan's tensors `start`, `start` + 1, ... as they were."""
        end = start + len(run)
        data_ptr, is_contiguous, contiguous = self.data_ptr, _is_contiguous, self.strides is None
        try:
            # every field of a tensor at once, then the next: the copy before it evicted the tensors' metadata from
            # the caches, and a pass per field would fetch it again each time (measured: twice the time for 20,000)
            for (name, tensor), planned, kind, ptr, shape, dtype in zip(
                    run, self.names[start:end], self.types[start:end], self.ptrs[start:end], self.shapes[start:end],
                    self.dtypes[start:end]):
                if (name != planned or type(tensor) is not kind or data_ptr(tensor) != ptr or tensor.shape != shape
                        or tensor.dtype is not dtype or contiguous and not is_contiguous(tensor)
                        or tensor.is_conj() or tensor.is_neg()):  # the same memory read conjugated or negated
                    return False
            if self.strides is None:
                return True
            return [tensor.stride() for _, tensor in run] == self.strides[start:end]
        except (TypeError, ValueError, AttributeError, RuntimeError):
            return False  # malformed, or no memory of its own: what is wrong, the fresh sync names


def _contiguous(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether a tensor of `shape` and `stride` is contiguous (torch's rule: strides of dimensions of 1 are free)."""
    if 0 in shape:
        return True
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def sent_tensor(name: str, tensor: torch.Tensor, data_ptr: Callable[[torch.Tensor], int]) -> SentTensor | None:
    """One tensor as a plan records it (and as a replay compares it: equal only if it is the same memory, read as
    the same layout); None for a tensor of bytes with no address to know its memory by (no plan can hold it)."""
    # every field: `param.data = ...` keeps the object and changes its storage, shape or strides; the type, because
    # a subclass may read its memory otherwise (a DTensor's data_ptr is its local shard's)
    ptr = data_ptr(tensor)
    if not identified(ptr, tensor, data_ptr):
        return None
    return (name, type(tensor), ptr, tensor.shape, tensor.stride(), tensor.dtype)


@dataclass
class ReadPlan:
    """A receiver's side: the destinations and copies of the last sync it read wholly from the sender's segments
    (host memmoves from shared parameter segments, device copies from its mapped device segments)."""

    #: the sender (pid) and its sync that made the plan
    sender_pid: int
    sync: int
    #: per tensor: name, dtype, shape, and the destination into() gave and its data pointer (all checked each time)
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
    #: how the destinations' addresses were read (the backend's Device.data_ptr), and are read again to check them
    data_ptr: Callable[[torch.Tensor], int] = _data_ptr
    #: a destination had no address to check it by (`identified`): the plan is never kept
    unidentified: bool = False
    #: the destinations field by field (made at the first replay, again once one is another tensor object)
    _columns: _Destinations | None = field(default=None, init=False, repr=False, compare=False)

    def add_destination(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], given: torch.Tensor) -> None:
        """Note a destination `into` gave, with its address now (each replay checks it is still the one)."""
        ptr = self.data_ptr(given)
        if not identified(ptr, given, self.data_ptr):
            self.unidentified = True
        self.destinations.append((name, dtype, shape, given, ptr))

    def merge_launches(self) -> None:
        """One launch per device and element width for the whole sync (the frames' launches joined)."""
        merged: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for dsts, srcs in self.launches:
            into_dsts, into_srcs = merged.setdefault((dsts[0].device, dsts[0].dtype), ([], []))
            into_dsts += dsts
            into_srcs += srcs
        self.launches = list(merged.values())

    def holds(self, into: IntoFn) -> bool:
        """Whether `into` still gives every destination the plan copies into, in the plan's dtype, shape and a
        contiguous layout (then the plan can replay; else a fresh sync takes what `into` gives, or refuses it)."""
        if self._columns is None:
            self._columns = _Destinations(self.destinations)
        columns, data_ptr, is_contiguous = self._columns, self.data_ptr, _is_contiguous
        now: list[torch.Tensor | None] = []
        given: torch.Tensor | None
        # each destination checked as `into` gives it, every field at once: the tensors' metadata is fetched once
        for asked, planned, ptr, shape, dtype in zip(columns.asked, columns.tensors, columns.ptrs, columns.shapes,
                                                     columns.dtypes):
            now.append(given := into(*asked))
            if (given is not planned or data_ptr(planned) != ptr or planned.shape != shape
                    or planned.dtype is not dtype or not is_contiguous(planned)):
                break
        else:
            return True
        now += starmap(into, columns.asked[len(now):])  # into() is asked once per tensor, as in a fresh sync
        destinations = self.destinations
        for i, (name, dtype, shape, dest, ptr) in enumerate(destinations):
            given = now[i]
            if (given is None or given.device != dest.device or given.dtype != dtype or tuple(given.shape) != shape
                    or not given.is_contiguous() or data_ptr(given) != ptr):
                return False
            destinations[i] = (name, dtype, shape, given, ptr)  # another tensor over the same memory: kept from now
        self._columns = None
        return True


class _Destinations:
    """A read plan's destinations field by field: what `ReadPlan.holds` compares what `into` gives against."""

    def __init__(self, destinations: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor, int]]) -> None:
        #: what `into` is asked for each: (name, dtype, shape)
        self.asked = [(name, dtype, shape) for name, dtype, shape, _, _ in destinations]
        self.tensors = [dest for _, _, _, dest, _ in destinations]
        self.ptrs = [ptr for *_, ptr in destinations]
        self.shapes = [shape for _, _, shape, _, _ in destinations]
        self.dtypes = [dtype for _, dtype, _, _, _ in destinations]
