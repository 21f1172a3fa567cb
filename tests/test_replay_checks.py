"""The checks that let a sync replay its plan (hwsync.colocated.replay), in one process: the sender's match of its
tensors against the plan, and the receiver's check of its destinations before a replay copies into them.

Both compare a column of fields at a time (issue 50: 20,000 tensors a sync); these pin that every change that must
plan afresh still does. The processes' side (a replay, then each change planning afresh, exact) is
tests/test_delta_model.py's replay sequence.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from hwsync.backend.registry import load_backend
from hwsync.colocated import refs
from hwsync.colocated.refs import SharedReader
from hwsync.colocated.replay import SentPlan, sent_tensor
from hwsync.errors import DestinationError
from hwsync.protocol import Refs
from hwsync.protocol.layout import Ref, SegmentSpec
from hwsync.sync.shared_params import SharedTensors, find_shared
from hwsync.sync.spec import dtype_name
from hwsync.sync.stats import SyncStats

Named = list[tuple[str, torch.Tensor]]


@pytest.fixture
def shared() -> SharedTensors:
    """Six tensors in shared memory, as a trainer's one-copy source holds them (a square one among them)."""
    specs = [((4, 6), torch.float32), ((8,), torch.bfloat16), ((5, 5), torch.float16), ((0, 3), torch.float32),
             ((1, 7), torch.bfloat16), ((3, 2, 4), torch.float32)]
    named = [(f"t{i}", torch.arange(torch.Size(s).numel()).to(d).view(s)) for i, (s, d) in enumerate(specs)]
    held = SharedTensors(named)
    yield held
    held.close()


def _plan(items: Named) -> SentPlan:
    return SentPlan([sent_tensor(name, t, torch.Tensor.data_ptr) for name, t in items], frozenset(), 0)


def _changed(at: int, how: Callable[[str, torch.Tensor], object]) -> Callable[[Named], list]:
    def change(items: Named) -> list:
        out: list = list(items)
        out[at] = how(*items[at])
        return out
    return change


CHANGES = {  # each a sync whose tensors are not the plan's: it must not replay
    "reshaped in place (same memory)": _changed(0, lambda n, t: (n, t.view(6, 4))),
    "another dtype over the same memory": _changed(0, lambda n, t: (n, t.view(torch.int32))),
    "transposed in place (same shape)": _changed(2, lambda n, t: (n, t.t())),
    "new memory": _changed(4, lambda n, t: (n, t.clone())),
    "another type": _changed(1, lambda n, t: (n, torch.nn.Parameter(t, requires_grad=False))),
    "renamed": _changed(4, lambda n, t: (n + "x", t)),
    "the last one changed": _changed(5, lambda n, t: (n, t.clone())),
    "a malformed item": _changed(3, lambda n, t: (n,)),
    "not a tensor": _changed(3, lambda n, t: (n, t.tolist())),
    "a negative view of the same memory": _changed(0, lambda n, t: (n, torch._neg_view(t))),
    "reordered": lambda items: [items[1], items[0], *items[2:]],
    "one fewer": lambda items: items[:-1],
    "one more": lambda items: [*items, ("extra", torch.zeros(2))],
    "one more, None": lambda items: [*items, None],
    "a None among them": lambda items: [*items[:2], None, *items[2:]],
}


def test_new_tensor_objects_over_the_same_memory_replay(shared):
    plan = _plan(list(shared.items()))
    again = [(name, t.view(t.shape)) for name, t in shared.items()]  # as state_dict() makes new objects each call
    same, items = plan.match(iter(again))
    assert same and [id(t) for _, t in items] == [id(t) for _, t in again]


@pytest.mark.parametrize("change", list(CHANGES))
def test_every_change_of_a_tensor_plans_afresh_and_keeps_every_item(shared, change):
    plan = _plan(list(shared.items()))
    items = CHANGES[change](list(shared.items()))
    same, rest = plan.match(iter(items))
    assert not same
    assert [id(item) for item in rest] == [id(item) for item in items]  # all of them, in order, once


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_look_at_the_first_tensor_never_refuses_what_the_match_takes_and_keeps_every_item(shared, change):
    # opens() decides whether receivers are asked to check their destinations for a replay: it may let through what
    # the whole match then refuses, never the reverse (a replay lost), and the sync gets every item, in order
    plan = _plan(list(shared.items()))
    items = CHANGES[change](list(shared.items()))
    opens, rest = plan.opens(iter(items))
    rest = list(rest)
    assert [id(item) for item in rest] == [id(item) for item in items]
    assert opens == (change not in {"reshaped in place (same memory)", "another dtype over the same memory",
                                    "a negative view of the same memory", "reordered"}), change  # of the first
    same, _ = plan.match(iter(items))
    assert opens or not same


def test_the_look_at_the_first_tensor_opens_the_plans_own_tensors_and_a_strided_one():
    base = torch.zeros(4, 6)
    plan = _plan([("a", base.t()), ("b", base)])
    assert plan.opens([("a", base.t()), ("b", base)])[0]
    assert not plan.opens([("a", base.view(6, 4)), ("b", base)])[0]  # same memory and shape, other strides
    row = torch.zeros(1, 6)
    plan = _plan([("r", row)])
    assert plan.opens([("r", row.as_strided((1, 6), (99, 1)))])[0]  # a contiguous tensor: a 1-long dim's stride is free
    assert plan.match([("r", row.as_strided((1, 6), (99, 1)))])[0]


