"""When a sync may be a delta, and what a receiver refuses: the bookkeeping of both sides, without processes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hwsync.sync.report import DtypeReport, EngineDtypes, ReceiverReport, engine_dtypes
from hwsync.sync.delta_receiver import ApplyDelta, ReceiverDeltas
from hwsync.sync.delta_sender import SenderDeltas
from hwsync.errors import ManifestError, ProtocolError
from hwsync.sync.spec import TensorSpec
from hwsync.protocol.delta import DeltaField
from hwsync.sync.planner import EngineState
from hwsync.backend.registry import load_backend
from hwsync.sync.stats import SyncStats

PAIRS = [("w", torch.arange(12, dtype=torch.float32).reshape(3, 4)), ("b", torch.ones(4))]


def _committed(deltas: SenderDeltas, delta: bool = True) -> SyncStats:
    stats = SyncStats()
    sync = deltas.prepare(list(PAIRS), None, EngineDtypes([]), delta, [ReceiverReport(held=deltas.base_id)], stats)
    list(sync.source)
    deltas.commit()
    return stats


def test_a_delta_needs_every_receiver_to_hold_the_baseline_and_says_why_not():
    deltas = SenderDeltas(load_backend("cpu").device())
    assert deltas.decide([ReceiverReport()]) == (False, "the first sync: no baseline yet")
    stats = _committed(deltas)
    assert stats.delta.mode == "full" and deltas.base_id is not None
    ok, why = deltas.decide([ReceiverReport(held=deltas.base_id), ReceiverReport(held=deltas.base_id)])
    assert ok and deltas.base_id in why
    assert deltas.decide([ReceiverReport(held=deltas.base_id), ReceiverReport()])[1].startswith("receiver 1 reports no complete sync")
    assert "holds 'other:3'" in deltas.decide([ReceiverReport(held="other:3")])[1]
    freed = EngineState(sleep_level=2, weights_freed=True, has_base=True)
    assert "freed its weights" in deltas.decide([ReceiverReport(held=deltas.base_id, engine=freed)])[1]
    changed = EngineState(sleep_level=0, weights_freed=False, has_base=True, base_intact=False)
    assert "found its weights changed" in deltas.decide([ReceiverReport(held=deltas.base_id, engine=changed)])[1]


def test_a_full_sync_asked_for_renews_the_baseline_and_the_next_may_be_a_delta():
    deltas = SenderDeltas(load_backend("cpu").device())
    _committed(deltas)
    first = deltas.base_id
    stats = _committed(deltas, delta=False)
    assert stats.delta.mode == "full" and "asked for a full sync" in stats.delta.reason
    assert deltas.base_id not in (None, first)
    assert _committed(deltas).delta.mode == "delta"


def test_a_failed_full_sync_drops_the_baseline_a_failed_delta_keeps_it():
    deltas = SenderDeltas(load_backend("cpu").device())
    _committed(deltas)
    held = deltas.base_id
    deltas.prepare(list(PAIRS), None, EngineDtypes([]), True, [ReceiverReport(held=held)], SyncStats())
    deltas.abort()  # a delta that failed
    assert deltas.base_id == held
    sync = deltas.prepare(list(PAIRS), None, EngineDtypes([]), True, [ReceiverReport()], SyncStats())
    list(sync.source)  # a full one that streamed, then failed
    deltas.abort()
    assert deltas.base_id is None and "did not complete" in deltas.decide([ReceiverReport()])[1]


def test_dropping_the_baseline_frees_it_and_the_next_delta_asked_for_is_full_saying_why():
    deltas = SenderDeltas(load_backend("cpu").device())
    _committed(deltas)
    assert deltas.baseline_bytes == sum(t.numel() * t.element_size() for _, t in PAIRS)
    assert deltas.drop("dropped to free its memory") == sum(t.numel() * t.element_size() for _, t in PAIRS)
    assert deltas.baseline_bytes == 0 and deltas.base_id is None
    plain = deltas.prepare(list(PAIRS), None, EngineDtypes([]), False, [ReceiverReport()], SyncStats())
    assert plain.wire is None, "a sync asking for no delta after a drop keeps no baseline (receivers drop theirs)"
    list(plain.source)
    deltas.commit()
    assert deltas.baseline_bytes == 0
    stats = _committed(deltas)  # asks for a delta: full, and it makes a new baseline
    assert stats.delta.mode == "full" and stats.delta.reason == "dropped to free its memory"
    assert _committed(deltas).delta.mode == "delta"


def test_a_full_sync_in_delta_mode_streams_the_baseline_it_cast_into():
    deltas = SenderDeltas(load_backend("cpu").device())
    bf16 = EngineDtypes([ReceiverReport(dtypes=DtypeReport("bfloat16", {"norm": "float32"}))])
    masters = [("w", torch.randn(64, 64)), ("b", torch.randn(64))]
    norm = torch.randn(64)  # held in fp32 by the engine: no cast, so it streams as itself (a mapped source may)
    for _ in range(2):  # the first makes the baseline, the second casts into the same memory
        sync = deltas.prepare([*masters, ("norm", norm)], None, bf16, True, [ReceiverReport()], SyncStats())  # full: none holds it
        streamed = list(sync.source)
        deltas.commit()
        for (name, master), (streamed_name, tensor) in zip(masters, streamed):
            assert streamed_name == name and tensor.dtype == torch.bfloat16
            assert torch.equal(tensor.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
            assert tensor.data_ptr() == deltas.baseline.tensors[name].data_ptr(), "a fresh cast tensor instead of the baseline"
        assert streamed[-1][1] is norm


def test_a_receiver_refuses_a_delta_from_another_base_and_holds_nothing_until_a_sync_completes():
    receiver = ReceiverDeltas()
    receiver.begin(DeltaField(None, "s:1"), None)
    receiver.complete()
    assert receiver.held == "s:1"
    with pytest.raises(ProtocolError, match="holds 's:1'"):
        receiver.begin(DeltaField("s:0", "s:2", []), [])
    assert receiver.held is None, "a sync that started (and failed) leaves nothing held"


def test_a_held_digest_speaks_for_its_memory_only_and_follows_a_staged_commit_into_the_engine():
    """A digest a receiver holds is trusted only for the memory it was taken of: an alias of that memory (a view,
    `.data`) has it, other memory does not (a tensor made anew; one over the same address but another storage, as
    an allocator reusing freed memory gives); after a staged commit it speaks for the engine's tensor."""
    from hwsync.sync.delta_receiver import held_digest

    receiver, engine = ReceiverDeltas(), torch.arange(64, dtype=torch.float32)
    receiver.begin(DeltaField(None, "s:1"), None)
    receiver._record("w", 1234, engine)
    assert receiver.held_for("w", engine) == 1234
    assert receiver.held_for("w", engine.data) == 1234 and receiver.held_for("w", engine.view(8, 8)) == 1234
    assert receiver.held_for("w", engine.clone()) is None, "other memory, the same values: digested whole"
    assert receiver.held_for("w", engine[1:]) is None
    elsewhere = torch.empty(64)
    reused = held_digest(1234, elsewhere, torch.Tensor.data_ptr)._replace(ptr=engine.data_ptr())  # another storage
    receiver._digests["w"] = reused
    assert receiver.held_for("w", engine) is None, "the address alone is not the memory"
    staging = engine.clone()  # a staged full sync's digests are taken of the staging area's tensors
    receiver._digests = {"w": held_digest(99, staging, torch.Tensor.data_ptr)}
    receiver.complete({"w": engine})  # the commit copied them into the engine's
    assert receiver.held_for("w", engine) == 99 and receiver.held_for("w", staging) is None


