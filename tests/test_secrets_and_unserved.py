"""The endpoint's secrets never reach an error, a log line or a repr; receivers the sender cannot serve,
or that die before a sync starts, end the wait at once for everyone.

- every way a sender's send() fails while it waits (for receivers, their accept, their releases, a
  receiver that exited) names the bound address, never the token or the CURVE key, on ipc:// and tcp://;
- a receiver that said it was ready and was killed before the sync started is named at once;
- a process that connected and died without presenting the token is named when the wait ends;
- a receiver of another protocol version makes send() raise, and a receiver already waiting for that
  sync hears at once that it will not run; the next sync is exact at its first attempt.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from hwsync import SyncTimeoutError, WeightReceiver, WeightSender
from hwsync.control.endpoints import Endpoint
from hwsync.errors import HwsyncError, ProtocolError
from hwsync.sync.options import SenderOptions

import control_procs
import transfer_procs as procs

CTX = mp.get_context("spawn")
TIMEOUT_S = 15.0
ADDRESSES = {"ipc": None, "tcp": "tcp://127.0.0.1:0"}


def _secrets(sender: WeightSender) -> list[str]:
    endpoint = Endpoint.parse(sender.endpoint)
    return [endpoint.token] + ([endpoint.server_key] if endpoint.server_key else [])


def _assert_no_secret(texts: list[str], secrets: list[str]) -> None:
    for text in texts:
        for secret in secrets:
            assert secret not in text, f"a secret of the endpoint reached a message: {text!r}"


def _start(target, *args, **kwargs):
    q = CTX.Queue()
    proc = CTX.Process(target=target, args=(*args, q), kwargs=kwargs, daemon=True)
    proc.start()
    assert "up" in q.get(timeout=60)
    return proc, q


def _stall_in_load(endpoint: str, q) -> None:
    """A receiver that takes the first bucket and never returns from load (it is killed)."""
    receiver = WeightReceiver(endpoint, timeout_s=60)
    q.put({"up": os.getpid()})
    receiver.receive(lambda pairs: (q.put({"loading": True}), time.sleep(600)))  # type: ignore[func-returns-value]


@pytest.mark.parametrize("where", sorted(ADDRESSES))
def test_no_sender_error_log_or_repr_carries_the_token_or_key(where, caplog):
    caplog.set_level(logging.DEBUG, logger="hwsync")
    texts: list[str] = []
    secrets: list[str] = []
    with WeightSender(ADDRESSES[where], options=SenderOptions(timeout_s=1.0)) as sender:  # no receiver ever comes
        secrets += _secrets(sender)
        with pytest.raises(SyncTimeoutError) as nobody:
            sender.send([("a", torch.ones(4))], version=1)
        texts += [str(nobody.value), repr(nobody.value), repr(Endpoint.parse(sender.endpoint))]
        assert sender.address in str(nobody.value)
    with WeightSender(ADDRESSES[where], options=SenderOptions(bucket_bytes=1 << 16, timeout_s=20.0)) as sender:  # a receiver dies mid-sync
        secrets += _secrets(sender)
        stalled, q = _start(_stall_in_load, sender.endpoint)
        killer = threading.Thread(target=lambda: q.get(timeout=60) and os.kill(stalled.pid, signal.SIGKILL))
        killer.start()
        with pytest.raises(HwsyncError) as exited:
            sender.send([(f"w{i}", torch.full((1 << 14,), float(i))) for i in range(64)], version=1)
        killer.join()
        stalled.join(10)
        texts += [str(exited.value), repr(exited.value), repr(sender)]
        assert str(stalled.pid) in str(exited.value) and sender.address in str(exited.value), exited.value
        for bad in ["x" + sender.endpoint] + ([sender.endpoint.rsplit("#", 1)[0]] if where == "tcp" else []):
            with pytest.raises(ValueError) as refused:
                Endpoint.parse(bad)
            texts.append(str(refused.value))
    texts += [record.getMessage() for record in caplog.records]
    _assert_no_secret(texts, secrets)


def test_a_ready_receiver_killed_before_the_sync_is_named_at_once():
    with WeightSender(num_receivers=2, options=SenderOptions(timeout_s=TIMEOUT_S)) as sender:
        first, _ = _start(control_procs.serve, sender.endpoint, timeout_s=TIMEOUT_S)
        time.sleep(1.0)  # its Ready is in: the sender waits for the second receiver
        first.kill()
        first.join(10)
        t0 = time.monotonic()
        with pytest.raises(SyncTimeoutError, match=rf"receiver pid {first.pid} .* exited after it said it was ready"):
            sender.send(procs.versioned(1).items(), version=1)
        assert time.monotonic() - t0 < 2.0, "a receiver known to be dead was waited for"


def test_a_process_that_connected_and_died_without_the_token_is_named_when_the_wait_ends():
    with WeightSender(options=SenderOptions(timeout_s=4.0)) as sender:
        outcome: dict[str, BaseException] = {}

        def send() -> None:
            try:
                sender.send(procs.versioned(1).items(), version=1)
            except BaseException as exc:  # noqa: BLE001 - inspected below
                outcome["send"] = exc

        thread = threading.Thread(target=send)
        thread.start()  # the sender waits for receivers
        code = ("import sys, time, zmq; s = zmq.Context().socket(zmq.DEALER); s.connect(sys.argv[1].rpartition('#')[0]); "
                "time.sleep(0.5); print('connected', flush=True); time.sleep(60)")
        stranger = subprocess.Popen([sys.executable, "-c", code, sender.endpoint], stdout=subprocess.PIPE, text=True)
        assert stranger.stdout.readline().strip() == "connected"
        stranger.kill()  # dies without a frame
        stranger.wait()
        thread.join(30)
        assert isinstance(outcome.get("send"), SyncTimeoutError), outcome
        assert f"Process {stranger.pid} connected to this sender and exited" in str(outcome["send"])


def _other_protocol(endpoint: str, q) -> None:
    """A receiver of a "newer" hwsync: its Ready says another protocol version."""
    import hwsync.colocated.receiver

    hwsync.colocated.receiver.PROTOCOL_VERSION = 99
    control_procs.receive_once(endpoint, q, TIMEOUT_S)


def test_a_receiver_of_another_protocol_ends_the_wait_for_every_receiver_at_once():
    with WeightSender(num_receivers=2, options=SenderOptions(timeout_s=TIMEOUT_S)) as sender:
        good, good_q = _start(control_procs.serve, sender.endpoint, timeout_s=TIMEOUT_S)
        time.sleep(1.0)  # the good receiver waits for the offer
        misfit, misfit_q = _start(_other_protocol, sender.endpoint)
        time.sleep(0.5)
        t0 = time.time()
        with pytest.raises(ProtocolError, match="speaks hwsync protocol 99"):
            sender.send(procs.versioned(1).items(), version=1)
        told = good_q.get(timeout=2 * TIMEOUT_S)
        assert "RemoteError" in told["error"] and "cannot run" in told["error"], told
        assert told["at"] - t0 < 2.0, f"the waiting receiver heard {told['at'] - t0:.1f}s later"
        misfit.join(10)
        helper, helper_q = _start(control_procs.serve, sender.endpoint, timeout_s=TIMEOUT_S)
        sender.send(procs.versioned(2).items(), version=2)  # the first attempt after the failure
        for q in (good_q, helper_q):
            result = q.get(timeout=60)
            assert result.get("version") == 2 and result["digests"] == procs.digests(procs.versioned(2)), result
        for proc in (good, helper):
            proc.kill()
            proc.join(10)
