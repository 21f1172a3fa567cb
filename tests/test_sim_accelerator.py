"""The strict simulated accelerator (tests/plugins/hwsync_sim) models what the issue's bugs depend on.

Each test shows that one modelled behaviour bites: code that forgets what a GPU or NPU needs
gets stale bytes, garbage, an error, a leak report or a hang here, not silent success.
"""

from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")

from hwsync.backend.registry import load_backend  # noqa: E402
from hwsync_sim import sharing  # noqa: E402
from hwsync_sim.runtime import POISON, UNINITIALIZED, SimDeviceError, SimLeakWarning, SimOutOfMemoryError, \
    runtime  # noqa: E402
from hwsync_sim.simccl import SimcclError, SimProcessGroup  # noqa: E402
from hwsync_sim.peers import Peer  # noqa: E402
from hwsync_sim.tensor import host_view  # noqa: E402



@pytest.fixture
def sim():
    """The sim backend, this thread on device 0 before and after."""
    backend = load_backend("sim")
    backend.device().set_index(0)
    yield backend
    backend.device().set_index(0)


def _bytes(t: torch.Tensor) -> list[int]:
    """What is in device memory right now, without waiting for anything (a racing reader)."""
    return host_view(t).reshape(-1).view(torch.uint8).tolist()


# -- streams: copies finish later ---------------------------------------------------------------

def test_a_copy_read_before_synchronize_sees_stale_bytes(sim):
    device = sim.device()
    src = torch.empty(8, dtype=torch.uint8, device=device.torch_device())
    src.copy_(torch.arange(8, dtype=torch.uint8))
    dst = torch.empty(8, dtype=torch.uint8, device=device.torch_device())
    dst.copy_(src)
    assert _bytes(dst) == [UNINITIALIZED] * 8, "the copy must still be queued"
    device.synchronize()
    assert _bytes(dst) == list(range(8))


def test_a_device_to_host_copy_waits_for_queued_work(sim):
    where = sim.device().torch_device()
    dst = torch.empty(4, dtype=torch.int32, device=where)
    dst.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    assert dst.cpu().tolist() == [1, 2, 3, 4]


def test_a_host_source_is_read_when_copy_returns(sim):
    host = torch.zeros(4)
    dst = torch.empty(4, device=sim.device().torch_device())
    dst.copy_(host)
    host.fill_(7.0)  # pageable memory: torch has staged it already, so this must not show up
    assert dst.cpu().tolist() == [0.0] * 4


def test_synchronizing_another_device_does_not_finish_the_copy(sim):
    device = sim.device()
    device.set_index(1)
    dst = torch.empty(4, dtype=torch.uint8, device=device.torch_device())
    dst.copy_(torch.ones(4, dtype=torch.uint8))
    device.set_index(0)
    device.synchronize()  # the wrong device: what a thread left on device 0 does
    assert _bytes(dst) == [UNINITIALIZED] * 4
    device.set_index(1)
    device.synchronize()
    assert _bytes(dst) == [1] * 4


# -- devices: per thread, strict ----------------------------------------------------------------

def test_a_new_thread_starts_on_device_0(sim):
    sim.device().set_index(1)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(sim.device().current_index()))
    thread.start()
    thread.join()
    assert sim.device().current_index() == 1 and seen == [0]


def test_using_a_device_1_tensor_with_device_0_current_raises(sim):
    device = sim.device()
    device.set_index(1)
    t = torch.zeros(4, device=device.torch_device())
    errors = []

    def worker():
        for work in (lambda: t.add_(1), lambda: t.cpu(), lambda: t.copy_(torch.ones(4)),
                     lambda: torch.empty(4, device=t.device), lambda: torch.ones(4, device=t.device)):
            try:
                work()
            except SimDeviceError as exc:
                errors.append(str(exc))
        t[1:3].view(torch.uint8)  # views are metadata only: allowed anywhere

    thread = threading.Thread(target=worker, name="hwsync-worker")
    thread.start()
    thread.join()
    assert len(errors) == 5 and "'hwsync-worker'" in errors[0] and "current device is sim:0" in errors[0]
    assert t.cpu().tolist() == [0.0] * 4


