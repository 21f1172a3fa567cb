"""What a dead hwsync process left in /dev/shm and the temp directory goes at the next start of any hwsync process.

Issue 32, item 4: a sender started by multiprocessing (spawn) registers its segments with its
parent's resource tracker, so SIGKILLed, its segments stay for as long as the parent lives, and its
private ipc:// directory for good. Names carry their owner (hwsync-<pid>-<start>-<pidns>-,
hwsync.backend.owners), and every hwsync process sweeps once what provably dead owners left: a pid that is
gone, or reused (another start time). This pytest process is the long-lived parent.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

import sweep_procs
import transfer_procs as procs
from hwsync.backend.owners import _pid_namespace, owner_prefix, sweep_dead_owners
from hwsync.backend.shm import SHM_DIR, SharedSegment, leftover_segments

CTX = mp.get_context("spawn")
#: a new hwsync process: making a sender makes its ipc directory, which sweeps first
NEW_HWSYNC_PROCESS = "from hwsync import WeightSender; WeightSender().close()"


def _start_hwsync_process() -> None:
    done = subprocess.run([sys.executable, "-c", NEW_HWSYNC_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _ipc_dir(endpoint: str) -> Path:
    return Path(endpoint.split("#")[0].removeprefix("ipc://")).parent


def _spawn_sender(mode: str):
    """(sender process, its first report, receiver process) after one complete sync."""
    q = CTX.Queue()
    sender = CTX.Process(target=sweep_procs.sender_main, args=(q, mode), daemon=True)
    sender.start()
    info = q.get(timeout=120)
    receiver, rq = procs.start_receiver(procs.receive_n, info["endpoint"], syncs=2 if mode == "mid" else 1)
    assert "error" not in rq.get(timeout=120)
    assert q.get(timeout=60) == {"synced": 1}
    return sender, q, info, receiver


@pytest.mark.parametrize("mode", ["between", "mid"], ids=["between-syncs", "mid-sync"])
def test_a_killed_spawned_senders_segments_and_ipc_dir_go_at_the_next_start(mode):
    sender, q, info, receiver = _spawn_sender(mode)
    pid, ipc_dir = info["pid"], _ipc_dir(info["endpoint"])
    if mode == "between":
        receiver.join(60)  # it received its one sync and closed: nothing but the sweep removes what follows
    else:
        assert q.get(timeout=60) == {"mid": True}
    os.kill(pid, signal.SIGKILL)
    if mode == "mid":
        receiver.kill()  # before it notices: what it would remove of a dead sender is the sweep's to remove
    sender.join(30)
    receiver.join(30)
    left = leftover_segments(pid)
    assert left, "the killed sender left no segment: nothing to test (its parent's resource tracker lives on)"
    if mode == "between":
        assert set(info["params"]) <= set(left) and ipc_dir.exists()
    _start_hwsync_process()
    assert not leftover_segments(pid), f"left after another hwsync process started: {leftover_segments(pid)}"
    assert not ipc_dir.exists()


def test_a_live_processs_segments_are_never_swept():
    sender, q, info, receiver = _spawn_sender("between")
    try:
        receiver.join(60)
        before = leftover_segments(info["pid"])
        mine = SharedSegment.create(4096)
        assert before and mine.name in leftover_segments(os.getpid())
        _start_hwsync_process()
        assert leftover_segments(info["pid"]) == before and _ipc_dir(info["endpoint"]).exists()
        assert mine.name in leftover_segments(os.getpid())
        mine.close()
    finally:
        sender.kill()
        sender.join(30)
        _start_hwsync_process()  # what it leaves, the next one removes


def _own_start() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def test_a_reused_pid_is_told_by_its_start_time():
    """Names of this live pid with another start time are a dead process's whose pid was reused: swept."""
    pid, start, ns = os.getpid(), _own_start(), _pid_namespace()
    assert owner_prefix() == f"hwsync-{pid}-{start}-{ns}-"
    names = {
        "reused": f"hwsync-{pid}-{start - 1}-{ns}-{secrets.token_hex(8)}",
        "reused params": f"hwsync-{pid}-{start + 7}-{ns}-params-{secrets.token_hex(8)}",
        "live (matching start)": f"hwsync-{pid}-{start}-{ns}-{secrets.token_hex(8)}",
        "other pid namespace": f"hwsync-{pid}-{start - 1}-{ns + 1}-{secrets.token_hex(8)}",
        "older hwsync's form": f"hwsync-{pid}-{secrets.token_hex(8)}",
    }
    tmp = tempfile.gettempdir()
    dirs = {"reused": f"hwsync-{pid}-{start - 1}-{ns}-abcd1234", "live": f"hwsync-{pid}-{start}-{ns}-abcd1234"}
    try:
        for name in names.values():
            Path(SHM_DIR, name).touch(mode=0o600)
        for name in dirs.values():
            Path(tmp, name).mkdir(mode=0o700)
            Path(tmp, name, "control").touch()
        removed = sweep_dead_owners(force=True)
        assert Path(SHM_DIR, names["reused"]).as_posix() in removed
        present = {k: Path(SHM_DIR, n).exists() for k, n in names.items()}
        assert present == {"reused": False, "reused params": False, "live (matching start)": True,
                           "other pid namespace": True, "older hwsync's form": True}
        assert not Path(tmp, dirs["reused"]).exists() and Path(tmp, dirs["live"]).exists()
    finally:
        for name in names.values():
            Path(SHM_DIR, name).unlink(missing_ok=True)
        for name in dirs.values():
            if Path(tmp, name).exists():
                Path(tmp, name, "control").unlink()
                Path(tmp, name).rmdir()