def test_engine_dtypes_cast_only_where_every_receiver_agrees_and_never_widen():
    report = engine_dtypes([("w", torch.zeros(2, dtype=torch.bfloat16)), ("n", torch.zeros(2)),
                            ("i", torch.zeros(2, dtype=torch.int64))])
    assert report == DtypeReport("bfloat16", {"n": "float32"})
    both = EngineDtypes([ReceiverReport(dtypes=report), ReceiverReport(dtypes=report)])
    assert both.target("w", torch.float32) == torch.bfloat16
    assert both.target("n", torch.float32) == torch.float32
    assert both.target("w", torch.float16) == torch.bfloat16  # the same width: as the loader would store it
    assert both.target("i", torch.int64) == torch.int64
    narrow = EngineDtypes([ReceiverReport(dtypes=DtypeReport("float32"))])
    assert narrow.target("w", torch.bfloat16) == torch.bfloat16, "never widened: the loader does that exactly"
    assert not EngineDtypes([ReceiverReport(dtypes=report), ReceiverReport()]), "one receiver says nothing: nothing is cast"
    fp32 = torch.randn(1000)
    assert torch.equal(both.cast("w", fp32).view(torch.int16), torch.empty(1000, dtype=torch.bfloat16).copy_(fp32)
                       .view(torch.int16))


