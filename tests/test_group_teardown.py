"""A Communicator on an accelerator: its barrier holds the host, and tearing it down after a peer died ends.

On the simulated accelerator, whose collective library (simccl) behaves as NCCL and HCCL do:
`wait()` only orders device streams, a collective whose peer died never ends, and `shutdown()`
waits for it. Rank 0 runs here, rank 1 in a peer process on its own device.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")

from hwsync.errors import HwsyncError  # noqa: E402
from hwsync.backend.registry import load_backend  # noqa: E402
from hwsync_sim.peers import Peer  # noqa: E402

#: how long a call that must block is watched, and how long one that must end may take (no speed measured)
WATCH_S = 1.5
ENDS_WITHIN_S = 10.0


@pytest.fixture(scope="module")
def peers():
    """Two peer processes on device 1: one that lives, one that is killed."""
    started = {name: Peer({"HWSYNC_SIM_DEVICE": "1"}) for name in ("live", "mortal")}
    yield started
    for peer in started.values():
        peer.close()


@pytest.fixture
def sim():
    backend = load_backend("sim")
    backend.device().set_index(0)
    return backend


def _joined(sim, peer: Peer, port: int, timeout_s: float):
    """A group of two on 127.0.0.1:`port`: rank 0 here (returned), rank 1 the peer."""
    address = f"tcp://127.0.0.1:{port}"
    peer.send("join", address, 1, 2)
    comm = sim.communicator(address, 0, 2, timeout_s=timeout_s)
    assert peer.recv() == "joined"
    return comm


def _stream_is_free(sim) -> bool:
    """Whether synchronizing the device returns: a collective left waiting for a dead peer holds its stream."""
    syncer = threading.Thread(target=sim.device().synchronize, daemon=True)
    syncer.start()
    syncer.join(ENDS_WITHIN_S)
    return not syncer.is_alive()


def test_barrier_returns_only_once_every_rank_called_it(sim, peers, free_port):
    peer = peers["live"]
    comm = _joined(sim, peer, free_port, 30)
    try:
        barrier = threading.Thread(target=comm.barrier, daemon=True)
        barrier.start()
        barrier.join(WATCH_S)
        assert barrier.is_alive(), "barrier() returned on rank 0 before rank 1 called it: not a host barrier"
        assert peer.call("barrier") == "passed"
        barrier.join(ENDS_WITHIN_S)
        assert not barrier.is_alive()
    finally:
        assert peer.call("destroy") == "destroyed"
        comm.destroy()


def test_destroy_after_the_peer_died_aborts_instead_of_waiting_for_it(sim, peers, free_port):
    mortal = peers["mortal"]
    comm = _joined(sim, mortal, free_port, 60)
    mortal.die()
    comm.broadcast(torch.zeros(8, dtype=torch.uint8, device=sim.device().torch_device()), 0)  # never ends
    destroyer = threading.Thread(target=comm.destroy, daemon=True)
    destroyer.start()
    destroyer.join(ENDS_WITHIN_S)
    assert not destroyer.is_alive(), "destroy() waits for a collective whose peer died (shutdown, not abort)"
    # the device stream that waited for the collective is free again: only an abort frees it (destroy()
    # itself returns after WORKER_JOIN_S whatever happens, so it is the stream that tells abort from shutdown)
    assert _stream_is_free(sim), "the collective of a dead peer still holds the device stream: the group was shut " \
                                 "down, not aborted"


def test_a_collective_launched_while_the_group_is_torn_down_is_aborted_with_it(sim, peers, free_port):
    # a collective thread launches while the main thread destroys the group after a failure: destroy() must
    # see that launch (and abort it), or the collective outlives a group it shut down and holds the device's stream
    mortal = Peer({"HWSYNC_SIM_DEVICE": "1"})
    try:
        comm = _joined(sim, mortal, free_port, 60)
        mortal.die()
    finally:
        mortal.close()
    group = comm._group
    launching, go_on = threading.Event(), threading.Event()
    launch = group.broadcast

    def slow_launch(*args):  # the launch is under way when destroy() is called
        launching.set()
        go_on.wait()
        return launch(*args)

    group.broadcast = slow_launch
    zeros = torch.zeros(8, dtype=torch.uint8, device=sim.device().torch_device())
    launcher = threading.Thread(target=comm.broadcast, args=(zeros, 0), daemon=True)
    launcher.start()
    assert launching.wait(ENDS_WITHIN_S)
    destroyer = threading.Thread(target=comm.destroy, daemon=True)
    destroyer.start()
    destroyer.join(WATCH_S)  # destroy() waits for the launch in flight (without that it is over by now)
    go_on.set()
    for thread in (launcher, destroyer):
        thread.join(ENDS_WITHIN_S)
        assert not thread.is_alive()
    assert _stream_is_free(sim), "a collective launched during destroy() still holds the device stream: destroy() " \
                                 "did not see it and shut the group down instead of aborting it"


def test_a_collective_on_a_destroyed_group_is_refused_by_name(sim, peers, free_port):
    peer = peers["live"]
    comm = _joined(sim, peer, free_port, 30)
    assert peer.call("destroy") == "destroyed"
    comm.destroy()
    with pytest.raises(HwsyncError, match="destroyed"):
        comm.broadcast(torch.zeros(8, dtype=torch.uint8, device=sim.device().torch_device()), 0)
