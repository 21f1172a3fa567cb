"""Choosing a bed's private subnet: one that no address or route of the machine, nor another bed, uses."""

from __future__ import annotations

import ipaddress
import json
import random
import subprocess
from collections.abc import Iterable, Iterator

from hwsync_tools.bed.names import bed_namespaces

Net = ipaddress.IPv4Network


def _ip_json(*args: str) -> list[dict]:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"`ip -j {' '.join(args)}` failed: {out.stderr.strip()} (a bed needs an iproute2 "
                           "with JSON output, 4.13 or newer, to see which subnets are in use)")
    return json.loads(out.stdout) if out.stdout.strip() else []


def networks_of(netns: str | None = None) -> list[Net]:
    """Every IPv4 network an address or a route of `netns` (None: the machine's own) covers.

    Default routes are left out: they cover everything, and a bed's packets never follow them
    (its hosts have no route but their own subnet's).
    """
    ns = ["-n", netns] if netns else []
    nets: list[Net] = []
    for link in _ip_json(*ns, "-4", "addr", "show"):
        for a in link.get("addr_info", []):
            if a.get("family") == "inet":
                nets.append(Net(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in _ip_json(*ns, "-4", "route", "show", "table", "all"):
        dst = route.get("dst", "default")
        if dst == "default":
            continue
        try:
            nets.append(Net(dst if "/" in dst else f"{dst}/32", strict=False))
        except ValueError:  # a route type without an IPv4 destination
            continue
    return nets


def in_use() -> list[Net]:
    """Networks of the machine's own namespace, and the subnets of other beds now on the machine."""
    nets = networks_of(None)
    for name in bed_namespaces():
        if name.endswith("-h0"):  # every host of a bed shares its subnet: one host per bed is enough
            try:
                nets.extend(n for n in networks_of(name) if not n.is_loopback)
            except RuntimeError:  # that bed was closed since it was listed
                continue
    return nets


def default_candidates(rng: random.Random | None = None) -> Iterator[str]:
    """/24s of 10.200.0.0-10.254.255.0, in a random order (two beds started together rarely pick the same)."""
    rng = rng or random.Random()
    slots = [(a, b) for a in range(200, 255) for b in range(256)]
    rng.shuffle(slots)
    return (f"10.{a}.{b}.0/24" for a, b in slots)


def pick_subnet(candidates: Iterable[str], used: list[Net], hosts: int) -> tuple[Net, list[str]]:
    """The first candidate that overlaps nothing in `used` and holds `hosts` addresses; (it, the skipped ones)."""
    skipped = []
    for text in candidates:
        net = Net(text, strict=True)
        if not net.is_private:
            raise ValueError(f"subnet {text} is not a private range: a bed uses private addresses only "
                             "(10/8, 172.16/12, 192.168/16)")
        if net.num_addresses - 2 < hosts:
            raise ValueError(f"subnet {text} holds {net.num_addresses - 2} host addresses, the bed needs {hosts}: "
                             "pass a larger one")
        if any(net.overlaps(u) for u in used):
            skipped.append(text)
            continue
        return net, skipped
    raise RuntimeError(f"every candidate subnet is in use on this machine ({', '.join(skipped) or 'none given'}): "
                       "pass free ones with subnets=")