def test_a_plans_delta_field_streams_groups_only_from_a_base_and_covers_the_manifest():
    from hwsync.protocol.delta import check_plan_delta
    from hwsync.protocol.fields import BadFrame

    def check(raw: dict, manifest: list[TensorSpec], buckets: int) -> None:  # decoded (its shape), then its fit
        check_plan_delta(DeltaField.from_wire(raw), manifest, buckets)

    manifest = [TensorSpec(n, "bfloat16", (4,)) for n in "abc"]
    check({"base": "s:1", "next": "s:2", "groups": [2, 1]}, manifest, 0)
    check({"base": None, "next": "s:2", "groups": None}, manifest, 3)  # a full sync, in buckets
    for delta, buckets, match in [
        ({"base": "s:1", "next": "s:2", "groups": [2]}, 0, "positive counts of the manifest's 3"),
        ({"base": "s:1", "next": "s:2", "groups": [3, 0]}, 0, "positive counts"),
        ({"base": "s:1", "next": "s:2", "groups": [True, 2]}, 0, "positive counts"),
        ({"base": None, "next": "s:2", "groups": [3]}, 0, "go with a base"),
        ({"base": "s:1", "next": "s:2", "groups": [3]}, 1, "no buckets"),
        ({"base": "s:1", "next": "s:2", "groups": None}, 0, "streams its tensors in groups"),
        ({"base": "s:1", "next": "s:2", "headers": None, "groups": [3]}, 0, "keys base, next and headers or groups"),
        ({"base": "s:1", "next": "", "groups": [3]}, 0, "next must be an id"),
    ]:
        with pytest.raises(BadFrame, match=match):
            check(delta, manifest, buckets)


def test_a_group_descriptor_round_trips_and_a_bad_one_names_the_tensor():
    from hwsync.delta.header import DeltaHeader, headers_from_words, headers_to_words

    headers = [DeltaHeader("block", "bfloat16", 1 << 17, 9, (1 << 64) - 1), DeltaHeader("same", "bfloat16", 4, 0, 5)]
    targets = [("w", "bfloat16", 1 << 17), ("b", "bfloat16", 4)]
    assert headers_from_words(headers_to_words(headers), targets) == headers
    words = headers_to_words(headers)
    for index, value, match in [(0, 5, "w: delta code number 5"), (4, 1, "b: a same delta of 4 elements cannot "
                                                                          "carry 1"), (1, -1, "w: a block delta")]:
        bad = words.clone()
        bad[index] = value
        with pytest.raises(ValueError, match=match):
            headers_from_words(bad, targets)
    with pytest.raises(ValueError, match="has 6 int64 words, got 3"):
        headers_from_words(words[:3], targets)
    receiver = ReceiverDeltas()
    with pytest.raises(ProtocolError, match="descriptor: b: a same delta"):
        bad = words.clone()
        bad[4] = 1
        receiver.announce([TensorSpec("w", "bfloat16", (1 << 17,)), TensorSpec("b", "bfloat16", (4,))], bad)