def test_the_main_thread_starts_where_hwsync_sim_device_says(peers):
    # the peers run with HWSYNC_SIM_DEVICE=1: a launcher's set_device(local_rank) in the main thread
    assert peers["a"].call("devices") == [1, 0]


def test_numpy_on_a_device_tensor_fails_as_on_a_gpu(sim):
    t = torch.zeros(2, device=sim.device().torch_device())
    with pytest.raises(TypeError, match="can't convert sim:0 device type tensor to numpy"):
        t.numpy()
    assert t.cpu().numpy().tolist() == [0.0, 0.0]


def test_parameters_move_with_data_and_back(sim):
    model = torch.nn.Linear(3, 2)
    host = model.weight.data
    model.weight.data = host.to(sim.device().torch_device())
    assert isinstance(model.weight, torch.nn.Parameter) and model.weight.device.type == "sim"
    with torch.no_grad():
        model.weight.add_(1.0)
    moved = model.weight.cpu()
    model.weight.data = host
    assert model.weight.device.type == "cpu" and torch.equal(moved, host + 1.0)


def test_an_allocation_past_free_memory_is_refused(sim):
    free, total = sim.device().mem_get_info()
    with pytest.raises(SimOutOfMemoryError, match="out of memory on sim:0"):
        torch.empty(free + 1, dtype=torch.uint8, device=sim.device().torch_device())


def test_free_memory_counts_other_processes(sim, peers):
    device = sim.device()
    free_before, _ = device.mem_get_info()
    assert peers["a"].call("hold", 64 << 20) == "allocated"
    free_during, _ = device.mem_get_info()
    assert peers["a"].call("free") == "freed"
    assert free_before - free_during >= 64 << 20
    assert device.mem_get_info()[0] >= free_before - (1 << 20)


# -- poison ---------------------------------------------------------------------------------------

def test_fresh_memory_is_not_zero_and_freed_memory_is_poisoned(sim):
    t = torch.empty(16, dtype=torch.uint8, device=sim.device().torch_device())
    raw = host_view(t)  # a pointer kept past the free, as a late reader (or another process) has
    assert raw.tolist() == [UNINITIALIZED] * 16
    del t
    assert raw.tolist() == [POISON] * 16


def test_a_read_still_queued_when_its_buffer_is_released_and_refilled_sees_poison(sim):
    transport = sim.transports()["sim_ipc"]
    sender = transport.open_sender(256, 2)
    try:
        sender.buffer(0).copy_(torch.full((256,), 7, dtype=torch.uint8))
        sender.publish(0, 256)
        # same process: the sender's own tensors (no export)
        receiver = transport.open_receiver(sender.handles_for("here", os.getpid(), socket.gethostname()))
        out = torch.empty(256, dtype=torch.uint8, device=sim.device().torch_device())
        out.copy_(receiver.view(0, 256))  # queued, not yet run
        receiver.release(0)  # sim_ipc's release, like NPU IPC's, does not wait
        sender.buffer(0)  # the sender starts refilling buffer 0
        assert set(out.cpu().tolist()) == {POISON}
        receiver.close()
    finally:
        sender.close()  # a same-process receiver maps nothing: no export was made for it, none leaks


def test_shm_release_waits_for_the_staging_copy_that_still_reads_the_segment(sim):
    """The shm transport (hwsync.backend.device_shm) stages a bucket with a host-to-device copy from its pinned
    segment, queued on the stream and reading the segment when it runs: release() must wait for it,
    since the sender refills (the sim poisons) the segment once the receiver released it."""
    transport = sim.transports()["shm"]
    sender = transport.open_sender(256, 2)
    receiver = transport.open_receiver(sender.handles())
    try:
        sender.buffer(0).copy_(torch.full((256,), 7, dtype=torch.uint8))
        sender.publish(0, 256)
        view = receiver.view(0, 256)  # queued, not yet run
        assert view.device == sim.device().torch_device()
        receiver.release(0)
        sender.buffer(0)  # the sender starts refilling buffer 0
        assert set(view.cpu().tolist()) == {7}, "the staging copy read the segment after release()"
    finally:
        receiver.close()
        sender.close()


