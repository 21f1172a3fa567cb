"""A receiver's side of delta syncs: what it holds, applying each payload on it, and the check after.

The receiver tracks the baseline id of the last sync it completed (`held`, reported to the sender
in its state); any sync drops it until that sync completes and checks out, so a sync that breaks
midway leaves it holding no known version and the next sync is full. In a delta sync every tensor
arrives as its payload (hwsync.delta: same, dense, block, bitmap or step) and a header with the digest of
the tensor the sender holds; a payload is applied only when the sync's declared base is what this
receiver holds, then the result's digest is compared with the sender's, which fails the sync on a
mismatch (DeltaCheckError, reported to the sender; the next sync is full).

How the digest is taken: on the host, where the receiver knows the digest of what it holds (it checked the
tensor at an earlier delta) and the delta is sparse (at most 1 in CHANGED_CHECK_RATIO elements changed; 1 in
STEP_CHECK_RATIO for a step code the compiled kernel applies), from the changed elements alone (on an H100
the torch ops of that path took 47 ms for 268M elements at 2% changed, a whole digest 3.7 ms: a device
digests whole): the digest is linear, so the held digest plus the terms of the values found at the changed
positions and of the values written is the result's (patch.apply_into(gain=True)); that catches a wrong
base or a corrupted payload at any changed element, at a cost that scales with the changes, not the model.
Otherwise, and at every HWSYNC_DELTA_FULL_CHECK_EVERY-th delta sync (default 8; 1: always), the whole
tensor is digested, which also catches a byte changed behind hwsync's back where no delta wrote.

A held digest speaks for the memory it was taken of, and nothing else: each is kept with the tensor's address and
its storage (weakly), and a tensor that `into` now gives in other memory (an engine that made its parameter anew)
is digested whole. Trusted there, an unchanged tensor ("same": nothing written) would pass on the digest of memory
the engine no longer uses, and the sync end in success with whatever the new memory holds.

Where the result goes: a tensor `into` names is patched in place (only the changed elements are
written); every other tensor is patched in a copy this receiver keeps (its own baseline, kept from
the first full sync of a sender in delta mode) and handed to `load` whole: engines whose loader
repacks tensors (vLLM's fused qkv, MoE experts) need the whole tensor.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

import torch

from hwsync.backend.devices import DeviceOwner, identified
from hwsync.backend.interfaces import Device
from hwsync.delta import native, warm
from hwsync.delta.digest import tensor_digest
from hwsync.delta.header import BITMAP, BLOCKS, DENSE, SAME, STEPS, DeltaHeader, headers_from_words
from hwsync.delta.patch import BaseMismatch, apply_into, verify
from hwsync.delta.staged import StagedPayload
from hwsync.errors import DeltaCheckError, ManifestError, ProtocolError
from hwsync.protocol.delta import DeltaField
from hwsync.sync.bucket import IntoFn, LoadFn, matching_destination
from hwsync.sync.jobs import wait_all
from hwsync.sync.spec import TensorSpec, dtype_from_name, dtype_name
from hwsync.sync.staging import StagedInto, payload_kept

#: a delta with at most 1 changed element in this many is checked from its changes (when the held digest is known)
CHANGED_CHECK_RATIO = 50
#: the same for a step code applied by the compiled kernel, which sums the terms in its one pass over the changes:
#: cheaper than a whole digest up to about 1 change in 6 (32M bf16 elements: 11 against 15 ms at 2%, even at 16%)
STEP_CHECK_RATIO = 8
#: the default of HWSYNC_DELTA_FULL_CHECK_EVERY: every how many delta syncs each tensor is digested whole
FULL_CHECK_EVERY = 8

log = logging.getLogger("hwsync")


class StagedBase(NamedTuple):
    """The engine's tensor a staging receiver checks one payload on, with the payload's header and announced spec
    (looked up once, by `staged_base`, for `stage`)."""

    tensor: torch.Tensor
    header: DeltaHeader
    spec: TensorSpec


def full_check_every() -> int:
    """HWSYNC_DELTA_FULL_CHECK_EVERY, checked: every how many delta syncs a receiver digests every tensor whole."""
    raw = os.environ.get("HWSYNC_DELTA_FULL_CHECK_EVERY", str(FULL_CHECK_EVERY))
    try:
        every = int(raw)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(f"HWSYNC_DELTA_FULL_CHECK_EVERY={raw!r}: a whole number of delta syncs, at least 1 (1: "
                         "digest every tensor whole at every delta)")
    return every


class HeldDigest(NamedTuple):
    """A tensor's digest, with the memory it was taken of: its address, and its storage (a weak reference: an engine
    that frees the tensor frees it; None where the backend's tensors hold no torch storage, their addresses unique)."""

    digest: int
    ptr: int
    storage: weakref.ref[torch.UntypedStorage] | None


