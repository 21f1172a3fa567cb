"""Names of a bed's namespaces, who owns them, and the sweep of beds whose owner died.

Every namespace of a bed is named `hwbed-PID-START-RAND-ROLE`: the owner's pid, the owner's start
time (clock ticks since boot, field 22 of /proc/PID/stat) and a random part. The name alone says
whether its owner still runs, so a bed left by a SIGKILLed run needs no state file to be found,
and a pid reused by another process (another start time) does not keep a dead bed alive.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile

PREFIX = "hwbed"
NETNS_DIR = "/run/netns"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([0-9a-f]+)-([a-z0-9]+)$")
#: a host process's work folder under the temp dir (spawn.py): the bed id, the host, mkdtemp's suffix
_WORKDIR = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([0-9a-f]+)-h\d+-")


def start_time(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after the last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


def new_bed_id() -> str:
    """A bed id unique to this process and run: `hwbed-PID-START-RAND`."""
    pid = os.getpid()
    return f"{PREFIX}-{pid}-{start_time(pid)}-{secrets.token_hex(4)}"


def parse(name: str) -> tuple[str, int, int] | None:
    """(bed id, owner pid, owner start time) of a bed namespace's name; None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    return name[: name.rfind("-")], int(m.group(1)), int(m.group(2))


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that made a bed still runs (same pid and the same start time)."""
    return start_time(pid) == start


def bed_namespaces() -> list[str]:
    """Names of every namespace of every bed on this machine, live or left behind."""
    try:
        names = os.listdir(NETNS_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if parse(n) is not None)


def kill_inside(netns: str) -> list[int]:
    """SIGKILL every process whose network namespace is `netns` (a bed's, never the machine's own)."""
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False)
    pids = [int(p) for p in out.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def delete_netns(netns: str) -> None:
    """Kill what runs inside `netns` and delete it; its links go with it (a veth pair dies with either end)."""
    kill_inside(netns)
    # a concurrent sweep may have deleted it first: not an error
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)


def sweep() -> list[str]:
    """Delete the namespaces (and so the links and processes) of every bed whose owner is gone; their names.

    The work folders its host processes left in the temp dir go too.
    """
    swept = []
    for name in bed_namespaces():
        parsed = parse(name)
        assert parsed is not None  # bed_namespaces lists only names parse() accepts
        _, pid, start = parsed
        if not owner_alive(pid, start):
            delete_netns(name)
            swept.append(name)
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        m = _WORKDIR.match(name)
        if m and not owner_alive(int(m.group(1)), int(m.group(2))):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
    return swept
