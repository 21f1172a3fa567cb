"""Bug 8: every HCCL group hwsync builds carries its own group id and its global ranks, as torch_npu's
own factory sets them (torch_npu/_init/registry/distributed.py), so two groups in one process are
never taken for one. HCCL cannot run here: a stand-in for torch_npu's binding records the options
it is given (the option names themselves are checked against the real wheel in
test_npu_api_conformance.py), while the store is torch's real one.
"""

from __future__ import annotations

import datetime
import threading
import types

import pytest
import torch.distributed as dist

from hwsync_npu import hccl


class _Options:
    """ProcessGroupHCCL.Options as the binding exposes it: attributes the caller sets."""


class _RecordingProcessGroupHCCL:
    """Stands in for torch_npu's ProcessGroupHCCL: keeps what it was built with."""

    Options = _Options
    built: list = []

    def __init__(self, store, rank: int, size: int, options: _Options) -> None:
        self.rank, self.size, self.options = rank, size, options
        _RecordingProcessGroupHCCL.built.append(self)


@pytest.fixture
def fake_binding(monkeypatch):
    _RecordingProcessGroupHCCL.built = []
    module = types.SimpleNamespace(ProcessGroupHCCL=_RecordingProcessGroupHCCL)
    monkeypatch.setattr(hccl, "import_torch_npu", lambda: None)
    monkeypatch.setattr(hccl.importlib, "import_module", lambda name: module)
    return _RecordingProcessGroupHCCL


def _group_of_two(store: dist.Store) -> list:
    """Both ranks of one group, built at once on threads (rank 1 waits for rank 0's id)."""
    timeout = datetime.timedelta(seconds=30)
    groups: dict[int, object] = {}
    threads = [threading.Thread(target=lambda r=r: groups.__setitem__(r, hccl.hccl_group(store, r, 2, timeout)))
               for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [groups[0], groups[1]]


def test_each_group_has_one_id_on_all_its_ranks_and_its_own(fake_binding):
    first = _group_of_two(dist.HashStore())
    second = _group_of_two(dist.HashStore())
    for group in first + second:
        options = group.options
        assert options.group_id and options.global_ranks_in_group == [0, 1]
        assert options.is_high_priority_stream is False
        assert options._timeout == datetime.timedelta(seconds=30)
    assert first[0].options.group_id == first[1].options.group_id, "the ranks of one group must agree on its id"
    assert first[0].options.group_id != second[0].options.group_id, "two hwsync groups must not share an id"
