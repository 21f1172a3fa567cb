"""A model checker for "a weight is never silently wrong" (issue 46): a Hypothesis state machine that drives a real
trainer process (WeightSender) and one to three real engine processes (WeightReceiver: spawned, real ZeroMQ, real
shared memory; tests/delta_model_procs.py) through random sequences of syncs, full and delta; in-place training
right after send() returns and between syncs; reshapes, dtype and element-count changes, tensors added and
removed; stable and staging sources (stable_sources both ways), and tensors in hwsync's shared memory (one-copy syncs,
replayed while nothing changed: hwsync.colocated.replay); load, into and stubborn-into engines; restarted
engines; an engine's destination made anew (other memory, of zeros or of what it held); an engine or the trainer killed mid-sync; drop_delta_baseline(). The test process holds only the model:
the specs of the trainer's tensors and the digests of what the trainer was given for each version, as the
engine's loader stores it (`torch.empty(shape, dtype=engine_dtype).copy_(t)`).

The invariant, after every sync: it ends exact on every engine (dtype, shape and bytes of each tensor), or it
raises a named hwsync error (hwsync.errors.HwsyncError) and the next sync is exact. A sync fails only when it was
provoked (a process killed in it, or a spec changed since the last sync). Each kind of breach raises its own
exception (below), so Hypothesis reports and shrinks each separately.

Run (from the repository root, in .venv):
    python -m pytest -q tests/test_delta_model.py                # CI: bounded, derandomized, no example database
    HWSYNC_MODEL_EXAMPLES=200 python -m pytest -q tests/test_delta_model.py -k machine --hypothesis-show-statistics
The long profile is random, and keeps its failing examples in ~/.cache/hwsync/delta-model (replayed first the next
time); HWSYNC_MODEL_BACKEND=sim runs either on the simulated accelerator. The pinned tests at the end replay the
shortest sequence Hypothesis found for each defect of issue 46.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from delta_model_fleet import Fleet

pytestmark = pytest.mark.slow

#: hwsync's own timeout (every wait); a reply later than REPLY_S is a hang
TIMEOUT_S = 60.0
REPLY_S = 2 * TIMEOUT_S + 30.0

EXAMPLES = int(os.environ.get("HWSYNC_MODEL_EXAMPLES", "0"))
settings.register_profile("delta-model-ci", max_examples=60, stateful_step_count=12, derandomize=True,
                          database=None, deadline=None, print_blob=False,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("delta-model-long", max_examples=EXAMPLES or 200, stateful_step_count=25,
                          database=DirectoryBasedExampleDatabase(Path.home() / ".cache/hwsync/delta-model"),
                          deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = "delta-model-long" if EXAMPLES else "delta-model-ci"
#: the most syncs of one example that kill a process (a third of the examples may)
MAX_KILLS = 3 if EXAMPLES else 1


class Violation(AssertionError):
    """hwsync broke its promise (each kind below is reported and shrunk on its own)."""


class WrongBytes(Violation):
    """A sync succeeded and an engine holds bytes the trainer never gave it (dtype and shape right)."""


class WrongBytesStaged(WrongBytes):
    """WrongBytes, through a source that gathers every tensor into one reused buffer (stable_sources=False)."""


class WrongSpec(Violation):
    """A sync succeeded and an engine holds a tensor of another shape or dtype than the trainer's, or none."""


class WrongDestinationWritten(Violation):
    """A sync succeeded after writing into an into() destination of another spec (it must be refused)."""


class UnnamedError(Violation):
    """A side raised an error that is not an hwsync error (a bare ValueError, IndexError, AssertionError...)."""


class UnprovokedFailure(Violation):
    """A sync failed with nothing killed and no spec changed since the last sync."""


class NotRecovered(Violation):
    """The sync after a failed one failed again, with nothing new to excuse it."""


class FalseSuccess(Violation):
    """send() returned success while an engine failed or died in that sync."""


TRAIN = [{"op": "adamw", "lr": 1e-5}, {"op": "add", "share": 1.0, "value": 1e-3},
         {"op": "add", "share": 0.02, "value": 1e-3}, {"op": "add", "share": 0.3, "value": 0.05},
         {"op": "adamw", "lr": 1e-3}, {"op": "add", "share": 0.02, "value": 1e-3, "only": True}]  # only: one tensor
