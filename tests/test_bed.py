"""The multi-host bed (hwsync_tools.bed): namespaces as hosts, rate-limited links, processes inside, teardown, sweep."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import bed_procs
from bed_procs import TESTS, bed_or_skip, process_state
from hwsync_tools.bed import Bed, BedUnavailableError, HostProcessError, names, sweep
from hwsync_tools.bed import stream
from hwsync_tools.bed.stream import measure
from hwsync_tools.bed.subnets import default_candidates, in_use, networks_of, pick_subnet

PROCS = os.path.abspath(bed_procs.__file__)
CONNECT = stream.target("connect_once")  # by path: the host process imports no torch


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


def _root_view() -> tuple[str, str]:
    """The machine's own links and addresses (without counters that change by themselves)."""
    return _ip("-br", "link"), _ip("-br", "addr")


@pytest.fixture
def bed3():
    """A bed of three hosts, unlimited links; skipped with the reason where the machine cannot hold one."""
    bed = bed_or_skip(3)
    yield bed
    bed.close()


def test_unavailable_reasons(monkeypatch):
    """Not root, or no `ip`: a BedUnavailableError that says so (the fixture turns it into a skip)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(BedUnavailableError, match="needs root"):
        Bed(2)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    import shutil

    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "ip" else real(tool))
    with pytest.raises(BedUnavailableError, match="`ip` command is not installed"):
        Bed(2)


def test_refused_namespace_is_unavailable(monkeypatch):
    """Root in a container that may not make namespaces: BedUnavailableError naming the capabilities."""
    if os.geteuid() != 0:
        pytest.skip("needs root to reach the `ip netns add` call")
    import hwsync_tools.bed.hosts as hosts

    real = subprocess.run

    def run(cmd, *args, **kwargs):
        if cmd[:3] == ["ip", "netns", "add"]:
            err = "mount --make-shared /run/netns failed: Operation not permitted"
            return subprocess.CompletedProcess(cmd, 1, "", err)
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(hosts.subprocess, "run", run)
    with pytest.raises(BedUnavailableError, match="CAP_SYS_ADMIN"):
        Bed(2)
    monkeypatch.undo()
    assert f"hwbed-{os.getpid()}-" not in _ip("netns", "list")


def test_pick_subnet_rules():
    """A used candidate is skipped; a public or too small one is refused with the reason."""
    used = [ipaddress.ip_network("10.1.0.0/16")]
    net, skipped = pick_subnet(["10.1.5.0/24", "10.2.0.0/24"], used, 3)
    assert (str(net), skipped) == ("10.2.0.0/24", ["10.1.5.0/24"])
    with pytest.raises(ValueError, match="not a private range"):
        pick_subnet(["8.8.8.0/24"], [], 3)
    with pytest.raises(ValueError, match="holds 2 host addresses"):
        pick_subnet(["10.3.0.0/30"], [], 3)
    with pytest.raises(RuntimeError, match="every candidate subnet is in use"):
        pick_subnet(["10.1.0.0/24"], used, 3)


def test_subnet_in_use_is_skipped():
    """A candidate that overlaps an address or route of the machine is passed over for the next one."""
    mine = [n for n in networks_of(None) if n.is_private and not n.is_loopback and n.prefixlen < 32]
    if not mine:
        pytest.skip("the machine's namespace has no private network to collide with")
    taken = str(ipaddress.ip_network(f"{mine[0].network_address}/{max(mine[0].prefixlen, 24)}", strict=False))
    used = in_use()
    free = next(c for c in default_candidates() if not any(ipaddress.ip_network(c).overlaps(u) for u in used))
    with bed_or_skip(2, subnets=[taken, free]) as bed:
        assert str(bed.subnet) == free and bed.skipped_subnets == [taken]


def test_three_hosts_stream(bed3):
    """A Python TCP stream from host 0 to host 2 arrives, from host 0's address to host 2's."""
    got = measure(bed3, 0, 2, seconds=0.5)
    assert got["bytes"] > 0
    assert (got["peer"], got["local"]) == (bed3.address(0), bed3.address(2))
    # host 1 answers host 0 at once (nothing listens there)
    assert bed3.start(0, CONNECT, bed3.address(1), 9).result(30) == "ConnectionRefusedError"


def test_host_sees_only_itself(bed3):
    """A process in host 1 sees lo and its own interface, its own address, no default route, its IFNAME vars."""
    seen = bed3.start(1, f"{PROCS}:whoami").result(30)
    dev = bed3.interface(1)
    assert seen["interfaces"] == sorted(["lo", dev])
    assert seen["addresses"] == sorted(["127.0.0.1", bed3.address(1)])
    assert seen["routes"] == [str(bed3.subnet)], "a host must route nowhere but the bed's subnet"
    assert seen["env"]["GLOO_SOCKET_IFNAME"] == dev
    assert seen["env"]["NCCL_SOCKET_IFNAME"] == seen["env"]["HCCL_SOCKET_IFNAME"] == f"={dev}"
    assert seen["env"]["HCCL_IF_IP"] == bed3.address(1)
    assert seen["hostname"] == bed3.hostname(1) != bed_procs.whoami()["hostname"]  # a node of its own
    bare = bed3.start(1, f"{PROCS}:whoami", interface_vars=False, env={"GLOO_SOCKET_IFNAME": "eth0"}).result(30)
    assert set(bare["env"]) == {"HWSYNC_BED_HOST", "HWSYNC_BED_ADDRESS", "HWSYNC_BED_INTERFACE"}, bare["env"]
    # the machine's own addresses are out of reach from inside (no route: refused at once)
    for addr in [a for a in bed_procs.whoami()["addresses"] if not a.startswith("127.")][:2]:
        reach = bed3.start(1, CONNECT, addr, 22).result(30)
        assert reach != "ok", f"host 1 reached the machine's {addr}"


@pytest.mark.slow
def test_child_imports_hwsync_from_venv(bed3):
    """The host's Python is this interpreter, and imports this checkout's hwsync."""
    got = bed3.start(0, f"{PROCS}:import_hwsync").result(60)
    import hwsync

    assert got == {"hwsync": hwsync.__file__, "prefix": sys.prefix, "executable": sys.executable}


@pytest.mark.slow
def test_child_imports_the_hwsync_its_parent_imported(bed3, tmp_path):
    """A parent whose hwsync is not the venv's (a checkout run with -m from its root) starts hosts that import that
    same hwsync, not the venv's (a bench run from another checkout had measured the venv's code in its hosts)."""
    bed3.close()  # made only to skip where the machine holds no bed: the parent below makes its own
    import hwsync

    (tmp_path / "hwsync").symlink_to(os.path.dirname(os.path.abspath(hwsync.__file__)))
    code = (f"import json, sys; sys.path.insert(0, {str(tmp_path)!r}); import hwsync\n"
            "from hwsync_tools.bed import Bed\n"
            f"with Bed(1) as bed: got = bed.start(0, {PROCS + ':import_hwsync'!r}).result(60)\n"
            "print(json.dumps([hwsync.__file__, got['hwsync']]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    parent, child = json.loads(done.stdout.strip().splitlines()[-1])
    assert parent == str(tmp_path / "hwsync" / "__init__.py")
    assert child == parent


def test_failure_and_kill_are_reported(bed3):
    """A target that raises comes back as HostProcessError with its message; a SIGKILLed one is reaped."""
    with pytest.raises(HostProcessError, match="must be 'module:function'"):
        bed3.start(0, "no_colon").result(30)
    p = bed3.start(0, f"{PROCS}:sleep_forever")
    time.sleep(0.3)
    p.kill()
    assert p.poll() == -signal.SIGKILL and process_state(p.pid) == ""
    with pytest.raises(HostProcessError, match="before writing a result"):
        p.result(1)


def test_kill_host_kills_every_process_of_that_host_only(bed3):
    """kill_host(2): both processes of host 2 die at once (a node losing power); host 1's lives on."""
    victims = [bed3.start(2, f"{PROCS}:sleep_forever") for _ in range(2)]
    bystander = bed3.start(1, f"{PROCS}:sleep_forever")
    deadline, killed = time.monotonic() + 20, set()
    # a process counts once it is in the namespace; one killed by an earlier call is not listed again
    while set(p.pid for p in victims) - killed:
        killed |= set(bed3.kill_host(2))
        assert time.monotonic() < deadline, "host 2's processes never appeared in its namespace"
        time.sleep(0.05)
    for p in victims:
        p.popen.wait(10)
        assert p.poll() == -signal.SIGKILL
    assert bystander.alive()
    bystander.kill()


