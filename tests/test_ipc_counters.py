"""Every IPC export taken down exactly once (the H200's exit warning: docs/cuda.md), in units.

torch reads an export's ref counter as unsigned, so one released by both its consumer and the
sender holds its block until exit. hwsync.backend.ipc_counters reads torch's counter files and releases
only while a counter is above 0; hwsync.backend.exports keeps a live receiver's failed attempt's exports
as orphans until that attempt is surely over. The whole-path tests are the sim's (its counters
are torch's rules: tests/test_ipc_exports.py, tests/test_mapped_sources.py) and the GPU's
(ci/gpu_ipc_exit.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.multiprocessing

from hwsync.colocated.mapped_reader import MappedReader
from hwsync.errors import ProtocolError
from hwsync.backend.exports import ORPHANS, ReceiverExports, SegmentExports
from hwsync.backend.ipc_counters import counter, release_if_held
from hwsync.protocol.layout import DeviceSegment

HOST = socket.gethostname()


@pytest.fixture
def slots() -> Iterator[tuple[torch.Tensor, bytes]]:
    """Eight int64 slots in a file made by torch's own RefcountedMapAllocator, as its ref-counter files are."""
    saved = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        values = torch.zeros(8, dtype=torch.int64).share_memory_()
        _manager, handle, _size = values.untyped_storage()._share_filename_cpu_()
        yield values, bytes(handle)
    finally:
        torch.multiprocessing.set_sharing_strategy(saved)


def test_a_counter_is_read_from_torchs_own_file_after_its_header(slots):
    values, handle = slots
    values[2], values[5] = 1, -1
    assert handle.startswith(b"/torch_")
    assert [counter(handle, i) for i in (0, 2, 5)] == [0, 1, -1]


def test_a_release_runs_only_while_the_counter_is_above_zero(slots):
    values, handle = slots
    values[0], values[1], values[2] = 1, 0, -1

    def release(_handle: bytes, i: int) -> None:
        values[i] -= 1  # what torch's _release_ipc_counter_cuda does to the slot

    assert [release_if_held(handle, i, release) for i in (0, 1, 2)] == [True, False, False]
    assert values[:3].tolist() == [0, 0, -1]
    assert not release_if_held(handle, 0, release)  # a second release is skipped too


def test_a_gone_file_reads_as_nothing_to_release_and_a_path_is_refused():
    ran: list[int] = []
    assert counter("/torch_0_0_0_gone", 0) is None
    assert not release_if_held(b"/torch_0_0_0_gone", 0, lambda _h, _o: ran.append(1))
    assert ran == []
    for name in ("../etc/passwd", "/dev/shm/../x", "a/b", ""):
        with pytest.raises(ValueError, match="not a torch ref-counter slot"):
            counter(name, 0)


