"""Host copies on unbound threads (hwsync.sync.host_threads): every byte lands where a plain copy puts it, and the
copy threads run on every CPU even when the thread that made them was bound to one (as vLLM's CPU worker is).

The copies are cut and spread over threads by bytes, so any batch (contiguous or strided, cut into pieces or not,
small or past the threshold) must leave the destinations equal to `dest.copy_(src)` each, and the sources unchanged:
random batches, with the threshold and the piece size made small so that the cutting runs on small tensors.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hwsync.sync import host_threads
from hwsync.sync.host_threads import copy_host_tensors, copy_pool, host_cores_free

DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float64)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pairs of mixed dtypes: contiguous ones, transposed destinations, and strided views of a larger tensor."""
    dests, srcs = [], []
    for _ in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        rows, cols = draw(st.integers(1, 40)), draw(st.integers(1, 40))
        src = (torch.randn(rows, cols) * 100).to(dtype)
        kind = draw(st.sampled_from(("contiguous", "transposed", "strided")))
        if kind == "transposed":
            dest = torch.zeros(cols, rows, dtype=dtype).t()
        elif kind == "strided":
            dest = torch.zeros(rows, cols * 2, dtype=dtype)[:, ::2]
        else:
            dest = torch.zeros(rows, cols, dtype=dtype)
        dests.append(dest)
        srcs.append(src)
    return dests, srcs


@settings(max_examples=60, deadline=None)
@given(batch=batches(), threshold=st.sampled_from((1, 256, 1 << 30)), piece=st.sampled_from((1, 64, 1000, 1 << 24)))
def test_every_copy_lands_as_a_plain_copy_whatever_the_cut(batch, threshold, piece):
    dests, srcs = batch
    originals = [s.clone() for s in srcs]
    with pytest.MonkeyPatch.context() as m, host_cores_free():
        m.setattr(host_threads, "PARALLEL_FROM_BYTES", threshold)
        m.setattr(host_threads, "PIECE_BYTES", piece)
        copy_host_tensors(dests, srcs)
    for dest, src, original in zip(dests, srcs, originals):
        assert torch.equal(dest, original)
        assert torch.equal(src, original)


def test_a_failed_copy_is_raised_after_every_other_copy_ran(monkeypatch):
    monkeypatch.setattr(host_threads, "PARALLEL_FROM_BYTES", 1)
    dests = [torch.zeros(1000), torch.zeros(3), torch.zeros(1000)]
    srcs = [torch.ones(1000), torch.ones(4), torch.ones(1000)]  # the middle pair cannot be copied
    with pytest.raises(RuntimeError), host_cores_free():
        copy_host_tensors(dests, srcs)
    assert torch.equal(dests[0], srcs[0]) and torch.equal(dests[2], srcs[2])


def test_copies_stay_on_the_calling_thread_unless_the_cores_are_free(monkeypatch):
    """A streamed packed sync's sender packs on the other core meanwhile: its receiver's copies must not take it."""
    monkeypatch.setattr(host_threads, "PARALLEL_FROM_BYTES", 1)
    used: list[str] = []
    real = host_threads._shared_pool
    monkeypatch.setattr(host_threads, "_shared_pool", lambda: used.append("pool") or real())
    dests, srcs = [torch.zeros(1000), torch.zeros(1000)], [torch.ones(1000), torch.ones(1000)]
    copy_host_tensors(dests, srcs)
    assert used == [] and all(torch.equal(d, s) for d, s in zip(dests, srcs))
    with host_cores_free():
        copy_host_tensors([torch.zeros(1000), torch.zeros(1000)], srcs)
    assert used == ["pool"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs a Linux host with two CPUs or more to bind a thread to one of them")
def test_copy_threads_made_by_a_thread_bound_to_one_cpu_run_on_every_cpu():
    allowed = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def bound_creator() -> None:
        os.sched_setaffinity(0, {min(allowed)})  # as vLLM binds its CPU worker's thread
        seen["creator"] = os.sched_getaffinity(0)
        pool = copy_pool(1, "hwsync-test-copy")
        try:
            seen["copy thread"] = pool.submit(os.sched_getaffinity, 0).result()
        finally:
            pool.shutdown()

    thread = threading.Thread(target=bound_creator)
    thread.start()
    thread.join()
    assert seen["creator"] == {min(allowed)}
    assert seen["copy thread"] == allowed
