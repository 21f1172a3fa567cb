"""Staging: a receiver takes version v into memory of its own while its engine keeps serving v-1, and applies it
only when the sender says every receiver of the sync staged it (the commit).

The staging area keeps one tensor per name, reused from sync to sync while the name's dtype and shape stay: after
a commit it holds exactly what the engine was given, so a delta applies on it in place (its digest checked there,
before any weight the engine reads changes) and needs no memory beyond it. Where the engine names its own tensor
(`into`) and the sender is in delta mode, that tensor is the delta's base instead: the area lets go of its copy
after each commit, and a delta sync stages only the checked payloads (hwsync.delta.staged), or the patched
tensor where a payload is about as large as the tensor; the commit writes each payload into the engine's tensor.
A sync that fails or is aborted before its commit releases the whole area (the receiver then holds no known
version: the sender's next sync is whole).

What the area holds is checked against free memory before a byte moves, when the offer announces its tensors: a
shortfall raises StagingMemoryError naming the host and the bytes missing, never an out-of-memory midway.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from hwsync.backend.interfaces import Device
from hwsync.delta.header import BITMAP, BLOCKS, SAME, STEPS, DeltaHeader
from hwsync.delta.staged import StagedPayload
from hwsync.errors import StagingMemoryError
from hwsync.sync.bucket import IntoFn, matching_destination
from hwsync.sync.host_threads import copy_host_tensors, host_cores_free
from hwsync.sync.jobs import wait_all
from hwsync.sync.loader import Hooks
from hwsync.sync.spec import TensorSpec, dtype_from_name, dtype_name

log = logging.getLogger("hwsync")

#: host memory left free beyond what staging takes (the engine and the OS keep working): a share of the total
HOST_HEADROOM = 0.05


@dataclass(frozen=True)
class StageOptions:
    """A receiver that stages: where its staging memory lives and how much it may hold."""

    #: stage on the receiving device (when it fits) instead of host memory
    on_device: bool = False
    #: the most bytes the staging area may hold; a sync needing more is refused before a byte moves
    max_bytes: int | None = None
    #: how long a receiver that staged waits for the commit (a trainer may run a step between its stage() and
    #: commit()); a sender that goes away ends the wait at once
    commit_timeout_s: float = 3600.0

    @classmethod
    def of(cls, stage: StageOptions | bool | None) -> StageOptions | None:
        """From what a receiver was given: True is the defaults, False or None is no staging."""
        if stage is None or stage is False:
            return None
        if stage is True:
            return cls()
        if not isinstance(stage, StageOptions):
            raise TypeError(f"stage= takes True, False or a StageOptions, got {type(stage).__name__}")
        return stage


@dataclass(frozen=True)
class ApplyResult:
    """What applying a staged version did: bytes copied into the engine's tensors or handed to its loader."""

    tensors: int
    bytes: int
    apply_s: float
    #: the engine's own tensors the staged ones were written into, by name (a delta's digests are rebound to them)
    landed: dict[str, torch.Tensor] = field(default_factory=dict)


