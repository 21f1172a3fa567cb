"""Shared fixtures: a `backend` fixture over every backend usable here, ports, leak checks.

The simulated accelerator (tests/plugins/hwsync_sim, backend "sim") is one of those backends
once installed (ci/setup.sh installs it). Its settings are fixed here for the whole session,
before any process starts it: enough simulated devices for one per rank, and a leak log that
every process appends to, checked after each test (a leak report is a failure).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import pytest

from hwsync.backend.registry import installed_names, load_backend, reset_backend_cache
from hwsync.backend.shm import leftover_segments
from tiers import guarded, mark_unit

SIM_INSTALLED = importlib.util.find_spec("hwsync_sim") is not None
#: simulated devices per node: one per rank of the largest multi-process test (5 ranks), and spare
SIM_DEVICES = 8
os.environ.setdefault("HWSYNC_SIM_DEVICES", str(SIM_DEVICES))


def _backend_params() -> list:
    params = []
    for name in installed_names():
        try:
            result = load_backend(name).probe()
            usable, reason = result.usable, result.reason
        except Exception as exc:  # a broken plugin is reported as a skip with its error
            usable, reason = False, f"{type(exc).__name__}: {exc}"
        marks = [] if usable else [pytest.mark.skip(reason=f"backend {name} not usable here: {reason}")]
        params.append(pytest.param(name, marks=marks, id=name))
    return params


@pytest.fixture(params=_backend_params())
def backend(request, monkeypatch):
    """Each test using this runs once per installed backend; unusable ones are skipped with the reason.

    A test (or one of its cases) marked `cpu_is_enough(why)` is skipped on the simulated accelerator
    with that reason: it exercises nothing an accelerator changes, and CI time is finite.
    """
    enough = request.node.get_closest_marker("cpu_is_enough")
    if request.param == "sim" and enough is not None:
        pytest.skip(f"not repeated on the simulated accelerator: {enough.args[0] if enough.args else ''}")
    monkeypatch.setenv("HWSYNC_BACKEND", request.param)
    reset_backend_cache()
    yield load_backend(request.param)
    reset_backend_cache()


@pytest.fixture
def sim(monkeypatch):
    """The sim backend selected for this process and its children, this thread on device 0."""
    monkeypatch.setenv("HWSYNC_BACKEND", "sim")
    backend = load_backend("sim")
    backend.device().set_index(0)
    return backend


@pytest.fixture
def gpu():
    """A usable CUDA Device, or a skip that carries the cuda probe's reason."""
    from hwsync_cuda import CudaDevice  # only tests that ask for a GPU need the cuda backend

    device = CudaDevice()
    probe = device.probe()
    if not probe.usable:
        pytest.skip(f"needs an NVIDIA GPU: {probe.reason}")
    return device


@pytest.fixture
def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True, scope="session")
def no_segments_left_behind():
    """After the whole suite, no hwsync shared-memory segment of ours may remain in /dev/shm."""
    before = set(leftover_segments())
    yield
    import time

    deadline = time.monotonic() + 10  # resource trackers of killed processes clean up asynchronously
    while time.monotonic() < deadline and set(leftover_segments()) - before:
        time.sleep(0.2)
    left = sorted(set(leftover_segments()) - before)
    assert not left, f"shared-memory segments left behind in /dev/shm: {left}"


#: per test module that left some: vLLM's shared-memory segments still in /dev/shm after it (see below)
VLLM_SEGMENTS_LEFT: list[tuple[str, list[str]]] = []


def vllm_segments() -> set[str]:
    """vLLM's shared-memory segments in /dev/shm (its message queues use Python's SharedMemory: psm_*)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("psm_*")} if shm.is_dir() else set()


@pytest.fixture(autouse=True, scope="module")
def vllm_segments_by_module(request):
    """Which test module leaves vLLM's segments behind (an engine killed, not shut down, leaves its own): named in
    the run's summary. vLLM's, not hwsync's (no_segments_left_behind checks those), so it is reported, not failed."""
    before = vllm_segments()
    yield
    import time

    deadline = time.monotonic() + 5  # an engine's resource tracker unlinks them after it exits
    while time.monotonic() < deadline and vllm_segments() - before:
        time.sleep(0.2)
    left = sorted(vllm_segments() - before)
    if left:
        VLLM_SEGMENTS_LEFT.append((request.module.__name__, left))


def pytest_terminal_summary(terminalreporter):
    """Name the test modules that left vLLM's shared-memory segments in /dev/shm."""
    for module, names in VLLM_SEGMENTS_LEFT:
        terminalreporter.write_line(f"vLLM shared-memory segments left in /dev/shm after {module}: {len(names)} "
                                    f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})")


