"""Host memory for a sender's delta payloads, kept from one sync to the next.

A payload lives from its encode until the baseline has taken its changes (after the sync committed), and
the next sync starts only after that (SenderDeltas.prepare), so each sync can write its payloads into the
memory the last one used. Fresh memory costs a page fault per 4 KiB at its first write: the first delta
after a full sync faulted in all of its payloads. The room keeps the slabs the last sync used, and after a
full sync makes RESERVE_SHARE of the baseline's bytes ready ahead of the first delta, on the baseline's
thread while the trainer goes on.
"""

from __future__ import annotations

import threading

import torch

#: bytes per slab of the room: payloads are carved from slabs, one larger than a slab gets its own
SLAB_BYTES = 16 << 20
#: the room made ready after a full sync, as a share of the baseline's bytes: an RL step changes 1-4% of a
#: bf16 model's elements, and a step code's payload is about 2 bytes per change
RESERVE_SHARE = 0.04
#: payloads start at multiples of this (a cache line)
ALIGN = 64
#: the first slab's bytes; each new one doubles what the room holds, up to a slab (a small model keeps little)
FIRST_SLAB = 64 << 10
#: a reserve below this is not made: its page faults cost next to nothing
MIN_RESERVE = 1 << 20


class PayloadRoom:
    """Slabs of host memory that one sync's payloads are carved from; `reset` gives them to the next sync."""

    def __init__(self, slab_bytes: int = SLAB_BYTES) -> None:
        self.slab_bytes = slab_bytes
        self._slabs: list[torch.Tensor] = []
        self._slab = 0  # the slab being carved
        self._at = 0  # bytes of it taken
        self._took = False  # whether this sync took any
        self._lock = threading.Lock()  # the encode threads take side by side

    @property
    def held_bytes(self) -> int:
        """Host memory the room keeps."""
        return sum(s.numel() for s in self._slabs)

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of uint8, not cleared, valid until the next `reset`."""
        with self._lock:
            self._took = True
            while self._slab < len(self._slabs):
                slab, at = self._slabs[self._slab], self._at
                if at + nbytes <= slab.numel():
                    self._at = (at + nbytes + ALIGN - 1) // ALIGN * ALIGN
                    return slab[at: at + nbytes]
                self._slab, self._at = self._slab + 1, 0
            slab = torch.empty(max(nbytes, min(self.slab_bytes, max(FIRST_SLAB, self.held_bytes))), dtype=torch.uint8)
            self._slabs.append(slab)
            self._slab, self._at = len(self._slabs) - 1, (nbytes + ALIGN - 1) // ALIGN * ALIGN
            return slab[:nbytes]

    def reset(self) -> None:
        """Start the next sync: what the last one took is free again; slabs it did not reach are let go (all are
        kept after a sync that took none: a full sync's reserve waits for the first delta)."""
        with self._lock:
            if self._took:
                del self._slabs[self._slab + 1:]
            self._slab = self._at = 0
            self._took = False

    def reserve(self, nbytes: int) -> None:
        """Have at least `nbytes` in slabs, their pages written once (faulted in here, not in the next sync); none
        made below MIN_RESERVE."""
        if nbytes < MIN_RESERVE:
            return
        with self._lock:
            while self.held_bytes < nbytes:
                slab = torch.empty(max(FIRST_SLAB, min(self.slab_bytes, nbytes - self.held_bytes)), dtype=torch.uint8)
                slab.numpy().fill(0)  # numpy: on this thread, not an OpenMP team's
                self._slabs.append(slab)

    def clear(self) -> None:
        """Let every slab go."""
        with self._lock:
            self._slabs, self._slab, self._at, self._took = [], 0, 0, False