def held_digest(digest: int, tensor: torch.Tensor, data_ptr: Callable[[torch.Tensor], int]) -> HeldDigest | None:
    """`digest`, as what `tensor`'s memory holds; None where the memory cannot be told apart (never trusted later)."""
    ptr = data_ptr(tensor)
    if not identified(ptr, tensor, data_ptr):
        return None
    try:
        storage = weakref.ref(tensor.untyped_storage())
    except (RuntimeError, TypeError):  # a wrapper subclass's: identified by the backend's own addresses
        storage = None
    return HeldDigest(digest, ptr, storage)


class ReceiverDeltas:
    """What one receiver holds of its sender's deltas, and how this sync's payloads are applied."""

    def __init__(self) -> None:
        #: the baseline id of the last sync this receiver completed and checked, or None
        self.held: str | None = None
        self._kept: dict[str, torch.Tensor] = {}
        self._wire: DeltaField | None = None
        self._headers: dict[str, DeltaHeader] = {}
        self._targets: dict[str, TensorSpec] = {}
        self._delta = False
        #: the digest of each tensor this receiver holds, as its last check (or the digests after a full sync) found
        #: it, and the memory it was found in
        self._digests: dict[str, HeldDigest] = {}
        #: how tensors' addresses are read (the backend's Device.data_ptr; set by `intake`)
        self._data_ptr: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr
        #: delta syncs completed since the last that digested every tensor whole; whether this one does
        self._since_full = 0
        self._full = True
        self._pool: ThreadPoolExecutor | None = None
        self._owner: DeviceOwner | None = None
        #: the tensors a full sync in delta mode wrote (destinations and kept copies), digested once it completes
        self._written: dict[str, torch.Tensor] = {}
        self._digesting: Future[dict[str, HeldDigest]] | None = None
        #: a staged full sync's digests, taken before it said staged (`digest_staged`), until it completes
        self._digested: dict[str, HeldDigest] | None = None

    def begin(self, wire: DeltaField | None, targets: list[TensorSpec] | None) -> None:
        """A sync starts; `wire` is its offer's or plan's delta field. Whatever it was, nothing is held until it
        completes. A delta's headers come with it (an offer) or group by group (`announce`: a streamed plan)."""
        self._settle()  # the digests of the last full sync, taken before anything is written again
        held, self.held, self._wire, self._digested = self.held, None, wire, None
        self._headers, self._targets, self._delta = {}, {}, False
        if wire is not None:  # a sender in delta mode: deltas will follow; their kernels load on a thread of their own
            warm.start()
        if wire is None or wire.base is None:
            self._digests, self._since_full = {}, 0  # what a full sync writes is digested once it completes
            if wire is None:
                self._kept = {}  # the sender left delta mode: its baseline copies go
            return  # a full sync of a sender in delta mode: keep copies of what goes to load
        if wire.base != held:
            raise ProtocolError(f"the sender sent a delta from {wire.base!r}, but this receiver holds "
                                f"{held!r}; refused (the sender's next sync is full)")
        headers = wire.headers
        if targets is None or (headers is None and wire.groups is None) or \
                (headers is not None and len(targets) != len(headers)):
            raise ProtocolError("a delta sync must announce every tensor it changes, with a header each")
        self._targets, self._delta = {spec.name: spec for spec in targets}, True
        self._full = not self._digests or self._since_full + 1 >= full_check_every()
        for spec, header in zip(targets, headers or []):
            if header.dtype != spec.dtype or header.numel != _numel(spec.shape):
                raise ProtocolError(f"{spec.name}: its delta header says {header.numel} {header.dtype} elements, its "
                                    f"announcement {spec.dtype} of shape {list(spec.shape)}")
            self._headers[spec.name] = header

    def announce(self, specs: list[TensorSpec], words: torch.Tensor) -> list[DeltaHeader]:
        """The headers of one streamed group, from its descriptor (checked against the group's targets)."""
        try:
            headers = headers_from_words(words, [(spec.name, spec.dtype, _numel(spec.shape)) for spec in specs])
        except ValueError as exc:
            raise ProtocolError(f"a delta group's descriptor: {exc}") from None
        for spec, header in zip(specs, headers):
            self._headers[spec.name] = header
        return headers

    @property
    def check(self) -> str:
        """How this delta sync's results are checked: "whole tensors", or "changed elements" where it can."""
        return "whole tensors" if self._full else "changed elements"  # where sparse; the rest whole

    @property
    def is_delta(self) -> bool:
        """Whether the sync running now is a delta (every tensor arrives as a payload)."""
        return self._delta

    def intake(self, load: LoadFn | None, into: IntoFn | None, device: Device) -> tuple[LoadFn | None, IntoFn | None]:
        """The (load, into) the bucket reader gets this sync: the caller's own outside delta mode. Called on the
        receiving thread: the threads that apply deltas take its current device of `device`."""
        owner = DeviceOwner(device)
        if self._pool is not None and self._owner is not None and self._owner.index != owner.index:
            self._pool.shutdown()
            self._pool = None
        self._owner, self._data_ptr = owner, device.data_ptr
        if self._wire is None:
            return load, into
        if not self.is_delta:  # a full sync: what it writes is digested once it completes (complete())
            self._written = {}
            return (None if load is None else _KeepThenLoad(self._kept, load)), \
                (None if into is None else _Recorded(into, self._written))
        return ApplyDelta(self, load, into), _no_destination

    def announced(self, name: str) -> tuple[DeltaHeader, TensorSpec]:
        """One payload's header and announced spec (ProtocolError for a tensor the sync did not announce)."""
        header, spec = self._headers.get(name), self._targets.get(name)
        if header is None or spec is None:
            raise ProtocolError(f"the sender sent a payload for {name!r}, which its delta sync did not announce")
        return header, spec

    def staged_base(self, name: str, into: IntoFn | None) -> StagedBase | None:
        """The engine's own tensor where a staging receiver stages this payload against it, with the payload's
        header and spec for `stage` (else None)."""
        if not isinstance(into, StagedInto):
            return None
        header, spec = self.announced(name)
        if header.code == DENSE:  # needs no base (and may come with a new spec): staged whole, copied at the commit
            return None
        tensor = into.engine_base(name, dtype_from_name(spec.dtype), spec.shape)
        return None if tensor is None else StagedBase(tensor, header, spec)

    def target(self, name: str, payload: torch.Tensor, into: IntoFn | None) -> tuple[torch.Tensor, bool]:
        """Where one tensor's delta applies: the caller's own tensor (`into`; True) or the copy kept for `load`."""
        header, spec = self.announced(name)
        dtype = dtype_from_name(spec.dtype)
        dest = matching_destination(name, dtype, spec.shape, into(name, dtype, spec.shape) if into else None)
        if dest is not None:
            return dest, True
        kept = self._kept.get(name)
        if kept is not None and (kept.dtype != dtype or tuple(kept.shape) != tuple(spec.shape)):
            if header.code != DENSE:  # a sender changes a tensor's spec only with the whole tensor
                raise ManifestError(f"{name}: a {header.code} delta for {spec.dtype} of shape {list(spec.shape)}, but "
                                    f"the copy this receiver keeps of it is {dtype_name(kept.dtype)} of shape "
                                    f"{list(kept.shape)}; refused (the sender's next sync is full)")
            kept = None  # reshaped, or another dtype: the dense payload fills a copy of the new spec
        if kept is None:
            if header.code != DENSE:
                raise ProtocolError(f"{name}: a {header.code} delta, but this receiver keeps no copy of it to "
                                    "apply it on; refused (the sender's next sync is full)")
            kept = self._kept[name] = torch.empty(spec.shape, dtype=dtype, device=payload.device)
        return kept, False

    def apply(self, name: str, payload: torch.Tensor, result: torch.Tensor, engine: torch.Tensor | None = None) -> None:
        """Apply one tensor's payload on `result` (its base) and check the result's digest (any thread). `engine`:
        the tensor `result` is a scratch copy of, which holds the result once the sync commits (a staged delta)."""
        header = self._headers[name]
        memory = result if engine is None else engine  # what the held digest was, and the new one is, taken of
        held = None if self._full else self.held_for(name, memory)
        payload = payload.to(result.device)
        if held is not None and header.code == SAME:
            ok, how = held == header.digest, "the digest it held (nothing changed)"
        else:
            try:
                if held is not None and result.device.type == "cpu" and _check_changes(header):
                    gain = apply_into(result, header, payload, name=name, gain=True)
                    ok, how = gain is not None and (held + gain) % (1 << 64) == header.digest, "its changed elements"
                else:
                    apply_into(result, header, payload, name=name)
                    ok, how = verify(result, header), "the whole tensor"
            except BaseMismatch:  # a step code checks its base's values first and then writes nothing
                ok, how = False, "the values at its changes, before writing"
            except ValueError as exc:  # a payload that does not fit its header or its base: nothing trusted
                self._digests.pop(name, None)
                raise ProtocolError(f"{name}: its {header.code} delta could not be applied ({exc}); this receiver "
                                    "holds no known version of it, and the sender's next sync is full") from None
        if not ok:
            moved = held is None and not self._full and name in self._digests
            self._digests.pop(name, None)
            if moved:
                why = ("into() gave it in other memory than the tensor this receiver last wrote (made anew?), which "
                       "did not hold the declared base")
            else:
                why = ("this receiver's copy was not the declared base (changed behind hwsync's back?) or the apply "
                       "was torn")
            raise DeltaCheckError(f"{name} does not have the sender's digest for its {header.code} delta (checked on "
                                  f"{how}): {why}; the next sync is full")
        self._record(name, header.digest, memory)

    def stage(self, name: str, payload: torch.Tensor, base: StagedBase, into: StagedInto) -> None:
        """Check one payload on a scratch copy of the engine's tensor (`base`, from `staged_base`; the engine reads
        it on) and stage what the commit writes: the payload where it is sparse, else the patched copy (any thread)."""
        header, spec, engine = base.header, base.spec, base.tensor
        held = self.held_for(name, engine)  # the base's, before this sync's check records the new one
        if header.code == SAME:
            self.apply(name, payload, engine)  # writes nothing: the digest it held, or the tensor read whole
            return
        scratch = engine.clone()
        self.apply(name, payload, scratch, engine)
        if payload_kept(header, scratch.numel() * scratch.element_size()):
            by_changes = not self._full and engine.device.type == "cpu" and _check_changes(header)
            into.area.keep_payload(StagedPayload(name, scratch.dtype, tuple(spec.shape), header, payload, held,
                                                 by_changes, engine))
        else:
            into.area.keep_tensor(name, scratch)

    def digest_staged(self) -> None:
        """A full sync in delta mode is staged: digest what it wrote now, before this receiver says so. The stage
        takes that time while the engine generates; digested after the commit instead, it would run beside the
        engine's first steps after the pause (measured: the first step 1.5-3x as long, issue 48's bench)."""
        if self._wire is None or self._delta:
            return
        try:
            self._digested = _digest_all({**self._written, **self._kept}, self._data_ptr)
        except Exception as exc:  # noqa: BLE001 - as a digest after the sync: the next delta is checked whole
            log.debug("hwsync: digesting a staged full sync failed (digested after it completes): %s", exc)
            self._digested = None

    def complete(self, landed: Mapping[str, torch.Tensor] | None = None) -> None:
        """The sync completed and every tensor checked out: this receiver holds the sender's new baseline.
        `landed`: a staged sync's tensors as written into the engine's own (their digests now speak for those)."""
        if self._wire is not None:
            self.held = self._wire.next
        if self._delta:
            self._since_full = 0 if self._full else self._since_full + 1
        digested, self._digested = self._digested, None
        if self._wire is not None and not self._delta:
            written, self._written = {**self._written, **self._kept}, {}
            if digested is not None:  # staged, and digested before it said so: the apply copied those bytes
                self._digests = digested
            else:
                # after a full sync in delta mode, digest what it wrote while the trainer trains: the first delta is
                # then checked from its changes; a full sync that landed wrong still fails it (its digest is the
                # sender's)
                self._digesting = self.pool().submit(_digest_all, written, self._data_ptr)
        if landed:
            self._rebind(landed)

    def held_for(self, name: str, tensor: torch.Tensor) -> int | None:
        """The digest held for `name`, where `tensor` is the memory it was taken of (else None: digest it whole)."""
        held = self._digests.get(name)
        if held is None or self._data_ptr(tensor) != held.ptr:
            return None
        if held.storage is not None:
            try:
                if held.storage() is not tensor.untyped_storage():  # freed, and another tensor at its address
                    return None
            except (RuntimeError, TypeError):
                return None
        return held.digest

    def _rebind(self, landed: Mapping[str, torch.Tensor]) -> None:
        """The staged bytes each digest was taken of now lie in the engine's tensors: the digests speak for those."""
        for name, tensor in landed.items():
            held = self._digests.get(name)
            if held is not None:
                self._record(name, held.digest, tensor)

    def _record(self, name: str, digest: int, tensor: torch.Tensor) -> None:
        """`tensor` checked out with `digest`: held for the next delta (unless its memory cannot be told apart)."""
        held = held_digest(digest, tensor, self._data_ptr)
        if held is None:
            self._digests.pop(name, None)
        else:
            self._digests[name] = held

    def _settle(self) -> None:
        """Take the last full sync's digests (waiting for them); none if digesting failed (checked whole then)."""
        digesting, self._digesting = self._digesting, None
        if digesting is not None and digesting.exception() is None:
            self._digests = digesting.result()

    def pool(self) -> ThreadPoolExecutor:
        """Threads that apply and check tensors side by side (made at the first delta sync, kept)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="hwsync-apply",
                                            initializer=None if self._owner is None else self._owner.enter)
        return self._pool

    def clear(self) -> None:
        """Drop the copies kept for `load` (and with them what this receiver holds) and the threads."""
        self._settle()
        self._kept, self.held, self._digests, self._written, self._digested = {}, None, {}, {}, None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class _Recorded:
    """A full sync's `into`, recording each destination it names (digested once the sync completes)."""

    def __init__(self, into: IntoFn, written: dict[str, torch.Tensor]) -> None:
        self._into, self._written = into, written

    def __call__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        dest = self._into(name, dtype, shape)
        if dest is not None:
            self._written[name] = dest
        return dest


