"""Strangers on a WeightSender's control socket, over ipc:// and tcp://, with real processes and sockets.

A stranger is a process (stranger_procs.py) that connects to the bound address without the
token (over tcp:// it may know the sender's public CURVE key, or not even that). Whatever it
sends, the next sync completes bit-exact at its first attempt, the sender's memory stays where
it was, and the stranger is logged. One sender and one receiver process serve every test of a
transport; "ipc-frames" has the receiver refuse the doorbell, so buckets and releases travel
as ZeroMQ frames (the path where a forged release would count).
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch.multiprocessing as mp

from hwsync import WeightSender
from hwsync.sync.report import ReceiverReport
from hwsync.control.endpoints import Endpoint
from hwsync.protocol import Abort, Accept, Complete, Done, Error, Gone, Ready, Release, encode
from hwsync.protocol import MAX_PEER_FRAME_BYTES
from hwsync.sync.options import SenderOptions

import control_procs
import transfer_procs as procs

HERE = Path(__file__).parent
CTX = mp.get_context("spawn")
TRANSPORTS = ["ipc", "tcp"]


def rss_bytes() -> int:
    """This process's resident memory (the sender lives in the test process)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Session:
    """A sender in this process and a receiver process that serves syncs until the module ends."""

    def __init__(self, transport: str) -> None:
        self.sender = WeightSender("tcp://127.0.0.1:0" if transport == "tcp" else None, options=SenderOptions(timeout_s=20))
        self.endpoint = Endpoint.parse(self.sender.endpoint)
        self.q = CTX.Queue()
        self.proc = CTX.Process(target=control_procs.serve, args=(self.sender.endpoint, self.q),
                                kwargs={"doorbell": transport != "ipc-frames"}, daemon=True)
        self.proc.start()
        assert "up" in self.q.get(timeout=60)
        self.version = 0
        self.sync_exact()  # buffers opened, caches warm: the baseline of the memory checks

    def sync_exact(self, source=None) -> None:
        """One sync; it must complete at its first attempt, bit-exact on the receiver."""
        self.version += 1
        tensors = procs.versioned(self.version)
        self.sender.send(source(tensors) if source else tensors.items(), version=self.version)
        result = self.q.get(timeout=30)
        assert "error" not in result, result
        assert result["version"] == self.version and result["digests"] == procs.digests(tensors)

    def stranger(self, messages: list[list[bytes]], *, mode: str = "burst", seconds: float = 1.0,
                 kind: str = "dealer", with_key: bool = True) -> subprocess.Popen:
        key = [self.endpoint.server_key] if with_key and self.endpoint.server_key else []
        proc = subprocess.Popen([sys.executable, str(HERE / "stranger_procs.py"), self.endpoint.address, kind, mode,
                                 str(seconds), *key], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc.stdin.write(msgpack.packb(messages, use_bin_type=True))
        proc.stdin.close()
        assert proc.stdout.readline().strip() == b"connected"
        return proc

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.sender.close()


@pytest.fixture(scope="module")
def session(request):
    s = Session(request.param)
    yield s
    s.close()


@pytest.fixture
def log_every_drop(monkeypatch):
    """A test that looks for its own stranger in the log: no rate limit across tests (units test it).

    Not for the tests that send thousands of frames: the log records would weigh on the memory checks."""
    monkeypatch.setattr("hwsync.control.sockets.DROP_LOG_INTERVAL_S", 0.0)


class Marker:
    """Unpickling this creates a file: the proof that nothing on the wire is ever unpickled."""

    path = "/tmp/hwsync-unpickled-marker"

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _ready_without_token() -> bytes:
    return msgpack.packb({"t": "ready", "proto": 4, "pid": 1, "host": "h", "state": {}, "doorbell": False,
                          "into": False, "backend": "cpu", "transports": ["shm"], "instance": "x"})


JUNK = {
    "garbage": [[b"\xc1\xff\x00 not msgpack at all \x00"]],
    "empty frame": [[b""]],
    "two parts": [[encode(Gone()), b"second part"]],
    "truncated msgpack": [[encode(Accept(sync=1))[:-1]]],
    "msgpack array": [[msgpack.packb([1, "ready", {"token": "x"}])]],
    "map without type": [[msgpack.packb({"sync": 1, "kind": "load", "message": "INJECTED"})]],
    "raw pickle": [[pickle.dumps(Marker())]],
    "deep nesting": [[b"\x91" * 100_000 + b"\xc0"]],
    "ready without token field": [[_ready_without_token()]],
    "ext type": [[msgpack.packb(msgpack.ExtType(5, b"payload"))]],
}


@pytest.mark.parametrize("session", TRANSPORTS, indirect=True)
@pytest.mark.parametrize("junk", list(JUNK) + ["REQ delimiter"])
def test_junk_is_dropped_and_logged_and_the_next_sync_is_exact(session, junk, caplog, log_every_drop):
    caplog.set_level(logging.WARNING, logger="hwsync")
    before = rss_bytes()
    if junk == "REQ delimiter":  # a REQ socket puts an empty delimiter frame before every message
        stranger = session.stranger([[encode(Accept(sync=session.version + 1))]], kind="req")
    else:
        stranger = session.stranger(JUNK[junk])
    stranger.wait(10)
    session.sync_exact()
    assert "the sender dropped a frame from peer" in caplog.text
    assert rss_bytes() - before < 32 << 20
    assert not Path(Marker.path).exists(), "a pickle payload was unpickled"


def _forged(sync_ids: range) -> list[list[bytes]]:
    """Every frame a receiver may send, for every sync id a stranger could guess, without the token."""
    frames: list = [Ready(token="not-the-token", proto=4, pid=1, host="h", report=ReceiverReport(), doorbell=True, into=False,
                          backend="cpu", transports=["shm"], instance="stranger"), Gone()]
    for s in [*sync_ids, None]:
        frames.append(Error(sync=s, kind="load", message="INJECTED"))
        frames.append(Error(sync=s, kind="protocol", message="INJECTED"))
        if s is not None:
            frames += [Accept(sync=s), Complete(sync=s, stats={"load_s": 1.0})]
            frames += [Release(sync=s, buf=b, seq=q) for b in range(2) for q in range(8)]
            frames += [Abort(sync=s, message="INJECTED"), Done(sync=s, buckets=1, tensors=1, bytes=1)]
    return [[encode(f)] for f in frames]


@pytest.mark.parametrize("session", [*TRANSPORTS, "ipc-frames"], indirect=True)
def test_forged_frames_without_the_token_never_touch_a_running_sync(session, caplog):
    """Forged error/accept/complete/release/gone frames rain on the sender while two syncs run."""
    caplog.set_level(logging.WARNING, logger="hwsync")

    def slowly(tensors):  # keeps each sync running while the stranger sends
        import time

        for item in tensors.items():
            time.sleep(0.05)
            yield item

    stranger = session.stranger(_forged(range(session.version, session.version + 4)), mode="repeat", seconds=1.5)
    before = rss_bytes()
    session.sync_exact(slowly)
    session.sync_exact(slowly)
    stranger.wait(10)
    session.sync_exact()
    assert "the sender dropped a frame from peer" in caplog.text
    assert "INJECTED" not in caplog.text  # never taken for a receiver's error
    assert rss_bytes() - before < 32 << 20


@pytest.mark.parametrize("session", TRANSPORTS, indirect=True)
@pytest.mark.parametrize("size,count", [(MAX_PEER_FRAME_BYTES + 1, 3), (200 << 20, 5)], ids=["limit+1", "5x200MB"])
def test_oversized_frames_never_reach_the_sender(session, size, count, caplog, log_every_drop):
    caplog.set_level(logging.INFO, logger="hwsync")
    before = rss_bytes()
    stranger = session.stranger([[b"zeros", str(size).encode()]] * count, seconds=2.0)
    stranger.wait(30)
    session.sync_exact()
    assert rss_bytes() - before < 32 << 20, "a stranger's big frames must not be buffered by the sender"
    assert "the sender lost a connection" in caplog.text


@pytest.mark.parametrize("session", TRANSPORTS, indirect=True)
def test_a_silent_stranger_is_ignored(session, caplog, log_every_drop):
    caplog.set_level(logging.DEBUG, logger="hwsync")
    stranger = session.stranger([], mode="silent", seconds=3.0)
    session.sync_exact()
    session.sync_exact()
    assert "the sender accepted a connection" in caplog.text
    stranger.kill()
    stranger.wait(10)


def test_a_tcp_stranger_without_the_key_cannot_even_connect(caplog):
    caplog.set_level(logging.WARNING, logger="hwsync")
    session = Session("tcp")  # a sender of its own: no other stranger's frames are queued on it
    try:
        stranger = session.stranger(_forged(range(session.version, session.version + 2)), with_key=False)
        stranger.wait(10)
        session.sync_exact()
        assert "failed the handshake" in caplog.text
        assert "dropped a frame" not in caplog.text, "nothing of a stranger without the key reaches hwsync"
    finally:
        session.close()
