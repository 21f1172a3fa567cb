"""Which address a sender's group binds, so that every receiver reaches it; and what to pass when none did.

A sender rank's group (its store, and the collective library's own connections) binds one address of its
host, announced to the receivers in Setup. That address must be one they reach: on a host with several
interfaces (a management NIC with the default route, a data NIC on the engines' network) the default
choice can be the wrong one. So `group_host` wins when given; sender 0 otherwise takes its hub's address
(the one every rank just reached), and when the hub is bound to a wildcard address, the address its
routes to the connected receivers leave from (routed_host); the other senders take the address their
route to the hub leaves from.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from hwsync.control.nic import describe_addresses, local_addresses, nic_owning, pick_local_host, source_address
from hwsync.disaggregated.roster import PeerInfo, describe
from hwsync.errors import SyncError

log = logging.getLogger("hwsync")


def default_host() -> str:
    """This host's address when nothing names one (hwsync.control.nic.pick_local_host); pass group_host where it is not
    the right NIC."""
    return pick_local_host()


def endpoint_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (`tcp://HOST:PORT[#...]`), or None (ipc://, or a wildcard address)."""
    address = endpoint.partition("#")[0]
    if not address.startswith("tcp://"):
        return None
    host = address[len("tcp://"):].rpartition(":")[0].strip("[]")
    return None if host in ("", "*", "0.0.0.0", "::") else host


def choose_group_host(group_host: str | None, rank: int, endpoint: str | None) -> str:
    """The address this sender's group binds: `group_host` (checked to be this host's), else for sender 0 its hub's
    address, for the others the address that routes to the hub, else default_host()."""
    if group_host:
        if nic_owning(group_host) is None and local_addresses() is not None:
            raise ValueError(f"group_host={group_host!r} is not an address of this host (its addresses: "
                             f"{describe_addresses()}); pass the address of the interface the engines reach "
                             "this host through")
        return group_host
    hub = endpoint_host(endpoint) if endpoint else None
    if hub is not None:
        mine = hub if rank == 0 else source_address(hub)
        if mine is not None and nic_owning(mine) is not None:
            return mine
    return default_host()


def pick_port(host: str) -> int:
    """A TCP port free on `host` right now (the group's store binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def routed_host(receivers: list[PeerInfo], fallback: str) -> str:
    """The address this host's routes to the receivers' control connections leave from: one they reach, since they
    connected through it (loopback ones count only if all are); `fallback` where none is known. SyncError when the
    routes leave from different addresses: no one address is sure to serve them all."""
    routes: dict[str, list[PeerInfo]] = {}
    for peer in receivers:
        mine = source_address(peer.ip) if peer.ip else None
        if mine is not None:
            routes.setdefault(mine, []).append(peer)
    if any(not ipaddress.ip_address(a).is_loopback for a in routes):
        routes = {a: ps for a, ps in routes.items() if not ipaddress.ip_address(a).is_loopback}
    if len(routes) > 1:
        ways = "; ".join(f"to {describe(ps)} from {a}" for a, ps in routes.items())
        raise SyncError(f"sender 0 is bound to a wildcard address and its routes to the receivers leave from different "
                        f"addresses ({ways}): no one group address is sure to serve them all. Pass group_host= an "
                        "address of this host that every engine host reaches")
    if not routes:
        return fallback
    host = next(iter(routes))
    if host != fallback:
        log.info("hwsync: sender 0's group binds %s, where its routes to the receivers leave from (the hub is bound to "
                 "a wildcard address and no group_host= was given)", host)
    return host


def unreachable_hint(addresses: list[str], group_host: str, taken_from: str | None, receivers: list[PeerInfo]) -> str:
    """What to check, and which address to pass, when new groups at `addresses` did not form."""
    how = taken_from or "the routes to the receivers, or this host's default address"
    ips = sorted({p.ip for p in receivers if p.ip})
    routed = sorted({a for a in (source_address(ip) for ip in ips) if a is not None})
    towards = (f" (the receivers connected from {', '.join(ips)}; this host reaches them from "
               f"{', '.join(routed) or 'no address it can tell'})") if ips else ""
    return (f"The groups were announced at {addresses}; sender 0's binds {group_host}, taken from {how}. Every "
            f"receiver must reach each of these addresses{towards}: where one does not, pass group_host= an address of "
            "that sender's host that every engine host reaches")