def test_a_streamed_delta_encodes_ahead_and_refuses_a_source_out_of_the_manifests_order():
    deltas = SenderDeltas(load_backend("cpu").device())
    _committed(deltas)
    manifest = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in PAIRS]
    taken = []

    def source():
        for pair in PAIRS:
            taken.append(pair[0])
            yield pair

    sync = deltas.prepare(source(), manifest, EngineDtypes([]), True, [ReceiverReport(held=deltas.base_id)], SyncStats(),
                          streamed=True)
    # the encodes started with the plan (they run while it goes out), the results come in the manifest's order
    assert sync.is_delta and sync.source is None and sync.encoded is not None and taken == ["w", "b"]
    assert [spec.name for spec, _ in sync.encoded] == ["w", "b"]
    deltas.commit()
    backwards = list(reversed(PAIRS))
    with pytest.raises(ManifestError, match="tensor 0 of the source is 'b' of shape \\[4\\], but the manifest "
                                            "announced 'w'"):
        deltas.prepare(backwards, manifest, EngineDtypes([]), True, [ReceiverReport(held=deltas.base_id)], SyncStats(),
                       streamed=True)
    deltas.abort()


def test_a_receiver_checks_changed_elements_and_digests_every_tensor_whole_at_every_kth_delta(monkeypatch):
    from hwsync.errors import DeltaCheckError

    monkeypatch.setenv("HWSYNC_DELTA_FULL_CHECK_EVERY", "3")
    device = load_backend("cpu").device()
    sender, receiver = SenderDeltas(device), ReceiverDeltas()
    g = torch.Generator().manual_seed(3)
    model = {"w": torch.randn(1 << 17, generator=g), "u": torch.randn(1 << 17, generator=g)}
    manifest = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in model.items()]
    held = {n: t.clone() for n, t in model.items()}

    def sync(lands_wrong: bool = False) -> tuple[str, str | None]:
        stats = SyncStats()
        prepared = sender.prepare(list(model.items()), manifest, EngineDtypes([]), True, [ReceiverReport(held=receiver.held)], stats)
        receiver.begin(prepared.wire, prepared.targets)
        load, into = receiver.intake(None, lambda name, dtype, shape: held[name], device)
        assert prepared.source is not None
        try:
            if receiver.is_delta:
                assert load is not None
                load(list(prepared.source))
            else:  # where the reader writes a full sync: the destinations `into` names
                assert into is not None
                for name, tensor in prepared.source:
                    into(name, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
                if lands_wrong:
                    held["u"][9] += 1.0
        except DeltaCheckError as exc:
            sender.abort()
            return stats.delta.mode, str(exc)
        receiver.complete()
        sender.commit()
        return stats.delta.mode, None

    def step() -> torch.Tensor:
        pos = torch.randint(0, model["w"].numel(), (100,), generator=g)
        model["w"][pos] += 1.0  # 100 of 131072 changed: checked from the changes; u never changes
        return pos

    assert sync() == ("full", None)
    step()
    assert sync() == ("delta", None) and receiver.check == "changed elements", "the full sync digested once complete"
    held["u"][7] += 1.0  # behind hwsync's back, where no delta writes
    step()
    assert sync() == ("delta", None) and receiver.check == "changed elements", "only the changes are read"
    step()
    mode, error = sync()  # the third delta since the full sync: every tensor digested whole
    assert mode == "delta" and error is not None and "u does not have the sender's digest" in error, error
    assert "the whole tensor" in error and receiver.held is None
    assert sync() == ("full", None) and torch.equal(held["u"], model["u"]), "healed by the full sync"
    step()
    assert sync() == ("delta", None)
    pos = step()
    held["w"][pos[0]] -= 0.5  # where the next delta writes: its changed elements no longer start from the base
    mode, error = sync()
    assert receiver.check == "changed elements" and error is not None, error
    assert "w does not have the sender's digest" in error and "its changed elements" in error, error
    assert sync(lands_wrong=True) == ("full", None)  # what it wrote is digested as it is: not the sender's
    step()
    mode, error = sync()
    assert receiver.check == "changed elements" and error is not None and "u does not have the sender's" in error


def test_the_full_check_period_must_be_a_whole_number_of_syncs(monkeypatch):
    from hwsync.sync.delta_receiver import full_check_every

    monkeypatch.setenv("HWSYNC_DELTA_FULL_CHECK_EVERY", "0")
    with pytest.raises(ValueError, match="HWSYNC_DELTA_FULL_CHECK_EVERY='0': a whole number of delta syncs"):
        full_check_every()
    monkeypatch.delenv("HWSYNC_DELTA_FULL_CHECK_EVERY")
    assert full_check_every() == 8


def test_the_encode_and_baseline_threads_are_kept_across_syncs_and_end_at_close():
    import threading

    before = set(threading.enumerate())

    def ours() -> set[str]:
        return {t.name.rsplit("_", 1)[0] for t in set(threading.enumerate()) - before if t.name.startswith("hwsync-")}

    deltas = SenderDeltas(load_backend("cpu").device())
    _committed(deltas)
    _committed(deltas)
    pool = deltas._pool
    stats = _committed(deltas)
    assert stats.delta.mode == "delta" and deltas._pool is pool, "one encode pool for every sync"
    assert {"hwsync-delta", "hwsync-baseline"} <= ours()
    deltas.close()
    assert not ours(), ours()
    assert deltas.base_id is not None and deltas.baseline_bytes > 0, "close ends threads, not the baseline"


class _RecordingDeltas:
    """What ApplyDelta asks of a receiver's deltas: destinations of given sizes, one apply thread that records."""

    def __init__(self, sizes: dict[str, int], failing: set[str]) -> None:
        self.sizes, self.failing, self.applied = sizes, failing, []
        self._pool = ThreadPoolExecutor(1)

    def target(self, name: str, payload: torch.Tensor, into: object) -> tuple[torch.Tensor, bool]:
        return torch.empty(self.sizes[name], dtype=torch.bfloat16), True

    def pool(self) -> ThreadPoolExecutor:
        return self._pool

    def apply(self, name: str, payload: torch.Tensor, result: torch.Tensor) -> None:
        self.applied.append(name)
        if name in self.failing:
            raise ProtocolError(f"{name} failed")


def test_the_apply_threads_take_the_largest_targets_first_and_raise_the_first_failure_in_stream_order():
    sizes = {"norm": 8, "q": 1 << 12, "mlp": 1 << 14, "k": 1 << 12, "lm_head": 1 << 16}
    deltas = _RecordingDeltas(sizes, failing={"q", "lm_head"})
    payloads = [(name, torch.zeros(4, dtype=torch.uint8)) for name in sizes]
    try:
        applying = ApplyDelta(deltas, None, None).submit(payloads)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="q failed"):  # q comes first in the stream, though applied after
            applying.finish()
    finally:
        deltas.pool().shutdown()
    assert deltas.applied == ["lm_head", "mlp", "q", "k", "norm"], "largest first, ties in stream order"


