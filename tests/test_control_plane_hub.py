"""Strangers on the disaggregated hub's tcp:// control socket, and ranks the hub cannot serve.

Sender rank 0 (the hub) runs in the test process with one CrossNodeReceiver process (gloo on
127.0.0.1). A stranger (stranger_procs.py) knows the hub's address and CURVE public key but
not the token; whatever it sends, the next collective sync completes bit-exact at its first
attempt, the hub's memory stays where it was, and the stranger is logged. A rank the hub
cannot serve (a rank beyond num_receivers, another protocol version, another backend) is told
why at once and raises it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch.multiprocessing as mp

from hwsync import CrossNodeSender
from hwsync.sync.report import ReceiverReport
from hwsync.errors import ProtocolError
from hwsync.control.endpoints import Endpoint
from hwsync.protocol import PROTOCOL_VERSION, Error, Joined, PlanAccept, Pong, Progress, RankComplete, RankReady, Sent, encode
from hwsync.protocol import MAX_PEER_FRAME_BYTES
from hwsync.sync.options import CrossNodeOptions

import control_procs
import transfer_procs as procs
from test_control_plane import JUNK, rss_bytes

HERE = Path(__file__).parent
CTX = mp.get_context("spawn")
HOST = "127.0.0.1"


class HubSession:
    """Sender rank 0 here, receiver 0 in a process that serves syncs until the module ends."""

    def __init__(self, num_receivers: int = 1, timeout_s: float = 20.0) -> None:
        self.tx = CrossNodeSender(f"tcp://{HOST}:0", num_receivers=num_receivers, group_host=HOST, options=CrossNodeOptions(bucket_bytes=64 << 10, timeout_s=timeout_s))
        self.endpoint = Endpoint.parse(self.tx.endpoint)
        self.q = CTX.Queue()
        self.procs: list[mp.Process] = []
        self.spawn(self.q)
        assert "up" in self.q.get(timeout=60)
        self.version = 0
        self.sync_exact()  # the group is built here, once

    def spawn(self, q, **kwargs) -> mp.Process:
        proc = CTX.Process(target=control_procs.serve_collective, args=(self.tx.endpoint, q), kwargs=kwargs,
                           daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def sync_exact(self) -> None:
        self.version += 1
        tensors = procs.versioned(self.version)
        self.tx.send(list(tensors.items()), version=self.version)
        result = self.q.get(timeout=30)
        assert "error" not in result, result
        assert result["version"] == self.version and result["digests"] == procs.digests(tensors)

    def stranger(self, messages: list[list[bytes]], *, mode: str = "burst", seconds: float = 1.0
                 ) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, str(HERE / "stranger_procs.py"), self.endpoint.address, "dealer",
                                 mode, str(seconds), str(self.endpoint.server_key)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        proc.stdin.write(msgpack.packb(messages, use_bin_type=True))
        proc.stdin.close()
        assert proc.stdout.readline().strip() == b"connected"
        return proc

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join(10)
        self.tx.close()


@pytest.fixture(scope="module")
def hub():
    s = HubSession()
    yield s
    s.close()


@pytest.fixture
def log_every_drop(monkeypatch):
    monkeypatch.setattr("hwsync.control.sockets.DROP_LOG_INTERVAL_S", 0.0)


@pytest.mark.parametrize("junk", list(JUNK))
def test_junk_on_the_hub_is_dropped_and_logged(hub, junk, caplog, log_every_drop):
    caplog.set_level(logging.WARNING, logger="hwsync")
    before = rss_bytes()
    hub.stranger(JUNK[junk]).wait(10)
    hub.sync_exact()
    assert "the hub dropped a frame from peer" in caplog.text
    assert rss_bytes() - before < 32 << 20


def _forged(sync_ids: range) -> list[list[bytes]]:
    """Every frame a rank may send, for every sync id a stranger could guess, without the token."""
    frames: list = [RankReady(token="not-the-token", proto=4, backend="cpu", role="receiver", rank=0, epoch=None,
                              pid=1, host="h", address=None, report=ReceiverReport(), attempt=1)]
    for s in sync_ids:
        frames += [Joined(sync=s), PlanAccept(sync=s), Progress(k=0, sync=s), Sent(sync=s), Pong(n=1, sync=s),
                   RankComplete(version=s, stats={}, sync=s)]
        frames += [Error(sync=s, kind=kind, message="INJECTED") for kind in ("load", "collective", "local")]
    return [[encode(f)] for f in frames]


def test_forged_rank_frames_never_touch_a_running_sync(hub, caplog):
    caplog.set_level(logging.WARNING, logger="hwsync")
    before = rss_bytes()
    stranger = hub.stranger(_forged(range(hub.version, hub.version + 4)), mode="repeat", seconds=1.0)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:  # syncs run while the frames rain
        hub.sync_exact()
    stranger.wait(10)
    hub.sync_exact()
    assert "the hub dropped a frame from peer" in caplog.text and "INJECTED" not in caplog.text
    assert rss_bytes() - before < 32 << 20


@pytest.mark.parametrize("size,count", [(MAX_PEER_FRAME_BYTES + 1, 3), (200 << 20, 5)], ids=["limit+1", "5x200MB"])
def test_oversized_frames_never_reach_the_hub(hub, size, count, caplog, log_every_drop):
    caplog.set_level(logging.INFO, logger="hwsync")
    before = rss_bytes()
    hub.stranger([[b"zeros", str(size).encode()]] * count, seconds=2.0).wait(30)
    hub.sync_exact()
    assert rss_bytes() - before < 32 << 20
    assert "the hub lost a connection" in caplog.text


def test_a_silent_stranger_on_the_hub_is_ignored(hub, caplog, log_every_drop):
    caplog.set_level(logging.DEBUG, logger="hwsync")
    stranger = hub.stranger([], mode="silent", seconds=3.0)
    hub.sync_exact()
    assert "the hub accepted a connection" in caplog.text
    stranger.kill()
    stranger.wait(10)


@pytest.mark.parametrize("misfit,reason", [
    ({"rank": 3}, "receiver 3 .* has no place in this sync"),
    ({"proto": 99}, f"speaks hwsync protocol 99 and this hub speaks {PROTOCOL_VERSION}"),
    ({"toy": True}, "runs backend 'toy' and sender 0 runs 'cpu'"),
], ids=["rank beyond num_receivers", "other protocol", "other backend"])
def test_a_rank_the_hub_cannot_serve_is_told_why_at_once(hub, misfit, reason):
    q = CTX.Queue()
    proc = hub.spawn(q, timeout_s=20.0, **misfit)
    assert "up" in q.get(timeout=60)
    time.sleep(0.5)  # its RankReady is on its way: the hub reads it as it gathers the next sync
    if "rank" in misfit:  # one rank too many: only that rank is told, the sync goes on
        hub.sync_exact()
    else:  # another protocol or backend: the deployment is wrong, sender 0 says so too
        with pytest.raises(ProtocolError, match=reason):
            hub.tx.send(list(procs.versioned(hub.version + 1).items()), version=hub.version + 1)
    result = q.get(timeout=30)
    assert "ProtocolError" in result["error"] and "refused this rank" in result["error"], result
    assert result["after_s"] < 5, "a rank that cannot be served is told at once, not at its timeout"
    proc.join(10)
    hub.sync_exact()
