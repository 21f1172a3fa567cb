"""A Communicator written once over torch.distributed process groups.

Each backend supplies only how to build its library's ProcessGroup (gloo, NCCL, HCCL), the
device its tensors must sit on, and which dtypes its reductions accept. The group is built
from its own TCPStore, so it is independent of any world the trainer or the engine already
initialised: trainer and engine processes that share no world can still form one.

Two NCCL/HCCL facts shape it: `Work.wait()` only makes the device stream wait, so the barrier
is a host barrier through the group's store; and `shutdown()` waits for outstanding
collectives, which never end once a peer died, so a group with a failed or unfinished
collective is aborted instead.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from hwsync.backend.interfaces import Backend, Communicator
from hwsync.control.nic import Nic
from hwsync.errors import HwsyncError
from hwsync.timing import FAILED_JOIN_S, GROUP_TIMEOUT_S, WORKER_JOIN_S

log = logging.getLogger("hwsync")

#: builds a ProcessGroup from (store, rank, world_size, timeout)
GroupFactory = Callable[[dist.Store, int, int, datetime.timedelta], Any]

_REDUCE_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def parse_rendezvous(init_method: str) -> tuple[str, int]:
    """Split tcp://host:port into (host, port), with an error naming the expected form."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"rendezvous address {init_method!r} must look like tcp://HOST:PORT")
    return url.hostname, url.port


class ProcessGroupCommunicator(Communicator):
    """Collectives over a standalone torch.distributed ProcessGroup."""

    def __init__(
        self,
        library: str,
        make_group: GroupFactory,
        init_method: str,
        rank: int,
        world_size: int,
        device: torch.device,
        reduce_dtypes: frozenset[torch.dtype],
        timeout_s: float = GROUP_TIMEOUT_S,
        *,
        interface_note: str = "",
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        host, port = parse_rendezvous(init_method)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.library = library
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.reduce_dtypes = reduce_dtypes
        #: how the group's interface was chosen (the backend's words), for the one log line per group build
        self.interface_note = interface_note
        # Rank 0 hosts the store; the prefix keeps several groups on one store apart.
        self._store: Any = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout)
        self._group: Any = make_group(dist.PrefixStore(f"hwsync/{library}", self._store), rank, world_size, timeout)
        self._last_work: Any = None  # the latest collective: destroy() aborts while it is unfinished
        self._failed = False
        self._barriers = 0
        # a collective thread may launch while another tears the group down: under this lock destroy() sees every
        # launch that got in, and none gets in after it (a launch it missed would outlive a group it shut down,
        # and on NCCL hold the device's stream until the group's timeout)
        self._lock = threading.Lock()

    def _run(self, what: str, launch: Callable[[Any], Any]) -> None:
        """Launch a collective on the group (`launch(group)` returns its Work) and wait for it."""
        with self._lock:
            if self._group is None:
                raise HwsyncError(f"{self.library} {what} on a group that was destroyed; build a new group")
            work = self._last_work = launch(self._group)
        try:
            work.wait()
        except Exception:
            self._failed = True
            raise

    def _bytes(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_contiguous():
            raise ValueError("communicator tensors must be contiguous; call .contiguous() first")
        if tensor.device != self.device and tensor.device.type != self.device.type:
            raise ValueError(f"{self.library} needs tensors on {self.device}, got one on {tensor.device}")
        return tensor.reshape(-1).view(torch.uint8)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast `tensor` in place from rank `src`, as raw bytes."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        flat = self._bytes(tensor)
        self._run("broadcast", lambda group: group.broadcast([flat], opts))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather an equally shaped tensor from every rank, in rank order."""
        flat = self._bytes(tensor)
        out = [torch.empty_like(flat) for _ in range(self.world_size)]
        self._run("all_gather", lambda group: group.allgather([out], [flat]))
        return [o.view(tensor.dtype).view(tensor.shape) for o in out]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduce in place; the dtype must be one the library reduces."""
        if op not in _REDUCE_OPS:
            raise ValueError(f"all_reduce op {op!r} is not one of {sorted(_REDUCE_OPS)}")
        if tensor.dtype not in self.reduce_dtypes:
            names = ", ".join(sorted(str(d).removeprefix("torch.") for d in self.reduce_dtypes))
            raise HwsyncError(
                f"{self.library} cannot reduce {tensor.dtype}; it reduces {names}. "
                "Cast the tensor to one of those first."
            )
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]
        self._run("all_reduce", lambda group: group.allreduce([tensor], opts))

    def barrier(self) -> None:
        """Block the calling thread until every rank has called barrier (a host barrier, through the store)."""
        self._barriers += 1
        key = f"hwsync/barrier/{self._barriers}"
        if self._store.add(key, 1) == self.world_size:
            self._store.set(f"{key}/all", "1")
        self._store.wait([f"{key}/all"])  # raises after the group's timeout

    def destroy(self) -> None:
        """Tear the group down: shut it down, or abort it if a collective failed or has not finished.

        Waits at most WORKER_JOIN_S (FAILED_JOIN_S for a failed or unfinished group): the release happens
        on a thread that holds the group's only reference.
        """
        with self._lock:
            group, self._group = self._group, None
            last = self._last_work
        if group is not None:
            unfinished = self._failed or (last is not None and not _finished(last))
            # gloo's group, once released, waits for an operation stuck on a dead peer until the group's own
            # timeout; the caller is tearing a failed group down and must not wait that long
            box = [group]
            del group
            done = threading.Thread(target=_release, args=(box, unfinished), name=f"hwsync-{self.library}-release",
                                    daemon=True)
            done.start()
            # an unfinished operation keeps an aborted group until the group's timeout, whatever we wait
            done.join(FAILED_JOIN_S if unfinished else WORKER_JOIN_S)
            if done.is_alive():
                log.warning("hwsync: a %s group is still being released behind an operation on a dead peer; it ends "
                            "at the group's timeout", self.library)
        self._last_work = None
        self._store = None


