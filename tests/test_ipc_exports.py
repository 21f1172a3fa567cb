"""IPC exports counted as torch counts them (bug 4), on the simulated accelerator's sim_ipc.

torch gives each export of a device block one expected consumer; a block its owner dropped is
freed only once every export's consumer closed it. So hwsync exports once per receiver process,
releases what a receiver never maps (it refused the offer, or died), and collects what receivers
let go. Leaks show up as failures through the sim's leak log (tests/conftest.py).
"""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")

import hwsync.colocated.receiver  # noqa: E402
from hwsync import HwsyncError, SyncError, WeightReceiver, WeightSender  # noqa: E402
from hwsync.errors import ProtocolError, RemoteError  # noqa: E402
from hwsync_sim.peers import Peer  # noqa: E402
from hwsync.sync.options import SenderOptions

import transfer_procs as procs  # noqa: E402

CTX = mp.get_context("spawn")


@pytest.fixture(scope="module")
def peers():
    started = {name: Peer() for name in ("first", "second")}
    yield started
    for peer in started.values():
        peer.close()


def test_each_receiver_gets_its_own_export_so_one_closing_never_frees_the_buffer_under_another(sim, peers):
    sender = sim.transports()["sim_ipc"].open_sender(4096, 1)
    sender.buffer(0).copy_(torch.full((4096,), 3, dtype=torch.uint8))
    sender.publish(0, 4096)
    first, second = peers["first"], peers["second"]
    assert first.call("map", sender.handles_for("first", first.pid, os.uname().nodename)) == [3, 3, 3, 3]
    assert second.call("map", sender.handles_for("second", second.pid, os.uname().nodename)) == [3, 3, 3, 3]
    assert first.call("close") == "closed"
    sender.close()  # the second receiver still maps it: parked, not freed
    assert second.call("read") == [3, 3, 3, 3], "freed while a receiver still maps it (one export shared by two)"
    assert second.call("close") == "closed"


def _refusing_receiver(endpoint: str, q) -> None:
    hwsync.colocated.receiver.PROTOCOL_VERSION = 99  # refused at its ready, before anything is exported for it
    with WeightReceiver(endpoint, timeout_s=30) as receiver:
        try:
            receiver.receive(lambda pairs: None)
        except ProtocolError as exc:
            q.put(str(exc))


def _receiver_that_cannot_map(endpoint: str, q, hold) -> None:
    """Fails to map the buffers exported for it (its sim_ipc's open_receiver raises, as a failed IPC open does),
    and stays alive until the sender has cleaned up: only the sender can release what it never mapped."""
    with WeightReceiver(endpoint, timeout_s=30) as receiver:
        real = receiver.backend.transports

        def transports() -> dict:
            found = dict(real())
            broken = copy.copy(found["sim_ipc"])
            broken.open_receiver = lambda handles, owner_pid=None: (_ for _ in ()).throw(
                HwsyncError("sim_ipc: cannot open the sender's IPC handles (test stand-in)"))
            found["sim_ipc"] = broken
            return found

        receiver.backend.transports = transports
        try:
            receiver.receive(lambda pairs: None)
        except HwsyncError as exc:
            q.put(str(exc))
        hold.wait(60)


def _dying_receiver(endpoint: str) -> None:
    with WeightReceiver(endpoint, timeout_s=30) as receiver:
        receiver.receive(lambda pairs: os.kill(os.getpid(), signal.SIGKILL))  # killed with the buffers mapped


def test_retries_after_failed_receivers_leave_no_buffers_behind(sim):
    device = sim.device()
    before = device.memory_allocated()
    with WeightSender(transport="sim_ipc", options=SenderOptions(bucket_bytes=1 << 16, timeout_s=30)) as sender:
        q = CTX.Queue()
        refusing = CTX.Process(target=_refusing_receiver, args=(sender.endpoint, q))
        refusing.start()
        with pytest.raises(ProtocolError):
            sender.send(procs.versioned(1).items(), version=1)
        assert "protocol" in q.get(timeout=60)
        refusing.join(30)
        hold = CTX.Event()
        lacking = CTX.Process(target=_receiver_that_cannot_map, args=(sender.endpoint, q, hold))
        lacking.start()
        with pytest.raises(HwsyncError, match="cannot open the sender's IPC handles"):
            sender.send(procs.versioned(1).items(), version=1)
        assert "cannot open" in q.get(timeout=60)
        hold.set()
        lacking.join(30)
        dying = CTX.Process(target=_dying_receiver, args=(sender.endpoint,))
        dying.start()
        with pytest.raises((SyncError, RemoteError)):
            sender.send(procs.versioned(2).items(), version=2)
        dying.join(30)
        p = CTX.Process(target=procs.receive_n, args=(sender.endpoint, 1, q))
        p.start()
        sender.send(procs.versioned(3).items(), version=3)
        assert q.get(timeout=60)["version"] == 3
        p.join(30)
    assert device.memory_allocated() == before, "each failed sync left its buffers behind in IPC limbo"
    from hwsync_sim import sharing

    assert sharing.limbo_bytes() == 0