def test_link_down_and_up(bed3):
    """A connection to a host whose link is down fails; once the link is up again it works."""
    server = bed3.start(1, f"{PROCS}:listen", 7000, 30.0)
    addr = bed3.address(1)
    deadline = time.monotonic() + 20
    while bed3.start(0, CONNECT, addr, 7000).result(30) != "ok":  # the server is still starting
        assert time.monotonic() < deadline, "the server in host 1 never answered"
    bed3.link_down(1)
    assert not bed3.is_up(1)
    assert bed3.start(0, CONNECT, addr, 7000, 1.0).result(30) in ("timeout", "TimeoutError", "OSError")
    bed3.link_up(1)
    assert bed3.start(0, CONNECT, addr, 7000, 5.0).result(30) == "ok"
    server.kill()


@pytest.mark.slow
def test_rate_limit(bed3):
    """A single stream gets near the configured rate (0.85-1.05x), and far more once the limit is lifted.

    The machine is shared: a stream starved of CPU for a moment gets less, so the lower bound holds for
    the better of two tries; the upper bound (the limit itself) holds for every try.
    """
    for rate in (200e6, 1e9):
        for host in (0, 1):
            bed3.set_rate(host, rate)
        tries = [measure(bed3, 0, 1, seconds=2.0)["bps"]]
        if tries[0] < 0.85 * rate:
            tries.append(measure(bed3, 0, 1, seconds=2.0)["bps"])
        shown = ", ".join(f"{t / 1e9:.3f}" for t in tries)
        assert max(tries) <= 1.05 * rate, f"{shown} Gbit/s at a {rate / 1e9} Gbit/s limit: the limit leaks"
        assert max(tries) >= 0.85 * rate, f"{shown} Gbit/s at a {rate / 1e9} Gbit/s limit: far below it"
    bed3.set_rate(0, None)
    bed3.set_rate(1, None)
    assert bed3.rate(0) is None
    assert measure(bed3, 0, 1, seconds=1.0)["bps"] > 1.5e9


