"""How far a cross-node sync's data got, for the errors that end a stuck or slow one.

An error that says only "nothing moved for 10 s" leaves the user guessing between a dead network
and a slow one. Sender 0's hub knows, from the receivers' Progress frames, which buckets every
receiver loaded; and, from this host's interface counters, how many bytes actually left while the
buckets were in flight. From those it says how many bytes moved at what rate, how long one bucket
takes at that rate, and what to raise: `timeout_s` bounds every wait for progress (and each
collective call), so it must exceed one bucket's broadcast.
"""

from __future__ import annotations

import time

from hwsync.control.nic import Nic, interface_bytes


def size(nbytes: float) -> str:
    """'12.3 MB' (decimal units, as rates are)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def rate(bytes_per_s: float) -> str:
    """'9.6 Mbit/s (1.2 MB/s)'."""
    bits = bytes_per_s * 8
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.1f} {unit} ({size(bytes_per_s)}/s)"
    return f"{bits:.0f} bit/s ({size(bytes_per_s)}/s)"


class SyncProgress:
    """The data phase of one sync on sender 0: bucket sizes in plan order, when it began, the interface's counters."""

    def __init__(self, bucket_bytes: list[int], num_receivers: int, timeout_s: float, nic: Nic | None) -> None:
        self.sizes = bucket_bytes
        self.num_receivers = num_receivers
        self.timeout_s = timeout_s
        self.nic = nic
        self.start = time.monotonic()
        self._sent0 = self._sent()

    def _sent(self) -> int | None:
        counters = interface_bytes(self.nic.name) if self.nic is not None else None
        return counters[1] if counters is not None else None

    def loaded_bytes(self, last_bucket: int | None) -> int:
        """Bytes of buckets 0..last_bucket (a receiver loads them in plan order)."""
        return 0 if last_bucket is None else sum(self.sizes[: last_bucket + 1])

    def describe(self, loaded: dict[str, int | None], advise: bool = True) -> str:
        """'in the 7.3 s since the data began, …: raise timeout_s above N s'; `loaded`: each receiver's last bucket.

        `advise=False`: the figures only (a rank that stopped answering is no question of rate).
        """
        elapsed = max(time.monotonic() - self.start, 1e-3)
        total, count = sum(self.sizes), len(self.sizes)
        done = {who: self.loaded_bytes(k) for who, k in loaded.items()}
        slowest = min(done, key=lambda who: done[who]) if done else None
        least = done[slowest] if slowest is not None else 0
        parts = [f"in the {elapsed:.1f} s since the data began, "]
        if slowest is None:
            parts.append(f"no receiver reported a bucket (of {count}, {size(total)})")
        else:
            k = loaded[slowest]
            speed = f", {rate(least / elapsed)}" if least else ""
            parts.append(f"the slowest receiver, {slowest}, had loaded {0 if k is None else k + 1} of {count} buckets "
                         f"({size(least)} of {size(total)}{speed})")
        sent0, sent = self._sent0, self._sent()
        wire = None
        if sent0 is not None and sent is not None and self.nic is not None:
            wire = (sent - sent0) / elapsed
            parts.append(f"; this host's {self.nic.name} sent {size(sent - sent0)} meanwhile ({rate(wire)})")
        # the rate one receiver's bytes arrive at: what it loaded, or the wire's share of it (a bucket under way)
        per_receiver = max(least / elapsed, (wire or 0.0) / max(self.num_receivers, 1))
        biggest = max(self.sizes, default=0)
        if not advise:
            pass
        elif per_receiver <= 0:
            parts.append(". Nothing moved at all: the network between the ranks is down or blocked (a firewall?)")
        else:
            bucket_s = biggest / per_receiver
            parts.append(f". At that rate one {size(biggest)} bucket takes about {bucket_s:.1f} s and timeout_s is "
                         f"{self.timeout_s:g} s")
            if bucket_s > self.timeout_s / 2:
                parts.append(f": a link this slow needs timeout_s above {max(2 * bucket_s, 1.0):.0f} s (it bounds each "
                             "bucket's broadcast), or a smaller bucket_bytes")
        return "".join(parts)
