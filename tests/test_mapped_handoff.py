"""What only an asynchronous device shows about the same-host path (issue 28), on the simulated accelerator.

The sim runs a device copy 0.2 s after it is queued unless something waits for it, and counts every
copy launch, device-wide synchronize and event wait, so these tests see: a receiver that answered
Complete before its copies from the trainer's memory ran (the trainer then steps under them), copies
launched one per tensor instead of one per bucket, and device-wide synchronizes per bucket where an
event on the copying stream is enough.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hwsync_sim", reason="the sim backend is not installed: pip install -e tests/plugins/hwsync_sim")

import mapped_procs as procs
from transfer_procs import digests, start_receiver

from hwsync import WeightSender
from hwsync.sync.options import SenderOptions


def _sync(sender: WeightSender, device, source: dict, version: int, q) -> tuple:
    before = dict(device.counters() or {})
    stats = sender.send(list(source.items()), version=version)
    sent = procs.counted(device, before)
    result = q.get(timeout=90)
    assert "error" not in result, result
    return stats, sent, result


def test_send_returns_only_after_every_receivers_copies_from_the_trainers_memory_ran(sim):
    """The trainer steps the moment send() returns: a receiver whose copies were still queued would read the step."""
    import multiprocessing as mp

    device = sim.device()
    net = procs.model(device.torch_device())
    stepped = mp.get_context("spawn").Event()
    with WeightSender(options=SenderOptions(timeout_s=60)) as sender:
        # the receiver's device runs a copy nobody waits for only after 30 s: it cannot slip in before the step
        p, q = start_receiver(procs.receive, sender.endpoint, env={"HWSYNC_SIM_STREAM_DELAY_S": "30"}, hold=stepped)
        want = digests(net.state_dict())
        stats = sender.send(net.state_dict().items(), version=1)
        with torch.no_grad():
            for t in net.state_dict().values():
                t.fill_(7.0)  # the next optimizer step...
        device.synchronize()  # ...has landed
        stepped.set()  # only now may the receiver read its destinations
        result = q.get(timeout=90)
        p.join(30)
    assert stats.notes["mapped"]["tensors"] == len(want)
    assert result["digests"] == want, "the receiver read the trainer's next step: send() returned before its copies ran"


def test_packed_copy_launches_do_not_grow_with_the_number_of_tensors_and_no_bucket_syncs_the_device(sim):
    """The same 512 KiB in 8 or 128 tensors made for the sync (nothing else holds them: they go packed) into
    64 KiB buckets: one launch per bucket on each side, and each bucket handed over by an event on the copying
    stream, never a device-wide synchronize."""
    device = sim.device()
    where = device.torch_device()
    seen = {}
    for count in (8, 128):
        source = {f"t{i}": torch.full(((512 << 10) // 4 // count,), float(i), device=where) for i in range(count)}
        device.synchronize()  # the fills have run (queued work holds its tensors, as a kernel's arguments)
        with WeightSender(options=SenderOptions(bucket_bytes=64 << 10, num_buffers=2, timeout_s=60)) as sender:
            p, q = start_receiver(procs.receive, sender.endpoint)
            stats, sent, result = _sync(sender, device, source, 1, q)
            p.join(30)
        assert result["digests"] == digests(source) and "mapped" not in stats.notes
        received = result["counts"]
        seen[count] = (sent.get("copy_launches", 0), received.get("copy_launches", 0), stats.buckets)
        assert sent.get("copy_launches", 0) <= stats.buckets, f"{count} tensors: the sender launched {sent}"
        assert received.get("copy_launches", 0) <= stats.buckets, f"{count} tensors: the receiver launched {received}"
        assert sent.get("device_syncs", 0) == 0 and received.get("device_syncs", 0) == 0, (sent, received)
        assert sent.get("event_waits", 0) >= stats.buckets and received.get("event_waits", 0) >= stats.buckets
    assert seen[8] == seen[128], f"launches per sync grew with the number of tensors: {seen}"


def _stepped_syncs(sim, syncs: int):
    """A model's parameters on the sim, stepped in place and sent `syncs` times to one receiver process; per sync
    (version, the model, the sender's stats, what each side's device counted)."""
    device = sim.device()
    net = procs.model(device.torch_device())
    with WeightSender(options=SenderOptions(timeout_s=60)) as sender:
        p, q = start_receiver(procs.receive, sender.endpoint, syncs=syncs)
        for version in range(syncs):
            procs.step(net, version)
            yield (version, net, *_sync(sender, device, dict(net.state_dict()), version, q))
        p.join(30)


def test_a_mapped_sync_waits_by_events_and_launches_once(sim):
    for _version, net, stats, sent, result in _stepped_syncs(sim, 2):
        assert result["digests"] == digests(net.state_dict())
        assert sent.get("device_syncs", 0) == 0 and result["counts"].get("device_syncs", 0) == 0
        assert result["counts"]["copy_launches"] == 1 and stats.buckets == 0


def test_a_replayed_mapped_sync_sends_no_reference_and_launches_once(sim):
    """Issue 50: after the first sync, the same parameters (stepped in place) are a replay of its plan: no Refs frame,
    the receiver's recorded copies run again in one launch per width, and every sync is exact."""
    for version, net, stats, sent, result in _stepped_syncs(sim, 3):
        assert result["digests"] == digests(net.state_dict()), f"sync {version} is not exact"
        assert ("replay" in stats.notes) == (version > 0), stats.notes
        assert result["counts"]["copy_launches"] == 1 and sent.get("copy_launches", 0) == 0
        assert stats.notes["mapped"]["tensors"] == len(net.state_dict())


def _staged(where: torch.device, values: dict, lent: bool):
    """A source that refills one staging tensor for each item (as LocalForwarder's receive buffers are refilled)."""
    from hwsync.sync.bucket import lend

    staging = torch.empty(4096, device=where)
    for name, value in values.items():
        staging.copy_(value)
        yield name, lend(staging.view(64, 64)) if lent else staging.view(64, 64)


@pytest.mark.parametrize("how", ["lent", "stable_sources=False"])
def test_a_source_that_refills_its_memory_after_each_item_is_copied_at_once(sim, how):
    """Tensors are read after the source moved on (a bucket's copies launch together; references are read by the
    receiver later), except memory hwsync lent to a load call (bucket.lend) and any of a sender that says its
    sources are not stable: those are copied before the source is asked for the next item."""
    device = sim.device()
    where = device.torch_device()
    values = {f"w{i}": torch.full((4096,), float(i)).to(where) for i in range(6)}
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 16, timeout_s=60, stable_sources=how == "lent")) as sender:
        p, q = start_receiver(procs.receive, sender.endpoint)
        stats = sender.send(_staged(where, values, lent=how == "lent"), version=1)
        result = q.get(timeout=90)
        p.join(30)
    assert "error" not in result, result
    assert result["digests"] == digests({n: v.view(64, 64) for n, v in values.items()}), "read after the refill"
    assert "mapped" not in stats.notes
