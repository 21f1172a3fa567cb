"""simccl: the sim's collective library, NCCL's behaviour over gloo.

hwsync's ProcessGroupCommunicator drives it exactly as it drives ProcessGroupNCCL (the factory
returns an object with the same methods), so what NCCL does to hwsync, simccl does too:
- a group is bound to the device current when it is made, and refuses two ranks on one device
  (NCCL: "Duplicate GPU detected");
- a collective is queued on the group's own stream after the work already queued on the
  device's current stream, and the call returns at once; `Work.wait()` only makes the current
  stream wait for it, the host does not: a barrier made of all_reduce().wait() is no host barrier.
  So collectives of different groups are ordered through the device's stream: ranks that issue
  them in different orders (threads racing) wait for each other forever, as on NCCL;
- the bytes move with gloo, on host views of the device tensors, when the stream gets to them;
- when a peer dies, gloo fails, but an NCCL kernel just keeps waiting: so does simccl, until the
  group is aborted or its timeout passes (NCCL's watchdog). Device synchronization waits for
  it meanwhile, and `shutdown()` waits for all outstanding work (ncclCommFinalize): tearing down
  a group whose peer died hangs unless it is aborted first. A failed collective is not a device
  error: it ends the waits on it, and its Work keeps the exception.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from hwsync_sim.runtime import TYPE, SimError, runtime
from hwsync_sim.streams import SimEvent
from hwsync_sim.tensor import as_sim, host_view, is_sim

# NCCL's reducible dtypes (ncclInt8/Uint8/Int32/Int64/Float16/Bfloat16/Float32/Float64)
SIMCCL_REDUCE_DTYPES = frozenset(
    {torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64}
)
_DEVICE_KEY = "simccl/device/{rank}"
_CHECKED_KEY = "simccl/devices-checked"


class SimcclError(SimError):
    """A simccl collective failed (after hanging as NCCL would) or the group was misused."""


class SimWork:
    """What a collective returns: wait() orders the current stream after it; the host goes on."""

    def __init__(self, done: SimEvent) -> None:
        self._done = done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Make the calling thread's current stream wait for the collective (not the host)."""
        done = self._done
        runtime().stream(runtime().current()).enqueue(lambda: done.synchronize(), sticky=False)
        return True

    def is_completed(self) -> bool:
        """Whether the collective has finished on its stream."""
        return self._done.query()

    def exception(self) -> BaseException | None:
        """Why the collective failed (aborted, or timed out after a peer failed), once it has ended."""
        return self._done.error