RESHAPE, DTYPE, NUMEL, ADD, REMOVE = "reshape", "dtype", "numel", "add_tensor", "remove"
SHAPES = [(64, 128), (4096,), (32, 32), (33, 7), (128, 64)]
#: how an engine takes tensors (tests/delta_model_procs.py: receiver_main)
MODES = ["load", "stubborn", "into", "mixed"]


@dataclass(frozen=True)
class Config:
    """One example's trainer and engines."""

    receivers: tuple[str, ...]  # each engine's mode (MODES)
    engine: str | None  # the dtype the engines hold floating tensors in (None: as sent)
    stable: bool  # WeightSender(stable_sources=...)
    source: str  # list, generator, callable, shared (in hwsync's shared memory: replays) (stable); staging, list
    delta: bool  # WeightSender(delta=...)
    bucket_bytes: int
    kills: int  # how many syncs may have a process killed in them (each kill costs a new process: seconds)
    tensors: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of w0, w1, ...
    seed: int


@st.composite
def configs(draw: st.DrawFn) -> Config:
    stable = draw(st.booleans())
    sources = ["list", "generator", "callable", "shared"] if stable else ["staging", "list"]
    return Config(receivers=tuple(draw(st.lists(st.sampled_from(MODES), min_size=1, max_size=3, unique=True))),
                  engine=draw(st.sampled_from([None, "float32", "bfloat16"])), stable=stable,
                  source=draw(st.sampled_from(sources)), delta=draw(st.sampled_from([True, True, False])),
                  bucket_bytes=draw(st.sampled_from([1 << 14, 1 << 17])),
                  kills=draw(st.sampled_from([0, 0, MAX_KILLS])),
                  tensors=tuple(draw(st.lists(st.tuples(st.sampled_from(SHAPES),
                                                        st.sampled_from(["float32", "float32", "bfloat16"])),
                                              min_size=1, max_size=5))),
                  seed=draw(st.integers(0, 1000)))


