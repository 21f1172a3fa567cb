"""One plain TCP stream between two bed hosts: what a link gives a single Python socket.

`sink` and `source` run inside hosts (stdlib only at the top: a child loads this file by path and
imports no torch); `measure` starts both; `python -m hwsync_tools.bed.stream` prints configured against
achieved rates:

    python -m hwsync_tools.bed.stream --rates none 1gbit 10gbit --seconds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
from types import ModuleType
from typing import Any


def _timing() -> ModuleType:
    """hwsync.timing, loaded by path where the hwsync package is not imported (importing it imports torch)."""
    if "hwsync.timing" in sys.modules:
        return sys.modules["hwsync.timing"]
    from hwsync_tools.bed.common import hwsync_package  # stdlib only (this file is also loaded by path)

    path = os.path.join(hwsync_package(), "timing.py")
    spec = importlib.util.spec_from_file_location("_hwbed_timing", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: the port a sink listens on: every host has its own namespace, so a fixed port never collides
PORT = 5201
CHUNK = 1 << 20
CONNECT_ATTEMPT_S = _timing().BED_CONNECT_ATTEMPT_S
CONNECT_RETRY_S = _timing().BED_CONNECT_RETRY_S


def sink(port: int = PORT, timeout_s: float = 30.0, warmup_s: float = 0.3) -> dict[str, Any]:
    """Accept one stream and read it to the end; its rate after the first `warmup_s` (bits/s) and its peer."""
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(timeout_s)
        conn, peer = server.accept()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = counted = 0
    first = start = last = 0.0
    with conn:
        local = conn.getsockname()[0]
        conn.settimeout(timeout_s)
        while True:
            n = conn.recv_into(view)
            now = time.monotonic()
            if n == 0:
                break
            if total == 0:
                first = now
            total += n
            if now - first >= warmup_s:  # the tbf bucket's first burst and TCP's slow start are left out
                if not start:
                    start = now
                else:
                    counted += n
            last = now
    seconds = last - start if start else 0.0
    return {"bytes": total, "seconds": seconds, "bps": counted * 8 / seconds if seconds > 0 else 0.0,
            "peer": peer[0], "local": local}


def source(address: str, port: int = PORT, seconds: float = 3.0, connect_timeout_s: float = 15.0) -> dict[str, Any]:
    """Connect to a sink (retrying until it listens) and send for `seconds`; bytes sent and the local address."""
    deadline = time.monotonic() + connect_timeout_s
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=CONNECT_ATTEMPT_S)
            break
        except (ConnectionRefusedError, socket.timeout, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(CONNECT_RETRY_S)
    view = memoryview(os.urandom(CHUNK))
    sent = 0
    with conn:
        conn.settimeout(None)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(view)
            sent += CHUNK
        local = conn.getsockname()[0]
    return {"bytes": sent, "local": local}


def connect_once(address: str, port: int = PORT, timeout_s: float = 1.0) -> str:
    """Try one connection: 'ok', or the error's class name (what a test of a dead link looks at)."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return "ok"
    except OSError as exc:
        return type(exc).__name__


def target(name: str) -> str:
    """The spawn target of function `name` of this file, loaded by path (no torch import in the host process)."""
    return f"{os.path.abspath(__file__)}:{name}"


def measure(bed: Any, src: int, dst: int, seconds: float = 3.0, port: int = PORT) -> dict[str, Any]:
    """A stream from host `src` to host `dst` of `bed` for `seconds`; the sink's report (bps, peer, local).

    Streams into one host at the same time need different ports.
    """
    sink_proc = bed.start(dst, target("sink"), port, timeout_s=seconds + 30)
    source_proc = bed.start(src, target("source"), bed.address(dst), port, seconds=seconds)
    try:
        source_proc.result(seconds + 60)
        return sink_proc.result(30)
    finally:
        source_proc.kill()
        sink_proc.kill()


def main(argv: list[str] | None = None) -> None:
    """Measure one stream per rate on a two-host bed; print configured and achieved rates."""
    from hwsync_tools.bed.hosts import Bed, parse_rate

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", nargs="+", default=["none", "1gbit", "10gbit"])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    with Bed(2) as bed:
        for text in args.rates:
            rate = parse_rate(text)
            for host in range(2):
                bed.set_rate(host, rate)
            for _ in range(args.repeat):
                got = measure(bed, 0, 1, args.seconds)["bps"]
                rows.append({"configured_bps": rate, "achieved_bps": got,
                             "ratio": got / rate if rate else None})
                if not args.json:
                    conf = f"{rate / 1e9:.3f} Gbit/s" if rate else "unlimited"
                    ratio = f"  ({got / rate:.3f}x)" if rate else ""
                    print(f"{conf:>16}: {got / 1e9:.3f} Gbit/s{ratio}", flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
