"""Who made a shared segment or an ipc directory, and the sweep of what dead processes left behind.

Every name hwsync makes in /dev/shm (transport buffers, doorbells, shared parameter segments) and
in the temp directory (private ipc:// directories) begins with its owner: `hwsync-<pid>-<start>-<pidns>-`
(owner_prefix). <start> is the process's start time (/proc/PID/stat field 22, clock ticks after
boot): with the pid it names that process and no later one that reuses the pid. <pidns> is the
inode of its pid namespace: a process of another namespace that shares /dev/shm (a container of
the same pod) is never judged by pids this one sees.

A process killed with SIGKILL cannot clean up, and the resource tracker that would have done it
is its parent's when multiprocessing spawned it: its segments then stay as long as the parent
lives, its ipc directory for good. So each hwsync process sweeps once (sweep_dead_owners), before
it first creates or maps a segment or makes an ipc directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable

log = logging.getLogger("hwsync")

#: where POSIX shared-memory segments live
SHM_DIR = "/dev/shm"
#: how an owned name begins: hwsync-<pid>-<start>-<pidns>- (groups: pid, start, pid namespace)
OWNER = r"hwsync-([0-9]{1,10})-([0-9]{1,20})-([0-9]{1,20})-"
#: a private ipc:// directory (hwsync.control.endpoints.private_ipc_dir): the owner prefix, then mkdtemp's 8 characters
IPC_DIR_NAME = re.compile(OWNER + r"[a-z0-9_]{8}")
_OWNED = re.compile(OWNER)

_sweep_lock = threading.Lock()
_swept_in: int | None = None  # the pid that swept (a forked child is another process: it sweeps again)
_prefix: tuple[int, str] | None = None


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0  # no /proc/self/ns (a sandbox): every process looks alike, as if in one namespace


def owner_prefix() -> str:
    """hwsync-<pid>-<start>-<pidns>-: how every segment and ipc directory this process makes begins."""
    global _prefix
    pid = os.getpid()
    if _prefix is None or _prefix[0] != pid:
        fields = _stat_fields("self")
        start = int(fields[19]) if fields and len(fields) > 19 else 0
        _prefix = (pid, f"hwsync-{pid}-{start}-{_pid_namespace()}-")
    return _prefix[1]


def owner_alive(pid: int, start: int, namespace: int) -> bool:
    """False only when the process that made a name is provably gone: exited, a zombie, or its pid reused."""
    if namespace != _pid_namespace():
        return True  # its pids are not ours to look up
    try:
        fields = _stat_fields(pid)
    except OSError:
        return True  # unreadable (hidepid): not provably gone
    if fields is None:
        return False
    return fields[0] != "Z" and len(fields) > 19 and int(fields[19]) == start


def own_entry(path: str, kind: Callable[[int], bool]) -> bool:
    """Whether `path` is itself (not through a link) a `kind` entry (stat.S_ISREG, S_ISDIR) of this user."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return kind(st.st_mode) and st.st_uid == os.geteuid()


def sweep_dead_owners(force: bool = False) -> list[str]:
    """Remove the segments and ipc directories whose owner is gone (owner_alive), once per process; the paths removed.

    Only names of owner_prefix's form, of this user: those of live processes, of other pid
    namespaces, of other users and of another form (an older hwsync's) are left alone.
    `force`: sweep again (tests).
    """
    global _swept_in
    with _sweep_lock:
        if _swept_in == os.getpid() and not force:
            return []
        _swept_in = os.getpid()
        removed: list[str] = []
        verdicts: dict[tuple[int, int, int], bool] = {}
        for directory, kind in ((SHM_DIR, stat.S_ISREG), (tempfile.gettempdir(), stat.S_ISDIR)):
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                match = _OWNED.match(name)
                if match is None or (kind is stat.S_ISDIR and not IPC_DIR_NAME.fullmatch(name)):
                    continue
                owner = (int(match.group(1)), int(match.group(2)), int(match.group(3)))
                if owner not in verdicts:
                    verdicts[owner] = owner_alive(*owner)
                path = os.path.join(directory, name)
                if verdicts[owner] or not own_entry(path, kind):
                    continue
                try:
                    if kind is stat.S_ISDIR:
                        shutil.rmtree(path)
                    else:
                        os.unlink(path)
                    removed.append(path)
                except OSError:
                    pass  # another process's sweep was first
    if removed:
        log.info("hwsync: removed %d segments and ipc directories of processes that died: %s", len(removed),
                 ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else ""))
    return removed
