"""Staged syncs into a vLLM worker: receive while the engine generates, apply inside its pause.

`hwsync_stage` (an RPC, returns at once) starts a thread on the worker that receives the next version into the
receiver's staging area (WeightReceiver(stage=True)): the engine keeps generating, since no RPC holds its busy
loop. The trainer's sender sends Apply once every worker staged; the thread then waits at the loader's `pause()`
until the worker's main thread is in `hwsync_apply`, which the trainer side calls once it paused generation
(vLLM's `pause_generation`): inside it no forward pass runs, and the thread hands the staged tensors to the
model's loader (loading.py's layerwise reload). `hwsync_apply` returns when the thread has, with its stats or its
error. A sync that fails before the Apply ends the thread with nothing applied; `hwsync_apply` (which the trainer
side calls then too, without pausing) reports why.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hwsync.backend.devices import start_on_this_device
from hwsync.errors import ClosedError, HwsyncError, SyncTimeoutError


class StagedReceive:
    """One staged sync on a worker: the receiving thread, and the gate its apply waits at."""

    def __init__(self, receive: Callable[[Callable[[], Any]], dict[str, Any]], wait_s: float) -> None:
        """`receive(pause)` runs the sync, applying inside `pause()`; `wait_s`: how long the apply may wait for the
        engine's pause."""
        self._wait_s = wait_s
        self._paused = threading.Event()
        self._closing = False
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None
        self._thread = start_on_this_device(lambda: self._run(receive), "hwsync-stage")

    def _run(self, receive: Callable[[Callable[[], Any]], dict[str, Any]]) -> None:
        try:
            self._result = receive(self._pause)
        except BaseException as exc:  # noqa: BLE001 - handed to hwsync_apply, which raises it on the RPC's thread
            self._error = exc

    @contextmanager
    def _pause(self) -> Iterator[None]:
        """Wait until the worker's main thread is in hwsync_apply (the engine paused), then apply."""
        if not self._paused.wait(self._wait_s):
            raise SyncTimeoutError(f"the sync was committed, but the engine did not pause within {self._wait_s:.0f}s "
                                   "to apply it (hwsync_apply was never called); nothing was applied")
        if self._closing:
            raise ClosedError("the worker closed its hwsync receiver before the engine paused; nothing was applied")
        yield

    @property
    def running(self) -> bool:
        """Whether the thread is still receiving, staging or applying."""
        return self._thread.is_alive()

    def apply(self, timeout_s: float) -> dict[str, Any]:
        """On the worker's main thread, with the engine paused: let the staged sync apply and wait for it; its
        stats, or its error raised here."""
        self._paused.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise SyncTimeoutError(f"the staged sync did not end within {timeout_s:.0f}s of the engine's pause")
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        assert self._result is not None
        return self._result

    def release(self) -> None:
        """End a thread waiting for the pause without applying (the worker is closing its receiver)."""
        self._closing = True
        self._paused.set()


def no_staged_sync() -> HwsyncError:
    """What hwsync_apply raises when hwsync_stage was never called."""
    return HwsyncError("hwsync_apply without a staged sync: call hwsync_stage first (AsyncVllmWeightSync does)")
