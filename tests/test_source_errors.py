"""Bad items of a sync's source are named, with the fix, on both paths (hwsync.sync.spec checks them all).

Each bad source goes through a real sync: the sender raises SourceError naming the item (its
position, and its name where it has one) and what to do; the receiver hears the abort; the
next sync of the same session is exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hwsync.errors import SourceError
from hwsync.errors import PlanError
from hwsync.sync.planner import SyncMode, TrainerModel, plan_sync

from test_control_plane import Session
from test_control_plane_hub import HubSession

GOOD = ("a", torch.ones(4))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # sparse CSR is "beta"
    CSR = torch.eye(3).to_sparse_csr()

#: (the item at position 1, what the error must say)
BAD = {
    "int name": ((5, torch.ones(2)), ["item #1 of the source is named 5, of type int", "names must be str",
                                      'f"layer.{i}"']),
    "bytes name": ((b"w", torch.ones(2)), ["item #1 of the source is named b'w', of type bytes", "name.decode()"]),
    "None name": ((None, torch.ones(2)), ["item #1 of the source is named None", "names must be str"]),
    "meta tensor": (("w", torch.empty(4, device="meta")), ["item #1 ('w') of the source is a meta tensor",
                                                           "materialise it before sending"]),
    "sparse COO": (("w", torch.eye(3).to_sparse()), ["item #1 ('w') of the source has layout torch.sparse_coo",
                                                     "tensor.to_dense()"]),
    "sparse CSR": (("w", CSR), ["item #1 ('w') of the source has layout torch.sparse_csr", "tensor.to_dense()"]),
    "bare tensor": (torch.ones(2), ["item #1 of the source is of type Tensor", "not a (name, tensor) pair",
                                    "model.state_dict().items()"]),
    "triple": (("w", torch.ones(2), "x"), ["item #1 of the source is a tuple of 3 items", "(name, tensor) pair"]),
    "str item": ("ab", ["item #1 of the source is of type str", "(name, tensor) pair"]),
    "not a tensor": (("w", [1.0, 2.0]), ["item #1 ('w') of the source is of type list, not a torch.Tensor",
                                         "torch.as_tensor"]),
    "conjugate view": (("w", torch.ones(2, dtype=torch.complex64).conj()),
                       ["item #1 ('w') of the source is a lazy conjugate view", "tensor.resolve_conj()"]),
    "negative view": (("w", torch._neg_view(torch.ones(2))),
                      ["item #1 ('w') of the source is a lazy negative view", "tensor.resolve_neg()"]),
}


@pytest.fixture(scope="module")
def colocated():
    s = Session("ipc")
    yield s
    s.close()


@pytest.fixture(scope="module")
def disaggregated():
    s = HubSession()
    yield s
    s.close()


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_item_is_named_with_the_fix_on_the_same_host_path(colocated, case):
    item, says = BAD[case]
    with pytest.raises(SourceError) as info:
        colocated.sender.send([GOOD, item], version=colocated.version + 1)
    for text in says:
        assert text in str(info.value), str(info.value)
    assert "sender aborted the sync" in colocated.q.get(timeout=30)["error"]
    colocated.sync_exact()


@pytest.mark.parametrize("case", ["int name", "meta tensor", "sparse COO", "bare tensor"])
def test_a_bad_item_is_named_with_the_fix_on_the_cross_node_path(disaggregated, case):
    item, says = BAD[case]
    with pytest.raises(SourceError) as info:
        disaggregated.tx.send([GOOD, item], version=disaggregated.version + 1)
    for text in says:
        assert text in str(info.value), str(info.value)
    assert "aborted" in disaggregated.q.get(timeout=30)["error"]
    disaggregated.sync_exact()


def test_the_planner_names_a_bad_item_of_its_sources_alike():
    plan = plan_sync(None, TrainerModel(SyncMode.FULL, base=[GOOD, BAD["meta tensor"][0]]))
    with pytest.raises(PlanError, match=r"item #1 \('w'\) of the weights source is a meta tensor"):
        list(plan.tensors())


class _Name(str):
    pass


#: items named_tensor takes, some only through its one-check-at-a-time path (a str subclass as a name)
ODD_GOOD = {
    "parameter": ("w", torch.nn.Parameter(torch.ones(2))),
    "bool": ("w", torch.ones(2, dtype=torch.bool)),
    "empty": ("w", torch.ones(0, 3)),
    "strided view": ("w", torch.ones(4, 4).t()),
    "a list pair": ["w", torch.ones(2)],
    "str subclass name": (_Name("w"), torch.ones(2)),
}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # nested tensors are a "prototype", quantized ones deprecated
    ODD_BAD = {
        "nested": ("w", torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])),
        "quantized": ("w", torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)),
    }


#: every item above, bad and good
ITEMS = {**{case: item for case, (item, _) in BAD.items()}, **ODD_GOOD, **ODD_BAD}


@pytest.mark.parametrize("case", list(ITEMS))
def test_the_quick_check_of_an_item_takes_exactly_what_the_one_that_names_the_fault_takes(case):
    # named_tensor checks every field at once and hands what fails to _checked_named_tensor, which names the fault
    from hwsync.sync.spec import _checked_named_tensor, named_tensor

    outcomes: list = []
    for check in (named_tensor, lambda at, item: _checked_named_tensor(at, item, "the source", SourceError)):
        try:
            outcomes.append(check(1, ITEMS[case]))
        except SourceError as exc:
            outcomes.append(str(exc))
    assert outcomes[0] == outcomes[1]
    assert isinstance(outcomes[0], str) == (case not in ODD_GOOD), outcomes[0]


def test_a_conjugate_view_of_shared_memory_is_refused_not_sent_as_its_memory_holds_it():
    """The one-copy path sends a reference to a tensor's memory: a lazy conjugate view of a shared tensor lies there
    unconjugated, and a receiver reading it completed holding the values before conj() (until 2026-11-30)."""
    import threading

    from hwsync import WeightReceiver, WeightSender
    from hwsync.sync.options import SenderOptions
    from hwsync.sync.shared_params import SharedTensors

    shared = SharedTensors([("z", torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64))])
    dest, outcome = torch.zeros(2, dtype=torch.complex64), []
    try:
        with WeightSender(options=SenderOptions(timeout_s=20)) as sender:
            def receive() -> None:
                with WeightReceiver(sender.endpoint, timeout_s=20) as receiver:
                    try:
                        receiver.receive(into=lambda name, dtype, shape: dest)
                        outcome.append("completed")
                    except Exception as exc:  # noqa: BLE001 - what the test reads
                        outcome.append(str(exc))

            thread = threading.Thread(target=receive)
            thread.start()
            with pytest.raises(SourceError, match="item #0 .'z'. of the source is a lazy conjugate view"):
                sender.send([("z", dict(shared.items())["z"].conj())], version=1)
            thread.join(30)
    finally:
        shared.close()
    assert outcome and "lazy conjugate view" in outcome[0], outcome
    assert torch.equal(dest, torch.zeros(2, dtype=torch.complex64))