class SimProcessGroup:
    """One simccl group: gloo underneath, NCCL's timing and failure behaviour on top."""

    _live: "weakref.WeakSet[SimProcessGroup]" = weakref.WeakSet()

    @classmethod
    def live(cls) -> list["SimProcessGroup"]:
        """This process's groups not yet shut down or aborted (tests abort stuck ones with it)."""
        return list(cls._live)

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        rt = runtime()
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout.total_seconds()
        self.index = rt.current()
        _refuse_shared_device(store, rank, world_size, f"{rt.host}:{rt.physical(self.index)}")
        self._gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._stream = rt.new_stream(self.index, f"simccl-{rank}")
        self._aborted = threading.Event()
        self._last: SimEvent | None = None
        SimProcessGroup._live.add(self)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        """Queue a broadcast of tensors[0] from opts.rootRank."""
        opts = opts or dist.BroadcastOptions()
        return self._launch("broadcast", tensors, lambda hosts: self._gloo.broadcast(hosts, opts))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> SimWork:
        """Queue an all-gather of inputs[0] into outputs[0] (a list, one per rank)."""
        flat, n = list(outputs[0]) + list(inputs), len(outputs[0])
        return self._launch("allgather", flat, lambda hosts: self._gloo.allgather([hosts[:n]], hosts[n:]))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SimWork:
        """Queue an all-reduce of tensors[0] in place (opts.reduceOp, sum by default)."""
        opts = opts or dist.AllreduceOptions()
        return self._launch("allreduce", tensors, lambda hosts: self._gloo.allreduce(hosts, opts))

    def _launch(self, what: str, tensors: list[torch.Tensor], start: Any) -> SimWork:
        rt = runtime()
        if self._aborted.is_set():
            raise SimcclError(f"simccl {what} on a group that was aborted; build a new group")
        sims = []
        for t in tensors:
            if not is_sim(t) or t.device.index != self.index:
                raise SimcclError(f"simccl {what}: tensor on {t.device}, but this group (rank {self.rank}) was made "
                                  f"on {TYPE}:{self.index}, the device current when it was built")
            sims.append(as_sim(t))
        rt.require_current(self.index, f"simccl {what}")
        ready = rt.stream(self.index).record()  # the collective runs after work already queued

        def collective() -> None:
            while not ready.synchronize(timeout=0.01):
                if self._aborted.is_set():
                    raise SimcclError(f"simccl {what} aborted before it started")
            try:
                work = start([host_view(t) for t in sims])
                while not work.is_completed():  # an abort ends the wait, as ncclCommAbort ends a kernel
                    if self._aborted.wait(0.001):
                        raise SimcclError(f"simccl {what} aborted while it waited for its peers")
                work.wait()
            except SimcclError:
                raise
            except Exception as exc:  # a dead or lost peer: NCCL would spin, not fail
                self._hang(what, exc)

        # a failed collective is no device error (NCCL reports it through its work and watchdog)
        self._last = self._stream.enqueue(collective, sticky=False)
        return SimWork(self._last)

    def _hang(self, what: str, cause: Exception) -> None:
        if self._aborted.wait(self.timeout_s):
            raise SimcclError(f"simccl {what} aborted (its peer had failed: {cause})") from cause
        raise SimcclError(f"simccl {what} timed out after {self.timeout_s:.0f}s, like NCCL's watchdog (a peer "
                          f"failed: {cause})") from cause

    def shutdown(self) -> None:
        """Wait for every outstanding collective, then close (ncclCommFinalize): hangs on a dead peer."""
        if self._last is not None:
            self._last.synchronize()
        self._close(pending=False)

    def abort(self) -> None:
        """End the group at once: an outstanding collective fails instead of waiting for its peer."""
        self._aborted.set()
        self._close(pending=True)

    def _close(self, pending: bool) -> None:
        SimProcessGroup._live.discard(self)
        runtime().drop_stream(self.index, self._stream)
        held = [self._gloo]
        self._gloo = None  # type: ignore[assignment]
        if not pending:
            held.clear()  # nothing outstanding: gloo closes at once
            return
        # gloo's destructor waits for its pending work (up to its timeout): let a daemon thread wait,
        # and let the process's exit wait for it (a C++ thread torn down mid-destructor aborts the process)
        closer = threading.Thread(target=held.clear, name="simccl-close", daemon=True)
        closer.start()
        _closers.append(closer)


_closers: list[threading.Thread] = []


@atexit.register
def _join_closers() -> None:
    for closer in _closers:
        closer.join(30)


def _refuse_shared_device(store: dist.Store, rank: int, world_size: int, device: str) -> None:
    # What NCCL does at communicator init, with its reason: every rank publishes its device.
    store.set(_DEVICE_KEY.format(rank=rank), device)
    owners: dict[str, list[int]] = {}
    for peer in range(world_size):
        owners.setdefault(store.get(_DEVICE_KEY.format(rank=peer)).decode(), []).append(peer)
    shared = {d: ranks for d, ranks in owners.items() if len(ranks) > 1}
    store.add(_CHECKED_KEY, 1)
    if shared and rank == 0:  # rank 0 hosts the store: it must outlive the others' reads
        deadline = time.monotonic() + 10
        while store.add(_CHECKED_KEY, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.01)
    if shared:
        listing = "; ".join(f"ranks {ranks} on host:device {d}" for d, ranks in sorted(shared.items()))
        raise SimcclError(f"simccl: Duplicate device detected ({listing}): like NCCL, one device per rank. Make "
                          f"each rank's device current before building the group ({TYPE} device = Device.set_index)")


def make_simccl_group(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> SimProcessGroup:
    """A simccl group on the current sim device (the factory ProcessGroupCommunicator calls)."""
    return SimProcessGroup(store, rank, world_size, timeout)