@pytest.fixture(autouse=True, scope="session")
def no_secret_in_any_message(tmp_path_factory):
    """After the whole suite: no endpoint token reached a log line (of any process) or an hwsync error.

    tests/secret_watch/sitecustomize.py records, in this process and every Python process it starts,
    each token made and each hwsync log line; here hwsync errors are recorded as they are made.
    """
    import hwsync.errors

    path = tmp_path_factory.mktemp("secrets") / "messages.jsonl"
    watch = str(Path(__file__).parent / "secret_watch")
    saved = {k: os.environ.get(k) for k in ("HWSYNC_TEST_SECRET_LOG", "PYTHONPATH")}
    os.environ["HWSYNC_TEST_SECRET_LOG"] = str(path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (watch, saved["PYTHONPATH"]) if p)
    sys.path.insert(0, watch)
    sys.modules.pop("sitecustomize", None)
    importlib.import_module("sitecustomize")  # this process records too
    errors: list[str] = []
    original_init = hwsync.errors.HwsyncError.__init__

    def recorded_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        errors.append(" ".join(map(str, args)))

    hwsync.errors.HwsyncError.__init__ = recorded_init
    yield
    hwsync.errors.HwsyncError.__init__ = original_init
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    tokens = {r["text"] for r in rows if r["kind"] == "token"}
    messages = [r["text"] for r in rows if r["kind"] == "log"] + errors
    leaks = [m for m in messages if any(t in m for t in tokens)]
    assert not leaks, f"endpoint tokens reached {len(leaks)} messages, e.g. {leaks[:3]}"


@pytest.fixture(autouse=True)
def _keep_env_clean():
    """Selection writes HWSYNC_BACKEND back to the environment; undo it between tests."""
    saved = os.environ.get("HWSYNC_BACKEND")
    yield
    if saved is None:
        os.environ.pop("HWSYNC_BACKEND", None)
    else:
        os.environ["HWSYNC_BACKEND"] = saved
    reset_backend_cache()


@pytest.fixture(autouse=True, scope="session")
def sim_leak_log(tmp_path_factory):
    """HWSYNC_SIM_LEAK_LOG for this process and every child it starts (None without the sim)."""
    if not SIM_INSTALLED:
        yield None
        return
    path = tmp_path_factory.mktemp("sim") / "leaks.jsonl"
    saved = os.environ.get("HWSYNC_SIM_LEAK_LOG")
    os.environ["HWSYNC_SIM_LEAK_LOG"] = str(path)
    yield str(path)
    if saved is None:
        os.environ.pop("HWSYNC_SIM_LEAK_LOG", None)
    else:
        os.environ["HWSYNC_SIM_LEAK_LOG"] = saved


@pytest.fixture(autouse=True)
def no_sim_leaks(request, sim_leak_log):
    """After each test: device memory the sim saw leaked (by any process) fails the test.

    This process's own exports still parked after the test count too (torch would keep them
    until exit); tests that provoke a leak on purpose carry the `sim_leaks_expected` marker.
    """
    yield
    if sim_leak_log is None:
        return
    from hwsync_sim import read_leak_log
    from hwsync_sim.runtime import initialized

    if initialized():
        from hwsync_sim import sharing
        from hwsync_sim.runtime import runtime

        sharing.report_parked(runtime())
    rows = read_leak_log(sim_leak_log, clear=True)
    if rows and request.node.get_closest_marker("sim_leaks_expected") is None:
        pytest.fail("the simulated accelerator saw device memory leaked:\n" +
                    "\n".join(f"  pid {r['pid']}: {r['leak']}" for r in rows), pytrace=False)


def pytest_collection_modifyitems(items):
    """Tests that run a vLLM engine go first: once the sim runs in this process it owns torch's
    PrivateUse1 slot and torch.accelerator reports "sim", which an engine started here (or a
    process it forks) must never see. The tests that spawn nothing get the `unit` marker (tests/tiers.py)."""
    mark_unit(items)
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)


# A unit test that starts a process fails, in any phase: its fixtures are watched too (tests/tiers.py).
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with guarded(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    with guarded(item):
        return (yield)


@pytest.fixture(autouse=True)
def _no_sim_under_vllm(request):
    """Isolation check: a vLLM test never runs in a process where the sim has started."""
    if SIM_INSTALLED and request.node.get_closest_marker("vllm") is not None:
        from hwsync_sim.runtime import initialized

        assert not initialized(), ("the simulated accelerator already runs in this pytest process; vLLM tests must "
                                   "run before it (tests/conftest.py orders them first)")
    yield
