"""Hand what a CrossNodeReceiver gets to the engine on the same node, through the same-node path.

On an engine node, one process (the engine's driver, or an agent beside it) receives the
sync over the collective group and forwards it, bucket by bucket, into a local sync: a
WeightSender that the engine's WeightReceiver (the vLLM worker extension) receives from, or
a whole `VllmWeightSync.sync`. The forwarding is zero-copy on this side: `load` yields the
receive buffer's views to the local sync and returns only once it has packed them, so the
views are never used after the collective receiver reuses its buffer.

    forward = LocalForwarder(lambda src, version, manifest: sender.send(src, version=version, manifest=manifest))
    receiver.receive(forward)            # a Loader: accept() starts the local sync, load() feeds it, done() ends it

The local sync runs on a thread of its own, on the device current in the thread that calls
`accept` (the receiver's), so the local sender's buffers land there.

A `StagedForwarder` forwards into a local sync that stages (the engine keeps serving what it
serves): its local sync returns once the engine staged and verified the version, which the
CrossNodeReceiver then reports; the engine applies it only when sender 0 commits it (every rank
staged it), and drops it if the sync fails anywhere first:

    forward = StagedForwarder(stage=lambda src, v, manifest: ...,   # stage v locally; raise if it failed
                              commit=..., abandon=...)               # apply it / drop it
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hwsync.backend.devices import start_on_this_device
from hwsync.backend.interfaces import Device
from hwsync.errors import SyncError, SyncTimeoutError
from hwsync.sync.spec import TensorSpec
from hwsync.timing import DEFAULT_TIMEOUT_S, FORWARD_SLICE_S

#: runs one local sync from (source, version, manifest), e.g. a WeightSender.send or VllmWeightSync.sync
LocalSync = Callable[[Iterator[tuple[str, torch.Tensor]], int, "list[TensorSpec] | None"], Any]

_END = object()


class LocalForwarder:
    """Feeds each received bucket into a local sync running on a thread, one sync per collective sync."""

    def __init__(self, run: LocalSync, *, timeout_s: float = DEFAULT_TIMEOUT_S, device: Device | None = None) -> None:
        self._run = run
        self.timeout_s = timeout_s
        #: whose current device the local sync's thread takes (the selected backend's when None)
        self.device = device
        self._items: queue.Queue = queue.Queue()
        self._taken = threading.Semaphore(0)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: what the last local sync returned (its SyncStats for a WeightSender)
        self.result: Any = None

    def accept(self, version: int, manifest: list[TensorSpec] | None) -> None:
        """Begin the local sync of `version` (a Loader's accept: the receiver calls it before any byte moves)."""
        if self._thread is not None:
            self.cancel()  # the previous collective sync broke midway
        self._items, self._taken, self._error, self.result = queue.Queue(), threading.Semaphore(0), None, None
        self._thread = start_on_this_device(lambda: self._main(version, manifest), "hwsync-forward", self.device)

    def _source(self) -> Iterator[tuple[str, torch.Tensor]]:
        while (item := self._items.get()) is not _END:
            yield item
            self._taken.release()  # asked for the next one: the local sync has packed this one

    def _main(self, version: int, manifest: list[TensorSpec] | None) -> None:
        try:
            self.result = self._run(self._source(), version, manifest)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the receiver's thread
            self._error = exc
            self._taken.release()  # wake a load() waiting for it

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """The receiver's load callback: returns once the local sync has packed every tensor."""
        if self._thread is None:
            raise SyncError("LocalForwarder.load before accept(); pass the forwarder itself to receive()")
        for item in tensors:
            self._items.put(item)
            deadline = time.monotonic() + self.timeout_s
            while not self._taken.acquire(timeout=FORWARD_SLICE_S):
                if time.monotonic() > deadline:
                    raise SyncTimeoutError(f"the local sync did not take {item[0]!r} within {self.timeout_s:.1f}s; is "
                                      "the engine receiving? (check its log, or raise timeout_s)")
            if self._error is not None:
                raise SyncError(f"the local sync failed: {type(self._error).__name__}: {self._error}") from self._error

    def cancel(self) -> None:
        """End a local sync that the collective sync abandoned (it fails there as incomplete)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._items.put(_END)
            thread.join(self.timeout_s)

    def done(self) -> None:
        """End the local sync and wait for it (a Loader's done: the receiver calls it after the last tensor); raises
        what it raised."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._items.put(_END)
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise SyncTimeoutError(f"the local sync did not finish within {self.timeout_s:.1f}s after the last tensor")
        if self._error is not None:
            raise SyncError(f"the local sync failed: {type(self._error).__name__}: {self._error}") from self._error


class StagedForwarder(LocalForwarder):
    """A LocalForwarder into a local sync that stages: the engine applies the version only once every rank of the
    collective sync staged it (`commit`), and drops it if the sync fails before that (`abandon`)."""

    def __init__(self, stage: LocalSync, *, commit: Callable[[], Any], abandon: Callable[[], Any],
                 timeout_s: float = DEFAULT_TIMEOUT_S, device: Device | None = None) -> None:
        """`stage(source, version, manifest)` stages the version on the engine and returns once it is staged and
        verified (raising if it failed there); `commit()` applies it, `abandon()` drops it."""
        super().__init__(stage, timeout_s=timeout_s, device=device)
        self._commit, self._abandon = commit, abandon

    def commit(self) -> None:
        """Every rank staged the version: apply it on the engine (what `commit` returns, if anything, becomes
        `self.result`)."""
        applied = self._commit()
        if applied is not None:
            self.result = applied

    def abandon(self) -> None:
        """The sync failed before its commit: end the local stage if it still runs, and drop what it staged."""
        self.cancel()
        self._abandon()
