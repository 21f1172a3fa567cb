"""SegmentIndex (hwsync.sync.shared_params): which shared segment a tensor lies in, by binary search over the
segments' addresses, agrees with a scan of every segment on any layout: tensors spread over many segments, views
at aligned and unaligned offsets, views that run past their segment's end, tensors outside every segment."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hwsync.protocol.layout import ALIGNMENT, SegmentSpec
from hwsync.sync.shared_params import LIVE, SegmentIndex, SharedTensors, find_shared


def _scan(tensor: torch.Tensor) -> tuple[SegmentSpec, int] | None:
    """The rule, segment by segment: a contiguous, non-empty host tensor (or Parameter) lying whole in one of this
    process's segments at an aligned offset."""
    if tensor.device.type != "cpu" or type(tensor) not in (torch.Tensor, torch.nn.Parameter) or not tensor.numel():
        return None
    if not tensor.is_contiguous():
        return None
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for segment in LIVE.values():
        base = segment.tensor.data_ptr()
        if segment.created_here and base <= start and end <= base + segment.size and (start - base) % ALIGNMENT == 0:
            return SegmentSpec(segment.name, segment.size), start - base
    return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=24), segment_kib=st.integers(4, 16),
       probes=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 4000), st.integers(0, 3)), max_size=30))
def test_the_index_finds_what_a_scan_of_every_segment_finds(sizes, segment_kib, probes):
    shared = SharedTensors([(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)],
                           segment_bytes=segment_kib << 10, pin=False)
    try:
        index = SegmentIndex()
        event(f"{min(len(shared._segments), 4)}+ segments" if len(shared._segments) >= 4 else
              f"{len(shared._segments)} segments")
        tensors = list(shared.tensors.values())
        candidates: list[torch.Tensor] = [*tensors, torch.ones(5), torch.empty(0)]
        for pick, length, kind in probes:  # views of the tensors and of whole segments, aligned or not
            whole = tensors[pick % len(tensors)] if kind < 2 else shared._segments[pick % len(shared._segments)].tensor
            start = pick % max(1, whole.numel())
            view = whole[start:start + length]
            candidates.append(view if kind != 1 else view.view(-1)[::2])  # kind 1: a strided view goes packed
        for tensor in candidates:
            assert index.find(tensor) == _scan(tensor) == find_shared(tensor), (tensor.shape, tensor.stride())
    finally:
        shared.close()
    assert SegmentIndex().find(tensors[0]) is None  # closed: in no live segment
