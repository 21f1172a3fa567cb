"""The sync planner over the whole engine-state matrix, and its tensor iterator."""

from __future__ import annotations

import itertools

import msgpack
import pytest
import torch

from hwsync.sync.planner import (
    DuplicateTensorError,
    EngineState,
    PlanError,
    SendSet,
    SyncMode,
    TrainerModel,
    plan_sync,
)
from hwsync.sync.report import ReceiverReport
from hwsync.sync.sender import resolve_source
from hwsync.sync.spec import Source, TensorSpec
from hwsync.sync.stats import SyncStats

BASE_NAMES = ["embed.weight", "layers.0.q.weight", "layers.0.v.weight", "lm_head.weight"]
ADAPTER_NAMES = ["layers.0.q.lora_A", "layers.0.q.lora_B"]


class CountingSource:
    """A re-callable source that records how often it was opened."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return ((n, torch.full((2,), float(i))) for i, n in enumerate(self.names))


def make_model(mode: SyncMode, base_version=None) -> tuple[TrainerModel, CountingSource, CountingSource | None]:
    base = CountingSource(BASE_NAMES)
    adapters = CountingSource(ADAPTER_NAMES) if mode is SyncMode.LORA_UNMERGED else None
    return TrainerModel(mode, base=base, adapters=adapters, base_version=base_version), base, adapters


def expected_send(sleep_level, weights_freed, has_base, engine_base, mode, trainer_base,
                  base_intact=None) -> SendSet | None:
    """The rules, written out independently of the planner; None means an invalid state."""
    if sleep_level == 0 and weights_freed:
        return None
    if mode is not SyncMode.LORA_UNMERGED:
        return SendSet.ALL
    lost = (
        not has_base
        or (sleep_level == 2 and weights_freed)
        or base_intact is False
        or (trainer_base is not None and engine_base is not None and engine_base != trainer_base)
    )
    return SendSet.BASE_THEN_ADAPTERS if lost else SendSet.ADAPTERS_ONLY


MATRIX = list(itertools.product(
    [0, 1, 2],                      # sleep_level
    [False, True],                  # weights_freed
    [False, True],                  # has_base
    [None, 0, 7],                   # version
    [None, "base-a", "base-b"],     # engine's base_version
    list(SyncMode),                 # trainer mode
    [None, "base-a"],               # trainer's base_version
    [None, False, True],            # base_intact: the engine's own check of its weights
))


@pytest.mark.parametrize("sleep_level,weights_freed,has_base,version,engine_base,mode,trainer_base,base_intact",
                         MATRIX)
def test_state_matrix(sleep_level, weights_freed, has_base, version, engine_base, mode, trainer_base, base_intact):
    want = expected_send(sleep_level, weights_freed, has_base, engine_base, mode, trainer_base, base_intact)
    fields = dict(sleep_level=sleep_level, weights_freed=weights_freed, has_base=has_base,
                  version=version, base_version=engine_base, base_intact=base_intact)
    if want is None:
        with pytest.raises(PlanError, match="level of the sleep that freed"):
            EngineState(**fields)
        return
    # The state travels as msgpack from the receiver: plan from what actually arrives.
    wire = msgpack.unpackb(msgpack.packb(EngineState(**fields).to_dict()))
    assert EngineState.from_dict(wire) == EngineState(**fields)
    model, base, adapters = make_model(mode, trainer_base)
    plan = plan_sync(wire, model)
    assert plan.send is want
    assert plan.reason and plan.reason.endswith(("sent", "adapters"))
    assert msgpack.unpackb(msgpack.packb(plan.to_dict()))["send"] == want.value
    # Planning consumes nothing.
    assert base.calls == 0 and (adapters is None or adapters.calls == 0)

    names = [n for n, _ in plan.tensors()]
    if want is SendSet.ALL:
        assert names == BASE_NAMES
    elif want is SendSet.ADAPTERS_ONLY:
        assert names == ADAPTER_NAMES
        assert base.calls == 0, "a base that is not sent must never be materialised"
    else:
        assert names == BASE_NAMES + ADAPTER_NAMES
    assert len(names) == len(set(names))


def test_field_bug_base_not_resent_when_engine_kept_it():
    """LoRA, engine awake or asleep without freeing: the base goes once, then adapters only."""
    model, base, _ = make_model(SyncMode.LORA_UNMERGED)
    for state in (EngineState(0, False, True, version=5), EngineState(1, True, True, version=5),
                  EngineState(2, False, True, version=5)):
        plan = plan_sync(state, model)
        assert plan.send is SendSet.ADAPTERS_ONLY, plan.reason
        assert [n for n, _ in plan.tensors()] == ADAPTER_NAMES
    assert base.calls == 0


def test_field_bug_base_resent_after_level2_sleep_freed_it():
    model, base, _ = make_model(SyncMode.LORA_UNMERGED)
    plan = plan_sync({"sleep_level": 2, "weights_freed": True, "has_base": True, "version": 5}, model)
    assert plan.send is SendSet.BASE_THEN_ADAPTERS
    assert "level-2 sleep" in plan.reason
    assert [n for n, _ in plan.tensors()] == BASE_NAMES + ADAPTER_NAMES
    assert base.calls == 1


def test_unknown_engine_state_sends_base():
    model, _, _ = make_model(SyncMode.LORA_UNMERGED)
    plan = plan_sync(None, model)
    assert plan.send is SendSet.BASE_THEN_ADAPTERS and "unknown" in plan.reason


def test_duplicate_within_base_names_it():
    model = TrainerModel(SyncMode.FULL, base=lambda: [("a", torch.ones(1)), ("b", torch.ones(1)), ("a", torch.ones(1))])
    it = plan_sync(EngineState(0, False, True), model).tensors()
    assert next(it)[0] == "a" and next(it)[0] == "b"
    with pytest.raises(DuplicateTensorError, match="'a' was yielded twice"):
        next(it)


def test_duplicate_across_base_and_adapters_names_it():
    model = TrainerModel(SyncMode.LORA_UNMERGED, base=lambda: [("w", torch.ones(1))],
                         adapters=lambda: [("w", torch.ones(1))])
    plan = plan_sync(EngineState(0, False, False), model)
    with pytest.raises(DuplicateTensorError, match=r"'w'.*first in base, again in adapters"):
        list(plan.tensors())


def test_one_shot_iterator_is_refused_the_second_time():
    gen = (n for n in [("x", torch.ones(1))])
    plan = plan_sync(EngineState(0, False, True), TrainerModel(SyncMode.FULL, base=gen))
    assert [n for n, _ in plan.tensors()] == ["x"]
    with pytest.raises(PlanError, match="pass a callable"):
        list(plan.tensors())


def test_callable_source_is_reopened_each_time():
    model, base, _ = make_model(SyncMode.FULL)
    plan = plan_sync(EngineState(0, False, True), model)
    assert [n for n, _ in plan.tensors()] == [n for n, _ in plan.tensors()] == BASE_NAMES
    assert base.calls == 2


def test_tensors_are_yielded_lazily():
    produced = []

    def base():
        for name in BASE_NAMES:
            produced.append(name)
            yield name, torch.zeros(1)

    it = plan_sync(EngineState(0, False, True), TrainerModel(SyncMode.FULL, base=base)).tensors()
    next(it)
    assert produced == BASE_NAMES[:1]


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="nope", base=[]), "not one of"),
    (dict(mode=SyncMode.FULL), "pass them as `base`"),
    (dict(mode=SyncMode.FULL, base=[], adapters=[]), "merge the adapters"),
    (dict(mode=SyncMode.LORA_MERGED, base=[], adapters=[]), "merge the adapters"),
    (dict(mode=SyncMode.LORA_UNMERGED, base=[]), "pass them as `adapters`"),
])
def test_trainer_model_misconfiguration(kwargs, match):
    with pytest.raises(PlanError, match=match):
        TrainerModel(**kwargs)


def test_mode_accepts_its_string_value():
    assert TrainerModel("lora_merged", base=[]).mode is SyncMode.LORA_MERGED


def test_base_needed_but_missing():
    model = TrainerModel(SyncMode.LORA_UNMERGED, adapters=lambda: [("a", torch.ones(1))])
    assert plan_sync(EngineState(0, False, True), model).send is SendSet.ADAPTERS_ONLY
    with pytest.raises(PlanError, match="TrainerModel.base is None"):
        plan_sync(EngineState(2, True, True), model)


def test_empty_adapters_is_an_error():
    plan = plan_sync(EngineState(0, False, True), TrainerModel(SyncMode.LORA_UNMERGED, adapters=list))
    with pytest.raises(PlanError, match="no adapter tensors"):
        list(plan.tensors())


def test_bad_items_are_named():
    plan = plan_sync(None, TrainerModel(SyncMode.FULL, base=[("a", [1, 2])]))
    with pytest.raises(PlanError, match=r"item #0 \('a'\) of the weights source is of type list, not a torch.Tensor"):
        list(plan.tensors())


@pytest.mark.parametrize("data,match", [
    ({"sleep_level": 1, "weights_freed": False}, "lacks has_base"),
    ({"sleep_level": 3, "weights_freed": False, "has_base": True}, "0, 1 or 2"),
    ({"sleep_level": True, "weights_freed": False, "has_base": True}, "0, 1 or 2"),
    ({"sleep_level": 0, "weights_freed": 0, "has_base": True}, "weights_freed must be a bool"),
    ({"sleep_level": 0, "weights_freed": False, "has_base": True, "version": 1.5}, "version must be"),
    ({"sleep_level": 0, "weights_freed": False, "has_base": True, "base_intact": "yes"}, "base_intact must be"),
])
def test_engine_state_validation(data, match):
    with pytest.raises(PlanError, match=match):
        EngineState.from_dict(data)


def test_engine_state_ignores_unknown_keys():
    state = EngineState.from_dict({"sleep_level": 1, "weights_freed": True, "has_base": True, "future": 1})
    assert state == EngineState(1, True, True)


def test_several_engines_get_the_base_if_any_lacks_it():
    from hwsync.sync.planner import plan_for_engines

    model, _, _ = make_model(SyncMode.LORA_UNMERGED)
    kept, freed = EngineState(0, False, True), EngineState(2, True, True)
    assert plan_for_engines([kept, kept], model).send is SendSet.ADAPTERS_ONLY
    plan = plan_for_engines([kept, freed.to_dict()], model)
    assert plan.send is SendSet.BASE_THEN_ADAPTERS and plan.reason.startswith("engine 1 of 2:")
    with pytest.raises(PlanError, match="at least one"):
        plan_for_engines([], model)


def test_one_shot_iterator_is_refused_by_the_next_plan_too():
    gen = (n for n in [("x", torch.ones(1))])
    model = TrainerModel(SyncMode.FULL, base=gen)
    assert [n for n, _ in plan_sync(EngineState(0, False, True), model).tensors()] == ["x"]
    with pytest.raises(PlanError, match="pass a callable"):
        list(plan_sync(EngineState(0, False, True), model).tensors())  # the next send() plans anew


def test_base_changed_behind_the_engines_back_is_resent():
    """The engine's own check outranks its sleep flags: a base that changed is sent again."""
    model, base, _ = make_model(SyncMode.LORA_UNMERGED)
    plan = plan_sync(EngineState(0, False, True, version=3, base_intact=False).to_dict(), model)
    assert plan.send is SendSet.BASE_THEN_ADAPTERS and "own check" in plan.reason
    kept = plan_sync(EngineState(0, False, True, version=3, base_intact=True), model)
    assert kept.send is SendSet.ADAPTERS_ONLY and "check confirms" in kept.reason