def test_the_look_at_the_first_tensor_reads_one_item_and_a_sources_error_waits_for_the_sync():
    t = torch.zeros(4)
    plan = _plan([("a", t), ("b", t)])
    taken = []

    def lazy():
        for name in ("x", "b"):
            taken.append(name)
            yield name, t

    opens, rest = plan.opens(lazy())
    assert not opens and taken == ["x"]
    assert [name for name, _ in rest] == ["x", "b"]

    def broken():
        raise KeyError("the trainer's own error")
        yield

    opens, rest = plan.opens(broken())
    assert not opens
    with pytest.raises(KeyError, match="the trainer's own error"):  # where the sync reads its source, as before
        next(rest)
    opens, rest = plan.opens(iter([]))
    assert not opens and not list(rest)


def test_a_conjugate_view_of_the_planned_memory_plans_afresh():
    z, w = torch.zeros(4, dtype=torch.complex64), torch.zeros(2)
    plan = _plan([("z", z), ("w", w)])
    assert plan.match(iter([("z", z.view(4)), ("w", w)]))[0]  # another object over the same memory: a replay
    assert not plan.opens([("z", z.conj()), ("w", w)])[0]  # the same memory, read conjugated: never
    assert not plan.match(iter([("z", z.conj()), ("w", w)]))[0]


def test_a_lazy_conjugate_or_negative_destination_is_refused():
    from hwsync.sync.bucket import matching_destination

    for view in (torch.zeros(3, dtype=torch.complex64).conj(), torch._neg_view(torch.zeros(3))):
        with pytest.raises(DestinationError, match="lazy .* view; return the tensor it views"):
            matching_destination("w", view.dtype, (3,), view)


def test_a_plan_of_a_strided_tensor_compares_strides():
    base = torch.zeros(4, 6)
    plan = _plan([("a", base.t()), ("b", base)])  # (6, 4) over strides (1, 6): not contiguous
    assert plan.match([("a", base.t()), ("b", base)])[0]
    assert not plan.match([("a", base.view(6, 4)), ("b", base)])[0]  # same memory and shape, other strides


def test_a_lazy_source_that_differs_is_read_only_one_item_in():
    t = torch.zeros(4)
    plan = _plan([(f"t{i}", t) for i in range(100)])
    taken = []

    def lazy():  # a cast source: a copy made per item, one at a time
        for i in range(100):
            taken.append(i)
            yield f"t{i}", t.clone()

    same, rest = plan.match(lazy())
    assert not same and taken == [0]
    assert len(list(rest)) == 100


# -- the receiver's side -----------------------------------------------------------------------------------
def _reader_with_plan(shared: SharedTensors, dest: dict[str, torch.Tensor]) -> SharedReader:
    """A receiver that read one sync of `shared` by reference into `dest` and kept its plan."""
    device = load_backend("cpu").device()
    reader = SharedReader(device)
    segments: list[SegmentSpec] = []
    entries = []
    for name, t in shared.items():
        found = find_shared(t)
        if found is None:  # an empty tensor goes packed
            continue
        segment, offset = found
        if segment not in segments:
            segments.append(segment)
        entries.append(Ref(name, dtype_name(t.dtype), tuple(t.shape), segments.index(segment), offset,
                           t.numel() * t.element_size()))
    reader.record(os.getpid(), 1)
    reader.receive(Refs(sync=1, segments=segments, refs=entries), os.getpid(), None,
                   lambda name, dtype, shape: dest[name], SyncStats())
    reader.finish(False)
    reader.keep_plan()
    assert reader.plan is not None and len(reader.plan.destinations) == len(entries)
    return reader


@pytest.fixture(params=["one piece", "pieces on the copy threads"])
def pieces(request, monkeypatch) -> str:
    if request.param != "one piece":  # cut the plan's copies into pieces of 32 bytes: tensors split across them
        monkeypatch.setattr(refs, "_PARALLEL_BYTES", 0)
        monkeypatch.setattr(refs, "COPY_CHUNK_BYTES", 32)
    return request.param


def _destinations(shared: SharedTensors) -> dict[str, torch.Tensor]:
    return {name: torch.full(t.shape, -1, dtype=t.dtype) for name, t in shared.items()}


def test_a_replay_copies_what_the_sender_holds_now(shared, pieces):
    dest = _destinations(shared)
    reader = _reader_with_plan(shared, dest)
    into = lambda name, dtype, shape: dest[name]  # noqa: E731
    for step in range(2):
        for t in shared.tensors.values():
            t.add_(step + 1)  # training, in place
        for d in dest.values():
            d.fill_(-1)
        assert reader.plan is not None and reader.plan.holds(into)
        reader.replay(SyncStats())
        reader.finish(False)
        for name, t in shared.items():
            assert torch.equal(dest[name], t), name
    reader.close()


@pytest.mark.parametrize("change", ["reshaped", "another dtype", "transposed"])
def test_a_destination_changed_in_place_plans_afresh(shared, change):
    """`.data = ...` keeps the engine's tensor object and its address and changes its layout: the plan does not
    hold (a fresh sync then refuses that destination by name, DestinationError), and no byte lands in it."""
    dest = _destinations(shared)
    reader = _reader_with_plan(shared, dest)
    into = lambda name, dtype, shape: dest[name]  # noqa: E731
    assert reader.plan is not None and reader.plan.holds(into)
    target = {"reshaped": "t5", "another dtype": "t0", "transposed": "t2"}[change]
    tensor, address = dest[target], dest[target].data_ptr()
    tensor.data = {"reshaped": lambda d: d.view(2, 3, 4), "another dtype": lambda d: d.view(torch.int32),
                   "transposed": lambda d: d.t()}[change](tensor.data)
    assert tensor.data_ptr() == address
    assert not reader.plan.holds(into)
    with pytest.raises(DestinationError, match=f"into\\('{target}'\\)"):  # what the fresh sync says of it
        _reader_with_plan(shared, dest)
    reader.close()
