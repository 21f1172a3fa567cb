"""Same-host syncs where sender and receiver sit on different devices, on the simulated accelerator.

The sender runs here on device 0; each receiver is a spawned process whose main thread starts
on the device its test says (HWSYNC_SIM_DEVICE, as a launcher's set_device(local_rank)) and
which may not even see device 0 (HWSYNC_SIM_VISIBLE_DEVICES, as CUDA_VISIBLE_DEVICES /
ASCEND_RT_VISIBLE_DEVICES restrict what a process sees).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")

from hwsync import WeightReceiver, WeightSender  # noqa: E402
from hwsync.backend.registry import get_backend  # noqa: E402
from hwsync.sync.options import SenderOptions

import transfer_procs as procs  # noqa: E402

CTX = mp.get_context("spawn")
BUCKET = 1 << 16


def _receive_and_measure(endpoint: str, q) -> None:
    """Receive one sync; report digests, where the tensors were, and this device's memory before and after."""
    device = get_backend().device()
    before = device.memory_allocated()
    receiver = WeightReceiver(endpoint, timeout_s=60)
    got, places = {}, set()

    def load(pairs):
        for name, t in pairs:
            got[name] = procs.digest(t)
            places.add(str(t.device))

    try:
        receiver.receive(load)
        during = device.memory_allocated()
        receiver.close()  # the receiver object stays referenced: what it holds on to shows below
        q.put({"digests": got, "devices": sorted(places), "current": device.current_index(), "before": before,
               "during": during, "after_close": device.memory_allocated()})
    except Exception as exc:  # noqa: BLE001 - reported to the test
        q.put({"error": f"{type(exc).__name__}: {exc}"})


def _sync_to_a_receiver(tensors: dict, transport: str) -> dict:
    with WeightSender(transport=transport, options=SenderOptions(bucket_bytes=BUCKET, timeout_s=60)) as sender:
        q = CTX.Queue()
        p = CTX.Process(target=_receive_and_measure, args=(sender.endpoint, q))
        p.start()
        try:
            sender.send(iter(tensors.items()), version=1)
        except Exception:  # noqa: BLE001 - the receiver's report says why
            pass
        result = q.get(timeout=120)
        p.join(30)
    return result


def test_a_receiver_that_cannot_see_the_senders_device_maps_the_buffers_on_its_own(sim, monkeypatch):
    """NPU IPC (bug 6): handles are rebuilt on the receiver's own device (peer access), as torch_npu's
    users do, instead of insisting that the receiver sees the sender's chip."""
    monkeypatch.setenv("HWSYNC_SIM_VISIBLE_DEVICES", "1")  # the receiver sees physical device 1 only, as its 0
    tensors = procs.versioned(1)
    result = _sync_to_a_receiver(tensors, "sim_ipc")
    assert "error" not in result, result
    assert result["digests"] == procs.digests(tensors)
    assert result["devices"] == ["sim:0"]  # its own device 0, which is physical device 1


@pytest.mark.parametrize("transport", ["sim_ipc", "shm"])
def test_split_tensors_are_reassembled_on_the_receivers_device_and_the_scratch_is_freed_at_close(
        sim, monkeypatch, transport):
    """Bug 10: the reassembly scratch goes on the receiver's own device (not the device of the view it is
    copied from), and receiver.close() gives it back."""
    monkeypatch.setenv("HWSYNC_SIM_DEVICE", "1")  # the receiver works on device 1, the sender here on 0
    tensors = procs.big_and_small(BUCKET)  # "huge" is 5x the bucket: reassembled from chunks
    result = _sync_to_a_receiver(tensors, transport)
    assert "error" not in result, result
    assert result["digests"] == procs.digests(tensors)
    assert result["current"] == 1 and result["devices"] == ["sim:1"]
    huge = tensors["huge"].numel() * tensors["huge"].element_size()
    assert result["during"] - result["before"] >= huge, "the reassembled tensor lives on the receiver's device"
    assert result["after_close"] == result["before"], "close() must free the reassembly scratch"


def test_the_reader_reassembles_on_the_device_it_was_begun_on_not_the_views(sim):
    """Bug 10, the reader's contract: a split tensor read from a buffer elsewhere (here host memory, as a
    staged or peer-mapped buffer may be) is reassembled on the receiver's device that begin() names."""
    from hwsync.sync.bucket import BucketReader
    from hwsync.protocol.layout import Entry

    here = sim.device().torch_device()
    data = torch.arange(96, dtype=torch.uint8)
    first, second = data[:64], data[64:]
    reader = BucketReader()
    reader.begin(here)
    assert reader.read(first, [Entry("w", "uint8", (96,), 0, 0, 64, 96)]) == []
    [(name, tensor)] = reader.read(second, [Entry("w", "uint8", (96,), 0, 64, 32, 96)])
    assert name == "w" and tensor.device == here, f"reassembled on {tensor.device}, not the receiver's {here}"
    assert torch.equal(tensor.cpu(), data)
    reader.clear()


def test_device_tensors_packed_into_pinned_shm_segments_are_published_only_when_the_copies_ran(sim):
    """The shm transport on a device pins its segments (as hwsync_cuda's does, for full-speed copies), so
    packing device tensors into them is a non_blocking copy queued on the stream: publish() must wait for
    the device. Without that wait the receiver reads segments the copies have not filled yet."""
    here = sim.device().torch_device()
    for version in (1, 2):
        tensors = {name: t.to(here) for name, t in procs.versioned(version).items()}
        result = _sync_to_a_receiver(tensors, "shm")
        assert "error" not in result, result
        assert result["digests"] == procs.digests(tensors), f"sync {version}: the receiver read unfinished bytes"


def test_a_replayed_bucket_of_host_and_device_tensors_into_shm_is_exact(sim):
    """Host tensors are packed into host buffers on their own address (no flat byte view); a bucket that also holds
    a device tensor replays as copies, for which each host tensor is read as bytes again: every replay exact."""
    import mapped_procs

    here = sim.device().torch_device()
    source = {"host.a": torch.zeros(96, dtype=torch.bfloat16), "dev.b": torch.zeros(40, 3, device=here),
              "host.c": torch.zeros(7, 5, dtype=torch.float16), "host.d": torch.zeros(3, dtype=torch.int64)}
    with WeightSender(transport="shm", options=SenderOptions(bucket_bytes=BUCKET, timeout_s=60)) as sender:
        p, q = procs.start_receiver(mapped_procs.receive, sender.endpoint, syncs=3)
        for version in (1, 2, 3):
            for i, t in enumerate(source.values()):
                t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype) + 10 * version + i)  # in place: replayable
            stats = sender.send(list(source.items()), version=version)
            result = q.get(timeout=90)
            assert "error" not in result, result
            assert result["digests"] == procs.digests(source), f"sync {version}"
            assert ("replay" in stats.notes) == (version > 1), stats.notes
        p.join(30)
