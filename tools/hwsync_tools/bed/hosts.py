"""A bed of N "hosts" on one machine: network namespaces on a bridge of their own, with rate-limited links.

Layout of a bed `hwbed-PID-START-RAND`: a switch namespace `…-sw` holds the bridge `br0` and one
port `p<i>` per host; host namespace `…-h<i>` holds the other end of that veth pair, `hwbed<i>`,
with the host's address in a private /24 and no other route. Nothing is created in the machine's
own namespace (each veth pair is made with its two ends already in bed namespaces), so a packet of
the bed can only reach another host of the bed, and deleting the namespaces removes everything.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from hwsync_tools.bed import names
from hwsync_tools.bed.common import INTERFACE_VARS, BedError, BedUnavailableError
from hwsync_tools.bed.subnets import default_candidates, in_use, pick_subnet

if TYPE_CHECKING:
    from hwsync_tools.bed.spawn import HostProcess


#: the bridge inside the switch namespace
BRIDGE = "br0"
#: tbf's queue, as time at the configured rate: TCP needs some queue to fill the link, a deep one only adds delay
TBF_LATENCY_MS = 20.0
#: tbf's bucket, as time at the configured rate (at least 64 KiB, one GSO packet, so big segments pass whole).
#: Tokens beyond the bucket are lost while the qdisc waits to be run (its timer fires in a softirq, late on a
#: busy machine): on a 2-core machine at load 5-9, a 0.5 ms bucket (5 ms queue) lost a third of the rate at
#: 1 Gbit/s; 4-20 ms reach 0.95x, the ceiling of 1448 payload bytes in 1514 on the wire, 10-20 ms most steadily.
#: The bucket is also the most a link sends above its rate after an idle spell (1.25 MB at 1 Gbit/s)
TBF_BURST_MS = 10.0


def tbf_args(rate_bps: float) -> list[str]:
    """The tbf settings for `rate_bps` (bits/s): a bucket of TBF_BURST_MS and a queue of TBF_LATENCY_MS."""
    rate_Bps = rate_bps / 8
    burst = max(64 << 10, int(rate_Bps * TBF_BURST_MS / 1e3))
    limit = max(2 * burst, int(rate_Bps * TBF_LATENCY_MS / 1e3))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]


def unavailable_reason() -> str | None:
    """Why this machine cannot hold a bed, or None if it may (the namespace calls themselves are tried later)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a bed needs root (network namespaces and links are made with `ip netns`): run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command is not installed (iproute2): install it to use a bed"
    return None


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise BedError(f"`{' '.join(cmd)}` failed (exit {out.returncode}): {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


class Bed:
    """N hosts on one bridge; host i has address(i) on interface(i) in namespace netns(i); use as a context."""

    def __init__(self, hosts: int, rate_bps: float | None = None, *, subnets: Iterable[str] | None = None) -> None:
        if hosts < 1:
            raise ValueError(f"a bed needs at least one host, got hosts={hosts}")
        reason = unavailable_reason()
        if reason:
            raise BedUnavailableError(reason)
        self.swept = names.sweep()  # earlier beds whose owner died: gone before we pick a subnet
        try:
            used = in_use()
        except RuntimeError as exc:
            raise BedUnavailableError(str(exc)) from exc
        self.subnet, self.skipped_subnets = pick_subnet(subnets if subnets is not None else default_candidates(),
                                                        used, hosts)
        self.id = names.new_bed_id()
        self.owner = os.getpid()
        self.hosts = hosts
        self._rates: list[float | None] = [None] * hosts
        self._up = [True] * hosts
        self._procs: list[HostProcess] = []
        self._made: list[str] = []
        self._lock = threading.RLock()  # close() may run again inside a signal handler that interrupted it
        self.closed = False
        _register(self)
        try:
            self._build()
            for i in range(hosts):
                self.set_rate(i, rate_bps)
        except BaseException:
            self.close()
            raise

    # --- names ------------------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        """The namespace that holds the bridge."""
        return f"{self.id}-sw"

    def netns(self, host: int) -> str:
        """The namespace of host `host`."""
        self._check(host)
        return f"{self.id}-h{host}"

    def interface(self, host: int) -> str:
        """The interface name inside host `host` (distinct per host, and absent from the machine's namespace)."""
        self._check(host)
        return f"hwbed{host}"

    def port(self, host: int) -> str:
        """The bridge port of host `host`, in the switch namespace."""
        self._check(host)
        return f"p{host}"

    def address(self, host: int) -> str:
        """The IPv4 address of host `host`."""
        self._check(host)
        return str(self.subnet.network_address + 1 + host)

    def hostname(self, host: int) -> str:
        """The host name processes of host `host` see (their own UTS namespace): the namespace's name."""
        return self.netns(host)

    def namespaces(self) -> list[str]:
        """Every namespace of this bed (the hosts', then the switch)."""
        return [self.netns(i) for i in range(self.hosts)] + [self.switch]

    def _check(self, host: int) -> None:
        if not 0 <= host < self.hosts:
            raise IndexError(f"host {host} is not in this bed of {self.hosts} hosts (0..{self.hosts - 1})")

    # --- building ---------------------------------------------------------------------------------
    def _netns_add(self, name: str) -> None:
        out = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            err = out.stderr.strip()
            if "ermission" in err or "not permitted" in err:
                raise BedUnavailableError(f"creating a network namespace was refused ({err}): a bed needs "
                                          "CAP_SYS_ADMIN and CAP_NET_ADMIN (root outside a restricted container)")
            raise BedError(f"`ip netns add {name}` failed: {err}")
        self._made.append(name)

    def _build(self) -> None:
        sw = self.switch
        self._netns_add(sw)
        try:
            _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
        except BedError as exc:
            raise BedUnavailableError(f"this kernel refused a bridge ({exc}): load the `bridge` module") from exc
        # no IPv6 link-local address on any link of the bed: the only address is the one we assign
        _run(["ip", "-n", sw, "link", "set", BRIDGE, "addrgenmode", "none", "up"])
        for i in range(self.hosts):
            h, dev, port = self.netns(i), self.interface(i), self.port(i)
            self._netns_add(h)
            try:  # both ends are born inside bed namespaces: nothing ever appears in the machine's own
                _run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", dev, "netns", h])
            except BedError as exc:
                raise BedUnavailableError(f"this kernel refused a veth pair ({exc}): load the `veth` module") from exc
            _run(["ip", "-n", sw, "link", "set", port, "addrgenmode", "none", "master", BRIDGE, "up"])
            _run(["ip", "-n", h, "link", "set", "lo", "up"])
            _run(["ip", "-n", h, "link", "set", dev, "addrgenmode", "none"])
            _run(["ip", "-n", h, "addr", "add", f"{self.address(i)}/{self.subnet.prefixlen}", "dev", dev])
            _run(["ip", "-n", h, "link", "set", dev, "up"])

    # --- operations -------------------------------------------------------------------------------
    def link_down(self, host: int) -> None:
        """Pull host `host`'s cable: its bridge port goes down, the host keeps its address but reaches no one."""
        _run(["ip", "-n", self.switch, "link", "set", self.port(host), "down"])
        self._up[host] = False

    def link_up(self, host: int) -> None:
        """Plug host `host`'s cable back (the bridge forwards at once: no STP on it)."""
        _run(["ip", "-n", self.switch, "link", "set", self.port(host), "up"])
        self._up[host] = True

    def unacked_bytes(self, host: int) -> int:
        """Bytes host `host`'s TCP connections sent and have not had acknowledged (their Send-Q): 0 once a link that
        came back has caught up. TCP retransmits with backoff, so after a long cut that can take seconds."""
        out = _run(["ip", "netns", "exec", self.netns(host), "ss", "-tnH", "state", "established"])
        return sum(int(line.split()[1]) for line in out.splitlines() if len(line.split()) >= 4)

    def add_interface(self, host: int, cidr: str, *, default_route: bool = True) -> str:
        """Give host `host` a second interface holding `cidr` (e.g. "198.18.0.1/24"), by default with the default
        route: a node whose management NIC routes everywhere while its peers sit on the bed's network. It is one end
        of a veth pair whose other end stays in the host too (this kernel may lack the dummy type): it reaches no
        other host. Its name."""
        name, ns = f"hwmgmt{host}", self.netns(host)
        _run(["ip", "-n", ns, "link", "add", name, "type", "veth", "peer", "name", f"{name}p"])
        _run(["ip", "-n", ns, "link", "set", f"{name}p", "addrgenmode", "none", "up"])
        _run(["ip", "-n", ns, "link", "set", name, "addrgenmode", "none"])
        _run(["ip", "-n", ns, "addr", "add", cidr, "dev", name])
        _run(["ip", "-n", ns, "link", "set", name, "up"])
        if default_route:
            _run(["ip", "-n", ns, "route", "add", "default", "dev", name])
        return name

    def is_up(self, host: int) -> bool:
        """Whether host `host`'s link is up (as this bed last set it)."""
        self._check(host)
        return self._up[host]

    def set_rate(self, host: int, rate_bps: float | None) -> None:
        """Limit host `host`'s link to `rate_bps` bits/s in each direction (a full-duplex NIC); None: unlimited."""
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive or None (unlimited), got {rate_bps} for host {host}")
        # upload: the host's own interface; download: its bridge port, which sends towards the host
        for ns, dev in ((self.netns(host), self.interface(host)), (self.switch, self.port(host))):
            if rate_bps is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)
            else:
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_bps)])
        self._rates[host] = rate_bps

    def rate(self, host: int) -> float | None:
        """Host `host`'s configured rate in bits/s (None: unlimited)."""
        self._check(host)
        return self._rates[host]

    def kill_host(self, host: int) -> list[int]:
        """SIGKILL every process in host `host` (a node that lost power); their pids. Its HostProcesses stay
        reapable."""
        return names.kill_inside(self.netns(host))

    def env(self, host: int) -> dict[str, str]:
        """Variables that make every collective library of a process in host `host` use that host's interface.

        NCCL and HCCL take a name *prefix* unless it starts with '=', so the exact form is used;
        HCCL_IF_IP wins over HCCL_SOCKET_IFNAME in HCCL, and is set too.
        """
        dev = self.interface(host)
        return {"GLOO_SOCKET_IFNAME": dev, "NCCL_SOCKET_IFNAME": f"={dev}", "HCCL_SOCKET_IFNAME": f"={dev}",
                "HCCL_IF_IP": self.address(host), "TP_SOCKET_IFNAME": dev, "HWSYNC_BED_HOST": str(host),
                "HWSYNC_BED_ADDRESS": self.address(host), "HWSYNC_BED_INTERFACE": dev}

    def start(self, host: int, target: str, *args: object, **kwargs: Any) -> HostProcess:
        """Run `target` ("module:function" or "/path/file.py:function") in a process of host `host`.

        See hwsync_tools.bed.spawn.start_in_host for the keyword options; the bed kills it at close().
        """
        from hwsync_tools.bed.spawn import start_in_host

        return start_in_host(self, host, target, *args, **kwargs)

    def adopt(self, proc: HostProcess) -> None:
        """Make close() kill and reap `proc` (start_in_host does this)."""
        with self._lock:
            if self.closed:
                proc.kill()
                raise BedError(f"bed {self.id} is closed: no process can start in it")
            self._procs.append(proc)

    # --- teardown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill and reap the bed's processes, delete its namespaces (and with them every link); idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            procs, self._procs = self._procs, []
        if os.getpid() != self.owner:  # a forked child inherited this object: the bed is its parent's
            return
        for p in procs:
            p.kill()
        for ns in reversed(self._made):
            names.delete_netns(ns)
        _unregister(self)

    def __enter__(self) -> Bed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bed({self.id}, hosts={self.hosts}, subnet={self.subnet}, closed={self.closed})"


