"""A model checker for staged syncs (issue 48): "whatever sequence of stage, commit, abandon, failure and training
happens, an engine only ever serves a version that was committed, bit-exact, and never a mix".

A Hypothesis state machine drives a real WeightSender (this process) and two real engine processes
(tests/staged_stateful_procs.py: a WeightReceiver(stage=True) each, one copying `into` its tensors, one through
`load`; both answer requests on a thread throughout, each request digesting the whole model under the engine's
pause lock) through random sequences of: full and delta syncs (send), stage() then commit(), stage() then
abandon(), a newer stage or a send superseding an uncommitted stage, training in place right after send() or
stage() returns (before the commit), a reshape or a dtype change of one tensor, a sync in which one engine refuses
the offer or finds its delta's base changed behind hwsync's back (a byte of the `load` engine's staged copy, or of
the `into` engine's own tensor: a digest mismatch), the `into` engine's own tensor changed between stage() and
commit(), and an engine killed after every engine staged and before commit(), or right as it says it staged. The
engines are started once for the test (a spare takes a killed one's place); each example starts with a full sync of
a fresh model.

The test process holds the model: what each engine serves (the committed version: the trainer's bytes when its
send() or stage() was called, with any byte the test changed in the engine's own tensors since; or, after an apply
that failed midway, what the engine said it holds, `incomplete`) and the version staged. After every step each
engine is probed on a thread of its own (during an uncommitted stage too): it serves exactly that, bit-exact, and
every request it answered since the last probe saw it or what it served before, whole. Every engine's reply to a
sync is the new version, exact, or an error with what it served kept and its staging memory released; the sender's
staged_version is the model's. After a delta whose base changed was caught, the next sync is whole.

Run (from the repository root, in .venv):
    python -m pytest -q tests/test_staged_stateful.py --durations=5       # CI: bounded, derandomized, no database
    HWSYNC_STAGED_EXAMPLES=100 python -m pytest -q tests/test_staged_stateful.py --hypothesis-show-statistics
CI draws no kill (each costs a process start): the pinned sequences at the end run both; the long profile is
random and kills in a quarter of its examples. HWSYNC_STAGED_MUTANT=apply-early|keep-staging|commit-unchecked|
baseline-aliases|deltas-unverified|commit-unverified runs either against the library broken on purpose
(staged_stateful_procs.mutate): each fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
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
    """The digest an engine holding exactly these tensors reports (staged_procs.model_digest; "" for none)."""
    return staged_procs.model_digest(tensors) if tensors else ""


@dataclass(frozen=True)
class Serves:
    """What the model says one engine serves: its receiver's version, the digest of the engine's bytes, those bytes
    (None where an apply failed midway: the engine's word, its receiver `incomplete` until a sync completes)."""

    version: int | None
    digest: str
    tensors: dict[str, torch.Tensor] | None
    incomplete: bool = False

    @staticmethod
    def exactly(version: int | None, tensors: dict[str, torch.Tensor]) -> Serves:
        """An engine holding exactly `tensors`, its receiver at `version`."""
        return Serves(version, model_digest(tensors), tensors)


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
        #: what each engine serves (known once fresh_model ran)
        self.serving: list[Serves] = []
        #: the version stage() left, and its bytes
        self.staged: tuple[int, dict[str, torch.Tensor]] | None = None
        #: a delta whose base changed was caught: the next sync (the next committed one too) must be whole
        self.whole_next = False
        #: what the rules' events said, in order (the pinned sequences check theirs)
        self.events: list[str] = []
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
        held = [engine.probe() for engine in self.bed.engines]
        self.serving = [Serves(None, seen["held"], None, seen["incomplete"]) for seen in held]
        self.windows = [{seen["held"]} for seen in held]
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
        version, tensors = self._version()
        stats = self.bed.sender.stage(list(self.trainer.items()), version=version, delta=delta)
        self._train(train_after)
        self._whole_if_due(self._mode(stats))
        assert stats.stage is None, "stage() reported an apply"
        assert self.bed.sender.staged_version == version
        if superseded:
            self._replies_kept("superseded", "SupersededError")
        self.staged = (version, tensors)
        self._event(f"stage: {self._mode(stats)}{' (superseding)' if superseded else ''}")

    @precondition(lambda self: self.staged is not None)
    @rule()
    def commit(self) -> None:
        """commit(): every engine applies the staged version (the bytes of stage() time), inside its pause."""
        assert self.staged is not None
        stats = self.bed.sender.commit()
        assert stats.stage is not None and stats.stage.receivers == 2
        (version, tensors), self.staged = self.staged, None
        self._replies_applied(version, tensors)

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
        """A sync (send(), or stage() then commit()) in which one engine refuses the offer, or finds its delta's base
        changed behind hwsync's back ("flip"): a byte of the `load` engine's staged copy, or of the `into` engine's own
        tensor (it keeps no copy: its base is what it serves, so the change shows in what it serves). The sync is
        applied everywhere exact (a whole sync overwrites the byte), or nowhere: the engine whose base changed fails
        its check (DeltaCheckError), and the next sync is whole."""
        name, engine = NAMES[pick], self.bed.engines[which]
        own = fault == "flip" and engine.mode == "into"  # the engine's own tensor is the base
        command: dict[str, object] = {"refuse": True} if fault == "refuse" else {} if own else {"flip": name}
        flipped = own and self._flip_served(which, name)
        self._offer({which: command})
        version, tensors = self._version()
        failed, mode = self._sync_catching(version, delta, split)
        assert self.bed.sender.staged_version is None
        if failed is None:
            assert fault != "refuse", "a sync that an engine refused was committed"
            self._whole_if_due(mode)
            self._replies_applied(version, tensors)
            self._event(f"faulty sync: {fault}{' (own tensor)' if own else ''}, committed ({mode} sync)")
            return
        assert str(engine.proc.pid) in str(failed), \
            f"the error does not name the engine that failed (pid {engine.proc.pid}): {failed}"
        replies = self._replies_kept(f"{fault} on engine {which}", None)
        if fault == "flip":
            assert flipped or replies[which]["flipped"], f"v{version} failed though no byte was changed: {failed}"
            assert f"DeltaCheckError: {name}" in replies[which]["error"], \
                f"engine {which}'s base of {name} changed, but it failed otherwise: {replies[which]}"
            self.whole_next = True
        self._event(f"faulty sync: {fault}{' (own tensor)' if own else ''}, {type(failed).__name__}")

    @precondition(lambda self: self.staged is None)
    @rule(pick=st.integers(0, len(NAMES) - 1), delta=DELTA)
    def flip_while_staged(self, pick: int, delta: bool) -> None:
        """stage(), then a byte of the `into` engine's own tensor changes behind hwsync's back (the base its staged
        delta checked out on), then commit(). Until the commit the engine serves its bytes, flip and all, and no
        staged one; the commit either overwrites the tensor whole (a whole sync, a dense delta) and every engine
        applies the version exact, or its check catches the change: that engine's apply fails loudly
        (DeltaCheckError, `incomplete`), the sender raises PartlyAppliedError naming it, the other engine applied
        the version, and the next sync is whole. The tensor changes in this sync, in its second half (a few elements
        trained first; the flip is in its first element, which a sparse delta then does not write): a tensor that a
        delta leaves unchanged is not written at the commit, so not checked there."""
        name, index = NAMES[pick], next(i for i, engine in enumerate(self.bed.engines) if engine.mode == "into")
        flat = self.trainer[name].view(-1)
        flat[flat.numel() // 2::max(1, flat.numel() // 8)] += 1
        self._offer({})
        version, tensors = self._version()
        mode = self._mode(self.bed.sender.stage(list(self.trainer.items()), version=version, delta=delta))
        self._whole_if_due(mode)
        before = self.serving[index]
        flipped = self._flip_served(index, name)
        self.staged = (version, tensors)
        self.engines_serve_a_committed_version()  # staged, flipped: the engine serves its own bytes, none staged
        self.staged = None
        try:
            self.bed.sender.commit()
        except HwsyncError as exc:
            failed: HwsyncError | None = exc
        else:
            failed = None
        if failed is None:
            self._replies_applied(version, tensors)
            self._event(f"flip while staged: committed ({mode} sync{', nothing held' if not flipped else ''})")
            return
        pid = self.bed.engines[index].proc.pid
        assert isinstance(failed, PartlyAppliedError) and str(pid) in str(failed) and name in str(failed), \
            f"a base changed before the commit must fail that engine's apply, after the Apply: {failed!r}"
        assert flipped and mode == "delta", f"a {mode} sync failed at the commit though no base changed: {failed!r}"
        other = 1 - index
        self._applied(other, self._reply(other), version, tensors)
        reply = self._reply(index)
        assert not reply["ok"] and f"DeltaCheckError: {name}" in reply["error"], f"engine {index}: {reply}"
        assert reply["incomplete"] and reply["version"] == before.version and reply["staging_bytes"] == 0, \
            f"engine {index} failed its apply but does not say incomplete, or holds staging memory: {reply}"
        self.serving[index] = Serves(before.version, reply["digest"], None, incomplete=True)
        self.windows[index].add(reply["digest"])
        self.whole_next = True
        self._event("flip while staged: PartlyAppliedError")

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
        version, tensors = self._version()
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
        self.serving[which], self.windows[which] = Serves.exactly(None, {}), {""}
        assert failed is not None, "a sync was committed though an engine died in it"
        assert when != "before commit" or isinstance(failed, NotAppliedError), \
            f"commit() after an engine was killed raised {failed!r}, not NotAppliedError"
        reply = self._reply(survivor)
        if isinstance(failed, NotAppliedError):
            assert str(doomed.proc.pid) in str(failed), f"NotAppliedError names not the dead engine: {failed}"
            self._kept(survivor, reply, "not applied")
            self._event(f"kill {when}: NotAppliedError")
        else:  # the Apply went out before the death was seen: the survivor applied (or failed) on its own
            assert isinstance(failed, PartlyAppliedError) and str(doomed.proc.pid) in str(failed), \
                f"a death after the Apply must say the version was committed, naming the engine: {failed!r}"
            if reply["ok"]:
                self._applied(survivor, reply, version, tensors)
            else:
                self._kept(survivor, reply, f"failed ({failed!r})")
            outcome = "applied" if reply["ok"] else "kept"
            self._event(f"kill {when}: {type(failed).__name__} after the Apply, the survivor {outcome}")

    # ---- the invariant -----------------------------------------------------------------------------------------
    @precondition(lambda self: bool(self.serving))  # from fresh_model on
    @invariant()
    def engines_serve_a_committed_version(self) -> None:
        """Each engine serves what it last applied, bit-exact (during an uncommitted stage too; with any byte the test
        changed in its own tensors since), and each request since the last probe saw it or the version before it,
        whole; an engine's receiver says incomplete only after an apply that failed midway; the sender's staged
        version is the model's."""
        assert self.bed.sender.staged_version == (None if self.staged is None else self.staged[0])
        for index, engine in enumerate(self.bed.engines):
            serves = self.serving[index]
            seen, digest = engine.probe(), serves.digest
            assert seen["held"] == digest, f"engine {index} serves bytes of no committed version (v{serves.version} is)"
            assert seen["incomplete"] == serves.incomplete, \
                f"engine {index}'s receiver says incomplete={seen['incomplete']}, the model {serves.incomplete}"
            mixed = set(seen["answered"]) - self.windows[index]
            assert not mixed, f"engine {index} answered {len(mixed)} requests on bytes of no committed version"
            if self.staged is not None:
                assert seen["staged"] == self.staged[0], f"engine {index} has not staged v{self.staged[0]}"
            self.windows[index] = {digest}

    # ---- the steps' parts --------------------------------------------------------------------------------------
    def _send(self, *, delta: bool, train_after: int | None) -> None:
        superseded = self.staged is not None
        self._offer({})
        version, tensors = self._version()
        stats = self.bed.sender.send(list(self.trainer.items()), version=version, delta=delta)
        self._train(train_after)
        assert stats.stage is not None and stats.stage.receivers == 2
        self._whole_if_due(self._mode(stats))
        if superseded:
            self.staged = None
            self._replies_kept("superseded by send()", "SupersededError")
        self._replies_applied(version, tensors)
        self._event(f"send: {self._mode(stats)}{' (superseding)' if superseded else ''}")

    def _version(self) -> tuple[int, dict[str, torch.Tensor]]:
        """A version never sent before, and the trainer's bytes now (what an engine that applies it serves)."""
        return self.bed.next_version(), {name: tensor.clone() for name, tensor in self.trainer.items()}

    @staticmethod
    def _mode(stats: Any) -> str:
        """A sync's mode: "delta" or "full"."""
        return stats.delta.mode if stats.delta else "full"

    def _whole_if_due(self, mode: str) -> None:
        """After a delta whose base changed was caught, the sync is whole (what that receiver held is unknown)."""
        assert not self.whole_next or mode == "full", "a delta sync right after a delta whose base changed was caught"

    def _event(self, what: str) -> None:
        self.events.append(what)
        event(what)

    def _flip_served(self, index: int, name: str) -> bool:
        """A byte of engine `index`'s own tensor `name` changes behind hwsync's back (the `into` engine's next delta's
        base), and alike in the model's copy of what it serves; False where the engine holds no such tensor."""
        serves = self.serving[index]
        flip = self.bed.engines[index].flip_served(name)
        assert flip["before"] == serves.digest, f"engine {index} served bytes of no committed version before a flip"
        tensors = serves.tensors
        if tensors is None:  # what an apply that failed midway left: the engine's word, as for its failed reply
            digest = flip["after"]
        else:
            assert flip["flipped"] == (name in tensors), f"engine {index} holds other tensors than the model: {flip}"
            if name in tensors:
                tensors = {**tensors, name: tensors[name].clone()}
                engines.flip_byte(tensors[name])
            digest = model_digest(tensors)
            assert flip["after"] == digest, f"engine {index}'s flipped tensor is not the model's: {flip}"
        assert flip["flipped"] == (digest != serves.digest), f"engine {index}: a flip changed no byte, or one too many"
        self.serving[index] = Serves(serves.version, digest, tensors, serves.incomplete)
        self.windows[index].add(digest)  # its requests may see either, whole (the flip is made under its lock)
        return bool(flip["flipped"])

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

    def _replies_applied(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Every engine applied `version`, exact: every engine holds the sender's baseline again."""
        for index in range(len(self.bed.engines)):
            self._applied(index, self._reply(index), version, tensors)
        self.whole_next = False

    def _applied(self, index: int, reply: dict[str, Any], version: int, tensors: dict[str, torch.Tensor]) -> None:
        serves = Serves.exactly(version, tensors)
        assert reply["ok"], f"engine {index} failed version {version}, which the sender committed: {reply}"
        assert reply["version"] == version, f"engine {index} says v{reply['version']}, not v{version}"
        assert reply["digest"] == serves.digest, f"engine {index} applied v{version} with bytes the trainer never sent"
        assert not reply["incomplete"], f"engine {index} applied v{version} but says incomplete: {reply}"
        self.serving[index] = serves
        self.windows[index].add(serves.digest)

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
        """Engine `index`'s sync failed, and it serves what it served before, exact, its staging memory released (and
        incomplete only where an apply that failed midway left it so before)."""
        serves = self.serving[index]
        assert not reply["ok"], f"engine {index} completed a sync that was {what}: {reply}"
        assert reply["version"] == serves.version and reply["digest"] == serves.digest, \
            f"engine {index} left v{serves.version} after a sync that was {what}: {reply}"
        assert reply["incomplete"] == serves.incomplete and reply["staging_bytes"] == 0, \
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
    pinned ones (each rule's case that CI's random draws may miss: both kills, a flip on a delta base of either
    engine, before a sync and between stage() and commit(), training between stage() and commit() before deltas),
    each checked to reach the outcomes it is pinned for."""
    StagedMachine.bed = bed
    run_state_machine_as_test(StagedMachine, settings=settings.get_profile(PROFILE))
    for steps, expected in PINNED:
        events = _replay(steps)
        missed = [what for what in expected if not any(what in said for said in events)]
        assert not missed, f"a pinned sequence no longer reaches {missed}: it went {events}"


Step = tuple[str, dict[str, Any]]
#: each sequence, and what events it must reach (each a part of one event's text, in any order)
PINNED: list[tuple[list[Step], list[str]]] = [
    ([  # stage during a training step, commit at its boundary; the deltas after it are exact
        ("fresh_model", {"seed": 1, "kills": 0}), ("train", {"how": 0}),
        ("stage", {"delta": True, "train_after": 2}), ("commit", {}),
        ("send", {"delta": True, "train_after": 0}), ("send", {"delta": True, "train_after": None}),
    ], ["send: delta"]),
    ([  # a newer stage supersedes one, a send supersedes that; an abandoned one is applied nowhere; each sync exact
        ("fresh_model", {"seed": 2, "kills": 0}), ("stage", {"delta": True, "train_after": 1}),
        ("stage", {"delta": True, "train_after": 0}), ("send", {"delta": True, "train_after": 0}),
        ("stage", {"delta": True, "train_after": None}), ("abandon", {}), ("send", {"delta": True, "train_after": 0}),
    ], ["stage: delta", "(superseding)"]),
    ([  # a staged base changed under a delta, a refusal, then new shapes and dtypes, each sync exact or nowhere
        ("fresh_model", {"seed": 3, "kills": 0}), ("send", {"delta": True, "train_after": 0}),
        ("faulty_sync", {"fault": "flip", "which": 1, "pick": 3, "delta": True, "split": True}),
        ("send", {"delta": True, "train_after": 0}),
        ("faulty_sync", {"fault": "refuse", "which": 0, "pick": 0, "delta": True, "split": False}),
        ("respec", {"change": "reshape", "pick": 0}), ("respec", {"change": "dtype", "pick": 2}),
        ("stage", {"delta": True, "train_after": 0}), ("commit", {}), ("send", {"delta": True, "train_after": None}),
    ], ["faulty sync: flip, NotAppliedError", "faulty sync: refuse, NotAppliedError"]),
    ([  # the `into` engine's own tensor (its delta's base) changed: before a send(), caught at the stage; the next
        # stage and send whole, the flipped byte served until the send overwrites it; changed between stage() and
        # commit(), caught at the commit (PartlyAppliedError, that engine incomplete through a refused sync and
        # until the next, whole, commit); changed before a stage(), caught there; each next sync whole
        ("fresh_model", {"seed": 5, "kills": 0}), ("send", {"delta": True, "train_after": 0}),
        ("faulty_sync", {"fault": "flip", "which": 0, "pick": 1, "delta": True, "split": False}),
        ("stage", {"delta": True, "train_after": None}), ("abandon", {}), ("send", {"delta": True, "train_after": 0}),
        ("send", {"delta": True, "train_after": 0}), ("flip_while_staged", {"pick": 1, "delta": True}),
        ("faulty_sync", {"fault": "refuse", "which": 1, "pick": 0, "delta": True, "split": False}),
        ("stage", {"delta": True, "train_after": 0}), ("commit", {}), ("send", {"delta": True, "train_after": 0}),
        ("faulty_sync", {"fault": "flip", "which": 0, "pick": 2, "delta": True, "split": True}),
        ("send", {"delta": True, "train_after": None}),
    ], ["faulty sync: flip (own tensor), NotAppliedError", "stage: full", "send: full", "send: delta",
        "flip while staged: PartlyAppliedError"]),
    ([  # an engine killed after every engine staged and before commit(); one killed as it says staged (in send())
        ("fresh_model", {"seed": 4, "kills": 2}), ("send", {"delta": True, "train_after": 0}),
        ("kill_engine", {"which": 0, "when": "before commit", "delta": True, "split": True}),
        ("send", {"delta": True, "train_after": 0}),
        ("kill_engine", {"which": 1, "when": "as it staged", "delta": True, "split": False}),
        ("send", {"delta": True, "train_after": None}),
    ], ["kill before commit: NotAppliedError"]),
]


def _replay(steps: list[Step]) -> list[str]:
    """One sequence of the machine's steps as Hypothesis runs one: the invariant after each; what its events said."""
    machine = StagedMachine()
    try:
        for name, kwargs in steps:
            getattr(machine, name)(**kwargs)
            machine.engines_serve_a_committed_version()
    finally:
        machine.teardown()
    return machine.events
