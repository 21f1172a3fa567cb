"""Delta syncs on the same-host path, with real processes, on every backend: exact, planned, checked, transactional.

- across optimizer steps every sync after the first is a delta and the receiver stays bit-exact (into and load);
- a trainer's fp32 masters travel as the bf16 the engine holds, equal to the engine loader's own cast;
- NaN payloads, infinities, -0.0 and subnormals come through exactly;
- a payload larger than a bucket, and dense, sparse and unchanged tensors in one sync;
- a receiver that restarted gets a full sync, with the reason in the stats;
- a byte changed in a destination behind hwsync's back fails the delta's check, and the next (full) sync heals it;
- a destination made anew (other memory) is digested whole: its zeros fail the delta by name, its old values pass;
- a receiver or a sender killed mid-delta leaves the receiver incomplete, and the next sync is full and exact.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from hwsync import WeightSender
from hwsync.errors import RemoteError, SyncError
from hwsync.backend.owners import sweep_dead_owners
from hwsync.sync.options import SenderOptions

import delta_procs
import transfer_procs as procs

BF16 = {"default": "bfloat16", "names": {}}


def _engine(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What an engine holding `dtype` stores from the trainer's tensors: its loader's copy_ (the cast)."""
    if dtype is None:
        return tensors
    return {n: torch.empty(t.shape, dtype=dtype).copy_(t) if t.dtype.is_floating_point else t
            for n, t in tensors.items()}


def _sync(sender, commands, results, tensors, version, **kwargs):
    commands.put({"receive": True, **kwargs.pop("command", {})})
    stats = sender.send(list(tensors.items()), version=version, **kwargs)
    return stats, results.get(timeout=60)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


@pytest.mark.parametrize("mode", ["into", "load"])
def test_delta_syncs_stay_exact_across_optimizer_steps_and_carry_the_engines_dtype(backend, mode):
    net = _model()
    opt = torch.optim.AdamW(net.parameters(), lr=2e-5)  # RL-like: a few % of the bf16 elements move a step
    with WeightSender(options=SenderOptions(delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, mode, dtypes=BF16)
        full_bytes = None
        for step in range(1, 7):
            stats, got = _sync(sender, commands, results, dict(net.state_dict()), step)
            expected = procs.digests(_engine(dict(net.state_dict()), torch.bfloat16))
            assert got.get("digests") == expected, f"step {step}: {got.get('error')}"
            note = stats.delta
            if step == 1:
                assert note.mode == "full" and "no baseline" in note.reason
                full_bytes = stats.bytes
                assert full_bytes == sum(p.numel() * 2 for p in net.state_dict().values()), "fp32 went as bf16"
            else:
                assert note.mode == "delta", note
                assert stats.bytes < full_bytes, (stats.bytes, full_bytes)
            loss = net(torch.randn(32, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        commands.put({"stop": True})
        proc.join(30)


def test_special_values_and_mixed_codes_and_a_payload_larger_than_a_bucket(backend):
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -1e-45, 0.0, 1.0])
    tensors = {"special32": specials.repeat(512).clone(), "special16": specials.repeat(512).to(torch.bfloat16),
               "big": torch.randn(1 << 16), "same": torch.randn(300), "sparse": torch.randn(4096)}
    odd_nan = torch.tensor([0x7FC0_0001, 0x7F80_0002], dtype=torch.int32).view(torch.float32)  # NaN payloads
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "into")
        _, got = _sync(sender, commands, results, tensors, 1)
        assert got["digests"] == procs.digests(tensors)
        tensors["special32"][:2] = odd_nan
        tensors["special32"][5::8] = -0.0
        tensors["special16"][8:10] = torch.tensor([-0.0, 1e-40]).to(torch.bfloat16)
        tensors["big"] += 1.0  # dense, 256 KiB: a payload of 16 buckets
        tensors["sparse"][::97] = 2.0
        stats, got = _sync(sender, commands, results, tensors, 2)
        assert got.get("digests") == procs.digests(tensors), got.get("error")
        codes = stats.delta.codes
        assert stats.delta.mode == "delta" and codes["dense"] >= 1 and codes["same"] == 1, codes
        assert codes["block"] + codes["bitmap"] >= 2, codes
        commands.put({"stop": True})
        proc.join(30)