def test_a_receivers_read_only_segments_are_pinned_read_only(sim):
    """The receiver maps the sender's segments read-only; CUDA registers such pages only with
    cudaHostRegisterReadOnly, which the sim models: pinned writable they are refused (and every staging
    copy would go the slow, pageable way), pinned read-only they are taken."""
    transport = sim.transports()["shm"]
    sender = transport.open_sender(4096, 2)
    receiver = transport.open_receiver(sender.handles())
    try:
        segment = receiver.segments[0].tensor
        assert not sim.device().pin_host_memory(segment), "read-only pages registered as writable"
        assert len(receiver._pinned) == 2, "the receiver left its read-only segments pageable"
    finally:
        receiver.close()
        sender.close()


# -- IPC: torch's reference counting --------------------------------------------------------------

def _open_sender(sim):
    sender = sim.transports()["sim_ipc"].open_sender(4096, 1)
    sender.buffer(0).copy_(torch.full((4096,), 3, dtype=torch.uint8))
    sender.publish(0, 4096)
    return sender


@pytest.mark.sim_leaks_expected
def test_an_export_never_mapped_stays_parked_and_is_reported_when_asked(sim):
    sender = _open_sender(sim)
    sender.handles()  # exported for a receiver that never maps it
    sender.close()  # not reported yet: an exporter may still release it (hwsync.backend.exports' orphans)
    assert sharing.limbo_bytes() >= 4096
    with pytest.warns(SimLeakWarning, match="export .* was never mapped"):
        sharing.report_parked(runtime())


@pytest.mark.sim_leaks_expected
def test_an_export_released_after_its_consumer_unmapped_it_is_held_for_good(sim, peers):
    # torch reads the counter as unsigned: at -1 the block is parked until exit (the H200's exit warning)
    sender = _open_sender(sim)
    handles = sender.handles()
    assert peers["a"].call("map", handles) == [3, 3, 3, 3]
    assert peers["a"].call("close") == "closed"
    sharing.release_export(handles["buffers"][0])  # unconditionally, as hwsync's sender did for exited receivers
    with pytest.warns(SimLeakWarning, match="released 2 times .* held until exit"):
        sender.close()
    assert sharing.limbo_bytes() >= 4096


def test_a_conditional_release_skips_an_export_its_consumer_unmapped(sim, peers):
    sender = _open_sender(sim)
    allocated, parked = sim.device().memory_allocated(), sharing.limbo_bytes()  # earlier tests' leaks stay parked
    handles = sender.handles()
    assert peers["a"].call("map", handles) == [3, 3, 3, 3]
    assert peers["a"].call("close") == "closed"
    for record in handles["buffers"]:
        sharing.release_if_held(record)  # what the sim's transports release with
    sender.close()
    assert sharing.limbo_bytes() == parked
    assert sim.device().memory_allocated() == allocated - 4096


def test_a_late_release_of_a_freed_export_never_reaches_a_newer_one(sim, peers):
    """torch hands out ref-counter slots in order and never reuses one, so hwsync's late, conditional release of an
    export whose block is long freed (an orphan settled after its receiver unmapped it) finds its old counter at 0
    and does nothing. A sim that reused the slot would take the newer export's counter down instead (and count it
    "released 2 times" once that consumer unmapped it)."""
    old = _open_sender(sim)
    stale = old.handles()["buffers"][0]
    assert peers["a"].call("map", old.handles()) == [3, 3, 3, 3]
    assert peers["a"].call("close") == "closed"
    old.close()  # freed: every counter of it is at 0
    new = _open_sender(sim)
    fresh = new.handles()["buffers"][0]
    assert (fresh["refs"], fresh["slot"]) != (stale["refs"], stale["slot"]), "a slot was reused"
    sharing.release_if_held(stale)  # the orphan's release, late
    assert peers["a"].call("map", new.handles()) == [3, 3, 3, 3]
    assert peers["a"].call("close") == "closed"
    leaks_before = len(runtime().leaks)
    new.close()
    assert len(runtime().leaks) == leaks_before


