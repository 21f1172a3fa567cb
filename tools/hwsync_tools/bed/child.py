"""Entry point of a process started inside a bed host: `python child.py WORKDIR` (run by path, see spawn.py).

It runs the target named in WORKDIR/args.json and writes WORKDIR/result.json: {"ok": true, "value": …}
or {"ok": false, "error": "Type: message", "traceback": …}. It is run by path, not with `-m`, so a
target that needs no torch does not pay for importing the hwsync package (which imports torch).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import json
import os
import signal
import socket
import sys
import traceback

PR_SET_PDEATHSIG = 1
CLONE_NEWUTS = 0x04000000


def take_hostname(name: str) -> None:
    """Give this process a host name of its own (a UTS namespace): peers then see another host, as across nodes."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUTS) failed ({os.strerror(err)}): a bed host needs CAP_SYS_ADMIN")
    socket.sethostname(name)


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when the process that started it dies (even by SIGKILL, which runs no cleanup)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


def load_target(spec: str):
    """The function named by "package.module:function" or "/path/to/file.py:function"."""
    where, _, func = spec.rpartition(":")
    if not where or not func:
        raise ValueError(f"target {spec!r} must be 'module:function' or '/path/file.py:function'")
    if where.endswith(".py"):
        name = "_hwbed_" + os.path.basename(where)[:-3]
        mod_spec = importlib.util.spec_from_file_location(name, where)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"cannot load {where} (target {spec!r})")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, func)


def main(workdir: str) -> int:
    """Run the target of `workdir`, write its result; the exit status says whether it returned."""
    with open(os.path.join(workdir, "args.json")) as f:
        spec = json.load(f)
    if spec.get("parent"):
        die_with_parent(spec["parent"])
    if spec.get("hostname"):
        take_hostname(spec["hostname"])
    sys.path[:0] = spec.get("sys_path", [])
    # the folders of the parent's hwsync and hwsync_tools: where one came from a folder the venv does not list (a
    # checkout run with -m from its root), this process imports that one, not the venv's
    for root in reversed(spec.get("roots", [])):
        if root not in sys.path:
            sys.path.insert(0, root)
    try:
        value = load_target(spec["target"])(*spec.get("args", []), **spec.get("kwargs", {}))
        result = {"ok": True, "value": value}
        text = json.dumps(result)  # a value JSON cannot carry is the target's error, reported as such
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        text = json.dumps(result)
    tmp = os.path.join(workdir, "result.json.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(workdir, "result.json"))  # the parent never reads half a result
    # the process ends now: its exit need not collect every module's cyclic garbage (seconds for one that imported
    # verl, on a busy machine); atexit handlers and thread joins still run
    gc.freeze()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    # run by path, sys.path[0] is this folder: its modules must not shadow top-level names
    sys.path.pop(0)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # a TextIOWrapper here
    sys.exit(main(sys.argv[1]))