class StagingArea:
    """One receiver's staging memory: a tensor per name, filled during the stage, applied at the commit."""

    def __init__(self, device: Device, options: StageOptions) -> None:
        self.device, self.options = device, options
        self._where = device.torch_device() if options.on_device else torch.device("cpu")
        self._tensors: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()
        #: a delta sync's checked payloads, each written into the engine's own tensor at the commit
        self._payloads: dict[str, StagedPayload] = {}
        #: the names this sync staged, in the order they came
        self._staged: list[str] = []
        #: whether the engine's own tensors are the delta base (a sender in delta mode): copies go after the commit
        self._base_in_engine = False
        self._lock = threading.Lock()  # a delta's payloads are staged from the apply threads

    @property
    def held_bytes(self) -> int:
        """Bytes the staging area holds now."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values()) + \
            sum(p.nbytes for p in self._payloads.values())

    @property
    def staged(self) -> int:
        """Tensors this sync staged so far."""
        return len(self._staged)

    @property
    def base_in_engine(self) -> bool:
        """Whether the engine's own tensors are the delta base (a sender in delta mode)."""
        return self._base_in_engine

    def holds(self, name: str) -> bool:
        """Whether the area holds a copy of `name` (for a delta: its base)."""
        return name in self._tensors

    def begin(self, manifest: list[TensorSpec] | None, version: int, *, delta_mode: bool = False,
              delta_sync: bool = False, headers: dict[str, DeltaHeader] | None = None) -> int:
        """A sync starts (no byte has moved): check its announced tensors fit; the bytes it will newly allocate.

        `delta_mode`: the sender keeps a delta baseline (the engine's own tensors are the base of the next delta).
        `delta_sync`: this sync sends deltas; a tensor without a copy here then counts its payload's size (`headers`,
        where the offer carries them; a dense payload, the whole tensor), or, in a streamed delta, is checked as
        it is staged. The scratch copy a delta is checked on lives only while it is checked."""
        with self._lock:
            self._staged, self._payloads = [], {}
            self._base_in_engine = delta_mode
        if manifest is None:
            return 0  # not announced: each tensor is checked as it is allocated
        needed = 0
        for spec in manifest:
            if self._reusable(spec.name, spec.dtype, spec.shape):
                continue
            if not delta_sync:
                needed += spec.nbytes
            elif headers is not None:
                header = headers.get(spec.name)
                needed += spec.nbytes if header is None or not payload_kept(header, spec.nbytes) else header.nbytes
        self._check_room(needed, f"staging version {version} ({len(manifest)} tensors)")
        return needed

    def for_sync(self, engine_into: IntoFn | None) -> StagedInto:
        """This sync's `into` for the receiving code: the area's tensors, and the engine's own as a delta's base."""
        return StagedInto(self, engine_into)

    def into(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The staging tensor for one incoming tensor (reused while its dtype and shape stay)."""
        with self._lock:
            tensor = self._tensors.get(name)
            if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                self._drop(name)
                nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
                self._check_room(nbytes, f"staging {name!r} ({dtype_name(dtype)} of shape {list(shape)})")
                tensor = torch.empty(shape, dtype=dtype, device=self._where)
                if self._where.type == "cpu" and self.device.pin_host_memory(tensor):
                    self._pinned.add(name)
                self._tensors[name] = tensor
            self._staged.append(name)
            return tensor

    def keep_payload(self, staged: StagedPayload) -> None:
        """Hold one tensor's checked delta payload (copied: the wire's buffer is reused) until the commit."""
        with self._lock:
            self._drop(staged.name)
            self._check_room(staged.nbytes, f"staging the delta of {staged.name!r}")
            payload = torch.empty(staged.nbytes, dtype=torch.uint8, device=self._where)
            payload.copy_(staged.payload)
            self._payloads[staged.name] = StagedPayload(staged.name, staged.dtype, staged.shape, staged.header,
                                                        payload, staged.base_digest, staged.by_changes, staged.base)
            self._staged.append(staged.name)

    def keep_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Hold one tensor whole until the commit (a delta patched on a scratch copy: as large as the tensor)."""
        if tensor.device == self._where:
            with self._lock:
                self._drop(name)
                self._check_room(tensor.numel() * tensor.element_size(), f"staging {name!r}")
                self._tensors[name] = tensor
                self._staged.append(name)
        else:
            self.into(name, tensor.dtype, tuple(tensor.shape)).copy_(tensor)

    def apply(self, hooks: Hooks, pool: Executor | None = None) -> ApplyResult:
        """Hand this sync's staged tensors to the engine: copied into what `into` names (a staged payload written
        into it, on `pool`'s threads where given), the rest to `load`, then `done()`, all inside the loader's
        `pause()` (the engine's safe point); returns once the copies have run. A sender in delta mode: the copies
        of what `into` took are let go."""
        load, into = hooks.load, hooks.into
        names, nbytes = list(dict.fromkeys(self._staged)), 0
        in_engine: list[str] = []
        landed: dict[str, torch.Tensor] = {}
        t0 = time.perf_counter()
        with hooks.pause() if hooks.pause is not None else nullcontext(), host_cores_free():
            writes: list[tuple[StagedPayload, torch.Tensor]] = []
            whole: list[tuple[str, torch.Tensor]] = []
            host_copies: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            for name in names:
                payload = self._payloads.get(name)
                if payload is not None:
                    nbytes += payload.nbytes
                    dest = matching_destination(name, payload.dtype, payload.shape,
                                                into(name, payload.dtype, payload.shape) if into else None)
                    if dest is None:
                        raise ValueError(f"into() returned None at the commit for {name!r}, whose tensor it gave as "
                                         "the delta's base at the stage; give the same tensor until the commit")
                    writes.append((payload, dest))
                    landed[name] = dest
                    continue
                staged = self._tensors[name]
                nbytes += staged.numel() * staged.element_size()
                dest = matching_destination(name, staged.dtype, tuple(staged.shape),
                                            into(name, staged.dtype, tuple(staged.shape)) if into else None)
                if dest is None:
                    whole.append((name, staged))
                elif dest.device.type == "cpu":  # copied together below, on the host's cores
                    host_copies[0].append(dest)
                    host_copies[1].append(staged)
                    in_engine.append(name)
                    landed[name] = dest
                else:
                    dest.copy_(staged, non_blocking=True)
                    in_engine.append(name)
                    landed[name] = dest
            if host_copies[0]:
                copy_host_tensors(*host_copies)
            _write_payloads(writes, pool)
            if whole:
                if load is None:
                    raise ValueError(f"into() returned None for {whole[0][0]!r} and no load was given; return "
                                     "a destination for every tensor or pass load")
                load(whole)
            if hooks.done is not None:  # the engine's end of a sync (its loader's finalize) is part of the apply
                hooks.done()
            if self.device.torch_type != "cpu" and self.device.runtime_in_use():
                self.device.synchronize()  # the copies into the engine's tensors have run when the pause ends
        with self._lock:
            self._staged, self._payloads = [], {}
            if self._base_in_engine:  # the engine's tensor is the next delta's base: no copy of it is kept
                for name in in_engine:
                    self._drop(name)
        return ApplyResult(len(names), nbytes, time.perf_counter() - t0, landed)

    def release(self) -> None:
        """Free every staging tensor (a sync failed or was aborted before its commit)."""
        with self._lock:
            for name in list(self._tensors):
                self._drop(name)
            self._staged, self._payloads = [], {}

    def _reusable(self, name: str, dtype: str, shape: tuple[int, ...]) -> bool:
        tensor = self._tensors.get(name)
        return tensor is not None and tensor.dtype == dtype_from_name(dtype) and tuple(tensor.shape) == tuple(shape)

    def _drop(self, name: str) -> None:
        self._payloads.pop(name, None)
        tensor = self._tensors.pop(name, None)
        if tensor is not None and name in self._pinned:
            self._pinned.discard(name)
            self.device.unpin_host_memory(tensor)

    def _check_room(self, needed: int, what: str) -> None:
        """StagingMemoryError unless `needed` more bytes fit in the cap and in free memory (with headroom)."""
        if needed <= 0:
            return
        host = socket.gethostname()
        cap = self.options.max_bytes
        if cap is not None and self.held_bytes + needed > cap:
            raise StagingMemoryError(
                f"{what} on {host} (pid {os.getpid()}) needs {_mib(needed)} more staging memory, and the staging "
                f"area already holds {_mib(self.held_bytes)} of its max_bytes={_mib(cap)} (short by "
                f"{_mib(self.held_bytes + needed - cap)}); raise StageOptions.max_bytes or receive without staging")
        free, total = free_memory(self.device, self._where)
        room = free - int(total * HOST_HEADROOM) if self._where.type == "cpu" else free
        if needed > room:
            where = "host memory" if self._where.type == "cpu" else f"{self._where} memory"
            raise StagingMemoryError(
                f"{what} on {host} (pid {os.getpid()}) needs {_mib(needed)} of {where}, and {_mib(max(room, 0))} "
                f"is free beyond the headroom kept (short by {_mib(needed - max(room, 0))}); free memory, "
                + ("stage in host memory (StageOptions(on_device=False))" if self._where.type != "cpu"
                   else "stage on the device (StageOptions(on_device=True))") + ", or receive without staging")


