"""Processes inside a bed's hosts: started with `ip netns exec`, their result back as JSON, always reaped.

A process in host i sees only host i's interface and address, its own host name (Bed.hostname:
a UTS namespace of its own, so hwsync's same-host checks see another node, as across machines),
and its environment names that interface to every collective library (Bed.env), so a rank cannot
bind another host's interface (or, with interface_vars=False, no variable: hwsync must choose).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hwsync_tools.bed.common import INTERFACE_VARS, BedError, hwsync_package

if TYPE_CHECKING:
    from hwsync_tools.bed.hosts import Bed

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child.py")
#: the folder holding this hwsync_tools package: a child imports the same one
TOOLS_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: how much of a failed process's output its error carries
LOG_TAIL_CHARS = 4000


class HostProcessError(BedError):
    """A host process raised, exited without a result, or ran past its time; the message carries its error."""


class HostProcess:
    """One process in one host of a bed: wait for its JSON result, or kill it; it is always reaped."""

    def __init__(self, popen: subprocess.Popen, workdir: str, host: int, target: str) -> None:
        self.popen = popen
        self.workdir = workdir
        self.host = host
        self.target = target

    @property
    def pid(self) -> int:
        """The process id (the Python process itself: `ip netns exec` execs in place)."""
        return self.popen.pid

    def poll(self) -> int | None:
        """Its exit status, or None while it runs."""
        return self.popen.poll()

    def alive(self) -> bool:
        """Whether it still runs."""
        return self.popen.poll() is None

    def log(self) -> str:
        """Its stdout and stderr so far (the tail)."""
        try:
            with open(os.path.join(self.workdir, "log"), errors="replace") as f:
                return f.read()[-LOG_TAIL_CHARS:]
        except FileNotFoundError:
            return ""

    def result(self, timeout: float) -> Any:
        """Wait up to `timeout` s for it to end; its target's return value, or HostProcessError (it is killed)."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            log = self.log()
            self.kill()
            raise HostProcessError(f"{self.target} in host {self.host} (pid {self.pid}) did not finish in "
                                   f"{timeout} s: killed. Its output:\n{log}") from None
        try:
            with open(os.path.join(self.workdir, "result.json")) as f:
                out = json.load(f)
        except FileNotFoundError:
            out = None
        log = self.log()
        self._remove_workdir()
        if out is None:
            raise HostProcessError(f"{self.target} in host {self.host} (pid {self.pid}) exited with status "
                                   f"{self.popen.returncode} before writing a result. Its output:\n{log}")
        if not out["ok"]:
            raise HostProcessError(f"{self.target} in host {self.host} (pid {self.pid}) raised {out['error']}\n"
                                   f"{out['traceback']}Its output:\n{log}")
        return out["value"]

    def kill(self) -> None:
        """SIGKILL it if it runs, and reap it; idempotent."""
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait()
        self._remove_workdir()

    def signal(self, signum: int) -> None:
        """Send it `signum` (it is still reaped by result() or kill())."""
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    def _remove_workdir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __repr__(self) -> str:
        return f"HostProcess({self.target}, host={self.host}, pid={self.pid}, exit={self.popen.poll()})"


def start_in_host(bed: Bed, host: int, target: str, *args: object, sys_path: Iterable[str] = (),
                  env: Mapping[str, str] | None = None, cwd: str | None = None, die_with_parent: bool = True,
                  interface_vars: bool = True, own_hostname: bool = True, **kwargs: object) -> HostProcess:
    """Start `target(*args, **kwargs)` in a Python process inside host `host` of `bed`; the bed owns it.

    `target`: "package.module:function" or "/path/file.py:function"; its arguments and its return
    value travel as JSON. `sys_path`: folders put first on the child's sys.path (to import a test
    helper). `env`: extra variables (the host's interface variables from Bed.env win over them).
    `die_with_parent`: the child is SIGKILLed when the thread that started it ends (PR_SET_PDEATHSIG),
    so a SIGKILLed owner leaves no process running; turn it off to start processes from a thread
    that ends before they do. `interface_vars=False`: none of the collective libraries' interface
    variables is set (those of this process are removed too), to test a program that must choose the
    interface itself. `own_hostname`: the process gets the host's name (Bed.hostname), not the machine's.
    The child is the venv's own interpreter (sys.executable).
    """
    workdir = tempfile.mkdtemp(prefix=f"{bed.id}-h{host}-")
    spec = {"target": target, "args": list(args), "kwargs": kwargs, "sys_path": [os.path.abspath(p) for p in sys_path],
            "parent": os.getpid() if die_with_parent else 0, "hostname": bed.hostname(host) if own_hostname else "",
            "roots": [os.path.dirname(hwsync_package()), TOOLS_ROOT]}
    with open(os.path.join(workdir, "args.json"), "w") as f:
        json.dump(spec, f)
    child_env = dict(os.environ)
    child_env.update(env or {})
    if interface_vars:
        child_env.update(bed.env(host))
    else:
        for name in INTERFACE_VARS:
            child_env.pop(name, None)
        child_env.update({k: v for k, v in bed.env(host).items() if k not in INTERFACE_VARS})
    child_env["PYTHONUNBUFFERED"] = "1"
    with open(os.path.join(workdir, "log"), "wb") as log:
        popen = subprocess.Popen(["ip", "netns", "exec", bed.netns(host), sys.executable, CHILD, workdir],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                 cwd=cwd)
    proc = HostProcess(popen, workdir, host, target)
    bed.adopt(proc)
    return proc


def wait_all(procs: Iterable[HostProcess], timeout: float) -> list[Any]:
    """Every process's result within one shared `timeout`; on the first failure the others are killed."""
    procs = list(procs)
    deadline = time.monotonic() + timeout
    try:
        return [p.result(max(0.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            p.kill()
