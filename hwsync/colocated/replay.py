"""Plan once, replay after: a one-copy sync whose tensors are the ones of the last is sent as one number.

From one training step to the next a trainer's tensors are the same: same names, same storage, same offsets, and
the engine's destinations are the same too. A sync sent wholly as references into the sender's shared parameter
segments (refs.py) leaves both sides a plan: the sender keeps each tensor's identity (`SentPlan`), each receiver
the host copies it made (`ReadPlan`). The next sync whose tensors all match is offered as a replay of that plan
(Offer.replay): no Refs frame is sent, and each receiver runs its recorded copies again, which read the bytes the
tensors hold now.

A plan holds only while nothing it was built from changed. The sender replays only when every tensor of the source
is the same memory, read with the same shape, strides and dtype, in the same order, its segments are all still
live, the sync is no delta and every receiver of the sync said it holds this very plan (Ready.plan) and took part
in the sync that made it. A receiver says it holds the plan only if `into` still gives the same destinations, and
drops it when a sync fails, when it maps or unmaps a segment, and whenever a sync is not a pure one-copy sync
into host tensors. Anything else is planned and sent as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

import torch

from hwsync.sync.bucket import IntoFn
from hwsync.sync.spec import TensorSpec

#: what one sent tensor was: its name, and its data pointer, shape, strides and dtype at the time (the bytes a
#: receiver reads follow from these alone while the segment holding them lives: a new tensor object, as
#: `state_dict()` makes each call, over the same memory replays too)
SentTensor = tuple[str, int, torch.Size, tuple[int, ...], torch.dtype]


@dataclass
class SentPlan:
    """The sender's side: the tensors of the last sync sent wholly by reference, and who holds it."""

    tensors: list[SentTensor]
    #: the shared segments they lie in (by name): a plan whose segment was freed never replays
    segments: frozenset[str]
    nbytes: int
    #: the manifest the sync was checked against (a replay skips the check: only under the same one)
    manifest: list[TensorSpec] | None = None
    #: the sync that made it (what receivers report in Ready.plan), and the receivers (instances) that took it
    sync: int = 0
    instances: frozenset[str] = field(default_factory=frozenset)

    def match(self, items: Iterable[tuple[str, torch.Tensor]]) -> tuple[bool, Iterator[tuple[str, torch.Tensor]]]:
        """Whether `items` are this plan's tensors as they were; and the items (those read so far first) to send
        as a fresh sync if not."""
        it = iter(items)
        seen: list[tuple[str, torch.Tensor]] = []
        for planned in self.tensors:
            item = next(it, None)
            if item is None:
                return False, iter(seen)
            seen.append(item)
            name, tensor = item
            if not same_tensor(name, tensor, planned):
                return False, chain(seen, it)
        extra = next(it, None)
        if extra is not None:
            return False, chain(seen, [extra], it)
        return True, iter(())


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # what find_shared sends by reference (a DTensor never is)


def same_tensor(name: str, tensor: torch.Tensor, planned: SentTensor) -> bool:
    """Whether (name, tensor) is what the plan sent: the same memory, read as the same layout."""
    p_name, p_ptr, p_shape, p_stride, p_dtype = planned
    # every field: `param.data = ...` keeps the object and changes its storage, shape or strides
    return (name == p_name and type(tensor) in _PLAIN and tensor.data_ptr() == p_ptr and tensor.dtype is p_dtype
            and tensor.shape == p_shape and tensor.stride() == p_stride)


def sent_tensor(name: str, tensor: torch.Tensor) -> SentTensor:
    """One tensor as a plan records it."""
    return (name, tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)


@dataclass
class ReadPlan:
    """A receiver's side: the destinations and host copies of the last sync it read wholly from shared segments."""

    #: the sender (pid) and its sync that made the plan
    sender_pid: int
    sync: int
    #: per tensor: name, dtype, shape, and the destination into() gave (its data pointer checked again each time)
    destinations: list[tuple[str, torch.dtype, tuple[int, ...], torch.Tensor, int]]
    #: the copies as (destination, source, bytes) on data pointers
    copies: list[tuple[int, int, int]]
    nbytes: int
    #: the copies as the copy threads take them (cut at the first replay)
    pieces: list[list[tuple[int, int, int]]] | None = None

    def holds(self, into: IntoFn) -> bool:
        """Whether `into` still gives every destination the plan copies into (then the plan can replay)."""
        for i, (name, dtype, shape, dest, ptr) in enumerate(self.destinations):
            now = into(name, dtype, shape)
            if now is dest:
                if dest.data_ptr() != ptr:  # the same tensor given new storage (`.data = ...`)
                    return False
                continue
            if (now is None or now.device.type != "cpu" or now.dtype != dtype or tuple(now.shape) != shape
                    or not now.is_contiguous() or now.data_ptr() != ptr):
                return False
            self.destinations[i] = (name, dtype, shape, now, ptr)
        return True