def test_a_staged_full_sync_is_digested_before_it_says_staged_not_beside_the_engine_after_the_commit():
    """Issue 48: after a staged full sync in delta mode, nothing is left to digest once it is committed (a digest
    there ran beside the engine's first steps after the pause); the next delta is still checked from its changes."""
    device = load_backend("cpu").device()
    sender, receiver = SenderDeltas(device), ReceiverDeltas()
    g = torch.Generator().manual_seed(5)
    model = {"w": torch.randn(1 << 16, generator=g)}
    manifest = [TensorSpec(n, "float32", tuple(t.shape)) for n, t in model.items()]
    staged = {n: torch.empty_like(t) for n, t in model.items()}  # the staging area's copies: what the apply copies

    def stage() -> SyncStats:
        stats = SyncStats()
        prepared = sender.prepare(list(model.items()), manifest, EngineDtypes([]), True,
                                  [ReceiverReport(held=receiver.held)], stats)
        receiver.begin(prepared.wire, prepared.targets)
        load, into = receiver.intake(None, lambda name, dtype, shape: staged[name], device)
        assert prepared.source is not None
        if receiver.is_delta:
            assert load is not None
            load(list(prepared.source))
        else:
            assert into is not None
            for name, tensor in prepared.source:
                into(name, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
        receiver.digest_staged()  # where a receiver that stages says so
        return stats

    assert stage().delta.mode == "full"
    receiver.complete()  # committed
    sender.commit()
    assert receiver._pool is None, "a digest was left to run after the commit"
    model["w"][:50] += 1.0
    stats = stage()
    assert stats.delta.mode == "delta" and receiver.check == "changed elements"
    receiver.complete()
    sender.commit()
    assert torch.equal(staged["w"], model["w"])