def test_a_mapping_freed_by_garbage_collection_while_work_is_queued_does_not_hang(sim, monkeypatch):
    """Garbage collection may run a mapping's finalizer on a thread that is inside a stream's lock (an allocation in
    enqueue). The finalizer waits for the stream before it releases the export's counter, as torch does; there the
    stream's thread could never take the lock to run anything, and the process hung (the delta model's long sim
    profile: a receiver stuck in its own digest). The release now runs as the thread leaves the lock."""
    from hwsync_sim import streams
    from hwsync_sim.runtime import Memory

    rt, device = runtime(), sim.device().torch_device()
    record = sharing.share(torch.ones(16, dtype=torch.uint8, device=device))
    mapping = Memory(0, torch.zeros(16, dtype=torch.uint8))  # as a consumer's mapping of that export
    mapping.segment, mapping.mapping = type("Unmapped", (), {"close": lambda self: None})(), (record["refs"],
                                                                                           record["slot"])
    finalizers = [lambda: sharing.freed(rt, mapping)]
    made = streams.SimEvent.__init__

    def collected_while_made(self, *args):  # the allocation that ran the collection
        if finalizers:
            finalizers.pop()()
        made(self, *args)

    monkeypatch.setattr(streams.SimEvent, "__init__", collected_while_made)
    worker = threading.Thread(target=lambda: rt.stream(0).record().synchronize(), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "hung: the finalizer waited for the stream inside the stream's lock"
    assert sharing.update(record["refs"], record["slot"])[0] == 0, "the mapping's counter was released"


def test_an_export_mapped_and_closed_is_freed_without_a_leak(sim, peers):
    sender = _open_sender(sim)
    allocated = sim.device().memory_allocated()
    assert peers["a"].call("map", sender.handles()) == [3, 3, 3, 3]
    assert peers["a"].call("close") == "closed"
    leaks_before = len(runtime().leaks)
    sender.close()
    assert len(runtime().leaks) == leaks_before
    assert sim.device().memory_allocated() == allocated - 4096


@pytest.mark.sim_leaks_expected
def test_an_export_mapped_by_a_process_that_died_is_reported_as_a_leak(sim, peers):
    sender = _open_sender(sim)
    mortal = peers["mortal-1"]
    assert mortal.call("map", sender.handles()) == [3, 3, 3, 3]
    mortal.die()  # no finalizers run: the mapping is never closed, as for a killed process
    with pytest.warns(SimLeakWarning, match=f"mapped by process {mortal.pid}, which exited without closing it"):
        sender.close()


def test_an_export_still_mapped_when_the_sender_closes_stays_parked_until_the_consumer_closes(sim, peers):
    sender = _open_sender(sim)
    peer = peers["a"]
    assert peer.call("map", sender.handles()) == [3, 3, 3, 3]
    leaks_before = len(runtime().leaks)
    sender.close()  # a live consumer will close it: not a leak yet
    assert len(runtime().leaks) == leaks_before
    parked = sharing.limbo_bytes()
    assert parked >= 4096
    assert peer.call("read") == [3, 3, 3, 3]  # parked, not freed: the consumer still reads good bytes
    assert peer.call("close") == "closed"
    sharing.collect(runtime())  # the consumer let go: the parked block is freed at the next collect
    assert sharing.limbo_bytes() == parked - 4096


@pytest.mark.sim_leaks_expected
def test_a_block_still_parked_when_its_owner_asks_is_reported(sim, peers):
    sender = _open_sender(sim)
    peer = peers["a"]
    assert peer.call("map", sender.handles()) == [3, 3, 3, 3]
    sender.close()
    with pytest.warns(SimLeakWarning, match=f"still mapped by process {peer.pid}"):
        sharing.report_parked(runtime())  # what process exit (and the test harness) does
    assert peer.call("close") == "closed"
    sharing.collect(runtime())


def test_an_export_maps_on_the_consumers_own_device_too(sim, peers):
    # what torch_npu and vllm-ascend do (peer access), and what bug 6's fix needs from the sim
    sender = _open_sender(sim)
    assert peers["b"].call("map", sender.handles(), 1) == [3, 3, 3, 3]
    assert peers["b"].call("device of mapped") == "sim:1"
    assert peers["b"].call("close") == "closed"
    sender.close()


def test_two_consumers_of_one_export_free_it_while_one_still_maps_it(sim, peers):
    sender = _open_sender(sim)
    first, second = peers["a"], peers["b"]
    assert first.call("map", sender.handles()) == [3, 3, 3, 3]
    assert second.call("map", sender.handles()) == [3, 3, 3, 3]
    assert first.call("close") == "closed"  # counter 1 -> 0: the sender thinks nobody maps it any more
    sender.close()  # so it is freed at once, although the second consumer maps it
    assert second.call("read") == [POISON] * 4
    assert second.call("close") == "closed"


# -- simccl: NCCL's behaviour ---------------------------------------------------------------------

def test_barrier_made_of_all_reduce_wait_is_not_a_host_barrier(sim, peers, free_port):
    address = f"tcp://127.0.0.1:{free_port}"
    peer = peers["b"]
    peer.send("join", address, 1, 2)
    comm = sim.communicator(address, 0, 2, timeout_s=20)
    assert peer.recv() == "joined"
    one = torch.zeros(1, dtype=torch.int32, device=sim.device().torch_device())
    comm._group.allreduce([one]).wait()  # returns although rank 1 has not even called it
    peer.send("all_reduce then synchronize")
    sim.device().synchronize()  # the device, not the host, waited for the barrier
    assert peer.recv() == "passed"
    assert peer.call("destroy") == "destroyed"
    comm.destroy()


def test_destroy_after_the_peer_died_hangs_unless_aborted(sim, peers, free_port):
    address = f"tcp://127.0.0.1:{free_port}"
    mortal = peers["mortal-2"]
    mortal.send("join", address, 1, 2)
    comm = sim.communicator(address, 0, 2, timeout_s=20)
    assert mortal.recv() == "joined"
    mortal.die()
    comm.broadcast(torch.zeros(8, dtype=torch.uint8, device=sim.device().torch_device()), 0)
    destroyer = threading.Thread(target=comm._group.shutdown, daemon=True)  # what destroy() did before bug 5
    destroyer.start()
    destroyer.join(2.0)
    assert destroyer.is_alive(), "destroy must wait for the collective stuck on the dead peer"
    for group in SimProcessGroup.live():  # what the fix of bug 5 must do before destroying
        group.abort()
    destroyer.join(5.0)
    assert not destroyer.is_alive()
    sim.device().synchronize()  # the stream that waited for the collective is free again


def test_two_groups_issued_in_different_orders_deadlock_as_on_nccl(sim, peers, free_port):
    # each collective waits for the device stream, which waits for the collective issued before it
    addresses = [f"tcp://127.0.0.1:{free_port}", f"tcp://127.0.0.1:{_another_port(free_port)}"]
    peer = peers["b"]
    peer.send("join", addresses[0], 1, 2)
    first = sim.communicator(addresses[0], 0, 2, timeout_s=20)
    assert peer.recv() == "joined"
    peer.send("join second", addresses[1], 1, 2)
    second = sim.communicator(addresses[1], 0, 2, timeout_s=20)
    assert peer.recv() == "joined"
    where = sim.device().torch_device()
    first.all_reduce(torch.zeros(4, device=where))  # here: first, then second
    second.all_reduce(torch.zeros(4, device=where))
    assert peer.call("all_reduce second then first") == "queued"
    waiter = threading.Thread(target=sim.device().synchronize, daemon=True)
    waiter.start()
    waiter.join(1.5)
    assert waiter.is_alive(), "each rank waits for its other group, which waits for the other rank: a deadlock"
    for group in SimProcessGroup.live():
        group.abort()
    assert peer.call("abort") == "aborted"
    waiter.join(5.0)
    assert not waiter.is_alive()


def _another_port(taken: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return port if port != taken else _another_port(taken)


def test_two_ranks_on_one_device_are_refused(sim, free_port):
    address = f"tcp://127.0.0.1:{free_port}"
    errors = []

    def rank(r):
        try:
            sim.communicator(address, r, 2, timeout_s=10)  # both threads start on device 0
        except SimcclError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 2 and all("Duplicate device" in e for e in errors)


# -- peer processes -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def peers():
    """Four peers started together (process start-up is what costs): two that live, two that die.

    Their main threads start on device 1, as after a launcher's set_device(local_rank).
    """
    started = {name: Peer({"HWSYNC_SIM_DEVICE": "1"}) for name in ("a", "b", "mortal-1", "mortal-2")}
    yield started
    for peer in started.values():
        peer.close()