def _reshaped(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The same elements in another shape: 64x128 -> 128x64, a square flattened, a vector as rows of 16."""
    if len(shape) == 2:
        return (shape[1], shape[0]) if shape[0] != shape[1] else (shape[0] * shape[1],)
    return (16, shape[0] // 16) if shape[0] % 16 == 0 else (1, shape[0])


class DeltaModel(RuleBasedStateMachine):
    """The model: the trainer's specs, the version, what may fail; the processes are the fleet's."""

    fleet: Fleet  # set by the test before running the machine

    def __init__(self) -> None:
        super().__init__()
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        self.version = 0
        self.changed: list[str] = []  # spec changes since the last sync: a sync may be refused for them
        self.failed_last = False
        self.syncs_since_disturb = 0
        self.last_was_sync = False
        self.added = 0
        self.kills = 0
        self.replayed: list[bool] = []  # per successful send(): whether it was a replay (replay.py)

    # ---- set-up -------------------------------------------------------------------------------------------
    @initialize(cfg=configs())
    def open(self, cfg: Config) -> None:
        self.cfg = cfg
        self.specs = {f"w{i}": (shape, dtype) for i, (shape, dtype) in enumerate(cfg.tensors)}
        self._open_sender(cfg.seed)
        for index in range(len(cfg.receivers)):
            self._connect(index, keep=False)

    def _open_sender(self, seed: int) -> None:
        reply = self.fleet.sender().call(
            cmd="open", delta=self.cfg.delta, stable=self.cfg.stable, bucket_bytes=self.cfg.bucket_bytes,
            timeout_s=TIMEOUT_S, receivers=len(self.cfg.receivers), seed=seed,
            specs=[[name, list(shape), dtype] for name, (shape, dtype) in self.specs.items()])
        self.endpoint = reply["endpoint"]

    def _connect(self, index: int, keep: bool) -> None:
        self.fleet.receiver(index).call(cmd="connect", endpoint=self.endpoint, mode=self.cfg.receivers[index],
                                        engine=self.cfg.engine, timeout_s=TIMEOUT_S, keep=keep)

    def teardown(self) -> None:
        self.fleet.quiet()

    # ---- rules --------------------------------------------------------------------------------------------
    @rule(before=st.sampled_from([None, *TRAIN, RESHAPE, RESHAPE, DTYPE, NUMEL, ADD, REMOVE]),
          pick=st.integers(0, 4), delta=st.sampled_from([None, None, True, False]),
          after=st.sampled_from([None, *TRAIN]))
    def sync(self, before, pick: int, delta: bool | None, after: dict | None) -> None:
        """A change (training, or of the tensors' specs), then a sync, then training right after send() returns."""
        if before is not None:
            self._change(before, pick)
        self._sync(delta, after, fault=None)

    @precondition(lambda self: self.last_was_sync and self.syncs_since_disturb >= 2)
    @rule(what=st.sampled_from(["restart_receiver", "drop_baseline", "restart_receiver_keeping_weights"]),
          which=st.integers(0, 2))
    def disturb(self, what: str, which: int) -> None:
        """An engine restarted (a fresh one, or one that kept its weights), or the trainer's baseline dropped."""
        self.syncs_since_disturb, self.last_was_sync = 0, False
        if what == "drop_baseline":
            self._named("drop_delta_baseline()", self.fleet.sender().call(cmd="drop"))
        else:
            self.fleet.receiver(which % len(self.cfg.receivers)).call(cmd="restart", keep=what.endswith("weights"))

    @precondition(lambda self: self.last_was_sync)
    @rule(keep=st.booleans(), pick=st.integers(0, 4), which=st.integers(0, 2))
    def renew(self, keep: bool, pick: int, which: int) -> None:
        """An engine makes one of the tensors `into` gave anew, in other memory, holding zeros or what it held (the
        digest hwsync holds is the old memory's: zeros may fail the next sync by name, what it held may not)."""
        index, names = which % len(self.cfg.receivers), list(self.specs)
        name = names[pick % len(names)]
        renewed = self.fleet.receiver(index).call(cmd="renew", name=name, keep=keep)["renewed"]
        if renewed and not keep:
            self.changed.append(f"engine {index} made {name} anew, of zeros")

    @precondition(lambda self: self.cfg.kills > self.kills and self.last_was_sync and self.syncs_since_disturb >= 2)
    @rule(victim=st.sampled_from(["receiver", "sender"]), which=st.integers(0, 2))
    def kill_mid_sync(self, victim: str, which: int) -> None:
        """A sync during which an engine, or the trainer, is killed (SIGKILL) while the engine is loading."""
        self.syncs_since_disturb, self.kills = 0, self.kills + 1
        self._sync(None, None, fault=(victim, which % len(self.cfg.receivers)))

    # ---- the steps' parts ---------------------------------------------------------------------------------
    def _change(self, before, pick: int) -> None:
        names = list(self.specs)
        name = names[pick % len(names)]
        seed = 7919 * self.version + pick
        shape, dtype = self.specs[name]
        if isinstance(before, dict):
            op = {**before, "seed": seed, **({"only": name} if before.get("only") else {})}
        elif before == RESHAPE:
            op = {"op": RESHAPE, "name": name, "shape": _reshaped(shape)}
            self.specs[name] = (op["shape"], dtype)
        elif before == DTYPE:
            op = {"op": DTYPE, "name": name, "dtype": "bfloat16" if dtype == "float32" else "float32"}
            self.specs[name] = (shape, op["dtype"])
        elif before == NUMEL:
            op = {"op": NUMEL, "name": name, "shape": (*shape[:-1], shape[-1] + 8), "seed": seed}
            self.specs[name] = (op["shape"], dtype)
        elif before == ADD:
            self.added += 1
            name = f"new{self.added}"
            op = {"op": ADD, "name": name, "shape": SHAPES[pick % len(SHAPES)], "dtype": "float32", "seed": seed}
            self.specs[name] = (op["shape"], "float32")
        elif len(names) > 1:  # REMOVE
            op = {"op": REMOVE, "name": name}
            del self.specs[name]
        else:
            return
        if not isinstance(before, dict):
            self.changed.append(f"{op['op']} {name}")
        self.fleet.sender().call(cmd="change", op=op)

    def _sync(self, delta: bool | None, after: dict | None, fault: tuple[str, int] | None) -> None:
        """One sync; `fault`: (victim, engine): that engine, or the trainer, dies while the engine is loading."""
        self.version += 1
        version, count = self.version, len(self.cfg.receivers)
        victim, waiter = fault if fault is not None else (None, 0)  # waiter: the engine that waits in its first load
        for index in range(count):
            stall = None if victim is None or index != waiter else "forever" if victim == "receiver" else 1.0
            self.fleet.receiver(index).put(cmd="receive", stall=stall)
        sender = self.fleet.sender()
        sender.put(cmd="sync", version=version, delta=delta, source=self.cfg.source,
                   after=None if after is None else {**after, "seed": 104729 + version}, engine=self.cfg.engine)
        expected = sender.get(REPLY_S, f"reporting what it sends at version {version}")
        if "crash" in expected:
            raise RuntimeError(expected["crash"])
        replies: list[dict | None] = [None] * count
        killed = False
        if victim is not None:
            first = self.fleet.receiver(waiter).get(REPLY_S, f"receiving version {version}")
            if first.get("stalled"):  # mid-sync: the victim dies now
                killed = True
                if victim == "receiver":
                    self.fleet.kill_receiver(waiter)
                else:
                    self.fleet.kill_sender()
            else:
                replies[waiter] = first  # the sync ended before the engine loaded anything: nobody dies
        sent = None if killed and victim == "sender" else sender.get(REPLY_S, f"sending version {version}")
        for index in range(count):
            if replies[index] is None and not (killed and victim == "receiver" and index == waiter):
                replies[index] = self.fleet.receiver(index).get(REPLY_S, f"receiving version {version}")
        self._judge(version, expected["expected"], sent, replies,
                    excuse=f"the {victim} was killed" if killed else ", ".join(self.changed))
        self.changed, self.last_was_sync = [], True
        self.syncs_since_disturb += 1
        if killed and victim == "sender":  # a new trainer (from another checkpoint); the engines reconnect
            from hwsync.backend.owners import sweep_dead_owners

            sweep_dead_owners(force=True)  # its segments: its resource tracker was this process's
            self._open_sender(self.cfg.seed + version)
            for index in range(count):
                self._connect(index, keep=True)
        elif killed:  # a new engine in its place
            self._connect(waiter, keep=False)

    def _breach(self, kind: type[Violation], message: str) -> None:
        """hwsync broke its promise: fail the example (one exception type per kind of breach)."""
        raise kind(message)

    def _named(self, side: str, reply: dict) -> None:
        if not reply.get("ok") and not reply.get("hwsync"):
            self._breach(UnnamedError, f"{side} raised {reply['type']}, not an hwsync error, at version "
                         f"{self.version}: {reply['error']}\n{reply.get('where', '')}")

    def _judge(self, version: int, expected: dict, sent: dict | None, replies: list[dict | None], excuse: str) -> None:
        """The invariant: exact, or named errors (provoked, and not twice in a row)."""
        if sent is not None:
            self._named("send()", sent)
            if sent.get("ok"):
                self.replayed.append(bool(sent.get("replay")))
            if currently_in_test_context():  # the pinned sequences replay outside Hypothesis
                event(f"sync: {sent.get('mode') if sent.get('ok') else 'failed: ' + sent['type']}"
                      f"{' (a replay)' if sent.get('replay') else ''}")
        for index, reply in enumerate(replies):
            if reply is not None:
                self._named(f"engine {index} ({self.cfg.receivers[index]})", reply)
        if sent is not None and sent.get("ok"):
            dead = [i for i, r in enumerate(replies) if r is None or not r.get("ok")]
            if dead:
                self._breach(FalseSuccess, f"send() of version {version} succeeded, engine(s) {dead} failed or "
                             f"died: {[(replies[i] or {}).get('error') for i in dead]}")
        for index, reply in enumerate(replies):
            if reply is not None and reply.get("ok"):
                self._exact(index, version, expected, reply, sent)
        failed = sent is None or not sent.get("ok") or any(r is None or not r.get("ok") for r in replies)
        if failed and not excuse:
            error = (sent or {}).get("error") or next((r.get("error") for r in replies if r and not r.get("ok")), "")
            self._breach(NotRecovered if self.failed_last else UnprovokedFailure,
                         f"version {version} failed with nothing killed and no spec changed: {error}")
        self.failed_last = failed

    def _exact(self, index: int, version: int, expected: dict, reply: dict, sent: dict | None) -> None:
        """An engine that says it completed `version` holds exactly what the trainer was given for it."""
        who = f"engine {index} ({self.cfg.receivers[index]}, engine dtype {self.cfg.engine})"
        how = f"sync mode {sent.get('mode')!r} ({sent.get('reason')})" if sent and sent.get("ok") else "send() failed"
        if reply["wrong_destinations"]:
            return self._breach(WrongDestinationWritten, f"{who} completed version {version} ({how}) after writing "
                                f"into destinations of another spec: {reply['wrong_destinations']}")
        if reply["version"] != version:
            return self._breach(WrongSpec, f"{who} completed a sync but reports version {reply['version']}, not "
                                f"{version}")
        got = reply["digests"]
        specs = [f"{n}: {got.get(n, ['missing'])[:2]} instead of {want[:2]}" for n, want in expected.items()
                 if got.get(n, [None])[:2] != want[:2]]
        if specs:
            return self._breach(WrongSpec, f"{who} completed version {version} ({how}) holding {len(specs)} of "
                                f"{len(expected)} tensors with the wrong spec: {specs}")
        wrong = [n for n, want in expected.items() if got[n] != want]
        if wrong:
            self._breach(WrongBytesStaged if self.cfg.source == "staging" else WrongBytes,
                         f"{who} completed version {version} ({how}) holding {len(wrong)} of {len(expected)} "
                         f"tensors with bytes the trainer never gave it: {wrong}")


@pytest.fixture(scope="module")
def fleet():
    """The processes, on HWSYNC_MODEL_BACKEND (default cpu), kept for the module's tests."""
    from hwsync.backend.registry import load_backend

    name = os.environ.get("HWSYNC_MODEL_BACKEND", "cpu")
    try:
        probe = load_backend(name).probe()
    except Exception as exc:  # noqa: BLE001 - not installed or broken: the reason is the skip's
        pytest.skip(f"backend {name} not loadable: {type(exc).__name__}: {exc}")
    if not probe.usable:
        pytest.skip(f"backend {name} not usable here: {probe.reason}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HWSYNC_BACKEND", name)
        fleet = Fleet(size=len(MODES) - 1)
        DeltaModel.fleet = fleet
        yield fleet
        fleet.stop()


@pytest.mark.timeout(900)
def test_delta_state_machine(fleet):
    """Random sequences (the CI profile: derandomized; HWSYNC_MODEL_EXAMPLES=N: the long one)."""
    run_state_machine_as_test(DeltaModel, settings=settings.get_profile(PROFILE))


# ---- the shortest failing sequences Hypothesis found for each defect of issue 46 (at 63f60b4), pinned --------------
def _replay(cfg: Config, steps: list[tuple[str, dict]]) -> DeltaModel:
    """One sequence of the machine's steps, as Hypothesis would run it; the machine, to look at afterwards."""
    machine = DeltaModel()
    try:
        machine.open(cfg)
        for name, kwargs in steps:
            getattr(machine, name)(**kwargs)
    finally:
        machine.teardown()
    return machine


def _config(receivers: tuple[str, ...], **kwargs) -> Config:
    """A Config as Hypothesis shrinks one: one fp32 64x128 tensor, stable list source, delta mode, no kills."""
    return Config(**{**dict(receivers=receivers, engine=None, stable=True, source="list", delta=True,
                            bucket_bytes=1 << 14, kills=0, tensors=(((64, 128), "float32"),), seed=0), **kwargs})


def _sync(**kwargs) -> tuple[str, dict]:
    return "sync", {"before": None, "pick": 0, "delta": None, "after": None, **kwargs}


def test_training_right_after_send_does_not_corrupt_the_next_delta(fleet):
    adamw, add = TRAIN[0], TRAIN[1]  # every fp32 element changes: each delta is dense
    steps = [_sync(after=adamw), *[_sync(after=add)] * 6, _sync()]  # the race is lost at most syncs: found at v3
    _replay(_config(("load",), tensors=(((64, 128), "float32"),) * 8), steps)


def test_a_staging_source_is_copied_before_the_next_tensor_is_gathered(fleet):
    cfg = _config(("load",), stable=False, source="staging",
                  tensors=(((64, 128), "float32"), ((4096,), "float32"), ((32, 32), "float32"), ((33, 7), "float32")))
    _replay(cfg, [_sync(), _sync(before=TRAIN[1]), _sync(before=TRAIN[1])])


def test_a_reshaped_tensor_reaches_a_load_engine_in_its_new_shape(fleet):
    _replay(_config(("load",)), [_sync(), _sync(before=RESHAPE), _sync()])


def test_a_destination_of_the_old_shape_is_refused_on_the_delta_path(fleet):
    _replay(_config(("stubborn",)), [_sync(), _sync(before=RESHAPE), _sync()])


def test_a_destination_of_the_old_shape_is_refused_on_the_full_path_with_an_hwsync_error(fleet):
    _replay(_config(("stubborn",)), [_sync(), _sync(before=RESHAPE, delta=False), _sync()])


@pytest.mark.parametrize("change", [DTYPE, NUMEL])
def test_a_dtype_or_element_count_change_goes_whole_or_is_refused_by_name(fleet, change):
    _replay(_config(("load",)), [_sync(), _sync(before=change), _sync()])


def test_an_unchanged_tensor_made_anew_by_the_engine_is_not_passed_on_its_old_digest(fleet):
    """Found by the machine once it could make a destination anew (renew): the digest a receiver held was taken of the
    engine's old memory, and an unchanged tensor's delta ("same": nothing written) passed on it, leaving zeros."""
    _replay(_config(("stubborn",)), [_sync(), ("renew", {"keep": False, "pick": 0, "which": 0}), _sync()])


REPLAYS = [_sync(), _sync(before=TRAIN[0]), _sync(after=TRAIN[1]), _sync(),
           _sync(before=RESHAPE), _sync(before=TRAIN[1]), _sync(before=DTYPE, pick=1), _sync(),
           ("disturb", {"what": "restart_receiver_keeping_weights", "which": 0}), _sync(), _sync(),
           _sync(before=REMOVE, pick=2), _sync()]
#: which of those syncs replay: not the first, nor one after a change of spec or a restarted engine
REPLAYED = [False, True, True, True, False, True, False, True, False, True, False, True]


def test_a_replayed_sync_reads_what_training_wrote_and_any_change_plans_afresh(fleet):
    """Tensors in shared memory into an `into` engine: a sync whose tensors are those of the last is a replay
    (issue 50), exact after training before it and right after it; a reshape of the same memory, a dtype change, a
    removed tensor and a restarted engine each send a fresh sync, exact, and the sync after it replays again."""
    cfg = _config(("into",), source="shared", delta=False,
                  tensors=(((64, 128), "float32"), ((4096,), "bfloat16"), ((33, 7), "float32")))
    assert _replay(cfg, REPLAYS).replayed == REPLAYED


@pytest.mark.timeout(300)
def test_replays_through_the_compiled_copy_loop_stay_exact():
    """The same sequence with every plan's host copies run as numba's compiled loop from the first replay
    (hwsync.sync.host_copy; in use only for plans of thousands of tensors): from shared memory (the receiver's
    memmoves) and from the trainer's own tensors packed into buckets (the sender's and the receiver's)."""
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed here: copies run as ctypes calls only")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HWSYNC_BACKEND", "cpu")
        mp.setenv("HWSYNC_TEST_COMPILED_COPIES", "1")  # the processes load the loop before their first sync
        own = Fleet(size=1)
        fleet, DeltaModel.fleet = getattr(DeltaModel, "fleet", None), own
        try:
            for source in ("shared", "parameters"):
                cfg = _config(("into",), source=source, delta=False,
                              tensors=(((64, 128), "float32"), ((4096,), "bfloat16"), ((33, 7), "float32")))
                assert _replay(cfg, REPLAYS).replayed == REPLAYED, source
        finally:
            DeltaModel.fleet = fleet
            own.stop()


@pytest.mark.timeout(300)
def test_a_replayed_sync_from_device_memory_launches_once_and_stays_exact():
    """The same on the simulated accelerator, from the trainer's own device tensors read in place (mapped.py): the
    replays launch the plan's copies again, and every change of spec still plans afresh."""
    from hwsync.backend.registry import load_backend

    probe = load_backend("sim").probe()
    if not probe.usable:
        pytest.skip(f"the simulated accelerator is not usable here: {probe.reason}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HWSYNC_BACKEND", "sim")
        sim = Fleet(size=1)
        fleet, DeltaModel.fleet = getattr(DeltaModel, "fleet", None), sim
        try:
            cfg = _config(("into",), source="parameters", delta=False,
                          tensors=(((64, 128), "float32"), ((4096,), "bfloat16"), ((33, 7), "float32")))
            assert _replay(cfg, REPLAYS).replayed == REPLAYED
        finally:
            DeltaModel.fleet = fleet
            sim.stop()
