"""The collector held back during a sync (hwsync/sync/collector.py): raised and restored, shared by concurrent
holds, the process's own thresholds kept, and no collection inside a planned sync of thousands of tensors."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from hwsync.colocated.receiver import WeightReceiver
from hwsync.colocated.sender import WeightSender
from hwsync.sync import collector
from hwsync.sync.collector import HELD_THRESHOLD, collector_held, hold_collector
from hwsync.sync.options import SenderOptions


@pytest.fixture(autouse=True)
def default_thresholds() -> Iterator[None]:
    """Each test starts from Python's default thresholds and leaves them as it found them."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)
    assert collector._holders == 0, "a hold was left behind"


def test_a_hold_raises_the_first_threshold_and_its_release_restores_them() -> None:
    with collector_held():
        assert gc.get_threshold() == (HELD_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_holds_on_two_threads_share_one_raise_undone_by_the_last_release() -> None:
    first = hold_collector()
    second: list = []
    t = threading.Thread(target=lambda: second.append(hold_collector()))
    t.start()
    t.join()
    first()
    first()  # a second release of the same hold counts for nothing
    assert gc.get_threshold()[0] == HELD_THRESHOLD, "the other thread's sync still runs"
    second[0]()
    assert gc.get_threshold() == (700, 10, 10)


def test_thresholds_the_process_sets_during_a_hold_stay() -> None:
    with collector_held():
        gc.set_threshold(5000, 20, 20)
    assert gc.get_threshold() == (5000, 20, 20)


@pytest.mark.parametrize("own", [(0, 10, 10), (HELD_THRESHOLD * 2, 10, 10)], ids=["off", "higher"])
def test_a_collector_turned_off_or_set_higher_is_left_alone(own: tuple[int, int, int]) -> None:
    gc.set_threshold(*own)
    with collector_held():
        assert gc.get_threshold() == own
    assert gc.get_threshold() == own


def test_hwsync_gc_hold_0_leaves_the_collector_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HWSYNC_GC_HOLD", "0")
    with collector_held():
        assert gc.get_threshold() == (700, 10, 10)


def test_a_child_forked_during_a_hold_gets_the_thresholds_back() -> None:
    with collector_held():
        pid = os.fork()
        if pid == 0:  # the child: no sync runs here
            os._exit(0 if gc.get_threshold() == (700, 10, 10) and collector._holders == 0 else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _sync_collections(tensors: int, fail: bool = False) -> tuple[int, list[tuple[int, ...]]]:
    """One planned same-host sync of `tensors` small tensors into this process's own (sender on a thread); the
    collections that ran between the receiver's first and last `into` call (while it takes its tensors), and the
    thresholds the first call saw."""
    source = [(f"layer.{i}.weight", torch.full((4,), float(i))) for i in range(tensors)]
    dest = {name: torch.zeros(4) for name, _ in source}
    seen: list[tuple[int, ...]] = []
    starts: list[float] = []
    calls: list[float] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(time.perf_counter())

    def into(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        calls.append(time.perf_counter())
        if not seen:
            seen.append(gc.get_threshold())
        if fail and name == source[-1][0]:
            raise RuntimeError("the engine refuses the last tensor")
        return dest[name]

    with WeightSender(options=SenderOptions(timeout_s=30)) as sender, \
            WeightReceiver(sender.endpoint, timeout_s=30) as receiver:
        errors: list[BaseException] = []

        def send() -> None:
            try:
                sender.send(source, version=1)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        gc.collect()
        gc.callbacks.append(count)
        try:
            t = threading.Thread(target=send)
            t.start()
            try:
                receiver.receive(into=into)
            except RuntimeError:
                assert fail
            t.join(30)
        finally:
            gc.callbacks.remove(count)
    assert fail or not errors, errors
    if not fail:
        assert all(torch.equal(dest[name], tensor) for name, tensor in source)
    return sum(calls[0] <= t <= calls[-1] for t in starts), seen


def test_a_planned_sync_of_thousands_of_tensors_runs_no_collection() -> None:
    collections, seen = _sync_collections(3000)
    assert seen == [(HELD_THRESHOLD, 10, 10)]
    assert collections == 0, f"{collections} collections ran inside the sync"
    assert gc.get_threshold() == (700, 10, 10)


def test_without_the_hold_the_same_sync_collects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: the same sync with the hold off collects many times."""
    monkeypatch.setenv("HWSYNC_GC_HOLD", "0")
    collections, seen = _sync_collections(3000)
    assert seen == [(700, 10, 10)]
    assert collections > 10


def test_a_failed_sync_gives_the_thresholds_back() -> None:
    _sync_collections(50, fail=True)
    assert gc.get_threshold() == (700, 10, 10)
