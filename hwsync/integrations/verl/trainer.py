"""The trainer side of a verl weight update: walk verl's generator once, send it with hwsync, report figures.

verl hands `send_weights` a generator of (name, tensor) that every trainer rank must walk to
its end: with FSDP each item is a DTensor's `full_tensor()`, a collective over the trainer's
ranks. So every rank walks it, even ranks that send nothing, and a rank whose send failed
keeps walking it to the end before raising; otherwise the others would hang in the gather.

hwsync's disaggregated sender plans the buckets from a manifest before the first byte moves,
and verl's generator announces none. The first step therefore sends the weights in windows
(each a list whose manifest is read from its tensors, at most `window_bytes` held at once) and
keeps the manifest it saw; later steps send the whole generator as one sync against it. Any
failure forgets it, on every rank alike (a failure reaches every rank), so the ranks always
agree on the mode. The last sync of a step carries an empty tensor named END, which tells
the receivers the step is complete.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hwsync.backend.registry import get_backend
from hwsync.disaggregated import CrossNodeSender
from hwsync.errors import SourceError
from hwsync.integrations.verl.topology import TrainerPlace, fresh_endpoint, trainer_metadata
from hwsync.sizes import MiB
from hwsync.sync.options import CrossNodeOptions
from hwsync.sync.spec import TensorSpec, named_tensor
from hwsync.sync.stats import SyncStats

log = logging.getLogger("hwsync")

#: name of the empty tensor that ends a step's last sync (reserved: a source may not use it)
END = "hwsync.verl:end-of-step"
#: prefix of the metrics send_weights returns, next to verl's own checkpoint_engine/* figures
PREFIX = "checkpoint_engine/hwsync_"


@dataclass(frozen=True)
class Options:
    """The engine's settings (verl's `engine_kwargs.hwsync`, plus verl's bucket_size)."""

    bucket_size: int  # verl's update_weights_bucket_megabytes, in bytes
    timeout_s: float
    bucket_megabytes: float | None
    max_senders: int
    num_buffers: int
    host: str
    #: send only what changed since what every rollout worker holds (hwsync's delta syncs)
    delta: bool = False

    def bucket_bytes(self, num_senders: int) -> int:
        """hwsync's bucket: the one set, else at most 64 MiB with S x buffers x bucket within verl's bucket_size."""
        if self.bucket_megabytes:
            return int(self.bucket_megabytes * MiB)
        return max(MiB, min(64 * MiB, self.bucket_size // (num_senders * self.num_buffers)))

    def window_bytes(self, num_senders: int) -> int:
        """Most bytes of tensors the first step holds at once (verl's own bucket_size, or the buffers' span)."""
        return max(self.bucket_size, num_senders * self.num_buffers * self.bucket_bytes(num_senders))


class Walk:
    """verl's (name, tensor) iterable, walked once: counts items, times the producer, can walk the rest."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not hasattr(weights, "__iter__"):
            raise TypeError(f"send_weights needs a (name, tensor) iterable such as verl's get_per_tensor_param() "
                            f"generator, got {type(weights).__name__}; an async iterable cannot be walked here")
        self._items = iter(weights)
        self.count = 0
        self.source_s = 0.0  # time inside verl's generator: its gathers and per-tensor onloads

    def __iter__(self) -> Walk:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        t0 = time.perf_counter()
        try:
            item = next(self._items)
        finally:
            self.source_s += time.perf_counter() - t0
        name, tensor = named_tensor(self.count, item, "verl's weights")
        if name == END:
            raise SourceError(f"item #{self.count} of verl's weights is named {END!r}, which hwsync reserves to "
                              "end a step; rename that tensor")
        self.count += 1
        return name, tensor

    def drain(self) -> int:
        """Walk the remaining items, dropping them; returns how many there were."""
        left = 0
        for _ in self._items:
            left += 1
        self.count += left
        return left


def windows(walk: Walk, window_bytes: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Consecutive runs of the items, each at most window_bytes (a larger tensor alone), with a last flag."""
    window: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in walk:
        nbytes = tensor.numel() * tensor.element_size()
        if window and size + nbytes > window_bytes:
            yield window, False
            window, size = [], 0
        window.append((name, tensor))
        size += nbytes
    yield window, True


def end_marker() -> tuple[str, torch.Tensor]:
    """The empty tensor that ends a step, on the device the sender packs from."""
    return END, torch.empty(0, dtype=torch.uint8, device=get_backend().device().torch_device())


class TrainerSide:
    """One trainer rank's part: a CrossNodeSender kept across steps while the topology stays the same."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.place: TrainerPlace | None = None
        self.sender: CrossNodeSender | None = None
        self.manifest: list[TensorSpec] | None = None
        #: the fresh endpoint rank 0 last announced, and its CURVE secret key (never leaves this process)
        self._fresh: tuple[str, str] | None = None

    def metadata(self, is_master: bool) -> dict[str, Any]:
        """prepare(): this rank's host; rank 0 adds its current hub and a fresh endpoint for a new one."""
        master: dict[str, Any] | None = None
        if is_master:
            self._fresh = fresh_endpoint(self.options.host)
            master = {"fresh": self._fresh[0]}
            if self.sender is not None and self.place is not None and self.place.rank == 0:
                master |= {"endpoint": self.sender.endpoint,
                           "counts": [self.place.num_senders, self.place.num_receivers]}
        return trainer_metadata(self.options.host, self.options.max_senders, master)

    def join(self, place: TrainerPlace) -> None:
        """init_process_group(): keep the sender (and its groups) when nothing changed, else start afresh."""
        if place == self.place:
            return
        self.close()
        if place.rank >= 0:
            # stable_sources: a delta's encodes read tensors after verl's generator moved on; some of its generators
            # yield memory they change then (a merged LoRA's weights are unmerged when the generator ends), so with
            # deltas each tensor is copied as it is taken (a full sync copies each into the buckets at once anyway)
            try:
                self.sender = CrossNodeSender(
                    place.endpoint, rank=place.rank, num_senders=place.num_senders, num_receivers=place.num_receivers,
                    group_host=self.options.host,
                    options=CrossNodeOptions(bucket_bytes=self.options.bucket_bytes(place.num_senders),
                                             num_buffers=self.options.num_buffers, timeout_s=self.options.timeout_s,
                                             secret_key=self._secret_for(place), delta=self.options.delta,
                                             stable_sources=not self.options.delta))
            except Exception as exc:
                raise RuntimeError(f"trainer sender {place.rank} could not open hwsync's control endpoint "
                                   f"{place.endpoint.split('#')[0]}: {exc}. If the port was taken meanwhile, the "
                                   "next update picks another; set engine_kwargs.hwsync.host if the address is "
                                   "not this node's") from exc
        self.place = place

    def _secret_for(self, place: TrainerPlace) -> str | None:
        """Sender 0 binds the endpoint it announced in prepare() with that endpoint's secret key."""
        if place.rank == 0 and self._fresh is not None and self._fresh[0] == place.endpoint:
            return self._fresh[1]
        return None

    def send(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[list[SyncStats], Walk]:
        """Send one step's weights; on failure walk the generator to its end on this rank, then raise."""
        walk = Walk(weights)
        if self.sender is None:
            walk.drain()  # rank -1: the gathers are collective, so walk with the senders
            if self.place is None:
                raise RuntimeError("send_weights before init_process_group: verl's CheckpointEngineManager calls "
                                   "prepare, build_topology and init_process_group first; drive the engine that way")
            return [], walk
        try:
            stats = self._send(walk, version)
        except Exception:
            self.manifest = None  # every rank fails this step, so every rank learns the manifest again
            try:
                left = walk.drain()
                log.warning("hwsync: sender %d walked the %d remaining tensors after the failure so the other "
                            "trainer ranks' gathers complete", self.sender.rank, left)
            except Exception as exc:  # noqa: BLE001 - the send's own error is the one to raise
                log.warning("hwsync: walking verl's weights after the failure raised too: %s", exc)
            raise
        return stats, walk

    def _send(self, walk: Walk, version: int) -> list[SyncStats]:
        sender = self.sender
        assert sender is not None and self.place is not None
        if self.manifest is not None:  # a step after the first: one sync against the manifest seen before
            marker = end_marker()
            manifest = self.manifest + [TensorSpec.of(*marker)] if self.place.rank == 0 else None
            return [sender.send(itertools.chain(walk, [marker]), version=version, manifest=manifest)]
        specs: list[TensorSpec] = []
        stats: list[SyncStats] = []
        for window, last in windows(walk, self.options.window_bytes(self.place.num_senders)):
            specs += [TensorSpec.of(name, tensor) for name, tensor in window]
            stats.append(sender.send(window + ([end_marker()] if last else []), version=version))
            del window  # let the window's gathered tensors go before the next ones are produced
        self.manifest = specs
        return stats

    def release_buffers(self) -> None:
        """finalize(): give the bucket buffers back until the next step (the groups stay)."""
        if self.sender is not None:
            self.sender.release_buffers()

    def close(self) -> None:
        """Close the sender (its hub, groups and buffers); safe to call twice."""
        if self.sender is not None:
            self.sender.close()
        self.sender, self.place, self.manifest = None, None, None


def metrics(stats: list[SyncStats], walk: Walk, sender: CrossNodeSender, place: TrainerPlace) -> dict[str, float]:
    """One step's figures for verl's logger: hwsync's SyncStats summed over the step's syncs, as floats."""
    out = {PREFIX + key: float(sum(getattr(s, key) for s in stats))
           for key in ("total_s", "plan_s", "onload_s", "pack_s", "wait_s", "load_s", "offload_s", "bytes", "buckets")}
    total = out[PREFIX + "total_s"]
    out |= {PREFIX + "gbps": out[PREFIX + "bytes"] / total / 1e9 if total > 0 else 0.0,
            PREFIX + "tensors": float(walk.count), PREFIX + "source_s": walk.source_s,
            PREFIX + "syncs": float(len(stats)), PREFIX + "bucket_bytes": float(stats[-1].bucket_bytes if stats else 0),
            PREFIX + "num_senders": float(place.num_senders), PREFIX + "num_receivers": float(place.num_receivers),
            PREFIX + "group_epoch": float(sender.group_epoch or 0),
            PREFIX + "delta_syncs": float(sum(1 for s in stats if s.delta is not None and s.delta.mode == "delta"))}
    return out