def test_teardown_leaves_nothing():
    """close() kills the bed's processes and removes every namespace, link and work folder; the machine's
    own links and addresses never change, even while the bed lives."""
    before = _root_view()
    bed = bed_or_skip(3, rate_bps=1e9)
    p = bed.start(2, f"{PROCS}:sleep_forever")
    assert _root_view() == before, "the bed touched the machine's own namespace"
    bed.close()
    assert bed.id not in _ip("netns", "list")
    assert "hwbed" not in _ip("link") and _root_view() == before
    assert p.poll() is not None and not os.path.exists(p.workdir)
    bed.close()  # idempotent


def test_two_beds_at_once():
    """Two beds side by side: their own names and subnets, each works, closing one leaves the other whole."""
    with bed_or_skip(2) as a, bed_or_skip(2) as b:
        assert a.id != b.id and not set(a.namespaces()) & set(b.namespaces())
        assert not a.subnet.overlaps(b.subnet)
        assert measure(a, 0, 1, 0.3)["bytes"] > 0
        a.close()
        assert measure(b, 1, 0, 0.3)["peer"] == b.address(1)


def test_reused_pid_is_swept():
    """A namespace named for this very pid but another start time (a dead owner whose pid was reused) is swept;
    one with this process's real start time is not."""
    me, start = os.getpid(), names.start_time(os.getpid())
    dead, live = f"hwbed-{me}-{start + 1}-0badbed0-h0", f"hwbed-{me}-{start}-0badbed1-h0"
    try:
        _ip("netns", "add", dead)
        _ip("netns", "add", live)
        swept = sweep()
        assert dead in swept and live not in swept
        assert live in _ip("netns", "list") and dead not in _ip("netns", "list")
    finally:
        for ns in (dead, live):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _start_owner() -> tuple[subprocess.Popen, dict]:
    owner = subprocess.Popen([sys.executable, PROCS, "owner"], stdout=subprocess.PIPE, text=True, cwd=TESTS)
    line = owner.stdout.readline()
    assert line, f"the owner process died (exit {owner.wait()})"
    return owner, json.loads(line)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while process_state(pid) not in ("", "Z"):  # init reaps orphans lazily here: a zombie counts as gone
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
def test_sigkilled_owner_is_swept_at_next_start():
    """A SIGKILLed owner leaves its bed; a bed started while it lives leaves it alone; the next one sweeps it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a bed")
    owner, info = _start_owner()
    try:
        with bed_or_skip(1) as other:  # the owner lives: its bed is not another's to sweep
            assert not set(info["namespaces"]) & set(other.swept)
        assert process_state(info["child"]) not in ("", "Z")
        owner.kill()
        owner.wait()
        listed = _ip("netns", "list")
        assert all(ns in listed for ns in info["namespaces"]), "SIGKILL runs no cleanup: the bed must remain"
        with bed_or_skip(1) as nxt:
            assert set(info["namespaces"]) <= set(nxt.swept)
        assert info["id"] not in _ip("netns", "list")
        assert _gone(info["child"]), "the sweep must kill a process left inside the dead bed"
        assert not os.path.exists(info["workdir"])
    finally:
        owner.kill()
        owner.wait()
        for ns in info["namespaces"]:
            names.delete_netns(ns)


@pytest.mark.slow
def test_sigterm_owner_cleans_up():
    """SIGTERM to an owner closes its bed on the way out: nothing is left for a sweep."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a bed")
    owner, info = _start_owner()
    try:
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(30) == -signal.SIGTERM  # it still dies of the signal
        assert info["id"] not in _ip("netns", "list")
        assert _gone(info["child"])
    finally:
        owner.kill()
        owner.wait()
        for ns in info["namespaces"]:
            names.delete_netns(ns)


@pytest.mark.slow
def test_gloo_group_across_hosts():
    """Two ranks in two hosts form a gloo group at host 0's address and broadcast a tensor over the bed."""
    with bed_or_skip(2) as bed:
        init = f"tcp://{bed.address(0)}:29500"
        ranks = [bed.start(r, f"{PROCS}:gloo_broadcast", r, 2, init) for r in range(2)]
        got = [p.result(120) for p in ranks]
    expected = float(sum(range(1000)) * 3)
    assert [g["sum"] for g in got] == [expected, expected]
    assert [g["ifname"] for g in got] == ["hwbed0", "hwbed1"]
