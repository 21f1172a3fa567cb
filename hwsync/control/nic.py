"""Which network interface a rank uses: the one that owns the address it binds, or that routes to its peer.

A node with several NICs (a management ethernet, a fast data network, docker bridges) gives a
collective library several choices, and the libraries guess: gloo resolves the hostname, NCCL
takes the first interface that is not loopback or docker. A wrong guess is silent until a peer
cannot connect, or the bytes go over the slow NIC. So the cross-node path decides from the
addresses it is given: a sender's group binds `group_host`, owned by exactly one interface; a
receiver reaches a sender's group address through the interface the kernel's routing table
picks for it (asked with an unconnected UDP socket's connect(), which sends nothing).

Linux only (getifaddrs through ctypes, /proc/net/dev); elsewhere every lookup answers None and
the libraries keep their own choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import socket
import sys
from dataclasses import dataclass

#: a port for route lookups: connect() on a UDP socket only picks a route, no packet is sent
_PROBE_PORT = 9


@dataclass(frozen=True)
class Nic:
    """A local network interface and the address on it that a rank uses."""

    name: str  # e.g. "eth0"
    address: str  # e.g. "10.0.0.5" (an IPv6 one without brackets)

    def __str__(self) -> str:
        return f"{self.address} on {self.name}"


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
                     ("addr", ctypes.POINTER(_SockAddr)), ("netmask", ctypes.POINTER(_SockAddr)),
                     ("ifu", ctypes.c_void_p), ("data", ctypes.c_void_p)]


def _ip_of(sa: ctypes.POINTER(_SockAddr)) -> str | None:  # type: ignore[valid-type]
    """The address a sockaddr holds (IPv4 or IPv6), or None for another family."""
    if not sa:
        return None
    family = sa.contents.family
    if family == socket.AF_INET:
        raw = bytes(ctypes.cast(sa, ctypes.POINTER(ctypes.c_ubyte * 8)).contents)[4:8]
        return socket.inet_ntop(socket.AF_INET, raw)
    if family == socket.AF_INET6:
        raw = bytes(ctypes.cast(sa, ctypes.POINTER(ctypes.c_ubyte * 24)).contents)[8:24]
        return socket.inet_ntop(socket.AF_INET6, raw)
    return None


def local_addresses() -> list[tuple[str, str]] | None:
    """(interface, address) of every IPv4 and IPv6 address of this host's network namespace; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return None
    out = []
    try:
        node = head
        while node:
            ip = _ip_of(node.contents.addr)
            if ip is not None:
                out.append((node.contents.name.decode(errors="replace"), ip.split("%")[0]))
            node = node.contents.next
    finally:
        libc.freeifaddrs(head)
    return out


def _literal(host: str) -> str | None:
    """`host` as an IP literal (a name resolved, brackets dropped), or None if it does not resolve."""
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except (OSError, IndexError):
        return None


def nic_owning(host: str) -> Nic | None:
    """The interface that holds address `host` (a name is resolved first), or None: not this host's, or unknown."""
    ip = _literal(host)
    addrs = local_addresses()
    if ip is None or addrs is None or ipaddress.ip_address(ip).is_unspecified:
        return None
    wanted = ipaddress.ip_address(ip)
    for name, addr in addrs:
        if ipaddress.ip_address(addr) == wanted:
            return Nic(name, addr)
    if wanted.is_loopback:  # 127.0.1.1 (a Debian hostname's) is lo's too, though lo lists 127.0.0.1 only
        for name, addr in addrs:
            if ipaddress.ip_address(addr).is_loopback and ipaddress.ip_address(addr).version == wanted.version:
                return Nic(name, ip)
    return None


def source_address(peer: str) -> str | None:
    """The local address the routing table sends from to reach `peer`, or None when no route reaches it."""
    ip = _literal(peer)
    if ip is None:
        return None
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((ip, _PROBE_PORT))
        except OSError:  # no route (a host without a default route, a peer on no local subnet)
            return None
        return probe.getsockname()[0].split("%")[0]


def nic_towards(peer: str) -> Nic | None:
    """The interface (and the address on it) whose route reaches `peer`, or None if none does or it is unknown."""
    local = source_address(peer)
    return nic_owning(local) if local is not None else None


def listening(port: int) -> bool | None:
    """Whether a TCP socket of this network namespace listens on `port` (on any address), from /proc/net/tcp and
    tcp6; None where that cannot be read (off Linux)."""
    readable = False
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()  # sl, local address (HEX_IP:HEX_PORT), remote address, state (0A: LISTEN), ...
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                return True
    return False if readable else None


def describe_addresses() -> str:
    """'eth0 10.0.0.5, lo 127.0.0.1' — this host's addresses, for an error that asks the user to pick one."""
    addrs = local_addresses()
    if addrs is None:
        return "(this platform cannot list them)"
    return ", ".join(f"{name} {addr}" for name, addr in addrs) or "(none)"


def interface_bytes(name: str) -> tuple[int, int] | None:
    """(received, sent) bytes of interface `name` since it came up, from /proc/net/dev; None if unknown.

    The counters cover every process of the host: on a NIC that other traffic shares, an upper bound.
    """
    try:
        with open("/proc/net/dev") as f:
            lines = f.readlines()[2:]
    except OSError:
        return None
    for line in lines:
        dev, _, rest = line.partition(":")
        if dev.strip() == name:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    return None


def pick_local_host() -> str:
    """This host's address when none is given: the hostname's, if an interface holds it; else the one the
    default route leaves from; else the only address that is not loopback; else 127.0.0.1."""
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = None
    if named is not None and not ipaddress.ip_address(named).is_loopback and nic_owning(named) is not None:
        return named
    # an address on no local subnet only picks the default route: nothing is sent to it
    routed = source_address("203.0.113.1")  # TEST-NET-3 (RFC 5737): documentation only, never a real host
    if routed is not None:
        return routed
    others = [addr for _, addr in local_addresses() or []
              if ":" not in addr and not ipaddress.ip_address(addr).is_loopback]
    if len(set(others)) == 1:
        return others[0]
    return named if named is not None and nic_owning(named) is not None else "127.0.0.1"