# --- every exit path: atexit, SIGTERM/SIGHUP (SIGINT raises KeyboardInterrupt: the context's exit) --------
_live: set[Bed] = set()
_live_lock = threading.RLock()  # taken again by _on_signal if the signal lands while it is held
_hooked = False


def _close_all() -> None:
    with _live_lock:
        beds = list(_live)
    for bed in beds:
        bed.close()


def _on_signal(signum: int, frame: object) -> None:
    _close_all()
    signal.signal(signum, signal.SIG_DFL)  # then die of the same signal, as without us
    os.kill(os.getpid(), signum)


def _register(bed: Bed) -> None:
    global _hooked
    with _live_lock:
        _live.add(bed)
        if _hooked:
            return
        _hooked = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:  # never replace a handler someone else installed
                signal.signal(sig, _on_signal)


def _unregister(bed: Bed) -> None:
    with _live_lock:
        _live.discard(bed)


def parse_rate(text: str) -> float | None:
    """'1gbit', '10Gbit', '500mbit', '1e9' or 'none' -> bits/s (None: unlimited)."""
    t = text.strip().lower()
    if t in ("none", "unlimited", "0", ""):
        return None
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * mult
    return float(t)


__all__ = ["INTERFACE_VARS", "Bed", "BedError", "BedUnavailableError", "parse_rate", "tbf_args", "unavailable_reason"]
