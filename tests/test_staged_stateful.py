"""A model checker for staged syncs (issue 48): "whatever sequence of stage, commit, abandon, failure and training
happens, an engine only ever serves a version that was committed, bit-exact, and never a mix".

A Hypothesis state machine drives a real WeightSender (this process) and two real engine processes
(tests/staged_stateful_procs.py: a WeightReceiver(stage=True) each, one copying `into` its tensors, one through
`load`; both answer requests on a thread throughout, each request digesting the whole model under the engine's
pause lock) through random sequences of: full and delta syncs (send), stage() then commit(), stage() then
abandon(), a newer stage or a send superseding an uncommitted stage, training in place right after send() or
stage() returns (before the commit), a reshape or a dtype change of one tensor, a sync in which one engine refuses
the offer or finds a byte of its staged copy changed (a digest mismatch), and an engine killed after every engine
staged and before commit(), or right as it says it staged. The engines are started once for the test (a spare
takes a killed one's place); each example starts with a full sync of a fresh model.

The test process holds the model: what each engine serves (the committed version: the trainer's bytes when its
send() or stage() was called) and the version staged. After every step each engine is probed on a thread of its
own (during an uncommitted stage too): it serves exactly that, bit-exact, and every request it answered since the
last probe saw it or what it served before, whole. Every engine's reply to a sync is the new version, exact, or an
error with what it served kept and its staging memory released; the sender's staged_version is the model's.

Run (from the repository root, in .venv):
    python -m pytest -q tests/test_staged_stateful.py --durations=5       # CI: bounded, derandomized, no database
    HWSYNC_STAGED_EXAMPLES=100 python -m pytest -q tests/test_staged_stateful.py --hypothesis-show-statistics
CI draws no kill (each costs a process start): the pinned sequences at the end run both; the long profile is
random and kills in a quarter of its examples. HWSYNC_STAGED_MUTANT=apply-early|keep-staging|commit-unchecked|
baseline-aliases runs either against the library broken on purpose (staged_stateful_procs.mutate): each fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import staged_procs
import staged_stateful_procs as engines
import torch
from hypothesis import HealthCheck, event as hypothesis_event, settings, strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hwsync import HwsyncError, NotAppliedError, PartlyAppliedError, WeightSender
from hwsync.sync.options import SenderOptions

EXAMPLES = int(os.environ.get("HWSYNC_STAGED_EXAMPLES", "0"))
settings.register_profile("staged-ci", max_examples=30, stateful_step_count=10, derandomize=True, database=None,
                          deadline=None, print_blob=False, suppress_health_check=list(HealthCheck))
settings.register_profile("staged-long", max_examples=EXAMPLES or 100, stateful_step_count=15, deadline=None,
                          database=None, suppress_health_check=list(HealthCheck))
PROFILE = "staged-long" if EXAMPLES else "staged-ci"

#: the trainer's tensors at the start of each example: (shape, dtype); small, and over several 16 KiB buckets
SPECS = {"w0": ((64, 64), torch.float32), "w1": ((4096,), torch.float32), "w2": ((48, 32), torch.bfloat16),
         "w3": ((16, 16), torch.float32)}
NAMES = list(SPECS)
#: every delta digested whole on the engines: a changed byte of a staged copy is caught at the first delta on it
ENGINE_ENV = {"HWSYNC_DELTA_FULL_CHECK_EVERY": "1"}
#: how many engines one example may kill: each costs a process start (seconds), so CI kills only in the pinned
#: sequences at the end, and the long profile in a quarter of its examples
KILLS = st.sampled_from([0, 0, 0, 1]) if EXAMPLES else st.just(0)
#: whether a sync asks for a delta (it is one where every engine holds the sender's baseline, else full)
DELTA = st.sampled_from([True, True, False])


def event(what: str) -> None:
    """A line of Hypothesis' statistics (--hypothesis-show-statistics); the pinned sequences run outside it."""
    if currently_in_test_context():
        hypothesis_event(what)


def model_digest(tensors: dict[str, torch.Tensor]) -> str:
    """The digest an engine holding exactly these tensors reports (staged_procs.model_digest)."""
    return staged_procs.model_digest(tensors)


