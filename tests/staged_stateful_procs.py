"""Engines for the staged state machine (tests/test_staged_stateful.py): a process that answers requests on a thread
(staged_procs.Engine: each request digests the whole model under the engine's pause lock) while a
WeightReceiver(stage=True) receives one sync per command on its main thread, and that answers probes on a third
thread at any moment, during a sync too: the model's digest now, and every digest a request saw since the last probe.
That thread also changes a byte of one of the engine's own tensors on the test's word (EngineProcess.flip_served),
between syncs or while one is staged and awaits its commit: the `into` engine's tensor is its next delta's base.

A probe during a staged, uncommitted sync is what shows that no staged byte reaches what the engine serves before the
commit; the digests the requests saw show that none ever saw a mix of versions.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import staged_procs
import torch

from hwsync import WeightReceiver
from hwsync.backend.registry import get_backend
from hwsync.protocol import Complete
from hwsync.sync.spec import TensorSpec

CTX = staged_procs.CTX
#: HWSYNC_STAGED_MUTANT=<name>: the library broken on purpose in the test process and the engines (mutate()), to show
#: that the state machine catches it; never set in CI
MUTANT_ENV = "HWSYNC_STAGED_MUTANT"
#: how long the test waits for an engine's answer before calling it a hang (hwsync's own waits are shorter)
REPLY_S = 90.0


def flip_byte(tensor: torch.Tensor) -> None:
    """Change one byte of `tensor` in place, behind hwsync's back (the test's model does the same to its copy)."""
    tensor.view(-1).view(torch.uint8)[1] ^= 0x10


@dataclass
class EngineProcess:
    """One engine process and its queues: commands and their replies (the main thread), probes and theirs."""

    proc: Any
    commands: Any
    results: Any
    probes: Any
    probed: Any

    #: how the engine takes a version: "into" (copies into its tensors) or "load" (its loader copies them)
    mode: str = "into"
    started: bool = False

    def up(self) -> EngineProcess:
        """Wait until the process is up (its receiver made)."""
        if not self.started:
            assert self.results.get(timeout=REPLY_S) == "up"
            self.started = True
        return self

    def receive(self, **command: object) -> None:
        """Queue one receive(): `refuse` (the engine's accept() refuses the offer), `flip` (a name: a byte of its
        staged copy changes behind hwsync's back first; only a `load` engine keeps one between syncs),
        `die_after_staging` (SIGKILL once it said staged)."""
        self.commands.put({"receive": True, "mode": self.mode, **command})

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        self.proc.kill()
        self.proc.join(timeout=30)

    def reply(self) -> dict[str, Any]:
        """The reply to the oldest receive() not answered yet."""
        return self.results.get(timeout=REPLY_S)

    def probe(self) -> dict[str, Any]:
        """What the engine serves now (and whether its receiver says incomplete), and the digests its requests saw
        since the last probe."""
        self.probes.put("probe")
        return self.probed.get(timeout=REPLY_S)

    def flip_served(self, name: str) -> dict[str, Any]:
        """Change a byte of the engine's own tensor `name` now (under its pause lock, as an engine's own write would
        be), whatever its receiver is doing: the model's digest before and after, and whether it held `name`."""
        self.probes.put({"flip": name})
        return self.probed.get(timeout=REPLY_S)

    def stop(self) -> None:
        """End the process (it closes its receiver first)."""
        if self.proc.is_alive():
            self.commands.put({"stop": True})
            self.probes.put(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


def spawn(endpoint: str, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> EngineProcess:
    """A staging engine process, starting (`up()` waits for it); it connects at its first receive()."""
    commands, results, probes, probed = CTX.Queue(), CTX.Queue(), CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=engine_main, args=(endpoint, env or {}, timeout_s, commands, results, probes, probed),
                       daemon=True)
    proc.start()
    return EngineProcess(proc, commands, results, probes, probed)


class RefusingLoader:
    """The engine's loader, whose accept() refuses the offer (a manifest the engine cannot take): nothing moves."""

    def __init__(self, engine: staged_procs.Engine) -> None:
        self.engine = engine

    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Never reached: the sync is refused first."""
        self.engine.load(pairs)

    def accept(self, version: int, manifest: list[TensorSpec] | None) -> None:
        """Refuse the sync."""
        raise ValueError(f"this engine refuses version {version} (told to by the test)")

    def pause(self) -> AbstractContextManager[object]:
        """The engine's pause (never reached)."""
        return self.engine.pause()


def mutate(setattr_: Callable[[object, str, object], None] = setattr) -> str | None:
    """Break the library as HWSYNC_STAGED_MUTANT names (a monkeypatch of this process only), to show the state machine
    fails on it: "apply-early" (a receiver applies the version before it says staged, not at the commit),
    "keep-staging" (a failed sync's staging memory is kept), "commit-unchecked" (commit() sends the Apply without
    checking that every receiver is still there), "baseline-aliases" (the sender's delta baseline is the trainer's
    own tensor, not a copy), "deltas-unverified" (a receiver takes every delta's result for the sender's digest, at
    the stage and at the commit), "commit-unverified" (only at the commit: a staged delta written into the engine's
    tensor is not checked there). Returns the name (None: nothing broken)."""
    from hwsync.colocated.receiver import WeightReceiver as Receiver
    from hwsync.colocated.sender_control import SyncReceivers
    from hwsync.delta import staged as staged_delta
    from hwsync.sync import delta_receiver
    from hwsync.sync.delta_baseline import Baseline
    from hwsync.sync.staging import StagingArea

    name = os.environ.get(MUTANT_ENV) or None
    if name == "apply-early":
        await_apply = Receiver._await_apply

        def early(self: Any, offer: Any, staging: StagingArea, hooks: Any, start: float, stats: Any) -> None:
            staging.apply(hooks)  # into the engine now; the real apply below finds nothing left to apply
            await_apply(self, offer, staging, hooks, start, stats)

        setattr_(Receiver, "_await_apply", early)
    elif name == "keep-staging":
        setattr_(StagingArea, "release", lambda self: setattr(self, "_staged", []))
    elif name == "commit-unchecked":
        poll = SyncReceivers.poll
        setattr_(SyncReceivers, "poll",
                 lambda self, what: [] if what == "before sending the Apply" else poll(self, what))
    elif name == "baseline-aliases":
        setattr_(Baseline, "keep", lambda self, name, tensor, dtype: self.tensors.__setitem__(name, tensor) or tensor)
    elif name in ("deltas-unverified", "commit-unverified"):
        setattr_(staged_delta, "verify", lambda tensor, header: True)
        if name == "deltas-unverified":
            setattr_(delta_receiver, "verify", lambda tensor, header: True)
    elif name is not None:
        raise ValueError(f"{MUTANT_ENV}={name!r}: no such mutant")
    return name


def _seen(engine: staged_procs.Engine) -> Iterator[str]:
    """The digests the engine's requests saw since the last call (the list is appended to by its thread)."""
    seen = engine.answered[:]
    del engine.answered[:len(seen)]  # appends meanwhile land past this slice: none is lost
    return iter(seen)


def _digest(engine: staged_procs.Engine) -> str:
    """The digest of what the engine holds ("" for nothing); the caller holds its lock."""
    return staged_procs.model_digest(engine.held) if engine.held else ""


def _answer_probes(engine: staged_procs.Engine, receiver: WeightReceiver, probes: Any, probed: Any) -> None:
    while (probe := probes.get()) is not None:
        if isinstance(probe, dict):  # flip_served: the engine's own tensor changes (no request sees it half done)
            with engine.lock:
                before, tensor = _digest(engine), engine.held.get(probe["flip"])
                flipped = tensor is not None and tensor.numel() > 0
                if flipped and tensor is not None:
                    flip_byte(tensor)
                probed.put({"before": before, "after": _digest(engine), "flipped": flipped})
            continue
        seen = sorted(set(_seen(engine)))
        with engine.lock:
            held = _digest(engine)
        probed.put({"held": held, "answered": seen, "version": receiver.version, "staged": receiver.staged,
                    "incomplete": receiver.incomplete})


def engine_main(endpoint: str, env: dict[str, str], timeout_s: float, commands: Any, results: Any, probes: Any,
                probed: Any) -> None:
    """Receive one sync per command (EngineProcess.receive), reply with the version and the model's digest (and the
    error, if it failed); answer probes meanwhile; {"stop": True} ends it."""
    os.environ.update(env)
    torch.set_num_threads(1)
    mutate()
    engine = staged_procs.Engine("into", get_backend().device().torch_device())
    engine.times = _Discard()  # the time of each request is not needed here: keep memory flat over a long run
    receiver = WeightReceiver(endpoint, timeout_s=timeout_s, stage=True)
    threading.Thread(target=_answer_probes, args=(engine, receiver, probes, probed), daemon=True).start()
    results.put("up")
    control: Any = receiver._control  # its send() is wrapped for die_after_staging
    send = control.send
    while not (command := commands.get()).get("stop"):
        control.send = send
        engine.mode = mode = command["mode"]
        if command.get("die_after_staging"):
            def send_and_die(frame: Any) -> None:
                send(frame)
                if isinstance(frame, Complete):  # said staged and checked: killed before the commit
                    os.kill(os.getpid(), signal.SIGKILL)

            control.send = send_and_die
        flipped = None
        if command.get("flip") and receiver._staging is not None:
            staged = receiver._staging._tensors.get(command["flip"])
            if staged is not None and staged.numel():
                flip_byte(staged)  # a byte of the staged copy (the next delta's base)
                flipped = command["flip"]
        loader: Any = RefusingLoader(engine) if command.get("refuse") else engine
        try:
            receiver.receive(loader, into=engine.into if mode == "into" else None)
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        with engine.lock:
            digest = _digest(engine)
        results.put({**reply, "version": receiver.version, "digest": digest, "flipped": flipped,
                     "incomplete": receiver.incomplete,
                     "staging_bytes": receiver._staging.held_bytes if receiver._staging else 0})
    engine.stop()
    receiver.close()
    os._exit(0)


class _Discard(list[float]):
    """A list that keeps nothing appended to it."""

    def append(self, item: object) -> None:
        """Drop it."""
