"""A plan knows its tensors by their addresses (Device.data_ptr): tensors that hold no storage of their own (the
simulated accelerator's, a wrapper subclass's) must not look alike to it. Without the backend's own addresses every
sim tensor answered 0, and a sync of new tensors of the same names and shapes replayed the old ones' copies: the
receiver kept the old weights and the sync said it succeeded."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from replay_address_procs import receive

from hwsync import WeightSender
from hwsync.backend.devices import identified
from hwsync.backend.registry import get_backend
from hwsync.colocated.replay import ReadPlan, sent_tensor
from hwsync.sync.options import SenderOptions
from hwsync.sync.shared_params import SharedTensors

NAMES = [f"layer.{i}.weight" for i in range(4)]


@pytest.fixture(params=["cpu", "sim"])
def backend(request, monkeypatch):
    """The CPU, or the simulated accelerator (its tensors hold no storage of their own)."""
    if request.param == "sim":
        pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")
        return request.getfixturevalue("sim")
    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")
    return get_backend()


def _tensors(base: float) -> dict[str, torch.Tensor]:
    where = get_backend().device().torch_device()
    return {name: torch.full((1024,), base + i, device=where) for i, name in enumerate(NAMES)}


def _syncs(sources: list[dict[str, torch.Tensor]], new_destinations_at: int | None = None) -> list[dict]:
    """Send each source in turn to one receiver process; what it held after each sync."""
    get_backend().device().synchronize()  # the fills have run
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with WeightSender(options=SenderOptions(timeout_s=60)) as sender:
        p = ctx.Process(target=receive, args=(sender.endpoint, NAMES, len(sources), new_destinations_at, q))
        p.start()
        try:
            out = []
            for version, source in enumerate(sources):
                stats = sender.send(list(source.items()), version=version)
                out.append({**q.get(timeout=90), "sent_replay": "replay" in stats.notes})
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def test_new_tensors_of_the_same_names_and_shapes_are_sent_afresh(backend):
    old, new = _tensors(1.0), _tensors(100.0)  # the old ones stay alive: their memory is not reused
    first, again, changed = _syncs([old, old, new])
    assert first["values"] == [1.0, 2.0, 3.0, 4.0] and not first["sent_replay"]
    assert again["sent_replay"], "the same tensors again replay the plan"
    assert changed["values"] == [100.0, 101.0, 102.0, 103.0], "the receiver kept the old tensors' weights"
    assert not changed["sent_replay"]


def test_new_destinations_of_the_same_names_and_shapes_are_planned_afresh(backend):
    old = _tensors(1.0)
    syncs = _syncs([old, old, _tensors(200.0)], new_destinations_at=2)
    assert syncs[1]["replay"]
    assert syncs[2]["values"] == [200.0, 201.0, 202.0, 203.0], "the copies went into the old destinations"
    assert not syncs[2]["replay"]


def test_shared_copies_of_distinct_device_tensors_are_not_taken_for_tied_ones(backend):
    named = list(_tensors(7.0).items())
    held = SharedTensors(named, device=get_backend().device())
    try:
        assert [float(t[0]) for t in held.tensors.values()] == [7.0, 8.0, 9.0, 10.0]
    finally:
        held.close()


class _Wrapped(torch.Tensor):
    """A wrapper subclass on the CPU, as torch's own examples make them: no storage of its own."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _Wrapped:
        wrapped = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        wrapped.inner = inner
        return wrapped

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: D105 - torch's protocol
        unwrap = lambda x: x.inner if isinstance(x, _Wrapped) else x  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def test_a_tensor_with_no_storage_of_its_own_enters_no_plan_on_either_side():
    data_ptr = torch.Tensor.data_ptr
    wrapped = _Wrapped(torch.ones(4))
    assert not identified(data_ptr(wrapped), wrapped, data_ptr)
    assert sent_tensor("w", wrapped, data_ptr) is None
    plan = ReadPlan(1, 1, [], [], 0)
    plan.add_destination("w", torch.float32, (4,), wrapped)
    assert plan.unidentified
    plain = torch.ones(4)
    assert sent_tensor("p", plain, data_ptr) is not None and identified(data_ptr(plain), plain, data_ptr)
    assert identified(0, torch.ones(0), data_ptr), "a tensor without bytes needs no address"
    assert identified(data_ptr(wrapped) + 1, wrapped, lambda t: data_ptr(t) + 1), "a backend's own addresses"