def _release(box: list, unfinished: bool) -> None:
    """End and drop the group in `box` (its only reference): abort it if unfinished, else shut it down."""
    group = box.pop()
    end = getattr(group, "abort" if unfinished else "shutdown", None)
    if end is None and unfinished:  # a library without abort: shutdown is all there is
        end = getattr(group, "shutdown", None)
    try:
        if end is not None:
            end()
    except RuntimeError:
        pass
    del group


def _finished(work: Any) -> bool:
    """Whether a collective's Work has completed (an unanswerable one counts as unfinished)."""
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a broken work object: treat the group as failed
        return False


# --- the group's network interface ---------------------------------------------------------------

_env_lock = threading.Lock()  # groups are built on worker threads: one check-and-set at a time
#: the interface variables hwsync set in this process, and their values
_set_here: dict[str, str] = {}


def claim_interface_env(library: str, values: dict[str, str], nic: Nic, reads: str) -> str:
    """Set `values` (a library's interface variables, for `nic`) in this process unless the user set any.

    `reads`: when the library reads them (they are process-wide: a library that reads them once keeps
    the first). Returns the note for the group's log line; a kept value that differs is logged as a warning.
    """
    with _env_lock:
        theirs = {k: os.environ[k] for k in values if k in os.environ and _set_here.get(k) != os.environ[k]}
        if theirs:
            shown = ", ".join(f"{k}={v}" for k, v in theirs.items())
            if any(values.get(k) != v for k, v in theirs.items()):
                log.warning("hwsync: %s (set by the user) is kept for a %s group, though the route to its peers goes "
                            "through %s; unset it to let hwsync choose", shown, library, nic)
            return f"{shown} set by the user, kept"
        mine = {k: _set_here[k] for k in values if k in _set_here}
        if mine:
            shown = ", ".join(f"{k}={v}" for k, v in mine.items())
            if mine != values:
                log.warning("hwsync: %s was set by hwsync for an earlier group and %s reads it %s: this group (%s) "
                            "keeps it; set the variable yourself to choose", shown, library, reads, nic)
            return f"{shown} (set by hwsync for an earlier group)"
        for k, v in values.items():
            os.environ[k] = v
            _set_here[k] = v
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        log.info("hwsync: set %s in this process for %s, which reads it %s; set it yourself to choose another "
                 "interface", shown, library, reads)
        return f"set {shown} for this process"


def _takes_nic(backend: Backend) -> bool:
    try:
        params = inspect.signature(backend.communicator).parameters
    except (TypeError, ValueError):
        return False
    return "nic" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def open_communicator(backend: Backend, init_method: str, rank: int, world_size: int, timeout_s: float,
                      nic: Nic | None) -> tuple[Communicator, str]:
    """`backend.communicator(...)` on interface `nic` where the backend takes `nic=`; (it, how the interface was
    chosen). A backend without `nic=` leaves the choice to its library (its own variables, or its guess)."""
    if nic is not None and _takes_nic(backend):
        # Backend.communicator's declared signature has no nic= yet: the backends that take it say so themselves
        comm = cast(Any, backend).communicator(init_method, rank, world_size, timeout_s, nic=nic)
        return comm, getattr(comm, "interface_note", "") or "bound"
    comm = backend.communicator(init_method, rank, world_size, timeout_s)
    if nic is None:
        return comm, "no local interface found for it: the library chose"
    return comm, f"backend {backend.name!r} takes no nic=: its library chose"