def test_plan_manifest_is_exactly_what_it_sends():
    from hwsync.sync.spec import TensorSpec

    base_specs = [TensorSpec(n, "float32", (2,)) for n in BASE_NAMES]
    adapter_specs = [TensorSpec(n, "float32", (2,)) for n in ADAPTER_NAMES]
    model, _, _ = make_model(SyncMode.LORA_UNMERGED)
    model.base_manifest, model.adapters_manifest = base_specs, adapter_specs
    both = plan_sync(None, model)
    assert both.manifest() == base_specs + adapter_specs
    assert [n for n, _ in both.tensors()] == [s.name for s in both.manifest()]
    assert plan_sync(EngineState(0, False, True), model).manifest() == adapter_specs
    model.adapters_manifest = None
    assert plan_sync(EngineState(0, False, True), model).manifest() is None
    full = TrainerModel(SyncMode.FULL, base=list, base_manifest=base_specs)
    assert plan_sync(None, full).manifest() == base_specs


class Checkpoint:
    """A Source of the user's own: its manifest from metadata, and a fresh iteration every time it is asked."""

    def __init__(self) -> None:
        self.opened = 0

    def manifest(self) -> list[TensorSpec]:
        return [TensorSpec("a", "float32", (2,)), TensorSpec("b", "float32", (3,))]

    def tensors(self):
        self.opened += 1
        return iter([("a", torch.zeros(2)), ("b", torch.ones(3))])


def test_a_source_is_asked_afresh_every_sync_and_announces_its_manifest():
    source = Checkpoint()
    assert isinstance(source, Source)
    for sync in (1, 2):
        stats = SyncStats()
        pairs, manifest = resolve_source(source, [], None, stats)
        assert [n for n, _ in pairs] == ["a", "b"] and source.opened == sync
        assert [s.name for s in manifest] == ["a", "b"] and stats.plan is None
    mine = [TensorSpec("a", "float32", (2,))]
    assert resolve_source(source, [], mine, SyncStats())[1] is mine  # the caller's manifest wins


def test_a_trainer_model_is_a_source_planned_against_the_receivers_reports():
    model, base, adapters = make_model(SyncMode.LORA_UNMERGED)
    assert isinstance(model, Source)
    assert [n for n, _ in model.tensors()] == BASE_NAMES + ADAPTER_NAMES  # an engine of unknown state: every part
    holds = ReceiverReport(engine=EngineState(sleep_level=0, weights_freed=False, has_base=True))
    stats = SyncStats()
    pairs, _ = resolve_source(model, [holds], None, stats)
    assert [n for n, _ in pairs] == ADAPTER_NAMES and stats.plan is not None and stats.plan.send == "adapters_only"
