"""hwsync_npu's NPU IPC transport and mapped-source segments, executed: real processes, a stand-in torch_npu.

No NPU here, so torch_npu is tests/npu_torch_standin.py in each process: the CPU stands in for the NPU's
memory (shared-memory files as the allocator's segments), and its sharing calls apply the checks of
torch_npu's StorageSharing.cpp (the 8-tuple, bytes/int/bool types, refusal of non-base formats and of
re-sharing a received storage, the 64-byte event handle) over torch's own ref-counter files, which
hwsync.backend.ipc_counters reads. Each process runs hwsync's NpuBackend unchanged (HWSYNC_BACKEND=npu). What
this cannot show: the runtime's mapping across chips, asynchrony, speed (docs/ascend.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from npu_ipc_procs import StandInProcess
from npu_torch_standin import PREFIX

pytestmark = pytest.mark.slow


@pytest.fixture
def pair() -> Iterator[tuple[StandInProcess, StandInProcess]]:
    sender, receiver = StandInProcess(), StandInProcess()
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()
    # the stand-in's NPU memory is files in /dev/shm: a process that ends leaves none of them
    left = [name for name in os.listdir("/dev/shm") for pid in (sender.pid, receiver.pid)
            if name.startswith(f"{PREFIX}{pid}-")]
    assert not left, left


def test_the_npu_backend_is_selected_and_npu_ipc_is_usable_with_the_stand_in(pair):
    report = pair[0].call("backend_report")
    assert report["backend"] == "npu"
    usable, reason = report["transports"]["npu_ipc"]
    assert usable, reason
    assert "pageable" in report["transports"]["shm"][1]  # 2.10.0.post4 has no npurt, and no CANN is here


def test_buffers_are_mapped_by_another_process_and_each_export_is_taken_down_once(pair):
    sender, receiver = pair
    sender.call("open_sender", 4096, 2)
    handles = sender.call("handles_for", "r1", receiver.pid)
    assert sender.call("counters", handles) == [1, 1]  # one export, one consumer each
    heads = receiver.call("open_receiver", handles, 4096)
    assert heads == [[(j + 7 * i) % 251 for j in range(16)] for i in range(2)]
    receiver.call("close_receiver")
    assert sender.call("counters", handles) == [0, 0], "the receiver's unmap takes each counter to 0"
    sender.call("release_for", "r1")  # the receiver unmapped: a release now would take them below 0
    assert sender.call("counters", handles) == [0, 0]

    never = sender.call("handles_for", "r2", receiver.pid + 1)  # a receiver that never maps its exports
    sender.call("release_for", "r2")
    assert sender.call("counters", never) == [0, 0]
    sender.call("release_for", "r2")
    assert sender.call("counters", never) == [0, 0], "released twice"
    assert "share" in sender.call("close_sender")


def test_segments_of_the_trainer_are_mapped_in_place_and_unshareable_ones_are_packed(pair):
    sender, receiver = pair
    kinds = ["plain", "nz", "pool", "expandable", "heap"]
    heads = sender.call("make_params", kinds)
    located = {kind: sender.call("locate", kind) for kind in kinds}
    assert located == {"plain": True, "nz": False, "pool": False, "expandable": False, "heap": False}
    export = sender.call("export", "plain")
    assert sender.call("segment_counter", export["record"]) == 1
    assert receiver.call("open_segment", export["record"], export["size"], export["offset"],
                         export["nbytes"]) == heads[0]
    # a storage this process received is in none of its segments, and torch_npu refuses to share it on
    assert receiver.call("reshare_mapped").startswith("located=False; Supported to send NPU tensor received")
    receiver.call("drop_mapped")
    assert sender.call("segment_counter", export["record"]) == 0
    assert sender.call("release_export", export["record"]) == 0, "released after the receiver's unmap"

    unmapped = sender.call("export", "plain")  # a second export no receiver maps
    assert sender.call("release_export", unmapped["record"]) == 0


def test_the_stand_in_refuses_what_torch_npu_refuses():
    process = StandInProcess()
    try:
        said = process.call("bad_calls")
    finally:
        process.close()
    assert said[0] == "RuntimeError: tuple of 8 items expected"
    assert said[1].startswith("TypeError: _new_shared in NPU mode received an invalid combination")  # str device
    assert said[2].startswith("TypeError: _new_shared in NPU mode")  # an int where the bool goes
    assert "event handle is 64 bytes" in said[3]
    assert said[4].startswith("TypeError: _new_shared in NPU mode")  # a str handle


def test_expandable_segments_keep_npu_memory_out_of_npu_ipc_with_the_reason():
    process = StandInProcess(env={"PYTORCH_NPU_ALLOC_CONF": "page_size:1g,expandable_segments:True"})
    try:
        report = process.call("backend_report")
        usable, reason = report["transports"]["npu_ipc"]
        assert not usable and "expandable_segments:True" in reason and "PYTORCH_NPU_ALLOC_CONF" in reason
        with pytest.raises(RuntimeError, match="npu_ipc cannot be used: .*expandable_segments"):
            process.call("open_sender", 4096, 2)
    finally:
        process.close()


@pytest.mark.parametrize("delta", [False, True])
def test_whole_syncs_and_deltas_go_through_the_npu_backend(pair, delta):
    # the trainer's tensors in its NPU allocator's segments, the engine's destinations in its own; every step
    # after the first changes ~2% of the elements, as an RL step does
    sender, receiver = pair
    endpoint = sender.call("sender_start", delta, 64 * 1024)
    receiver.call("receiver_start", endpoint)
    try:
        full_bytes = None
        for version in range(1, 5):
            receiver._conn.send(("receiver_sync", ()))  # the receiver blocks in receive() while the sender sends
            sent = sender.call("sender_step", version, 0.02)
            assert receiver._conn.poll(120)
            ok, got = receiver._conn.recv()
            assert ok, got
            assert got["version"] == version and got["digests"] == sent["digests"], f"step {version}"
            assert sent["transport"] == "npu_ipc"
            mode = sent["delta"].get("mode")
            if version == 1:
                full_bytes = sent["bytes"]
            elif delta:
                assert mode == "delta" and sent["bytes"] < full_bytes / 4, sent["delta"]
        assert "share" in sender.call("sender_close")
    finally:
        receiver.call("receiver_close")
