"""Threads hwsync starts run on their owner's device; device reads finish before a buffer goes back.

On the simulated accelerator, where (as on CUDA and torch_npu) the current device is per thread
and a new thread starts on device 0.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")

from hwsync.backend.devices import start_on_this_device, synchronize_for  # noqa: E402
from hwsync.disaggregated import LocalForwarder  # noqa: E402
from hwsync.disaggregated.worker import CollectiveWorker  # noqa: E402
from hwsync.backend.registry import load_backend  # noqa: E402


@pytest.fixture
def sim_on_1():
    """The sim's Device with this (main) thread on device 1, as a launcher's set_device(local_rank) leaves it."""
    device = load_backend("sim").device()
    device.set_index(1)
    yield device
    device.set_index(0)


def test_a_plain_new_thread_starts_on_device_0(sim_on_1):
    seen = []
    thread = threading.Thread(target=lambda: seen.append(sim_on_1.current_index()))
    thread.start()
    thread.join()
    assert seen == [0], "the model the fixes below rely on: a new thread starts on 0"


def test_collective_workers_run_on_the_device_of_the_thread_that_made_them(sim_on_1):
    worker = CollectiveWorker("test-worker", sim_on_1)
    try:
        worker.submit("where", sim_on_1.current_index)
        results = []
        while not results:
            results = worker.results()
        assert results == [("where", 1, None)]
    finally:
        assert worker.stop()


def test_the_forwarders_local_sync_runs_on_the_device_of_the_thread_that_starts_it(sim_on_1):
    seen: queue.Queue = queue.Queue()

    def local_sync(source, version, manifest):
        seen.put(sim_on_1.current_index())
        return list(source)

    forward = LocalForwarder(local_sync, timeout_s=10, device=sim_on_1)
    forward.accept(1, [])
    forward.done()
    assert seen.get(timeout=5) == 1


def test_start_on_this_device_carries_the_callers_device(sim_on_1):
    seen = []
    start_on_this_device(lambda: seen.append(sim_on_1.current_index()), "test", sim_on_1).join()
    assert seen == [1]


def test_synchronize_for_waits_for_the_views_device_whichever_is_current(sim_on_1):
    from hwsync_sim.tensor import host_view

    dst = torch.empty(4, dtype=torch.uint8, device="sim:1")
    dst.copy_(torch.full((4,), 7, dtype=torch.uint8))  # queued on sim:1's stream
    sim_on_1.set_index(0)
    synchronize_for(sim_on_1, dst.device)
    assert host_view(dst).tolist() == [7] * 4, "the copy on the view's device must have finished"
    assert sim_on_1.current_index() == 0, "and this thread's device is left as it was"
    synchronize_for(sim_on_1, torch.device("cpu"))  # host memory: nothing to wait for