@pytest.mark.cpu_is_enough("which sync is full is planning, the same on every backend")
def test_a_dropped_baseline_frees_its_memory_and_the_next_delta_asked_for_is_full(backend):
    with WeightSender(options=SenderOptions(delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "load")
        modes = []
        for step, delta in ((1, None), (2, None), ("drop", None), (3, False), (4, None), (5, None)):
            if step == "drop":
                held = sender.delta_baseline_bytes
                model = sum(t.numel() * t.element_size() for t in delta_procs.stepped(2).values())
                # the baseline, and the room of the next dense copies (the tensors the last dense deltas replaced)
                assert model <= held <= 2 * model, (held, model)
                assert sender.drop_delta_baseline() == held and sender.delta_baseline_bytes == 0
                continue
            stats, got = _sync(sender, commands, results, delta_procs.stepped(step), step, delta=delta)
            assert got.get("digests") == procs.digests(delta_procs.stepped(step)), got.get("error")
            note = stats.delta
            modes.append((None, None) if note is None else (note.mode, note.reason))
            if step == 3:  # asks for no delta while none is kept: no baseline made meanwhile
                assert sender.delta_baseline_bytes == 0
        assert [m for m, _ in modes] == ["full", "delta", None, "full", "delta"], modes
        assert "drop_delta_baseline" in modes[3][1], modes
        commands.put({"stop": True})
        proc.join(30)


@pytest.mark.cpu_is_enough("which sync is full is planning, the same on every backend")
def test_a_restarted_receiver_gets_a_full_sync_with_the_reason(backend):
    with WeightSender(num_receivers=2, options=SenderOptions(delta=True, timeout_s=60)) as sender:
        first, second = (delta_procs.start(sender.endpoint, "load") for _ in range(2))
        for step in (1, 2):
            for _, commands, _ in (first, second):
                commands.put({"receive": True})
            stats = sender.send(delta_procs.stepped(step).items(), version=step)
            for _, _, results in (first, second):
                assert results.get(timeout=60)["digests"] == procs.digests(delta_procs.stepped(step))
        assert stats.delta.mode == "delta"
        second[0].kill()
        second[0].join(10)
        second = delta_procs.start(sender.endpoint, "load")
        for _, commands, _ in (first, second):
            commands.put({"receive": True})
        stats = sender.send(delta_procs.stepped(3).items(), version=3)
        note = stats.delta
        assert note.mode == "full" and "reports no complete sync" in note.reason, note
        for proc, commands, results in (first, second):
            assert results.get(timeout=60)["digests"] == procs.digests(delta_procs.stepped(3))
            commands.put({"stop": True})
            proc.join(30)


def test_a_byte_changed_behind_hwsyncs_back_fails_the_check_and_the_next_sync_heals_it(backend, monkeypatch):
    # where no delta writes, only a whole-tensor check sees it: at every delta here (the default: every 8th)
    monkeypatch.setenv("HWSYNC_DELTA_FULL_CHECK_EVERY", "1")
    with WeightSender(options=SenderOptions(delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "into")
        # w2 does not change at step 3: only the check can see it
        _third_fails_and_fourth_heals(sender, commands, results, {"flip": "w2"}, "w2 does not have the sender's digest")
        commands.put({"stop": True})
        proc.join(30)


def _third_fails_and_fourth_heals(sender, commands, results, disturb: dict, match: str) -> None:
    """Syncs 1 (full) and 2 (delta) exact; `disturb` before sync 3, which fails with a DeltaCheckError matching
    `match` and leaves the receiver incomplete; sync 4 is full and exact."""
    for step in (1, 2):
        _, got = _sync(sender, commands, results, delta_procs.stepped(step), step)
        assert got["digests"] == procs.digests(delta_procs.stepped(step))
    commands.put({"receive": True, **disturb})
    with pytest.raises(RemoteError, match=match):
        sender.send(delta_procs.stepped(3).items(), version=3)
    got = results.get(timeout=60)
    assert "DeltaCheckError" in got["error"] and got["incomplete"], got
    stats, got = _sync(sender, commands, results, delta_procs.stepped(4), 4)
    assert stats.delta.mode == "full", stats.delta
    assert got["digests"] == procs.digests(delta_procs.stepped(4))


@pytest.mark.parametrize("name", ["w2", "w1"])  # unchanged at step 3 (nothing written), changed in 1% (sparse)
def test_a_destination_made_anew_fails_the_delta_by_name_and_the_next_sync_heals_it(backend, name):
    # the digest a receiver holds is its old memory's: trusted for the new, an unchanged tensor passed unwritten
    with WeightSender(options=SenderOptions(delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "into")
        # the engine made it anew: other memory, zeros
        _third_fails_and_fourth_heals(sender, commands, results, {"renew": [name]},
                                      f"{name} does not have .* other memory")
        # made anew holding what it held: digested whole, it checks out and the delta lands
        stats, got = _sync(sender, commands, results, delta_procs.stepped(5), 5, command={"copy": ["w1", "w2"]})
        assert stats.delta.mode == "delta", stats.delta
        assert got["digests"] == procs.digests(delta_procs.stepped(5))
        commands.put({"stop": True})
        proc.join(30)


@pytest.mark.cpu_is_enough("a killed peer mid-sync is process and socket logic")
def test_a_receiver_killed_mid_delta_and_the_next_sync_is_full_and_exact(backend):
    q = delta_procs.CTX.Queue()
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)) as sender:
        slow = delta_procs.CTX.Process(target=delta_procs.slow_load_receiver, args=(sender.endpoint, q, 600.0))
        slow.start()
        assert q.get(timeout=90) == "up"
        for step in (1, 2):
            sender.send(delta_procs.stepped(step).items(), version=step)
            assert q.get(timeout=60)["version"] == step
        def killer():
            assert q.get(timeout=60) == "loading"
            slow.kill()

        thread = threading.Thread(target=killer)
        thread.start()
        with pytest.raises(SyncError, match=f"peer process {slow.pid} exited"):
            sender.send(delta_procs.stepped(3).items(), version=3)
        thread.join()
        slow.join(10)
        proc, commands, results = delta_procs.start(sender.endpoint, "into")
        stats, got = _sync(sender, commands, results, delta_procs.stepped(4), 4)
        assert stats.delta.mode == "full" and got["digests"] == procs.digests(delta_procs.stepped(4))
        commands.put({"stop": True})
        proc.join(30)


@pytest.mark.cpu_is_enough("a killed peer mid-sync is process and socket logic")
def test_a_sender_killed_mid_delta_leaves_the_receiver_incomplete(backend):
    q = delta_procs.CTX.Queue()
    sender = delta_procs.CTX.Process(target=delta_procs.delta_sender_main, args=(q, 3))
    sender.start()
    endpoint = q.get(timeout=90)
    rq = delta_procs.CTX.Queue()
    receiver = delta_procs.CTX.Process(target=delta_procs.slow_load_receiver, args=(endpoint, rq, 2.0))
    receiver.start()
    assert rq.get(timeout=90) == "up"
    for step in (1, 2):
        got = rq.get(timeout=60)
        assert got["version"] == step and got["digests"] == procs.digests(delta_procs.stepped(step))
    assert rq.get(timeout=60) == "loading"  # mid-way through the third sync, a delta
    os.kill(sender.pid, signal.SIGKILL)
    sender.join(10)
    got = rq.get(timeout=60)
    assert "exited" in got["error"] and got["incomplete"] and got["version"] == 2, got
    receiver.join(30)
    sweep_dead_owners(force=True)  # the killed sender's segments (its resource tracker is this process's)


# -- issue 46: no success with a wrong weight --------------------------------------------------------------------


@pytest.mark.parametrize("dtype,engine", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, BF16)],
                         ids=["fp32 into fp32", "bf16 into bf16", "fp32 into bf16"])
