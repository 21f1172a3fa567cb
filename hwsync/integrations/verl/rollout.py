"""The rollout side of a verl weight update: hwsync receives on a thread, verl's adapter reads an async generator.

verl's CheckpointEngineWorker does `await server_adapter.update_weights(engine.receive_weights())`
on its actor's event loop, so receive_weights is an async generator of (name, tensor). hwsync's
CrossNodeReceiver blocks, so it runs on one thread of its own (every call on it, from
creating it to closing it, runs there), and each bucket's tensors cross to the event loop
through a Handoff: the thread posts the bucket and waits until the adapter has asked for the
item after the bucket's last one. verl's consumers copy each tensor before they advance (its
vLLM adapter packs them into its own buffer), so the yielded tensors are views of hwsync's
receive buffer, valid until the consumer advances past the bucket.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from hwsync.backend.registry import get_backend
from hwsync.disaggregated import CrossNodeReceiver
from hwsync.errors import SyncError, SyncTimeoutError
from hwsync.integrations.verl.topology import RolloutPlace, rollout_metadata
from hwsync.integrations.verl.trainer import END, Options
from hwsync.sync.spec import TensorSpec
from hwsync.sync.stats import SyncStats

log = logging.getLogger("hwsync")
Bucket = list[tuple[str, torch.Tensor]]


class Handoff:
    """Buckets from the receiving thread to the consumer on the event loop, one at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[Bucket | None] = asyncio.Queue()
        self._taken = threading.Event()
        self._closed = False

    # -- the receiving thread

    def put(self, bucket: Bucket) -> None:
        """Post a bucket and wait until the consumer is done with it; raises if it stopped reading."""
        self._taken.clear()
        self._post(bucket)
        if not self._taken.wait(self._timeout_s):
            raise SyncTimeoutError(f"verl's consumer of receive_weights (the rollout's server adapter) did not take a "
                              f"bucket within {self._timeout_s:.0f}s; it is stuck, or raise engine_kwargs.hwsync."
                              "timeout_s")
        if self._closed:
            raise SyncError("verl's consumer of receive_weights stopped reading before the step's last tensor "
                            "(the server adapter raised or was cancelled); see its error on this rollout worker")

    def end(self) -> None:
        """No more buckets (the step ended, or failed)."""
        self._post(None)

    def _post(self, item: Bucket | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is reading any more
            self._closed = True
            self._taken.set()

    # -- the event loop

    async def get(self) -> Bucket | None:
        """The next bucket, or None once the step has ended."""
        return await self._queue.get()

    def taken(self) -> None:
        """The consumer asked for the item after the bucket's last one: the thread may reuse the buffer."""
        self._taken.set()

    def close(self) -> None:
        """The consumer stopped: a waiting put() raises."""
        self._closed = True
        self._taken.set()


class RolloutSide:
    """One rollout worker's part: a CrossNodeReceiver kept across steps, driven from its own thread."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.place: RolloutPlace | None = None
        self._receiver: CrossNodeReceiver | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: tuple[Future, Handoff] | None = None

    @property
    def receiver(self) -> CrossNodeReceiver | None:
        """The hwsync receiver of the current topology, or None before init_process_group."""
        return self._receiver

    def metadata(self) -> dict[str, Any]:
        """prepare(): this worker's host."""
        return rollout_metadata(self.options.host)

    def _run(self, fn: Any, *args: Any) -> Any:
        """Run fn on the receiving thread and wait for it (fn's own waits are bounded; so is this one)."""
        if self._executor is None:
            device = get_backend().device()
            index = device.current_index()  # the thread receives into the device verl chose for this worker
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="hwsync-verl-receive",
                                                initializer=device.set_index, initargs=(index,))
        return self._executor.submit(fn, *args).result(timeout=2 * self.options.timeout_s)

    def join(self, place: RolloutPlace) -> None:
        """init_process_group(): keep the receiver (and its groups) when nothing changed, else start afresh."""
        self._settle()
        if place == self.place and self._receiver is not None:
            return

        def reopen() -> None:
            if self._receiver is not None:
                self._receiver.close()
            self._receiver = None
            self._receiver = CrossNodeReceiver(place.endpoint, rank=place.rank, num_buffers=self.options.num_buffers,
                                                timeout_s=self.options.timeout_s)

        self._run(reopen)
        self.place = place

    async def receive(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Every tensor of one step, as the trainer's sender 0 planned them; raises naming a failed rank."""
        if self._receiver is None:
            raise RuntimeError("receive_weights before init_process_group: verl's CheckpointEngineManager calls "
                               "prepare, build_topology and init_process_group first; drive the engine that way")
        self._settle()
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop, self.options.timeout_s)
        assert self._executor is not None
        future = self._executor.submit(self._receive_step, handoff)
        self._inflight = (future, handoff)
        finished = False
        try:
            while (bucket := await handoff.get()) is not None:
                for item in bucket:
                    yield item
                handoff.taken()
            finished = True
        finally:
            handoff.close()
            try:
                await asyncio.wrap_future(future)  # the step's outcome: an error names the failed rank
            except Exception as exc:
                if finished:
                    raise
                log.info("hwsync: the receive ended after its consumer stopped: %s", exc)
            finally:
                self._inflight = None

    def _receive_step(self, handoff: Handoff) -> list[SyncStats]:
        """On the receiving thread: one sync per window until the one that carries END."""
        receiver, device = self._receiver, get_backend().device()
        assert receiver is not None
        stats: list[SyncStats] = []
        try:
            while True:
                last = False

                class Window:  # a Loader: hands each bucket on; the manifest says whether the window is the last
                    @staticmethod
                    def accept(version: int, manifest: list[TensorSpec] | None) -> None:
                        nonlocal last
                        last = manifest is not None and len(manifest) > 0 and manifest[-1].name == END

                    @staticmethod
                    def load(tensors: Bucket) -> None:
                        bucket = [(name, t) for name, t in tensors if name != END]
                        if bucket:
                            handoff.put(bucket)
                            device.synchronize()  # the consumer's copies out of the buffer, before it is reused

                stats.append(receiver.receive(Window()))
                if last:
                    return stats
        finally:
            handoff.end()

    def _settle(self) -> None:
        """Wait for a receive left running by a step verl abandoned (its waits are bounded by the timeout)."""
        if self._inflight is None:
            return
        future, handoff = self._inflight
        handoff.close()  # nobody reads it any more: a waiting put() raises at once
        try:
            future.result(timeout=2 * self.options.timeout_s)
        except Exception as exc:  # noqa: BLE001 - that step already failed; this one starts clean
            log.info("hwsync: an abandoned receive ended with %s", exc)
        self._inflight = None

    def release_buffers(self) -> None:
        """finalize(): give the receive buffers back until the next step (the groups stay)."""
        if self._receiver is not None:
            self._run(self._receiver.release_buffers)

    def close(self) -> None:
        """Close the receiver and its thread; safe to call twice."""
        if self._executor is not None:
            if self._receiver is not None:
                self._run(self._receiver.close)
            self._executor.shutdown(wait=False)
        self._receiver, self._executor, self.place = None, None, None
