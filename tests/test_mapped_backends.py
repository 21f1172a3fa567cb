"""Mapped sources on CUDA and the NPU, checked where no GPU or NPU is needed (issue 28).

What runs here: which tensors count as kept by something else (torch's storage use count, as on a
GPU), how a tensor's caching-allocator segment is found from the allocator's snapshot (a stand-in
snapshot in torch's format), that export records from a peer are checked field by field, and that
the NPU offers no device segments where its IPC is not allowed, saying so. Exporting and mapping
themselves need the hardware: unverified here (docs/cuda.md, docs/ascend.md).
"""

from __future__ import annotations

import pytest
import torch

from hwsync.errors import HwsyncError


def test_only_tensors_something_else_keeps_are_read_in_place():
    """A Parameter or a state_dict() entry (sharing its parameter's storage) outlives the sync; a cast, a fresh
    tensor, one held only by a list, does not, and goes packed."""
    from hwsync_cuda.segments import CudaDeviceSegments

    segments = CudaDeviceSegments()
    net = torch.nn.Linear(4, 3)
    held = [torch.zeros(5)]
    assert segments.held_elsewhere(net.weight)
    assert all(segments.held_elsewhere(t) for t in net.state_dict().values())
    assert not segments.held_elsewhere(net.weight.detach().to(torch.float16))
    assert not segments.held_elsewhere(held[0])
    assert segments.held_elsewhere(held[0][1:])  # a view: the list's tensor keeps the storage


def test_a_tensors_segment_is_found_in_the_allocators_snapshot_taken_once_per_sync(monkeypatch):
    import hwsync_cuda.segments as cuda_segments

    calls = []
    snapshot = [{"device": 0, "address": 1 << 20, "total_size": 2 << 20, "is_expandable": False},
                {"device": 0, "address": 8 << 20, "total_size": 20 << 20, "is_expandable": False},
                {"device": 0, "address": 64 << 20, "total_size": 4 << 20, "is_expandable": True},
                {"device": 1, "address": 1 << 20, "total_size": 2 << 20}]
    monkeypatch.setattr(cuda_segments, "_snapshot_segments", lambda: calls.append(1) or snapshot)
    segments = cuda_segments.CudaDeviceSegments()
    assert segments._segment_of(0, (8 << 20) + 4096) == (8 << 20, 20 << 20)
    assert segments._segment_of(0, (1 << 20) + 17) == (1 << 20, 2 << 20)
    assert segments._segment_of(1, 1 << 20) == (1 << 20, 2 << 20)
    assert segments._segment_of(0, (64 << 20) + 8) is None, "expandable segments are shared by fd, never exported"
    assert segments._segment_of(0, 40 << 20) is None
    assert len(calls) == 1, "one snapshot until the next collect"

    class Ref:  # a StorageWeakRef stand-in
        def __init__(self, live: bool) -> None:
            self.live = live

        def expired(self) -> bool:
            return not self.live

    segments._anchors = {(0, 8 << 20): [Ref(True)], (0, 1 << 20): [Ref(False)]}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    segments.collect()
    assert segments._segment_of(0, (8 << 20) + 1) == (8 << 20, 20 << 20) and len(calls) == 1, \
        "a segment a live anchor vouches for stays known"
    snapshot[0]["total_size"] = 1 << 20  # freed by empty_cache and made again at the same address, smaller
    assert segments._segment_of(0, (1 << 20) + 17) == (1 << 20, 1 << 20) and len(calls) == 2, \
        "a range no live anchor vouches for is looked up again"


@pytest.mark.parametrize("record", [
    None, [], {"kind": "cuda_segment"},
    {"kind": "cuda_segment", "uuid": "GPU-1", "pid": 1, "size": 4096, "handle": "not bytes",
     "ref_counter_handle": b"/torch_1_1", "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False},
    {"kind": "cuda_segment", "uuid": "GPU-1", "pid": 1, "size": 4096, "handle": b"h", "ref_counter_handle": b"r",
     "ref_counter_offset": True, "event_handle": None, "event_sync_required": False},
    {"kind": "npu_segment", "uuid": "GPU-1", "pid": 1, "size": 4096, "handle": b"h", "ref_counter_handle": b"r",
     "ref_counter_offset": 0, "event_handle": None, "event_sync_required": False},
])
def test_a_peers_export_record_is_checked_before_torch_sees_it(record):
    from hwsync_cuda.segments import CudaDeviceSegments

    with pytest.raises(HwsyncError, match="not a device segment export"):
        CudaDeviceSegments().open(record, 4096)


def test_a_cuda_receiver_with_expandable_segments_still_maps_a_senders_segments(monkeypatch):
    """Expandable segments stop this process exporting (cuda_ipc unavailable), not mapping another's."""
    from hwsync_cuda.backend import CudaBackend

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    transport = CudaBackend().transports()["cuda_ipc"]
    monkeypatch.setattr(transport, "_ipc_reason", lambda: None)  # as on a GPU machine
    monkeypatch.setattr("hwsync_cuda.ipc.expandable_segments_reason", lambda: "expandable (test)")
    assert not transport.available().usable
    assert transport.device_segments() is not None


def test_the_npu_offers_device_segments_only_where_its_ipc_is_allowed():
    from hwsync_npu.backend import NpuBackend
    from hwsync_npu.versions import decide_ipc

    transport = NpuBackend().transports()["npu_ipc"]
    transport._decision = decide_ipc("8.2.RC1", "25.2.0")
    assert transport.device_segments() is None
    assert "device tensors go packed" in transport.available().reason
    transport._decision = decide_ipc("8.3.RC1", "25.3.RC1")
    assert transport.device_segments() is not None
    assert "mapped sources" in transport.decision().reason


def test_an_npu_export_record_is_checked_before_torch_npu_sees_it():
    from hwsync_npu.segments import NpuDeviceSegments

    with pytest.raises(HwsyncError, match="not a device segment export"):
        NpuDeviceSegments().open({"kind": "npu_segment", "handle": b"h", "size": 4096}, 4096)
