"""One copy per byte: a trainer whose parameters live in hwsync's shared memory, synced by reference.

Real processes, real sockets, real /dev/shm. The receivers map the trainer's segments and copy
each tensor once (into) or read views of them (load); the trainer may step only once send()
has returned, and the tests check that nothing a receiver reads changes before then.
"""

from __future__ import annotations

import functools
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

from hwsync import SharedParameters, SyncTimeoutError, WeightSender
from hwsync.colocated.carrier import SharedBuffers
from hwsync.protocol import Done
from hwsync.sync.shared_params import find_shared, live_segments
from hwsync.backend.shm import leftover_segments
from hwsync.sync.options import SenderOptions

import shared_procs as procs
from transfer_procs import digests, start_receiver as spawn_receiver

HERE = Path(__file__).parent


#: a receiver process running shared_procs.receive_digests: (process, result queue)
start_receiver = functools.partial(spawn_receiver, procs.receive_digests)


def _step(net: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    opt.zero_grad()
    net(torch.randn(8, 96)).square().mean().backward()
    opt.step()
    net.running.add_(1)


@pytest.mark.parametrize("mode", ["into", "load"])
def test_a_module_trained_in_shared_memory_syncs_bit_exact_by_reference(backend, mode):
    net = procs.model()
    with SharedParameters(net) as shared, WeightSender(options=SenderOptions(timeout_s=60)) as sender:
        opt = torch.optim.AdamW(net.parameters(), lr=0.05)
        ptrs = [p.data_ptr() for p in net.parameters()]
        p, q = start_receiver(sender.endpoint, syncs=3, mode=mode)
        for version in range(3):
            _step(net, opt, version)
            assert [p.data_ptr() for p in net.parameters()] == ptrs, "the optimizer updates shared memory in place"
            stats = sender.send(net.state_dict().items(), version=version)
            result = q.get(timeout=60)
            assert "error" not in result, result
            assert result["digests"] == digests(net.state_dict()) and result["version"] == version
            n = len(net.state_dict())
            assert stats.notes["shared"]["tensors"] == n and stats.buckets == 0, "every tensor went by reference"
            assert result["tensors"] == n
        p.join(30)
        names = shared.shared.segment_names
    assert not set(names) & set(leftover_segments()), "the segments are unlinked at close"
    _step(net, torch.optim.SGD(net.parameters(), lr=0.1), 9)  # the module trains on after close()
    assert find_shared(next(net.parameters())) is None


@pytest.mark.cpu_is_enough("which tensors go packed is host logic; the sim covers both paths in the test above")
def test_shared_and_ordinary_tensors_mix_in_one_sync(backend):
    net = procs.model()
    with SharedParameters(net), WeightSender(options=SenderOptions(bucket_bytes=1 << 14, timeout_s=60)) as sender:
        weight = net[0].weight.data
        source = {"ordinary.a": torch.randn(3000), **dict(list(net.state_dict().items())[:3]),
                  "transposed": weight.t(),  # lies in shared memory but is not contiguous: goes packed
                  "ordinary.b": torch.randn(17, 5).to(torch.bfloat16), **dict(list(net.state_dict().items())[3:])}
        for mode in ("into", "load"):
            p, q = start_receiver(sender.endpoint, mode=mode)
            stats = sender.send(source.items(), version=1)
            result = q.get(timeout=60)
            p.join(30)
            assert "error" not in result, result
            assert result["digests"] == digests(source)
            assert stats.notes["shared"]["tensors"] == len(net.state_dict()) and stats.buckets >= 2


def _stepping_trainer(sender: WeightSender, net: torch.nn.Module, versions: int, q) -> list[dict]:
    """Fill the parameters with the version, send, and overwrite them the moment send() returns."""
    results = []
    for version in range(versions):
        for t in net.state_dict().values():
            t.fill_(version)
        expected = digests(net.state_dict())
        sender.send(net.state_dict().items(), version=version)
        for t in net.state_dict().values():
            t.fill_(-1.0)  # the next step: a receiver still reading would see it
        result = q.get(timeout=60)
        results.append({"same": result.get("digests") == expected, **result})
    return results


@pytest.mark.parametrize("mode", ["load", "into"])
def test_the_trainer_cannot_change_what_a_receiver_still_reads(backend, mode):
    """load: slow views on the host; into: on the sim, host-to-device copies from pinned memory that read
    their source only when they run (the receiver waits for them before its Complete)."""
    if mode == "into" and backend.name == "cpu":
        pytest.skip("on the CPU an into copy is done when it returns: the load case covers the CPU")
    net = procs.model()
    with SharedParameters(net), WeightSender(options=SenderOptions(timeout_s=60)) as sender:
        p, q = start_receiver(sender.endpoint, syncs=2, mode=mode, slow_s=0.3 if mode == "load" else 0.0)
        results = _stepping_trainer(sender, net, 2, q)
        p.join(30)
    assert all(r["same"] for r in results), [r.get("error") for r in results]


@pytest.mark.cpu_is_enough("shows the check above can fail; the host path is enough")
def test_the_tear_check_can_fail_when_send_does_not_wait(backend, monkeypatch):
    def confirm_without_waiting(self, version, stats):
        receivers = self._receivers
        receivers.broadcast(Done(sync=receivers.sync, buckets=stats.buckets, tensors=stats.tensors, bytes=stats.bytes))
        self._control.end_sync(failed=False)

    monkeypatch.setattr(SharedBuffers, "confirm", confirm_without_waiting)
    net = procs.model()
    with SharedParameters(net), WeightSender(options=SenderOptions(timeout_s=60)) as sender:
        p, q = start_receiver(sender.endpoint, syncs=1, mode="load", slow_s=0.3)
        results = _stepping_trainer(sender, net, 1, q)
        p.join(30)
    assert not results[0]["same"], "without the wait for Complete the receiver reads the next step's values"


def test_a_failed_sync_raises_only_once_no_receiver_reads_the_trainer_memory(backend):
    """One receiver fails at once while the other still reads views of the trainer's memory: send() raises only
    after that one stopped, so the trainer's next step (right after) reaches none of its reads. Had send() raised at
    once, the slow receiver's later views would hold the next step's values (a receiver that missed the abort in
    flight would even complete with them)."""
    net = procs.model()
    with SharedParameters(net), WeightSender(num_receivers=2, options=SenderOptions(timeout_s=60)) as sender:
        reader, read_q = start_receiver(sender.endpoint, mode="load", slow_s=0.3)
        failing, fail_q = start_receiver(sender.endpoint, mode="fail")
        for t in net.state_dict().values():
            t.fill_(1.0)
        sent = digests(net.state_dict())
        with pytest.raises(Exception, match="no room for"):
            sender.send(net.state_dict().items(), version=1)
        for t in net.state_dict().values():
            t.fill_(-1.0)  # the trainer steps the moment send() raised
        read, failed = read_q.get(timeout=60), fail_q.get(timeout=60)
        reader.join(30)
        failing.join(30)
    assert "no room for" in failed["error"]
    assert "aborted" in read.get("error", ""), read  # the slow receiver fails its sync too: it holds no version
    assert read["read"], "the slow receiver read views before it heard the abort"
    assert all(read["read"][name] == sent[name] for name in read["read"]), \
        "a view read after send() raised held the trainer's next step"


def test_a_receiver_killed_while_reading_references(backend):
    net = procs.model()
    with SharedParameters(net), WeightSender(options=SenderOptions(timeout_s=20)) as sender:
        slow = subprocess.Popen([sys.executable, str(HERE / "shared_procs.py"), "slow_receiver", sender.endpoint],
                                stdout=subprocess.PIPE, text=True)
        killer = threading.Thread(target=lambda: slow.stdout.readline().strip() == "loading" and slow.kill())
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(SyncTimeoutError, match=rf"peer process {slow.pid} exited waiting for receivers to finish"):
            sender.send(net.state_dict().items(), version=1)
        assert time.monotonic() - t0 < 20
        killer.join()
        slow.wait()
        p, q = start_receiver(sender.endpoint)  # the next sync works
        sender.send(net.state_dict().items(), version=2)
        assert q.get(timeout=60)["digests"] == digests(net.state_dict())
        p.join(30)


@pytest.mark.cpu_is_enough("a killed sender's segments and the receiver's error are host logic")
def test_a_sender_killed_mid_sync_leaves_no_segment(backend):
    sender = subprocess.Popen([sys.executable, str(HERE / "shared_procs.py"), "sender"], stdout=subprocess.PIPE,
                              text=True, cwd=HERE)
    info = json.loads(sender.stdout.readline())
    assert set(info["segments"]) <= set(leftover_segments(info["pid"]))
    p, q = start_receiver(info["endpoint"], timeout_s=5, mode="load")
    assert sender.stdout.readline().strip() == "stalling"
    sender.send_signal(signal.SIGKILL)
    sender.wait()
    result = q.get(timeout=60)
    p.join(30)
    # the sender is named by its pid (the /proc check) or its endpoint (its closed connection), whichever is first
    named = f"peer process {info['pid']} exited" in result["error"] or info["endpoint"].split("#")[0] in result["error"]
    assert named and "SyncTimeoutError" in result["error"], result
    deadline = time.monotonic() + 15
    while leftover_segments(info["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftover_segments(info["pid"]), "a killed sender's shared segments must be removed"


@pytest.mark.cpu_is_enough("segment bookkeeping on the host")
def test_segments_are_few_aligned_and_removed(backend):
    net = procs.model()
    shared = SharedParameters(net, segment_bytes=1 << 15)
    names = shared.shared.segment_names
    assert 1 < len(names) <= len(net.state_dict()) and set(names) <= set(leftover_segments(os.getpid()))
    assert {s.name for s in live_segments()} == set(names)
    for name, t in net.state_dict().items():
        segment, offset = find_shared(t)
        assert segment.name in names and offset % 256 == 0, name
    assert find_shared(net[0].weight.data.t()) is None, "a non-contiguous view goes packed"
    assert find_shared(torch.ones(3)) is None
    shared.close()
    shared.close()
    assert not set(names) & set(leftover_segments()) and not live_segments()


def test_offloading_trainer_moves_to_the_device_trains_and_moves_back(backend):
    device = backend.device().torch_device()
    net = procs.model()  # an offloading trainer's module starts on the host (FSDP/DeepSpeed CPU offload)
    with SharedParameters(net, device=device) as shared:
        assert next(net.parameters()).device.type == "cpu", "constructed offloaded, into shared memory"
        assert shared.home == device and (shared.shared.pinned == (device.type != "cpu"))
        before = digests(net.state_dict())
        shared.to_device()
        assert next(net.parameters()).device == device
        if device.type != "cpu":
            with pytest.raises(RuntimeError, match="call to_host"):
                shared.items()
        with torch.no_grad():  # an update on the device, in place (the sim has no autograd)
            for t in net.parameters():
                t.mul_(0.5).add_(1.0)
        shared.to_host()
        after = dict(shared.items())
        assert all(t.device.type == "cpu" for t in after.values()) and digests(after) != before
        assert digests(after) == digests(net.state_dict())