def test_a_dead_pid_and_a_zombie_are_swept_and_links_are_not_followed(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # gone (its pid may be reused: then by another start time, swept alike)
    with open(f"/proc/{os.getpid()}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    ns = _pid_namespace()
    dead = f"hwsync-{child.pid}-{start}-{ns}-{secrets.token_hex(8)}"
    link = f"hwsync-{child.pid}-{start}-{ns}-{secrets.token_hex(8)}"
    target = tmp_path / "kept"
    target.write_text("not hwsync's")
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(0.5)  # exited, not reaped yet: a zombie
    with open(f"/proc/{zombie.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    of_zombie = f"hwsync-{zombie.pid}-{fields[19]}-{ns}-{secrets.token_hex(8)}"
    try:
        Path(SHM_DIR, dead).touch(mode=0o600)
        Path(SHM_DIR, of_zombie).touch(mode=0o600)
        os.symlink(target, Path(SHM_DIR, link))
        sweep_dead_owners(force=True)
        assert fields[0] == "Z" and not Path(SHM_DIR, of_zombie).exists()
        assert not Path(SHM_DIR, dead).exists()
        assert target.read_text() == "not hwsync's" and Path(SHM_DIR, link).is_symlink(), "a link is never followed"
    finally:
        zombie.wait()
        for name in (dead, of_zombie, link):
            Path(SHM_DIR, name).unlink(missing_ok=True)


def test_a_forked_child_neither_names_nor_removes_its_parents_segments():
    """A forked child inherits the parent's segment objects, not their ownership: it offers none of them (its offer
    would name another pid's segment) and closing them, or exiting, leaves them to the parent."""
    from hwsync.sync.shared_params import SharedTensors, live_segments

    shared = SharedTensors([("w", __import__("torch").ones(8))])
    name = shared.segment_names[0]
    try:
        pid = os.fork()
        if pid == 0:  # the child: no pytest machinery from here on
            ok = not live_segments()
            shared.close()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child listed its parent's segment as its own"
        assert Path(SHM_DIR, name).exists() and [s.name for s in live_segments()] == [name]
    finally:
        shared.close()
    assert not Path(SHM_DIR, name).exists()
