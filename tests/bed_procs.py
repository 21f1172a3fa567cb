"""Processes for the bed tests: what runs inside a bed host, and an owner process to SIGKILL.

The functions are targets of hwsync_tools.bed.spawn (arguments and results are JSON). Nothing here
imports torch or hwsync at the top: a host process that needs neither starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))


def bed_or_skip(hosts: int, **kwargs):
    """A Bed, or pytest.skip with the reason this machine cannot hold one."""
    import pytest

    from hwsync_tools.bed import Bed, BedUnavailableError

    try:
        return Bed(hosts, **kwargs)
    except BedUnavailableError as exc:
        pytest.skip(f"no multi-host bed on this machine: {exc}")


def process_state(pid: int) -> str:
    """The state letter of process `pid` ('R', 'S', 'Z' …), or '' when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return ""
    return stat[stat.rfind(")") + 2]


def whoami() -> dict:
    """What this process sees of the network: interfaces, IPv4 addresses, routes, the interface variables."""
    addrs = json.loads(subprocess.run(["ip", "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout)
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True,
                                       text=True, check=True).stdout)
    return {"interfaces": sorted(name for _, name in socket.if_nameindex()),
            "addresses": sorted(a["local"] for link in addrs for a in link.get("addr_info", [])),
            "routes": sorted(r.get("dst", "default") for r in routes if r.get("type", "unicast") == "unicast"),
            "env": {k: v for k, v in os.environ.items()
                    if k.endswith("_IFNAME") or k.startswith(("HCCL_IF", "HWSYNC_BED"))},
            "pid": os.getpid(), "hostname": socket.gethostname()}


def nics(peer: str) -> dict:
    """hwsync.control.nic's answers in this host (loaded by path: no torch): the interface towards `peer`, the one owning
    it, the default address; and this process's host name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_nic", os.path.join(os.path.dirname(TESTS), "hwsync", "control", "nic.py"))
    nic = importlib.util.module_from_spec(spec)
    sys.modules["_nic"] = nic  # dataclasses look their module up there
    spec.loader.exec_module(nic)
    towards, owning = nic.nic_towards(peer), nic.nic_owning(peer)
    return {"towards": [towards.name, towards.address] if towards else None,
            "owning": [owning.name, owning.address] if owning else None,
            "pick": nic.pick_local_host(), "hostname": socket.gethostname()}


def import_hwsync() -> dict:
    """Where hwsync and the interpreter come from, seen from inside a host."""
    import hwsync

    return {"hwsync": hwsync.__file__, "prefix": sys.prefix, "executable": sys.executable}


def listen(port: int, seconds: float) -> int:
    """Accept and close connections on `port` for `seconds`; how many came."""
    n = 0
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(0.2)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            conn.close()
            n += 1
    return n


def sleep_forever() -> None:
    """Never returns: a process to kill."""
    while True:
        time.sleep(60)


def gloo_broadcast(rank: int, world: int, init_method: str, timeout_s: float = 60.0) -> dict:
    """Form a gloo group of `world` ranks at `init_method`, broadcast a tensor from rank 0; what this rank got."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        t = torch.arange(1000, dtype=torch.float32) * 3 if rank == 0 else torch.zeros(1000)
        dist.broadcast(t, src=0)
        return {"sum": float(t.sum()), "first": t[:4].tolist(), "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}
    finally:
        dist.destroy_process_group()


def owner_main() -> None:
    """A bed owner to SIGKILL: makes a 2-host bed with a process in host 0, prints its ids, then waits."""
    from hwsync_tools.bed import Bed

    bed = Bed(2)
    # die_with_parent=False: this process outlives its owner, so the next start's sweep must kill it
    proc = bed.start(0, f"{os.path.abspath(__file__)}:sleep_forever", die_with_parent=False)
    print(json.dumps({"id": bed.id, "namespaces": bed.namespaces(), "child": proc.pid, "workdir": proc.workdir}),
          flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1:] == ["owner"]:
        owner_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} owner")
