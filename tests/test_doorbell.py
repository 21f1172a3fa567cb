"""The doorbell: per-bucket signalling through a shared segment, and the ZeroMQ frame path it replaces.

Real processes, real sockets, real shared memory. HWSYNC_DOORBELL=0 in a process's environment
turns the doorbell off for it: the sender reads it when it creates its buffers, a receiver in
every ready frame; the doorbell is used only when both sides can.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hwsync import SyncTimeoutError, WeightSender
from hwsync.sync.bucket import align_up
from hwsync.colocated.doorbell import DESCRIPTOR_BYTES, Doorbell, doorbell_supported, spin_wait
from hwsync.backend.shm import SHM_DIR, leftover_segments
from hwsync.sync.options import SenderOptions

import transfer_procs as procs
from into_procs import into_set, long_names, start_receiver

HERE = Path(__file__).parent
X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_doorbell = pytest.mark.skipif(not X86, reason="the doorbell is used on x86-64 hosts only")


def set_doorbell(monkeypatch, on: bool) -> None:
    """Turn the doorbell on or off for this process and the children it starts from now on."""
    if on:
        monkeypatch.delenv("HWSYNC_DOORBELL", raising=False)
    else:
        monkeypatch.setenv("HWSYNC_DOORBELL", "0")


def segment_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


# --- both paths, end to end -------------------------------------------------------------------

@needs_doorbell
def test_frames_on_the_socket_are_read_as_they_come_not_at_the_next_liveness_check():
    """Done (and Refs) come on the socket while the receiver watches the doorbell. With its liveness checks an hour
    apart, a receiver that took frames only when it checks (every 2-5 ms before) waits out its timeout instead."""
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        p, q = procs.start_receiver(procs.receive_with_slow_checks, sender.endpoint, syncs=3)
        try:
            for version in (1, 2, 3):
                tensors = procs.versioned(version)
                stats = sender.send(iter(tensors.items()), version=version)
                got = q.get(timeout=60)
                assert "error" not in got, got
                assert got["version"] == version and got["digests"] == procs.digests(tensors)
                assert stats.transport and got["buckets"] >= 1
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)


@pytest.mark.parametrize("sender_bell,receiver_bell", [
    pytest.param(True, True, id="doorbell", marks=needs_doorbell),
    pytest.param(False, False, id="frames"),
    pytest.param(True, False, id="receiver-says-no", marks=[needs_doorbell, pytest.mark.cpu_is_enough(
        "which side declines the doorbell is host logic; both paths run on the sim")]),
    pytest.param(False, True, id="sender-says-no", marks=pytest.mark.cpu_is_enough(
        "which side declines the doorbell is host logic; both paths run on the sim")),
])
def test_round_trip_on_both_paths_is_bit_exact(backend, monkeypatch, sender_bell, receiver_bell):
    bucket = 1 << 16
    both = sender_bell and receiver_bell
    syncs = [into_set(bucket), procs.versioned(2), into_set(bucket, seed=6)]
    specs = [{}, {}, {"set": "into2", "bucket": bucket, "into": True}]  # load, load, into
    assert any(t.numel() * t.element_size() > bucket for t in syncs[0].values())
    assert any(t.numel() == 0 for t in syncs[0].values())
    with WeightSender(options=SenderOptions(bucket_bytes=bucket, timeout_s=30)) as sender:
        set_doorbell(monkeypatch, receiver_bell)
        with start_receiver(sender.endpoint, specs) as q:
            set_doorbell(monkeypatch, sender_bell)
            total_buckets = 0
            segment = None
            for version, tensors in enumerate(syncs, 1):
                stats = sender.send(iter(tensors.items()), version=version)
                result = q.get(timeout=60)
                assert "error" not in result, result
                assert {**result["loaded"], **result["into_digests"]} == procs.digests(tensors)
                assert result["version"] == version and stats.tensors == result["stats"]["tensors"] == len(tensors)
                assert stats.buckets == result["stats"]["buckets"] > 1
                # the receiver reads buckets from a doorbell exactly when both sides can use one
                assert result["doorbell_seen"] and set(result["doorbell_seen"]) == {both}, result["doorbell_seen"]
                total_buckets += stats.buckets
                if sender_bell:
                    assert isinstance(sender._carrier._doorbell, Doorbell)
                    segment = segment or sender._carrier._doorbell.segment.name
                    assert sender._carrier._doorbell.segment.name == segment, "one doorbell serves every sync of a session"
                    assert segment in leftover_segments(os.getpid())
                else:
                    assert sender._carrier._doorbell is None
            if both:  # every bucket went through the doorbell's counters, numbered across the syncs
                assert sender._carrier._doorbell.posted == total_buckets
                assert sender._carrier._doorbell.min_released(1) == total_buckets
            elif sender_bell:
                assert sender._carrier._doorbell.posted == 0, "a receiver without the doorbell gets frames only"
    if segment is not None:
        assert not segment_exists(segment), "closing the sender unlinks its doorbell"
    assert not leftover_segments(os.getpid())


# --- a peer dies while the other spins on the doorbell ---------------------------------------

@needs_doorbell
def test_receiver_killed_while_sender_waits_on_the_doorbell(backend, monkeypatch):
    set_doorbell(monkeypatch, True)
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        slow = subprocess.Popen([sys.executable, str(HERE / "transfer_procs.py"), "slow_receiver", sender.endpoint],
                                stdout=subprocess.PIPE, text=True)
        seen: dict = {}

        def kill_when_loading() -> None:
            if slow.stdout.readline().strip() == "loading":
                time.sleep(1.0)  # the sender has been spinning (and checking on the receiver) for a while
                bell = sender._carrier._doorbell
                seen["posted"] = bell.posted if bell is not None else None
                seen["segment"] = bell.segment.name if bell is not None else None
                seen["killed_at"] = time.monotonic()
                slow.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_when_loading)
        killer.start()
        try:
            with pytest.raises(SyncTimeoutError, match=r"peer process \d+ exited waiting for receivers to release buffer"):
                sender.send(procs.versioned(1).items(), version=1)
            noticed = time.monotonic() - seen["killed_at"]
        finally:
            killer.join(30)
            if slow.poll() is None:
                slow.kill()
            slow.wait()
        assert seen["posted"] and seen["posted"] >= 1, "the receiver was loading a bucket posted on the doorbell"
        assert noticed < 5, f"the dead receiver was noticed after {noticed:.1f}s; timeout_s=30 must not end it"
        assert sender._carrier._doorbell is None and not segment_exists(seen["segment"])
        assert not leftover_segments(os.getpid()), "buffers and doorbell are unlinked after the failure"
        # a new receiver works with the same sender, on a new doorbell
        with start_receiver(sender.endpoint, [{}]) as q:
            stats = sender.send(procs.versioned(2).items(), version=2)
            result = q.get(timeout=60)
        assert result["loaded"] == procs.digests(procs.versioned(2)) and result["version"] == 2
        assert set(result["doorbell_seen"]) == {True}
        assert sender._carrier._doorbell is not None and sender._carrier._doorbell.segment.name != seen["segment"]
        assert sender._carrier._doorbell.posted == stats.buckets
    assert not leftover_segments(os.getpid())


@needs_doorbell
def test_sender_killed_while_receiver_waits_on_the_doorbell(backend, monkeypatch):
    set_doorbell(monkeypatch, True)
    # the sender posts 5 buckets of 64 KiB, then stalls in its source until killed
    sender = subprocess.Popen([sys.executable, str(HERE / "transfer_procs.py"), "sender", "v1", str(1 << 16), "5"],
                              stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(sender.stdout.readline())
        with start_receiver(info["endpoint"], [{}], timeout_s=30) as q:
            assert sender.stdout.readline().strip() == "stalling"
            time.sleep(1.0)  # the receiver has been spinning (and checking on the sender) for a while
            sender.send_signal(signal.SIGKILL)
            sender.wait()
            t0 = time.monotonic()
            result = q.get(timeout=60)
            noticed = time.monotonic() - t0
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.wait()
    # noticed either by the /proc check ("exited") or by the closed connection, whichever comes first
    assert result["error"].startswith("SyncTimeoutError:") and re.search(r"(exited|closed) while waiting for bucket 5|"
                                                                    r"exited waiting for bucket 5", result["error"]), result
    assert noticed < 5, f"the dead sender was noticed after {noticed:.1f}s; timeout_s=30 must not end it"
    assert result["load_calls"] == 5 and set(result["doorbell_seen"]) == {True}
    assert result["incomplete"] is True and "version" not in result
    deadline = time.monotonic() + 15  # the killed sender's resource tracker unlinks its segments
    while leftover_segments(info["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_segments(info["pid"]), "a killed sender's buffers and doorbell must be removed"


# --- the descriptor slot bounds a bucket's entries -------------------------------------------

@needs_doorbell
def test_many_long_names_need_several_buckets_and_too_long_a_name_is_refused(backend, monkeypatch):
    set_doorbell(monkeypatch, True)
    tensors = long_names(10_000, name_chars=200)
    assert len(tensors) == 10_000 and {len(n) for n in tensors} == {200}
    bucket = 4 << 20
    assert sum(align_up(t.numel() * t.element_size()) for t in tensors.values()) <= bucket, \
        "the bytes alone fit one bucket"
    # every name has to travel in some descriptor slot: at least this many buckets
    least = sum(len(n) for n in tensors) // DESCRIPTOR_BYTES + 1
    with WeightSender(options=SenderOptions(bucket_bytes=bucket, timeout_s=30)) as sender:
        with start_receiver(sender.endpoint, [{}, {}, {}]) as q:
            stats = sender.send(tensors.items(), version=1)
            result = q.get(timeout=60)
            assert "error" not in result, result
            assert result["loaded"] == procs.digests(tensors)
            assert stats.tensors == 10_000 and stats.buckets == result["stats"]["buckets"]
            assert stats.buckets > 1 and stats.buckets >= least, (stats.buckets, least)
            assert sender._carrier._doorbell.posted == stats.buckets

            with pytest.raises(ValueError, match="shorten the name"):
                sender.send([("short", torch.ones(2)), ("n" * 40_000, torch.ones(2))], version=2)
            assert "sender aborted the sync" in q.get(timeout=60)["error"]

            stats = sender.send(procs.versioned(3).items(), version=3)
            result = q.get(timeout=60)
            assert result["version"] == 3 and result["loaded"] == procs.digests(procs.versioned(3))
            assert stats.tensors == 8
    assert not leftover_segments(os.getpid())


def test_too_long_a_name_is_refused_wherever_it_falls(backend, monkeypatch):
    set_doorbell(monkeypatch, True)
    cases = {
        "40k first in the sync": [("n" * 40_000, torch.ones(2))],
        "40k after a full bucket": [("full", torch.ones((1 << 16) // 4)), ("n" * 40_000, torch.ones(2))],
        "70k first in the sync": [("n" * 70_000, torch.ones(2))],
    }
    outcomes = {}
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        with start_receiver(sender.endpoint, [{}] * len(cases)) as q:
            for version, (case, items) in enumerate(cases.items(), 1):
                try:
                    sender.send(items, version=version)
                    outcomes[case] = "sent"
                except ValueError as exc:
                    outcomes[case] = str(exc)
                q.get(timeout=60)
    assert all("shorten the name" in o for o in outcomes.values()), outcomes


# --- the Doorbell itself ---------------------------------------------------------------------

def test_doorbell_supported_follows_the_environment(monkeypatch):
    monkeypatch.setenv("HWSYNC_DOORBELL", "0")
    assert doorbell_supported() is False
    monkeypatch.delenv("HWSYNC_DOORBELL")
    assert doorbell_supported() is X86
    monkeypatch.setenv("HWSYNC_DOORBELL", "1")
    assert doorbell_supported() is X86


def test_doorbell_post_read_release_between_two_mappings():
    sender_side = Doorbell.create(num_receivers=2, num_slots=3)
    name = sender_side.segment.name
    try:
        assert name in leftover_segments(os.getpid())
        handle = sender_side.handle()
        assert handle == {"name": name, "bytes": sender_side.segment.size, "receivers": 2, "slots": 3}
        receiver_side = Doorbell.attach(handle)  # a second mapping of the same segment
        assert (receiver_side.num_receivers, receiver_side.num_slots) == (2, 3)
        assert receiver_side.posted == 0 and receiver_side.min_released(2) == 0

        sender_side.start_sync(2, first=5)  # sequence numbers carry on across syncs
        assert receiver_side.posted == 5 and receiver_side.released(0) == receiver_side.released(1) == 5

        frames = {seq: f"bucket {seq}".encode() * (seq + 1) for seq in range(5, 10)}
        sender_side.post(5, frames[5])
        assert receiver_side.posted == 6 and receiver_side.read(5) == frames[5]
        sender_side.post(6, frames[6])
        sender_side.post(7, frames[7])
        assert receiver_side.posted == 8
        assert [receiver_side.read(s) for s in (5, 6, 7)] == [frames[5], frames[6], frames[7]]
        sender_side.post(8, frames[8])  # 3 slots: bucket 8 takes bucket 5's slot
        assert receiver_side.read(8) == frames[8] and receiver_side.read(5) == frames[8]
        assert receiver_side.read(6) == frames[6]

        receiver_side.release(0, 6)  # rank 0 is done with buckets up to 6
        assert sender_side.released(0) == 7 and sender_side.released(1) == 5
        assert sender_side.min_released(2) == 5 and sender_side.min_released(1) == 7
        receiver_side.release(1, 7)
        assert sender_side.min_released(2) == 7
        receiver_side.release(0, 8)
        assert sender_side.min_released(2) == 8 and sender_side.released(0) == 9

        biggest = b"x" * (DESCRIPTOR_BYTES - 4)
        sender_side.post(9, biggest)
        assert receiver_side.read(9) == biggest and receiver_side.posted == 10
        with pytest.raises(ValueError, match="exceeds"):
            sender_side.post(10, biggest + b"x")
        assert receiver_side.posted == 10, "a refused post rings nothing"

        receiver_side.close()
        assert segment_exists(name), "a receiver closing its mapping never unlinks the sender's doorbell"
        assert sender_side.posted == 10
    finally:
        sender_side.close()
    assert not segment_exists(name), "closing the sender's doorbell unlinks its segment"
    sender_side.close()  # twice is fine


def test_spin_wait_returns_checks_and_times_out():
    calls = [0]
    start = time.monotonic()
    spin_wait(lambda: time.monotonic() - start > 0.05, lambda: calls.__setitem__(0, calls[0] + 1), timeout_s=5,
              what="waiting for a test", endpoint="ipc://nowhere")
    assert calls[0] >= 1, "a wait past the spinning phase checks on the peer"

    class PeerGone(Exception):
        pass

    def check():
        raise PeerGone("peer gone")

    with pytest.raises(PeerGone):
        spin_wait(lambda: False, check, timeout_s=5, what="waiting", endpoint="ipc://nowhere")
    t0 = time.monotonic()
    with pytest.raises(SyncTimeoutError, match=r"timed out after 0.2s waiting for bucket 3 \(endpoint ipc://nowhere\)"):
        spin_wait(lambda: False, lambda: None, timeout_s=0.2, what="waiting for bucket 3", endpoint="ipc://nowhere")
    assert 0.2 <= time.monotonic() - t0 < 2


class _LateBell:
    """A doorbell whose bucket is posted just after the receiver first looks (then the sender sends Done)."""

    def __init__(self, bucket: bytes) -> None:
        self.looks, self.bucket = 0, bucket

    @property
    def posted(self) -> int:
        self.looks += 1
        return 0 if self.looks == 1 else 1

    def read(self, seq: int) -> bytes:
        return self.bucket


class _DoneWaiting:
    """The receiver's control with the sender's Done already on the socket."""

    address = "ipc://nowhere"

    def __init__(self, done) -> None:
        self.queued = [done]

    def frame_waiting(self) -> bool:
        return bool(self.queued)

    def poll(self, sync: int, what: str) -> list:
        taken, self.queued = self.queued, []
        return taken


def test_a_bucket_posted_before_done_was_sent_comes_before_done():
    """The receiver read the doorbell (nothing yet), then the sender posted its last bucket and sent Done: the
    receiver takes Done off the socket, and must look at the doorbell again before handing Done on."""
    from hwsync.colocated.receiver import WeightReceiver
    from hwsync.protocol import Bucket, Done, encode
    from hwsync.sync.stats import SyncStats

    bucket = Bucket(sync=3, index=0, seq=0, buf=0, nbytes=0, entries=[])
    receiver = WeightReceiver.__new__(WeightReceiver)  # only _ring_next's parts: the control and a timeout
    receiver._control, receiver.timeout_s = _DoneWaiting(Done(sync=3, buckets=1, tensors=0, bytes=0)), 5.0
    pending: list = []
    first = receiver._ring_next(_LateBell(encode(bucket)), 0, 3, "waiting for bucket 0", pending, SyncStats())
    assert isinstance(first, Bucket) and first.seq == 0
    assert [type(f).__name__ for f in pending] == ["Done"]  # Done waits for the next call