def test_an_in_place_step_right_after_send_returns_never_reaches_the_next_delta(backend, dtype, engine, monkeypatch):
    """The caller's tensors are theirs again once send() returns: an optimizer step at once (in place) must not
    change what the baseline holds. Uncast dense deltas streamed views of the caller's tensors, copied into the
    baseline after send() returned: 7 of 8 tensors went stale at version 3, with matching digests. The baseline's
    background writes are held back here (as a loaded machine would), so that the step always comes first."""
    import hwsync.sync.delta_sender as delta_sender

    advance_all = delta_sender._advance_all
    monkeypatch.setattr(delta_sender, "_advance_all", lambda *a: (time.sleep(0.3), advance_all(*a)))
    torch.manual_seed(3)
    tensors = {f"t{i}": torch.randn(64, 128).to(dtype) for i in range(8)}
    with WeightSender(options=SenderOptions(delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "load", dtypes=engine)
        for version in range(1, 6):
            expected = procs.digests(_engine(tensors, None if engine is None else torch.bfloat16))
            commands.put({"receive": True})
            stats = sender.send(list(tensors.items()), version=version)
            for t in tensors.values():  # the optimizer's step, as soon as send() returned
                t.add_(0.05)  # most bf16 elements of this size move too
            got = results.get(timeout=60)
            assert got.get("digests") == expected, (version, got.get("error"))
            if version > 1:
                assert stats.delta.mode == "delta", stats.delta
        commands.put({"stop": True})
        proc.join(30)


def test_a_source_that_reuses_one_staging_buffer_stays_exact_in_delta_mode(backend):
    """stable_sources=False holds on the delta path: each tensor is copied as it is taken, before the encodes
    (which run ahead on other threads) read it; before, 32-33 of 38 tensors arrived wrong with success."""
    tensors = delta_procs.stepped(1, n=12)
    staging = torch.empty(128 * 64)

    def gathered(state: dict) -> list:  # FSDP's full_tensor() into one buffer, one tensor at a time
        def pairs():
            for name, t in tensors.items():
                staging.copy_(t.view(-1))
                yield name, staging.view(t.shape)
        return pairs()

    with WeightSender(options=SenderOptions(delta=True, timeout_s=60, stable_sources=False)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "into")
        for step in range(1, 5):
            tensors = delta_procs.stepped(step, n=12)
            commands.put({"receive": True})
            stats = sender.send(gathered, version=step)
            got = results.get(timeout=60)
            assert got.get("digests") == procs.digests(tensors), (step, got.get("error"))
            assert stats.delta.mode == ("full" if step == 1 else "delta")
        commands.put({"stop": True})
        proc.join(30)


@pytest.mark.parametrize("mode", ["load", "into"])
def test_a_tensor_reshaped_retyped_or_resized_between_syncs_goes_whole(backend, mode):
    """A change of shape (same element count), dtype or element count makes that tensor go whole, and a `load`
    receiver gets it in its new spec (it reused its kept copy of the old shape, or raised a bare ValueError)."""
    tensors = delta_procs.stepped(1)
    changes = {3: ("w1", lambda t: t.reshape(64, 128).clone()), 4: ("w2", lambda t: t.double()),
               5: ("w3", lambda t: t[:100].clone())}
    with WeightSender(options=SenderOptions(delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, mode)
        for version in range(1, 7):
            tensors["w4"].view(-1)[version * 10] += 1.0  # a sparse change in every sync
            if version in changes:
                name, change = changes[version]
                tensors[name] = change(tensors[name])
            stats, got = _sync(sender, commands, results, tensors, version)
            assert got.get("digests") == procs.digests(tensors), (version, got.get("error"))
            if version > 1:
                assert stats.delta.mode == "delta", stats.delta
        commands.put({"stop": True})
        proc.join(30)


@pytest.mark.cpu_is_enough("the check of a destination is the same on every backend")
def test_an_into_destination_of_the_wrong_shape_is_refused_on_the_delta_path_as_on_the_full_path(backend):
    """An engine whose into() returns its old tensor for a reshaped one: the delta path wrote the new tensor's
    bytes into it and reported success; now it is refused with a DestinationError naming the tensor and both specs,
    before any byte of it is written, and the sync after (the sender's old shapes again) is exact."""
    original = delta_procs.stepped(1)
    with WeightSender(options=SenderOptions(delta=True, timeout_s=60)) as sender:
        proc, commands, results = delta_procs.start(sender.endpoint, "into-rigid")
        for version in (1, 2):
            _, got = _sync(sender, commands, results, delta_procs.stepped(version), version)
            assert got["digests"] == procs.digests(delta_procs.stepped(version))
        reshaped = {**delta_procs.stepped(2), "w1": delta_procs.stepped(2)["w1"].reshape(64, 128).clone()}
        commands.put({"receive": True})
        with pytest.raises(RemoteError, match="DestinationError: into\\('w1'\\) gave a torch.float32 tensor of shape "
                                              "\\(128, 64\\), but the sender sent torch.float32 of shape \\(64, 128\\)"):
            sender.send(reshaped.items(), version=3)
        got = results.get(timeout=60)
        assert "DestinationError" in got["error"] and got["incomplete"], got
        stats, got = _sync(sender, commands, results, delta_procs.stepped(4), 4)
        assert stats.delta.mode == "full" and got["digests"] == procs.digests(delta_procs.stepped(4))
        assert original  # the receiver's tensors kept their shapes throughout
        commands.put({"stop": True})
        proc.join(30)