@pytest.fixture
def live_pid() -> Iterator[int]:
    """A receiver process that stays alive until the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class _Releases:
    def __init__(self) -> None:
        self.released: list[Any] = []

    def __call__(self, record: dict[str, Any]) -> None:
        self.released.append(record["id"])


def test_a_live_receivers_failed_attempt_is_released_once_it_comes_back(live_pid):
    released = _Releases()
    exports = ReceiverExports(lambda: [{"id": "buf0"}, {"id": "buf1"}], released)
    exports.records_for("first", live_pid, HOST)
    exports.release("first")  # it failed before accepting, and may still be unmapping
    assert released.released == []
    exports.release_dead()
    assert released.released == []  # still alive
    exports.records_for("again", live_pid, HOST)  # the same process, back for a later sync: its attempt is over
    assert released.released == ["buf0", "buf1"]
    assert ORPHANS.held() == 0


def test_orphans_outlive_their_buffers_and_go_when_the_process_does(live_pid):
    released = _Releases()
    exports = ReceiverExports(lambda: [{"id": "buf0"}], released)
    exports.records_for("r", live_pid, HOST)
    exports.release("r")
    exports.forget()  # the sender closed its buffers; the receiver lives on
    assert released.released == [] and ORPHANS.held() == 1
    os.kill(live_pid, 9)
    os.waitpid(live_pid, 0)
    ReceiverExports(lambda: [], released).release_dead()  # any later check of dead receivers settles them
    assert released.released == ["buf0"] and ORPHANS.held() == 0


def test_a_dead_receivers_exports_are_released_at_once():
    released = _Releases()
    pid = _dead_pid()
    exports = ReceiverExports(lambda: [{"id": "buf0"}], released)
    exports.records_for("r", pid, HOST)
    exports.release("r")
    assert released.released == ["buf0"]
    segments = SegmentExports(released)
    segments.record_for("r", pid, HOST, 7, lambda: {"id": "seg7"})
    segments.release_unconfirmed(["r"])
    assert released.released == ["buf0", "seg7"]


def test_a_failed_syncs_segment_exports_wait_for_the_receiver_to_come_back(live_pid):
    released = _Releases()
    segments = SegmentExports(released)
    segments.record_for("r", live_pid, HOST, 1, lambda: {"id": "seg1"})
    segments.confirm()  # mapped in a completed sync: the receiver unmaps it itself
    segments.record_for("r", live_pid, HOST, 2, lambda: {"id": "seg2"})
    segments.release_unconfirmed(["r"])
    assert released.released == [] and segments.count() == 0
    segments.record_for("r2", live_pid, HOST, 1, lambda: {"id": "seg1-again"})
    assert released.released == ["seg2"]  # only the failed sync's own export


class _ShortSegments:
    """Maps every export one byte short, and tells when a mapping is freed and when an export is released."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def open(self, export: dict[str, Any], size: int) -> torch.Tensor:
        mapping = torch.zeros(size - 1, dtype=torch.uint8)
        weakref.finalize(mapping, self.events.append, ("unmapped", export["id"]))
        return mapping

    def release_export(self, export: dict[str, Any]) -> None:
        self.events.append(("released", export["id"]))


def test_a_mapping_that_fails_its_check_is_unmapped_before_the_exports_are_released():
    reader = MappedReader(device=None)  # type: ignore[arg-type]  # map() reads no device
    segments = _ShortSegments()
    reader._segments = segments  # type: ignore[assignment]
    with pytest.raises(ProtocolError, match="not the 64 bytes announced") as failed:
        reader.map([DeviceSegment(0, 64, {"id": 0}), DeviceSegment(1, 64, {"id": 1})])
    # unmapped first, so the release (which reads the counter) skips it: never released twice
    assert segments.events == [("unmapped", 0), ("released", 0), ("released", 1)]
    del failed


def test_a_receiver_that_completed_a_failed_sync_keeps_its_segment_exports(live_pid):
    """It maps every export it was sent (its Complete came before the abort): kept, as confirmed, and never released
    for it; the receiver that failed the sync has its export of that sync orphaned as above."""
    released = _Releases()
    segments = SegmentExports(released)
    segments.record_for("done", live_pid, HOST, 1, lambda: {"id": "seg1-done"})
    segments.record_for("failed", live_pid, HOST, 1, lambda: {"id": "seg1-failed"})
    segments.release_unconfirmed(["done", "failed"], completed={"done"})
    assert segments.held_by("done") == {1} and segments.held_by("failed") == set()
    assert segments.record_for("done", live_pid, HOST, 1, lambda: {"id": "again"}) is None, "not exported again"
    segments.release_unconfirmed(["done"])  # a later sync it did not complete: nothing of it was unconfirmed
    segments.record_for("failed2", live_pid, HOST, 1, lambda: {"id": "x"})  # the process comes back: orphans go
    assert released.released == ["seg1-failed"]


def test_a_receiver_killed_in_a_failed_sync_has_every_segment_export_released(live_pid):
    """Killed mid-sync, it never unmaps what it mapped in earlier syncs either: those go too, not only that sync's
    (before, they were forgotten as if it had unmapped them, and its block stayed parked until the sender exited)."""
    released = _Releases()
    segments = SegmentExports(released)
    segments.record_for("r", live_pid, HOST, 1, lambda: {"id": "seg1"})
    segments.confirm()  # mapped in a completed sync
    segments.record_for("r", live_pid, HOST, 2, lambda: {"id": "seg2"})
    os.kill(live_pid, 9)
    os.waitpid(live_pid, 0)
    segments.release_unconfirmed(["r"])
    assert sorted(released.released) == ["seg1", "seg2"] and segments.count() == 0