class StagedInto:
    """A staging receiver's `into` for one sync: the area's own tensors, and, for a delta, the engine's tensor
    (what its `into` names) as the base its payloads are checked on and staged for."""

    def __init__(self, area: StagingArea, engine_into: IntoFn | None) -> None:
        self.area, self._engine_into = area, engine_into

    def __call__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The staging tensor for one incoming tensor."""
        return self.area.into(name, dtype, shape)

    def engine_base(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The engine's own tensor for `name` where it is a delta's base (the sender is in delta mode and the
        area holds no copy of it), else None: the delta applies on the area's copy."""
        if self._engine_into is None or not self.area.base_in_engine or self.area.holds(name):
            return None
        return matching_destination(name, dtype, shape, self._engine_into(name, dtype, shape))


def _write_payloads(writes: list[tuple[StagedPayload, torch.Tensor]], pool: Executor | None) -> None:
    """Write each staged payload into its engine tensor, the largest tensors first on the pool's threads (a write
    costs about its tensor's size: they end together); raises the first failure once every write ended."""
    if pool is None or len(writes) < 2:
        for payload, dest in writes:
            payload.write(dest)
        return
    order = sorted(writes, key=lambda write: -write[1].numel())
    wait_all([pool.submit(payload.write, dest) for payload, dest in order])


def payload_kept(header: DeltaHeader, nbytes: int) -> bool:
    """Whether a staged delta keeps its payload (sparse: at most half the tensor's bytes) rather than the patched
    tensor; a SAME payload keeps nothing."""
    return header.code == SAME or (header.code in (BLOCKS, BITMAP, STEPS) and 2 * header.nbytes <= nbytes)

def free_memory(device: Device | None = None, where: torch.device | None = None) -> tuple[int, int]:
    """(available, total) bytes of host memory, or of `device`'s memory at `where` when that is not the host."""
    if device is not None and where is not None and where.type != "cpu":
        return device.mem_get_info(where.index)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):  # not Linux: what sysconf says
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _mib(n: int) -> str:
    """Bytes as a person reads them: B below 1 KiB, then KiB, MiB, GiB."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