def _digest_all(tensors: Mapping[str, torch.Tensor], data_ptr: Callable[[torch.Tensor], int]) -> dict[str, HeldDigest]:
    """Each tensor's digest, with its memory (an apply thread's job)."""
    digests = {name: held_digest(tensor_digest(tensor), tensor, data_ptr) for name, tensor in tensors.items()}
    return {name: held for name, held in digests.items() if held is not None}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _no_destination(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """In a delta sync every payload goes through the delta's apply, never straight into a tensor."""
    return None


class _KeepThenLoad:
    """A full sync in delta mode: each tensor for `load` is also copied into the receiver's baseline."""

    def __init__(self, kept: dict[str, torch.Tensor], load: LoadFn) -> None:
        self._kept, self._load = kept, load

    def __call__(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in tensors:
            copy = self._kept.get(name)
            if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                copy = self._kept[name] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            copy.copy_(tensor)
        self._load(tensors)


class ApplyDelta:
    """A delta sync's load: each payload applied and checked on the apply threads; whole tensors to `load`."""

    def __init__(self, deltas: ReceiverDeltas, load: LoadFn | None, into: IntoFn | None) -> None:
        self._deltas, self._load, self._into = deltas, load, into

    def __call__(self, payloads: list[tuple[str, torch.Tensor]]) -> None:
        self.submit(payloads).finish()

    def submit(self, payloads: list[tuple[str, torch.Tensor]]) -> "Applying":
        """Start applying `payloads` (views that must stay valid until `finish` returns)."""
        deltas = self._deltas
        # user code (into) runs here, on the receiving thread. A staging receiver stages a payload against the
        # engine's own tensor where that is the base; every other payload applies on its target
        staging = self._into if isinstance(self._into, StagedInto) else None
        bases = [None if staging is None else deltas.staged_base(name, staging) for name, _ in payloads]
        targets = [(base.tensor, True) if base is not None else deltas.target(name, payload, self._into)
                   for (name, payload), base in zip(payloads, bases)]
        pool = deltas.pool()
        # the largest targets first: an apply costs about its target's size (at RL densities the changes touch
        # most of its cache lines), so the threads end together, not on a large tensor taken last. At the end of a
        # sync that was the LM head: the last group's applies took 8 ms, 5.5 ms largest first
        order = sorted(range(len(payloads)), key=lambda i: -targets[i][0].numel())
        started = {}
        for i in order:
            name, payload = payloads[i]
            base = bases[i]
            if base is not None:
                assert isinstance(self._into, StagedInto)
                started[i] = pool.submit(deltas.stage, name, payload, base, self._into)
            else:
                started[i] = pool.submit(deltas.apply, name, payload, targets[i][0])
        jobs = [started[i] for i in range(len(payloads))]  # in the payloads' order: the first failure is raised
        whole = [(name, result) for (name, _), (result, own) in zip(payloads, targets) if not own]
        return Applying(jobs, whole, self._load)


class Applying:
    """Payloads being applied; `finish` waits for them, raises the first failure, then hands whole tensors to load."""

    def __init__(self, jobs: list[Future[None]], whole: list[tuple[str, torch.Tensor]], load: LoadFn | None) -> None:
        self._jobs, self._whole, self._load = jobs, whole, load

    def wait(self) -> None:
        """Wait for every apply to end, failed or not (their payloads are views of a buffer)."""
        wait(self._jobs)

    def finish(self) -> None:
        """Wait for every apply, raise the first failure, then load the whole tensors."""
        jobs, self._jobs = self._jobs, []
        wait_all(jobs)  # empties jobs: each future holds its error, which would otherwise be in a reference cycle
        whole, self._whole = self._whole, []
        if whole:
            if self._load is None:
                raise ValueError(f"into() returned None for {whole[0][0]!r} and no load was given; return "
                                 "a destination for every tensor or pass load")
            self._load(whole)


def _check_changes(header: DeltaHeader) -> bool:
    """Whether a host tensor's result is checked from its changes rather than digested whole (the cheaper; on a
    GPU a whole digest always is)."""
    if header.code == STEPS and native.ready():
        return header.count * STEP_CHECK_RATIO <= header.numel
    return header.code in (BLOCKS, BITMAP, STEPS) and header.count * CHANGED_CHECK_RATIO <= header.numel
