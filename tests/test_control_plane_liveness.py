"""Failures told at once: a sender that dies between syncs, close() during a sync, calls after close(),
a receiver beyond num_receivers, a receiver whose backend lacks the sender's transport.

Each of these waited out a whole timeout (or raised a bare AssertionError) before the control
plane was rebuilt; every test here bounds the wait far below the timeouts it sets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hwsync import ClosedError, WeightReceiver, WeightSender
from hwsync.errors import ProtocolError, RemoteError
from hwsync.backend.shm import ShmTransport, leftover_segments
from hwsync.colocated import stream
from hwsync.sync.options import SenderOptions

import control_procs
import transfer_procs as procs

HERE = Path(__file__).parent
CTX = mp.get_context("spawn")
#: every wait here may take this long before it fails; the failures must come far sooner
TIMEOUT_S = 15.0


def _start(target, *args, **kwargs):
    q = CTX.Queue()
    proc = CTX.Process(target=target, args=(*args, q), kwargs=kwargs, daemon=True)
    proc.start()
    assert "up" in q.get(timeout=60)
    return proc, q


@pytest.mark.parametrize("address,syncs", [("ipc", 1), ("ipc", 0), ("tcp://127.0.0.1:0", 1)],
                         ids=["ipc, after a sync", "ipc, before any sync", "tcp, after a sync"])
def test_a_sender_killed_between_syncs_is_noticed_at_once(address, syncs):
    sender = subprocess.Popen([sys.executable, str(HERE / "control_procs.py"), address, str(syncs)],
                              stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(sender.stdout.readline())
        receiver, q = _start(control_procs.serve, info["endpoint"], timeout_s=TIMEOUT_S)
        for v in range(1, syncs + 1):
            assert q.get(timeout=60)["version"] == v
        assert sender.stdout.readline().strip() == "idle"
        time.sleep(0.5)  # the receiver now waits for the next offer
        sender.send_signal(signal.SIGKILL)
        killed = time.time()
        result = q.get(timeout=2 * TIMEOUT_S)
    finally:
        sender.kill()
        sender.wait()
    receiver.kill()
    receiver.join(10)
    assert "waiting for the sender's offer" in result["error"], result
    assert result["at"] - killed < 2.0, f"noticed {result['at'] - killed:.1f}s after the kill: {result['error']}"


def test_close_during_a_sync_aborts_every_receiver_at_once():
    sender = WeightSender(num_receivers=2, options=SenderOptions(timeout_s=TIMEOUT_S))
    receivers = [_start(control_procs.serve, sender.endpoint, timeout_s=TIMEOUT_S) for _ in range(2)]
    outcome: dict[str, BaseException] = {}

    def slow_source():
        for i in range(100):
            time.sleep(0.05)
            yield f"w{i}", torch.full((1024,), float(i))

    def run() -> None:
        try:
            sender.send(slow_source(), version=1)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["send"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1.0)  # the sync is under way
    closed = time.time()
    sender.close()
    assert time.time() - closed < 2.0, "close() ends the running sync at once"
    thread.join(10)
    assert isinstance(outcome.get("send"), ClosedError) and "closed" in str(outcome["send"])
    for proc, q in receivers:
        result = q.get(timeout=2 * TIMEOUT_S)
        assert "sender aborted the sync" in result["error"] and "closed" in result["error"], result
        assert result["at"] - closed < 2.0, f"heard {result['at'] - closed:.1f}s after close()"
        proc.kill()
        proc.join(10)
    with pytest.raises(ClosedError, match="this WeightSender is closed"):
        sender.send([("a", torch.ones(2))], version=2)


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_close_from_inside_the_source_ends_the_sync_with_closed_error(delta, monkeypatch):
    """close() called by send()'s own source, on the sending thread: the buffers stay until send() is done with
    them (no IndexError from a released buffer), send() raises ClosedError saying where close() came from, the
    receiver hears the abort, and nothing is left in /dev/shm."""
    # no periodic check while packing (as when packing is faster than its interval): close() is seen before the
    # next item, not at a later wait (in CI a sync once completed on the receiver, the abort sent after the Done)
    monkeypatch.setattr(stream, "PACKING_CHECK_S", 3600.0)
    sender = WeightSender(options=SenderOptions(timeout_s=TIMEOUT_S, bucket_bytes=1 << 16, delta=delta))
    proc, q = _start(control_procs.serve, sender.endpoint, timeout_s=TIMEOUT_S)

    def closing_source():
        for i in range(64):  # 64 tensors of 32 KiB in 64 KiB buckets
            if i == 8:
                sender.close()
            yield f"w{i}", torch.full((8192,), float(i))

    with pytest.raises(ClosedError, match="close\\(\\) called from inside the call.* while packing tensor 'w8'"):
        sender.send(closing_source(), version=1)  # seen at the next item, before any Done
    result = q.get(timeout=2 * TIMEOUT_S)
    assert "closed" in result.get("error", ""), result
    proc.kill()
    proc.join(10)
    assert not leftover_segments(os.getpid())
    with pytest.raises(ClosedError, match="this WeightSender is closed"):
        sender.send([("a", torch.ones(2))], version=2)


def test_close_while_waiting_for_receivers_ends_the_wait():
    sender = WeightSender(options=SenderOptions(timeout_s=TIMEOUT_S))
    outcome: dict[str, BaseException] = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("send", _raises(sender.send, [("a", torch.ones(2))],
                                                                                 version=1)))
    thread.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    sender.close()
    thread.join(10)
    assert time.monotonic() - t0 < 2.0
    assert isinstance(outcome["send"], ClosedError) and "waiting for receivers" in str(outcome["send"])


def _raises(fn, *args, **kwargs) -> BaseException | None:
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_every_call_after_close_says_it_is_closed():
    sender = WeightSender()
    receiver = WeightReceiver(sender.endpoint)
    sender.close()
    receiver.close()
    sender.close()  # twice is fine
    with pytest.raises(ClosedError, match="this WeightSender is closed; make a new one"):
        sender.send([("a", torch.ones(2))], version=1)
    with pytest.raises(ClosedError, match="this WeightReceiver is closed; make a new one"):
        receiver.receive(lambda pairs: None)


def test_a_receiver_closed_during_a_sync_tells_the_sender_at_once():
    sender = WeightSender(options=SenderOptions(timeout_s=TIMEOUT_S))
    receiver = WeightReceiver(sender.endpoint, timeout_s=TIMEOUT_S)
    outcome: dict[str, BaseException | None] = {}

    def slow_source():
        for i in range(100):
            time.sleep(0.05)
            yield f"w{i}", torch.full((1024,), float(i))

    threads = [threading.Thread(target=lambda: outcome.setdefault("send", _raises(sender.send, slow_source(),
                                                                                   version=1))),
               threading.Thread(target=lambda: outcome.setdefault("receive", _raises(receiver.receive,
                                                                                      lambda pairs: None)))]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    receiver.close()
    for thread in threads:
        thread.join(10)
    assert time.monotonic() - t0 < 2.0
    assert isinstance(outcome["receive"], ClosedError)
    assert isinstance(outcome["send"], RemoteError) and "WeightReceiver was closed" in str(outcome["send"])
    sender.close()


def test_a_receiver_beyond_num_receivers_is_refused_at_once():
    sender = WeightSender(num_receivers=1, options=SenderOptions(timeout_s=TIMEOUT_S))
    first, q = _start(control_procs.serve, sender.endpoint, timeout_s=TIMEOUT_S)
    sender.send(procs.versioned(1).items(), version=1)
    assert q.get(timeout=30)["version"] == 1
    extra_q = CTX.Queue()
    extra = CTX.Process(target=control_procs.receive_once, args=(sender.endpoint, extra_q, TIMEOUT_S), daemon=True)
    extra.start()
    assert "up" in extra_q.get(timeout=60)
    told: dict = {}
    sent: list[tuple[str, torch.Tensor]] = []

    def source():  # the sync runs until the extra receiver has been told (the sender reads it meanwhile)
        for i in range(400):
            if not told and not extra_q.empty():
                told.update(extra_q.get())
            if told and i > 2:
                return
            sent.append((f"w{i}", torch.full((64,), float(i))))
            yield sent[-1]
            time.sleep(0.05)

    sender.send(source(), version=2)
    result = q.get(timeout=30)
    assert result["version"] == 2 and result["digests"] == procs.digests(dict(sent))
    assert "ProtocolError" in told.get("error", ""), told
    assert "serves num_receivers=1" in told["error"] and told["after_s"] < 5.0, told
    extra.join(10)
    first.kill()
    first.join(10)
    sender.close()


class FancyShm(ShmTransport):
    """Shared memory under a name the receiver's backend does not have (as cuda_ipc is to a cpu receiver)."""

    name = "fancy_shm"


def test_a_receiver_lacking_the_senders_transport_is_refused_at_once():
    sender = WeightSender(transport=FancyShm(), options=SenderOptions(timeout_s=TIMEOUT_S))
    proc, q = _start(control_procs.receive_once, sender.endpoint, timeout_s=TIMEOUT_S)
    with pytest.raises(ProtocolError, match="lack this sender's 'fancy_shm'"):
        sender.send(procs.versioned(1).items(), version=1)
    result = q.get(timeout=30)
    assert "refused this receiver" in result["error"] and "set HWSYNC_BACKEND alike" in result["error"]
    assert result["after_s"] < 5.0
    proc.join(10)
    sender.close()