class Bed:
    """The sender and the two engines, kept for the whole test, and a spare engine, up, that takes a killed one's
    place at once; the version counter runs across examples."""

    def __init__(self) -> None:
        options = SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)
        self.sender = WeightSender(num_receivers=2, options=options)
        started = [engines.spawn(self.sender.endpoint, ENGINE_ENV) for _ in range(3)]
        self.engines, self.spare = [engine.up() for engine in started[:2]], started[2]  # the spare starts meanwhile
        self.engines[1].mode = "load"
        self.version = 0

    def next_version(self) -> int:
        """A version never sent before."""
        self.version += 1
        return self.version

    def replace(self, index: int) -> None:
        """Engine `index` was killed: the spare takes its place (holding nothing), a new spare starts."""
        self.engines[index].proc.join(timeout=30)
        mode = self.engines[index].mode
        self.engines[index], self.spare = self.spare.up(), engines.spawn(self.sender.endpoint, ENGINE_ENV)
        self.engines[index].mode = mode

    def close(self) -> None:
        """Stop the engines, then the sender."""
        for engine in [*self.engines, self.spare]:
            engine.stop()
        self.sender.close()


class StagedMachine(RuleBasedStateMachine):
    """The model: the trainer's tensors, what each engine serves (the committed version, but for a commit that an
    engine died in), the staged version; the processes: the bed's."""

    bed: Bed  # set by the test before running the machine

    def __init__(self) -> None:
        super().__init__()
        self.trainer: dict[str, torch.Tensor] = {}
        #: each engine's version and the digest of what it serves (known once fresh_model ran)
        self.serving: list[tuple[int | None, str]] = []
        #: the version stage() left, and its digest
        self.staged: tuple[int, str] | None = None
        #: per engine, what it may have served since the last probe: what it served then, and what it applied since
        self.windows: list[set[str]] = []
        #: receive() commands each engine has not answered yet
        self.outstanding = [0, 0]
        self.kills = 0

    # ---- set-up ------------------------------------------------------------------------------------------------
    @initialize(seed=st.integers(0, 1 << 16), kills=KILLS)
    def fresh_model(self, seed: int, kills: int) -> None:
        """A fresh model, sent whole: every example starts from a version it knows; `kills`: how many engines this
        example may kill (a new one costs a process start)."""
        g = torch.Generator().manual_seed(seed)
        self.trainer = {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in SPECS.items()}
        self.kills = kills
        # what each engine serves now, from itself: an example that failed may have left anything (the bed is shared)
        held = [engine.probe()["held"] for engine in self.bed.engines]
        self.serving, self.windows = [(None, digest) for digest in held], [{digest} for digest in held]
        self._send(delta=False, train_after=None)

    def teardown(self) -> None:
        """An uncommitted stage is dropped, and every engine's reply collected: the next example starts clean."""
        sender = self.bed.sender
        if sender.staged_version is not None:
            sender.abandon("the example ended")
        for index, count in enumerate(self.outstanding):
            for _ in range(count):
                self.bed.engines[index].reply()
        self.outstanding = [0, 0]

    # ---- rules -------------------------------------------------------------------------------------------------
    @rule(delta=DELTA, train_after=st.sampled_from([None, 0, 1, 2]))
    def send(self, delta: bool, train_after: int | None) -> None:
        """send(): staged and committed everywhere (superseding an uncommitted stage); training right after it."""
        self._send(delta=delta, train_after=train_after)

    @rule(delta=DELTA, train_after=st.sampled_from([None, 0, 1, 2]))
    def stage(self, delta: bool, train_after: int | None) -> None:
        """stage(): every engine stages and keeps serving what it served; training right after (before the commit).
        A stage left uncommitted is superseded: no engine applies it."""
        superseded = self.staged is not None
        self._offer({})
        version, digest = self.bed.next_version(), model_digest(self.trainer)
        stats = self.bed.sender.stage(list(self.trainer.items()), version=version, delta=delta)
        self._train(train_after)
        assert stats.stage is None, "stage() reported an apply"
        assert self.bed.sender.staged_version == version
        if superseded:
            self._replies_kept("superseded", "SupersededError")
        self.staged = (version, digest)
        event(f"stage: {stats.delta.mode if stats.delta else 'full'}{' (superseding)' if superseded else ''}")

    @precondition(lambda self: self.staged is not None)
    @rule()
    def commit(self) -> None:
        """commit(): every engine applies the staged version (the bytes of stage() time), inside its pause."""
        assert self.staged is not None
        stats = self.bed.sender.commit()
        assert stats.stage is not None and stats.stage.receivers == 2
        (version, digest), self.staged = self.staged, None
        self._replies_applied(version, digest)

    @precondition(lambda self: self.staged is not None)
    @rule()
    def abandon(self) -> None:
        """abandon(): no engine applies the staged version; each keeps what it served, its staging released."""
        self.bed.sender.abandon("dropped by the test")
        self.staged = None
        self._replies_kept("abandoned", "SupersededError")

    @rule(how=st.sampled_from([0, 1, 2]))
    def train(self, how: int) -> None:
        """A training step between syncs (in place: the trainer's own tensors)."""
        self._train(how)

    @rule(change=st.sampled_from(["reshape", "dtype"]), pick=st.integers(0, len(NAMES) - 1))
    def respec(self, change: str, pick: int) -> None:
        """One tensor takes another shape (same elements) or another dtype from the next sync on."""
        name = NAMES[pick]
        tensor = self.trainer[name]
        if change == "reshape":
            shape = tuple(tensor.shape)
            new = (shape[1], shape[0]) if len(shape) == 2 and shape[0] != shape[1] else (tensor.numel(),) \
                if len(shape) == 2 else (64, tensor.numel() // 64)
            self.trainer[name] = tensor.reshape(new).clone()
        else:
            self.trainer[name] = tensor.to(torch.float32 if tensor.dtype == torch.bfloat16 else torch.bfloat16)

    @precondition(lambda self: self.staged is None)
    @rule(fault=st.sampled_from(["refuse", "flip"]), which=st.integers(0, 1), pick=st.integers(0, len(NAMES) - 1),
          delta=DELTA, split=st.booleans())
    def faulty_sync(self, fault: str, which: int, pick: int, delta: bool, split: bool) -> None:
        """A sync (send(), or stage() then commit()) in which one engine refuses the offer, or finds a byte of its
        staged copy (the next delta's base) changed: it is applied everywhere exact, or nowhere. Only the engine
        that loads copies keeps a staged copy between syncs; the `into` engine's base is its own tensor (a change
        there between stage and commit: tests/test_staged.py), so a flip there changes nothing."""
        command: dict[str, object] = {"refuse": True} if fault == "refuse" else {"flip": NAMES[pick]}
        self._offer({which: command})
        version, digest = self.bed.next_version(), model_digest(self.trainer)
        failed, mode = self._sync_catching(version, delta, split)
        assert self.bed.sender.staged_version is None
        if failed is None:
            assert fault != "refuse", "a sync that an engine refused was committed"
            self._replies_applied(version, digest)
            event(f"faulty sync: {fault}, committed ({mode} sync)")
            return
        pid = self.bed.engines[which].proc.pid
        assert str(pid) in str(failed), f"the error does not name the engine that failed (pid {pid}): {failed}"
        replies = self._replies_kept(f"{fault} on engine {which}", None)
        if fault == "flip":
            assert replies[which]["flipped"], f"version {version} failed though no byte was changed: {failed}"
        event(f"faulty sync: {fault}, {type(failed).__name__}")

    @precondition(lambda self: self.staged is None and self.kills > 0)
    @rule(which=st.integers(0, 1), when=st.sampled_from(["before commit", "as it staged"]), delta=DELTA,
          split=st.booleans())
    def kill_engine(self, which: int, when: str, delta: bool, split: bool) -> None:
        """An engine killed once every engine staged, before the commit (stage(), the kill, commit()): NotAppliedError
        naming it, and the other keeps what it served. Or killed right as it says it staged (in send(), or before
        stage() returns): NotAppliedError and none applied, or, where the sender sent its Apply before it saw the
        death, PartlyAppliedError naming it and the survivor applied the version (docs/staged.md: the row "a receiver
        fails or dies after the Apply went out")."""
        self.kills -= 1
        self._offer({which: {"die_after_staging": True}} if when == "as it staged" else {})
        version, digest = self.bed.next_version(), model_digest(self.trainer)
        doomed, survivor = self.bed.engines[which], 1 - which
        failed: HwsyncError | None = None
        if when == "before commit":
            self.bed.sender.stage(list(self.trainer.items()), version=version, delta=delta)
            doomed.kill()
            try:
                self.bed.sender.commit()
            except HwsyncError as exc:
                failed = exc
        else:
            failed, _ = self._sync_catching(version, delta, split)
        self.outstanding[which] = 0  # it never answers: the spare takes its place before anything is checked
        self.bed.replace(which)
        self.serving[which], self.windows[which] = (None, ""), {""}
        assert failed is not None, "a sync was committed though an engine died in it"
        assert when != "before commit" or isinstance(failed, NotAppliedError), \
            f"commit() after an engine was killed raised {failed!r}, not NotAppliedError"
        reply = self._reply(survivor)
        if isinstance(failed, NotAppliedError):
            assert str(doomed.proc.pid) in str(failed), f"NotAppliedError names not the dead engine: {failed}"
            self._kept(survivor, reply, "not applied")
            event(f"kill {when}: NotAppliedError")
        else:  # the Apply went out before the death was seen: the survivor applied (or failed) on its own
            assert isinstance(failed, PartlyAppliedError) and str(doomed.proc.pid) in str(failed), \
                f"a death after the Apply must say the version was committed, naming the engine: {failed!r}"
            if reply["ok"]:
                self._applied(survivor, reply, version, digest)
            else:
                self._kept(survivor, reply, f"failed ({failed!r})")
            outcome = "applied" if reply["ok"] else "kept"
            event(f"kill {when}: {type(failed).__name__} after the Apply, the survivor {outcome}")

    # ---- the invariant -----------------------------------------------------------------------------------------
    @precondition(lambda self: bool(self.serving))  # from fresh_model on
    @invariant()
    def engines_serve_a_committed_version(self) -> None:
        """Each engine serves what it last applied, bit-exact (during an uncommitted stage too), and each request
        since the last probe saw it or the version before it, whole; the sender's staged version is the model's."""
        assert self.bed.sender.staged_version == (None if self.staged is None else self.staged[0])
        for index, engine in enumerate(self.bed.engines):
            version, digest = self.serving[index]
            seen = engine.probe()
            assert seen["held"] == digest, f"engine {index} serves bytes of no committed version (v{version} is)"
            mixed = set(seen["answered"]) - self.windows[index]
            assert not mixed, f"engine {index} answered {len(mixed)} requests on bytes of no committed version"
            if self.staged is not None:
                assert seen["staged"] == self.staged[0], f"engine {index} has not staged v{self.staged[0]}"
            self.windows[index] = {digest}

    # ---- the steps' parts --------------------------------------------------------------------------------------
    def _send(self, *, delta: bool, train_after: int | None) -> None:
        superseded = self.staged is not None
        self._offer({})
        version, digest = self.bed.next_version(), model_digest(self.trainer)
        stats = self.bed.sender.send(list(self.trainer.items()), version=version, delta=delta)
        self._train(train_after)
        assert stats.stage is not None and stats.stage.receivers == 2
        if superseded:
            self.staged = None
            self._replies_kept("superseded by send()", "SupersededError")
        self._replies_applied(version, digest)
        event(f"send: {stats.delta.mode if stats.delta else 'full'}{' (superseding)' if superseded else ''}")

    def _sync_catching(self, version: int, delta: bool, split: bool) -> tuple[HwsyncError | None, str]:
        """send(), or stage() then commit() at once: the error it raised (None: committed) and the sync's mode."""
        sender = self.bed.sender
        try:
            if split:
                stats = sender.stage(list(self.trainer.items()), version=version, delta=delta)
                sender.commit()
            else:
                stats = sender.send(list(self.trainer.items()), version=version, delta=delta)
        except HwsyncError as exc:
            return exc, ""
        return None, stats.delta.mode if stats.delta else "full"

    def _offer(self, faults: dict[int, dict[str, object]]) -> None:
        """Each engine's receive() for the next sync (queued behind one that awaits its commit)."""
        for index, engine in enumerate(self.bed.engines):
            engine.receive(**faults.get(index, {}))
            self.outstanding[index] += 1

    def _reply(self, index: int) -> dict[str, Any]:
        reply = self.bed.engines[index].reply()
        self.outstanding[index] -= 1
        return reply

    def _replies_applied(self, version: int, digest: str) -> None:
        """Every engine applied `version`, exact."""
        for index in range(len(self.bed.engines)):
            self._applied(index, self._reply(index), version, digest)

    def _applied(self, index: int, reply: dict[str, Any], version: int, digest: str) -> None:
        assert reply["ok"], f"engine {index} failed version {version}, which the sender committed: {reply}"
        assert reply["version"] == version, f"engine {index} says v{reply['version']}, not v{version}"
        assert reply["digest"] == digest, f"engine {index} applied v{version} with bytes the trainer never sent"
        self.serving[index] = (version, digest)
        self.windows[index].add(digest)

    def _replies_kept(self, what: str, error: str | None) -> list[dict[str, Any]]:
        """Every engine's sync failed (`error` in its message), and it kept what it served."""
        replies = []
        for index in range(len(self.bed.engines)):
            reply = self._reply(index)
            assert error is None or error in reply.get("error", ""), f"engine {index}: {reply}"
            self._kept(index, reply, what)
            replies.append(reply)
        return replies

    def _kept(self, index: int, reply: dict[str, Any], what: str) -> None:
        """Engine `index`'s sync failed, and it serves what it served before, exact, its staging memory released."""
        version, digest = self.serving[index]
        assert not reply["ok"], f"engine {index} completed a sync that was {what}: {reply}"
        assert reply["version"] == version and reply["digest"] == digest, \
            f"engine {index} left v{version} after a sync that was {what}: {reply}"
        assert not reply["incomplete"] and reply["staging_bytes"] == 0, \
            f"engine {index} holds staging memory or an incomplete model after a sync that was {what}: {reply}"

    def _train(self, how: int | None) -> None:
        """In place, as an optimizer step does: 0: a few elements of every tensor, 1: one tensor whole, 2: both."""
        if how is None:
            return
        g = torch.Generator().manual_seed(self.bed.version * 31 + how)
        for index, tensor in enumerate(self.trainer.values()):
            flat = tensor.view(-1)
            if how in (0, 2):
                picked = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
                flat[picked] += torch.ones(len(picked), dtype=flat.dtype)
            if how in (1, 2) and index == self.bed.version % len(self.trainer):
                flat.copy_(torch.randn(flat.shape, generator=g).to(flat.dtype))


@pytest.fixture(scope="module")
def bed() -> Iterator[Bed]:
    """The sender and two engines on the cpu backend, for the module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HWSYNC_BACKEND", "cpu")
        engines.mutate(mp.setattr)  # HWSYNC_STAGED_MUTANT: the sender's side broken on purpose (the engines' too)
        made = Bed()
        try:
            yield made
        finally:
            made.close()


@pytest.mark.timeout(300)
def test_staged_state_machine(bed: Bed) -> None:
    """Random sequences (the CI profile: derandomized; HWSYNC_STAGED_EXAMPLES=N: the long, random one), then the
    pinned ones (each rule's case that CI's random draws may miss: both kills, a flip on a delta base, training
    between stage() and commit() before deltas)."""
    StagedMachine.bed = bed
    run_state_machine_as_test(StagedMachine, settings=settings.get_profile(PROFILE))
    for steps in PINNED:
        _replay(steps)


Step = tuple[str, dict[str, Any]]
PINNED: list[list[Step]] = [
    [  # stage during a training step, commit at its boundary; the deltas after it are exact
        ("fresh_model", {"seed": 1, "kills": 0}), ("train", {"how": 0}),
        ("stage", {"delta": True, "train_after": 2}), ("commit", {}),
        ("send", {"delta": True, "train_after": 0}), ("send", {"delta": True, "train_after": None}),
    ],
    [  # a newer stage supersedes one, a send supersedes that; an abandoned one leaves the deltas going
        ("fresh_model", {"seed": 2, "kills": 0}), ("stage", {"delta": True, "train_after": 1}),
        ("stage", {"delta": True, "train_after": 0}), ("send", {"delta": True, "train_after": 0}),
        ("stage", {"delta": True, "train_after": None}), ("abandon", {}), ("send", {"delta": True, "train_after": 0}),
    ],
    [  # a staged base changed under a delta, a refusal, then new shapes and dtypes, each sync exact or nowhere
        ("fresh_model", {"seed": 3, "kills": 0}), ("send", {"delta": True, "train_after": 0}),
        ("faulty_sync", {"fault": "flip", "which": 1, "pick": 3, "delta": True, "split": True}),
        ("send", {"delta": True, "train_after": 0}),
        ("faulty_sync", {"fault": "refuse", "which": 0, "pick": 0, "delta": True, "split": False}),
        ("respec", {"change": "reshape", "pick": 0}), ("respec", {"change": "dtype", "pick": 2}),
        ("stage", {"delta": True, "train_after": 0}), ("commit", {}), ("send", {"delta": True, "train_after": None}),
    ],
    [  # an engine killed after every engine staged and before commit(); one killed as it says staged (in send())
        ("fresh_model", {"seed": 4, "kills": 2}), ("send", {"delta": True, "train_after": 0}),
        ("kill_engine", {"which": 0, "when": "before commit", "delta": True, "split": True}),
        ("send", {"delta": True, "train_after": 0}),
        ("kill_engine", {"which": 1, "when": "as it staged", "delta": True, "split": False}),
        ("send", {"delta": True, "train_after": None}),
    ],
]


def _replay(steps: list[Step]) -> None:
    """One sequence of the machine's steps as Hypothesis runs one: the invariant after each."""
    machine = StagedMachine()
    try:
        for name, kwargs in steps:
            getattr(machine, name)(**kwargs)
            machine.engines_serve_a_committed_version()
    finally:
        machine.teardown()
