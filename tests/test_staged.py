"""Staged syncs on the same-host path: receivers stage while their engines keep answering requests, and apply only
once every receiver staged the version; a failure before that leaves every engine on the previous version, bit-exact.

Engines are real processes (staged_procs.py) that answer requests on a thread of their own throughout each sync:
each request digests the whole model under the engine's pause lock, so a request that saw a mix of versions, or a
staged byte before the commit, shows up as a digest of no version.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import staged_procs
import torch

from hwsync import (
    CrossNodeSender,
    HwsyncError,
    NotAppliedError,
    PartlyAppliedError,
    StageOptions,
    StagingMemoryError,
    SyncError,
    WeightSender,
)
from hwsync.backend.owners import sweep_dead_owners
from hwsync.backend.registry import load_backend
from hwsync.sync.jobs import wait_all
from hwsync.sync.options import CrossNodeOptions, SenderOptions
from hwsync.sync.spec import TensorSpec
from hwsync.sync.staging import StagingArea

pytestmark = pytest.mark.timeout(300)

#: why the failure cases run on the cpu backend alone
FAILURES_ON_CPU = ("the failure paths are the control plane's; the staging area's copies run on the sim in the first "
                   "test")


def version_digest(version: int) -> str:
    """The digest of the whole model at `version` (0: an engine that holds nothing yet)."""
    return staged_procs.model_digest(staged_procs.stepped(version)) if version else ""


def _send(sender: WeightSender | CrossNodeSender, engines: list, version: int, **command) -> list[dict]:
    for _proc, commands, _results in engines:
        commands.put({"receive": True, **command.get("each", {})})
    try:
        sender.send(list(staged_procs.stepped(version).items()), version=version)
    finally:
        replies = [results.get(timeout=60) for _proc, _commands, results in engines]
    return replies


def _stop(engines: list) -> None:
    for proc, commands, _results in engines:
        if proc.is_alive():
            commands.put({"stop": True})
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _served_only(reply: dict, *versions: int) -> None:
    """Every request the engine answered during the sync saw one of `versions` whole (and it answered some)."""
    allowed = {version_digest(v) for v in versions}
    assert reply["requests"] > 0, "the engine answered no request during the sync"
    assert set(reply["answered"]) <= allowed, f"a request saw no version whole: {reply['answered']}"


@pytest.mark.parametrize("mode", ["into", "load"])
def test_staged_syncs_full_then_delta_are_exact_and_the_engine_serves_throughout(backend, mode):
    with WeightSender(num_receivers=2, options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)) as s:
        engines = [staged_procs.start(s.endpoint, mode) for _ in range(2)]
        try:
            for version in (1, 2, 3):
                for _proc, commands, _results in engines:
                    commands.put({"receive": True})
                stats = s.send(list(staged_procs.stepped(version).items()), version=version)
                replies = [results.get(timeout=60) for _proc, _commands, results in engines]
                assert stats.stage is not None and stats.stage.receivers == 2
                assert stats.stage.apply_s > 0 and stats.stage.held_bytes > 0
                assert stats.delta is not None and stats.delta.mode == ("full" if version == 1 else "delta")
                for reply in replies:
                    assert "error" not in reply, reply
                    assert reply["version"] == version and reply["digest"] == version_digest(version)
                    assert reply["applies"] == version  # one pause per sync, the apply inside it
                    _served_only(reply, version - 1, version)
                    model = sum(t.numel() * t.element_size() for t in staged_procs.stepped(version).values())
                    if mode == "load":  # the engine's loader takes copies: the staged copy is the delta's base
                        assert reply["staging_bytes"] == model
                        if version > 1:  # a delta applies on the staged copy: it allocates nothing
                            assert reply["stage"]["new_bytes"] == 0
                    else:  # the engine's own tensors are the base: after the commit no copy is held
                        assert reply["staging_bytes"] == 0
                        if version > 1:  # a delta stages its payloads (and one tensor changed whole), not the model
                            assert 0 < reply["stage"]["held_bytes"] < model // 4, (reply["stage"], model)
        finally:
            _stop(engines)


@pytest.mark.cpu_is_enough(FAILURES_ON_CPU)
def test_a_receiver_killed_after_staging_applies_nowhere_and_the_next_sync_commits(backend):
    with WeightSender(num_receivers=2, options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)) as s:
        engines = [staged_procs.start(s.endpoint) for _ in range(2)]
        try:
            assert all(r["version"] == 1 for r in _send(s, engines, 1))
            doomed, survivor = engines
            doomed[1].put({"receive": True, "die_after_staging": True})
            survivor[1].put({"receive": True, "slow_to_say_staged": 1.0})  # the doomed one dies before it says so
            with pytest.raises(NotAppliedError, match=f"receiver pid {doomed[0].pid}|process {doomed[0].pid}") as info:
                s.send(list(staged_procs.stepped(2).items()), version=2)
            assert "applied by no receiver that stages" in str(info.value)
            reply = survivor[2].get(timeout=60)
            assert "aborted" in reply["error"] and reply["version"] == 1
            assert reply["digest"] == version_digest(1) and not reply["incomplete"]  # v1, bit-exact
            assert reply["staging_bytes"] == 0  # released
            _served_only(reply, 1)
            doomed[0].join(timeout=30)
            assert doomed[0].exitcode == -signal.SIGKILL
            engines = [survivor, staged_procs.start(s.endpoint)]
            for reply in _send(s, engines, 3):  # whole (the survivor holds no staged base), and exact
                assert reply["version"] == 3 and reply["digest"] == version_digest(3) and reply["delta"] is None  # full
        finally:
            _stop(engines)


@contextmanager
def _one_bad_sync(mode: str, fault: dict, error: type[HwsyncError], match: str) -> Iterator[tuple]:
    """Two engines in `mode`, every delta digested whole, after a first full sync; version 2, with `fault` in the
    first engine's (the bad one's) receive command, raises `error` matching `match` (`{pid}`: the bad engine's).
    Yields (bad, good, the error's info) for the test to check their replies; then version 3 is whole and exact on
    both (the bad one holds no known version)."""
    env = {"HWSYNC_DELTA_FULL_CHECK_EVERY": "1"}  # every delta (and the commit) digested whole: a changed byte anywhere
    with WeightSender(num_receivers=2, options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)) as s:
        engines = [staged_procs.start(s.endpoint, mode=mode, env=env) for _ in range(2)]
        try:
            _send(s, engines, 1)
            bad, good = engines
            bad[1].put({"receive": True, **fault})
            good[1].put({"receive": True})
            with pytest.raises(error, match=match.format(pid=bad[0].pid)) as info:
                s.send(list(staged_procs.stepped(2).items()), version=2)
            yield bad, good, info
            for reply in _send(s, engines, 3):
                assert reply["version"] == 3 and reply["digest"] == version_digest(3), reply
        finally:
            _stop(engines)


@pytest.mark.cpu_is_enough(FAILURES_ON_CPU)
def test_a_digest_mismatch_on_one_receiver_applies_nowhere(backend):
    # engines whose loader takes copies: the staging area's copy is the delta's base, and its byte is flipped (changed
    # behind hwsync's back)
    with _one_bad_sync("load", {"flip": "w3"}, NotAppliedError, "pid {pid}.*DeltaCheckError: w3") as (bad, good, _):
        for reply in (bad[2].get(timeout=60), good[2].get(timeout=60)):
            assert reply["version"] == 1 and reply["digest"] == version_digest(1), reply
            _served_only(reply, 1)


def test_an_engine_tensor_changed_between_stage_and_commit_is_caught_at_the_commit(backend):
    # into mode: the engine's own tensor is the delta's base; it changes after the delta checked out on a copy of
    # it and before the commit. The commit's check finds it: that engine fails, loudly, and the next sync is whole
    with _one_bad_sync("into", {"change_engine_after_staging": "w3"}, PartlyAppliedError, "{pid}") as (bad, good, info):
        assert "w3" in str(info.value) and "between the stage" in str(info.value), info.value
        failed, applied = bad[2].get(timeout=60), good[2].get(timeout=60)
        assert "DeltaCheckError: w3" in failed["error"] and failed["incomplete"], failed
        assert applied["version"] == 2 and applied["digest"] == version_digest(2), applied


@pytest.mark.cpu_is_enough(FAILURES_ON_CPU)
@pytest.mark.parametrize("when", ["mid-stream", "before the offer"])
def test_a_sender_killed_mid_stage_leaves_every_engine_on_the_previous_version(backend, when):
    # mid-stream: a full sync, whose first tensors are staged when the sender stalls; before the offer: a delta,
    # encoded whole before it is offered, so nothing is staged and the staging area (the delta's base) is kept
    commands, out = staged_procs.CTX.Queue(), staged_procs.CTX.Queue()
    sender = staged_procs.CTX.Process(target=staged_procs.sender_main,
                                      args=(commands, out, 2, 3, when == "before the offer"), daemon=True)
    sender.start()
    endpoint = out.get(timeout=90)
    # engines whose loader takes copies: the staging area keeps the model, the next delta's base
    engines = [staged_procs.start(endpoint, mode="load", timeout_s=20) for _ in range(2)]
    try:
        for _proc, engine_commands, _results in engines:
            engine_commands.put({"receive": True})
        commands.put(1)
        assert out.get(timeout=60) == 1
        assert all(results.get(timeout=60)["version"] == 1 for _p, _c, results in engines)
        for _proc, engine_commands, _results in engines:
            engine_commands.put({"receive": True})
        commands.put(2)
        assert out.get(timeout=60) == "stalling"
        os.kill(sender.pid, signal.SIGKILL)
        model_bytes = sum(t.numel() * t.element_size() for t in staged_procs.stepped(1).values())
        for _proc, _commands, results in engines:
            reply = results.get(timeout=60)
            assert "error" in reply and reply["version"] == 1 and reply["digest"] == version_digest(1), reply
            assert not reply["incomplete"]
            assert reply["staging_bytes"] == (0 if when == "mid-stream" else model_bytes), reply
            _served_only(reply, 1)
    finally:
        sender.kill()
        _stop(engines)
        sender.join(10)
        sweep_dead_owners(force=True)  # the killed sender's segments (its resource tracker is this process's)


@pytest.mark.cpu_is_enough("two senders and two engines: control-plane logic; the sim runs the staging copies above")
def test_a_late_joiner_catches_up_from_its_own_sender_while_the_others_keep_serving(backend):
    options = SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)
    with WeightSender(options=options) as first, WeightSender(options=options) as late:
        a = staged_procs.start(first.endpoint)
        engines = [a]
        try:
            _send(first, [a], 1)
            _send(first, [a], 2)  # a serves version 2, received as a delta
            b = staged_procs.start(late.endpoint)  # an engine that starts now
            engines.append(b)
            a[1].put({"serve": 2.0})
            (joined,) = _send(late, [b], 2)  # whole, from its own sender, staged and committed on its own
            assert joined["version"] == 2 and joined["digest"] == version_digest(2) and joined["delta"] is None
            served = a[2].get(timeout=60)  # a answered requests meanwhile, on version 2, and never paused
            assert served["requests"] > 0 and served["answered"] == [version_digest(2)] and served["applies"] == 2
            for sender, engine in ((first, a), (late, b)):  # from here each goes on with its own deltas
                (reply,) = _send(sender, [engine], 3)
                assert reply["version"] == 3 and reply["digest"] == version_digest(3) and reply["delta"] == "delta"
        finally:
            _stop(engines)


def test_staging_beyond_its_cap_is_refused_before_a_byte_moves_naming_the_host_and_the_shortfall():
    host = load_backend("cpu").device()
    area = StagingArea(host, StageOptions(max_bytes=1 << 20))
    specs = [TensorSpec("a", "float32", (512, 256)), TensorSpec("b", "float32", (512, 256))]  # 1 MiB in all
    assert area.begin(specs, 1) == 1 << 20
    for spec in specs:
        area.into(spec.name, torch.float32, spec.shape)
    assert area.begin(specs, 2) == 0  # the same specs: reused
    grown = [*specs, TensorSpec("c", "float32", (4,))]
    with pytest.raises(StagingMemoryError, match=r"staging version 3 \(3 tensors\) on .* needs 16 B more .*"
                                                 r"max_bytes=1.0 MiB \(short by 16 B\)"):
        area.begin(grown, 3)
    area.release()
    assert area.held_bytes == 0
    huge = StagingArea(host, StageOptions())
    with pytest.raises(StagingMemoryError, match=r"needs .* of host memory, and .* is free beyond the headroom "
                                                 r"kept \(short by"):
        huge.begin([TensorSpec("x", "uint8", (1 << 50,))], 4)


def test_the_commit_writes_wait_for_every_job_and_raise_the_first_failure_holding_nothing_alive():
    # the staging area's commit writes and a delta sync's applies wait for their jobs with jobs.wait_all: every job
    # ends before the first failure (in the jobs' order, not in time) is raised, and once the caller lets go of it
    # nothing a failed job's frames held stays alive (no traceback kept, no reference cycle) without a collection
    class Held:  # what a failed write's frame holds (in a sync: a view of the bucket, an engine tensor)
        pass

    class JobFailed(RuntimeError):  # (a built-in exception takes no weak reference)
        pass

    later_failed, ended = threading.Event(), []
    held: list[weakref.ref] = []

    def job(index: int) -> None:
        frame_holds = Held()
        held.append(weakref.ref(frame_holds))
        if index == 0:
            assert later_failed.wait(60)  # the first job fails only after the second did
        if index == 1:
            later_failed.set()
        if index == 2:  # succeeds, and ends last
            assert later_failed.wait(60)
            ended.append(index)
            return
        raise JobFailed(f"job {index} failed")

    gc.disable()  # a collection would free a cycle: what is checked is that there is none
    try:
        with ThreadPoolExecutor(3) as pool:
            with pytest.raises(JobFailed, match="job 0 failed") as info:
                wait_all([pool.submit(job, i) for i in range(3)])
            assert ended == [2] and len(held) == 3
            assert info.value.__traceback__ is not None  # raised here, not in a job's frames
            raised = weakref.ref(info.value)
            del info
            assert [ref() for ref in held] == [None] * 3, "a failed job's frames outlived its error"
            assert raised() is None, "the error raised is in a reference cycle (with the frames it was raised through)"
    finally:
        gc.enable()


# -- across nodes: CrossNodeReceiver(stage=...), sender 0's commit only once every rank staged --------------------


@pytest.mark.cpu_is_enough("the commit is the hub's frames; the staging area is the same-host path's, run on the sim")
@pytest.mark.parametrize("failure", ["digest mismatch", "killed after staging"])
def test_cross_node_stages_commit_everywhere_or_nowhere(backend, failure):
    env = {"HWSYNC_DELTA_FULL_CHECK_EVERY": "1"}
    options = CrossNodeOptions(timeout_s=30, bucket_bytes=1 << 14, delta=True)
    with CrossNodeSender("tcp://127.0.0.1:0", num_receivers=2, group_host="127.0.0.1", options=options) as s:
        # the flipped byte is in the staging area's copy (the base of an engine that loads copies); the other case
        # runs engines that name their own tensors (the base)
        mode = "load" if failure == "digest mismatch" else "into"
        engines = [staged_procs.start(s.endpoint, mode=mode, env=env, rank=rank) for rank in range(2)]
        try:
            for version in (1, 2):
                replies = _send(s, engines, version)
                for reply in replies:
                    assert reply["version"] == version and reply["digest"] == version_digest(version), reply
                    _served_only(reply, version - 1, version)
                    assert reply["stage"]["apply_s"] > 0
            bad, good = engines
            if failure == "digest mismatch":
                bad[1].put({"receive": True, "flip": "w3"})
                good[1].put({"receive": True})
            else:
                bad[1].put({"receive": True, "die_after_staging": True})
                good[1].put({"receive": True, "slow_to_say_staged": 1.0})
            with pytest.raises(SyncError, match="receiver 0|rank 0"):
                s.send(list(staged_procs.stepped(3).items()), version=3)
            survivors = [good] if failure != "digest mismatch" else engines
            for _proc, _commands, results in survivors:
                reply = results.get(timeout=60)
                assert "error" in reply and reply["version"] == 2 and reply["digest"] == version_digest(2), reply
                assert not reply["incomplete"] and reply["staging_bytes"] == 0
                _served_only(reply, 2)
            if failure != "digest mismatch":
                bad[0].join(timeout=30)
                engines = [staged_procs.start(s.endpoint, mode=mode, env=env, rank=0), good]
            for reply in _send(s, engines, 4):
                assert reply["version"] == 4 and reply["digest"] == version_digest(4), reply
        finally:
            _stop(engines)


# -- stage() during a training step, commit() at its boundary; a newer stage supersedes ----------------------------


@pytest.mark.cpu_is_enough(FAILURES_ON_CPU)
def test_stage_then_commit_apart_keeps_serving_the_previous_version_until_the_commit(backend):
    with WeightSender(num_receivers=2, options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)) as s:
        engines = [staged_procs.start(s.endpoint) for _ in range(2)]
        try:
            _send(s, engines, 1)
            for _proc, commands, _results in engines:
                commands.put({"receive": True})
            staged = s.stage(list(staged_procs.stepped(2).items()), version=2)
            assert s.staged_version == 2 and staged.stage is None  # staged, nothing applied yet
            time.sleep(1.0)  # the trainer's next step runs; the engines keep serving version 1
            before_commit = time.time()
            stats = s.commit()
            assert s.staged_version is None and stats.stage is not None and stats.stage.receivers == 2
            assert stats.delta is not None and stats.delta.mode == "delta"
            for _proc, _commands, results in engines:
                reply = results.get(timeout=60)
                assert reply["version"] == 2 and reply["digest"] == version_digest(2), reply
                early = {digest for at, digest in reply["timeline"] if at < before_commit}
                assert early == {version_digest(1)}, "a request saw a staged byte before the commit"
            with pytest.raises(HwsyncError, match=r"commit\(\) without a staged sync"):
                s.commit()
        finally:
            _stop(engines)


@pytest.mark.cpu_is_enough(FAILURES_ON_CPU)
def test_a_newer_stage_supersedes_an_uncommitted_one(backend):
    with WeightSender(num_receivers=2, options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)) as s:
        engines = [staged_procs.start(s.endpoint) for _ in range(2)]
        try:
            _send(s, engines, 1)
            for _proc, commands, _results in engines:
                commands.put({"receive": True})
            s.stage(list(staged_procs.stepped(2).items()), version=2)
            for _proc, commands, _results in engines:
                commands.put({"receive": True})
            s.stage(list(staged_procs.stepped(3).items()), version=3)  # version 2 is dropped, never applied
            superseded = [results.get(timeout=60) for _proc, _commands, results in engines]
            for reply in superseded:
                assert "SupersededError" in reply["error"] and reply["version"] == 1, reply
                assert reply["digest"] == version_digest(1)
            s.commit()
            for _proc, _commands, results in engines:
                reply = results.get(timeout=60)
                assert reply["version"] == 3 and reply["digest"] == version_digest(3), reply
                _served_only(reply, 1, 3)
        finally:
            _stop(engines)
