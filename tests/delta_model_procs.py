"""The processes of the delta model checker (tests/test_delta_model.py): a trainer with its WeightSender, and
engines with their WeightReceivers, each in a process of its own, driven by a command queue.

They use hwsync's public API only. The trainer reports what it was given for a version (each tensor as the
engine's loader would store it: `torch.empty(shape, dtype=engine_dtype).copy_(t)`, then digested) before it
calls send(), and changes its tensors in place as soon as send() returns when told to; an engine reports the
digest of everything it holds after each receive(). The test process compares the two.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import tempfile
import time
import traceback
import zlib
from typing import Any

import torch
import torch.multiprocessing as mp

import transfer_procs
from hwsync.sync.options import SenderOptions
from hwsync.sync.report import DtypeReport, ReceiverState

CTX = mp.get_context("spawn")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_copy(tensor: torch.Tensor, engine: str | None) -> torch.Tensor:
    """What an engine whose parameters are `engine` stores from `tensor`: its loader's cast (floating tensors)."""
    if engine is None or not tensor.dtype.is_floating_point:
        return tensor
    return torch.empty(tensor.shape, dtype=DTYPES[engine], device=tensor.device).copy_(tensor)


def engine_digests(tensors: dict[str, torch.Tensor], engine: str | None) -> dict[str, list]:
    """[dtype, shape, sha256] of each tensor as the engine holds it."""
    return {name: transfer_procs.digest(engine_copy(t, engine)) for name, t in tensors.items()}


def _error(exc: BaseException) -> dict[str, Any]:
    from hwsync.errors import HwsyncError

    return {"ok": False, "type": type(exc).__name__, "error": str(exc)[:2000], "hwsync": isinstance(exc, HwsyncError),
            "where": "".join(traceback.format_exception(exc)[-3:])[-1500:]}


def _device() -> torch.device:
    from hwsync.backend.registry import get_backend

    return get_backend().device().torch_device()


class Trainer:
    """The trainer's tensors, what changes them in place, and the sources send() is given."""

    def __init__(self, specs: list[list[Any]], seed: int, device: torch.device) -> None:
        self.device = device
        self.tensors: dict[str, torch.Tensor] = {}
        self.moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.staging: torch.Tensor | None = None  # one buffer every tensor is gathered into (stable_sources=False)
        #: the "shared" source: the tensors live in hwsync's shared memory (sent by reference, replayed; replay.py)
        self.shared: Any = None
        for i, (name, shape, dtype) in enumerate(specs):
            self.tensors[name] = self._fresh(tuple(shape), dtype, seed * 101 + i)

    def _fresh(self, shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(shape, generator=g).to(DTYPES[dtype]).to(self.device)

    def apply(self, op: dict[str, Any]) -> None:
        """One change: training (in place) or a change of the tensors' set or specs (the test's model mirrors it)."""
        kind, g = op["op"], torch.Generator().manual_seed(op.get("seed", 0))
        if kind == "add":  # add_ a small value to a share of each tensor's elements (or of one: the rest frozen), in place
            for t in [self.tensors[op["only"]]] if op.get("only") in self.tensors else self.tensors.values():
                flat = t.view(-1)
                # on the tensor's own device: the "shared" source's tensors are in host memory on any backend
                idx = torch.nonzero(torch.rand(flat.numel(), generator=g) < op["share"]).view(-1).to(t.device)
                flat.index_add_(0, idx, torch.full((idx.numel(),), op["value"], dtype=t.dtype, device=t.device))
        elif kind == "adamw":  # an AdamW-like step at a small LR, in place (moments in fp32)
            lr = op["lr"]
            for name, t in self.tensors.items():
                grad = torch.randn(t.shape, generator=g).to(t.device)
                m, v = self.moments.get(name, (None, None))
                if m is None or m.shape != t.shape or m.device != t.device:
                    m, v = torch.zeros_like(grad), torch.zeros_like(grad)
                    self.moments[name] = (m, v)
                m.mul_(0.9).add_(grad, alpha=0.1)
                v.mul_(0.999).addcmul_(grad, grad, value=0.001)
                t.mul_(1 - lr * 0.01)
                t.add_((m / (v.sqrt() + 1e-8) * -lr).to(t.dtype))
        elif kind == "reshape" and (self.shared is not None or self.device.type != "cpu"):
            # the same memory seen in another shape (`param.data = param.data.view(...)`): in shared memory, or on a
            # device, where the sender reads a Parameter's memory in place
            self.tensors[op["name"]] = self.tensors[op["name"]].view(op["shape"])
        elif kind == "reshape":  # the same elements in another shape
            self.tensors[op["name"]] = self.tensors[op["name"]].reshape(op["shape"]).clone()
        elif kind == "dtype":
            self.tensors[op["name"]] = self.tensors[op["name"]].to(DTYPES[op["dtype"]])
        elif kind in ("numel", "add_tensor"):  # new elements (a new tensor, or one of another element count)
            dtype = op.get("dtype") or str(self.tensors[op["name"]].dtype).removeprefix("torch.")
            self.tensors[op["name"]] = self._fresh(tuple(op["shape"]), dtype, op.get("seed", 0))
        elif kind == "remove":
            del self.tensors[op["name"]]
        else:
            raise ValueError(f"unknown change {op!r}")

    def source(self, kind: str) -> Any:
        """What send() is given: the pairs, a generator, a callable of the receiver's state, or a staging source."""
        items = list(self.tensors.items())
        if kind == "list":
            return items
        if kind == "generator":
            return (item for item in items)
        if kind == "callable":
            return lambda state: items
        if kind == "staging":
            return self._staged(items)
        if kind == "shared":
            return self._in_shared_memory()
        if kind == "parameters":  # a module's: on a device, the sender reads them in place (mapped.py)
            for name, t in self.tensors.items():
                if not isinstance(t, torch.nn.Parameter):
                    self.tensors[name] = torch.nn.Parameter(t, requires_grad=False)
            return list(self.tensors.items())
        raise ValueError(f"unknown source {kind!r}")

    def close(self) -> None:
        """Free the shared memory of the "shared" source."""
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def _in_shared_memory(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors, in hwsync's shared memory (copied there once a tensor is new: the rest keep their memory,
        so a sync whose tensors are those of the last is a replay, and training in place changes what it reads)."""
        from hwsync.sync.shared_params import SharedTensors, find_shared

        if self.shared is None or any(find_shared(t) is None for t in self.tensors.values()):
            old, self.shared = self.shared, SharedTensors(list(self.tensors.items()))
            self.tensors = dict(self.shared.items())
            if old is not None:
                old.close()
        return list(self.tensors.items())

    def _staged(self, items: list[tuple[str, torch.Tensor]]):
        """Each tensor copied into ONE reused buffer and yielded as a view of it (FSDP's full_tensor() into a
        staging buffer): the previous tensor's memory holds the next one once the next is asked for."""
        need = max(t.numel() * t.element_size() for _, t in items)
        if self.staging is None or self.staging.numel() < need:
            self.staging = torch.empty(need, dtype=torch.uint8, device=self.device)
        for name, t in items:
            view = self.staging[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t)
            yield name, view


def stacks_path(pid: int) -> str:
    """Where process `pid` writes every thread's stack when sent SIGUSR1 (the fleet asks before it calls it stuck)."""
    return os.path.join(tempfile.gettempdir(), f"hwsync-model-{pid}.stacks")


def _dump_stacks_on_request() -> None:
    faulthandler.register(signal.SIGUSR1, file=open(stacks_path(os.getpid()), "w"), all_threads=True)  # noqa: SIM115


def _compiled_copies() -> None:
    """Under HWSYNC_TEST_COMPILED_COPIES=1, every plan's host copies run as the compiled loop from the first."""
    if os.environ.get("HWSYNC_TEST_COMPILED_COPIES") == "1":
        from hwsync.sync import host_copy

        host_copy.COMPILED_FROM = 0
        if not host_copy.wait(120):
            raise RuntimeError("the compiled copy loop did not load (numba installed?)")


def sender_main(commands, results) -> None:
    """The trainer: {"open"}, {"tensors"}, {"change"}, {"sync"}, {"drop"}, {"stop"}; one reply each ("sync": two)."""
    _dump_stacks_on_request()
    torch.set_num_threads(1)
    _compiled_copies()
    from hwsync import WeightSender

    device = _device()
    sender: WeightSender | None = None
    trainer: Trainer | None = None
    results.put({"up": os.getpid()})
    while (command := commands.get())["cmd"] != "stop":
        cmd = command["cmd"]
        try:
            if cmd == "open":
                if sender is not None:
                    sender.close()
                if trainer is not None:
                    trainer.close()
                sender = WeightSender(num_receivers=command["receivers"], options=SenderOptions(delta=command["delta"], stable_sources=command["stable"], bucket_bytes=command["bucket_bytes"], timeout_s=command["timeout_s"]))
                trainer = Trainer(command["specs"], command["seed"], device)
                results.put({"ok": True, "endpoint": sender.endpoint})
            elif cmd == "change":
                assert trainer is not None
                trainer.apply(command["op"])
                results.put({"ok": True})
            elif cmd == "drop":
                assert sender is not None
                results.put({"ok": True, "freed": sender.drop_delta_baseline()})
            elif cmd == "sync":
                assert sender is not None and trainer is not None
                results.put({"expected": engine_digests(trainer.tensors, command["engine"])})
                _sync(sender, trainer, command, results)
            elif cmd == "close":
                if sender is not None:
                    sender.close()
                if trainer is not None:
                    trainer.close()
                sender = trainer = None
                results.put({"ok": True})
        except Exception as exc:  # noqa: BLE001 - the test reports it
            results.put({**_error(exc), "crash": traceback.format_exc()})
    if sender is not None:
        sender.close()
    os._exit(0)


def _sync(sender: Any, trainer: Trainer, command: dict[str, Any], results) -> None:
    """send() once; the change told to happen right after it returns happens before anything else."""
    source = trainer.source(command["source"])
    error: BaseException | None = None
    stats = None
    try:
        stats = sender.send(source, version=command["version"], delta=command["delta"])
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = exc
    if command["source"] == "staging" and trainer.staging is not None:
        trainer.staging.fill_(0xFF)  # the buffer is the trainer's again: it gathers something else now
    if command.get("after"):
        trainer.apply(command["after"])  # e.g. optimizer.step() as soon as send() returned
    if error is not None:
        results.put(_error(error))
        return
    assert stats is not None
    note = stats.delta
    results.put({"ok": True, "mode": "plain" if note is None else note.mode, "reason": "" if note is None else note.reason,
                 "codes": None if note is None else note.codes, "replay": "replay" in stats.notes,
                 "paths": sorted(k for k in stats.notes if k in ("shared", "mapped"))})


def receiver_main(commands, results) -> None:
    """An engine: {"connect"}, {"receive"} (optionally stalling in its first callback), {"restart"}, {"renew"} (a
    destination made anew), {"stop"}.

    Modes: "load" keeps a copy of what load() is handed; "into" keeps one tensor per name and makes a new one
    on a new spec; "stubborn" returns its existing tensor whatever spec is asked (a wrong one must be refused;
    after a failed sync it makes new ones);
    "mixed" gives destinations for some names and takes the others through load().
    """
    _dump_stacks_on_request()
    torch.set_num_threads(1)
    _compiled_copies()
    from hwsync import WeightReceiver

    device = _device()
    receiver: WeightReceiver | None = None
    held: dict[str, torch.Tensor] = {}
    config: dict[str, Any] = {}
    results.put({"up": os.getpid()})
    while (command := commands.get())["cmd"] != "stop":
        cmd = command["cmd"]
        try:
            if cmd in ("connect", "restart"):
                if receiver is not None:
                    receiver.close()
                if cmd == "connect":
                    config = command
                if not command.get("keep", False):
                    held = {}  # a fresh engine
                receiver = WeightReceiver(config["endpoint"], timeout_s=config["timeout_s"])
                results.put({"ok": True})
            elif cmd == "receive":
                assert receiver is not None
                results.put(_receive(receiver, held, config["mode"], config["engine"], command.get("stall"), results,
                                     device))
            elif cmd == "renew":  # the engine makes its tensor anew: other memory, holding zeros or what it held
                name, mode = command["name"], config["mode"]
                ours = name in held and mode != "load" and not (mode == "mixed" and zlib.crc32(name.encode()) % 2)
                if ours:  # only a destination into() gave: a load engine's copies are its own business
                    held[name] = held[name].clone() if command["keep"] else torch.zeros_like(held[name])
                results.put({"ok": True, "renewed": ours})
            elif cmd == "close":
                if receiver is not None:
                    receiver.close()
                receiver = None
                results.put({"ok": True})
        except Exception as exc:  # noqa: BLE001 - the test reports it
            results.put({**_error(exc), "crash": traceback.format_exc()})
    if receiver is not None:
        receiver.close()
    os._exit(0)


def _receive(receiver: Any, held: dict[str, torch.Tensor], mode: str, engine: str | None, stall: Any, results,
             device: torch.device) -> dict[str, Any]:
    """One receive(); the reply says what the engine holds afterwards, or the error."""
    wrong: list[str] = []  # names a stubborn engine handed a destination of another spec for
    stalled: list[bool] = []

    def maybe_stall() -> None:
        if stall is not None and not stalled:
            stalled.append(True)
            results.put({"stalled": True})
            time.sleep(600.0 if stall == "forever" else float(stall))

    def into(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        maybe_stall()
        dest = held.get(name)
        if mode == "mixed" and zlib.crc32(name.encode()) % 2:
            return None
        if dest is None or (mode != "stubborn" and (dest.dtype != dtype or tuple(dest.shape) != tuple(shape))):
            dest = held[name] = torch.empty(shape, dtype=dtype, device=device)
        elif dest.dtype != dtype or tuple(dest.shape) != tuple(shape):
            wrong.append(name)
        return dest

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        maybe_stall()
        for name, tensor in pairs:
            held[name] = tensor.clone()

    state = ReceiverState(dtypes=DtypeReport(engine)) if engine is not None else None
    try:
        receiver.receive(load if mode in ("load", "mixed") else None, into=None if mode == "load" else into,
                         state=state)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        if mode == "stubborn":  # a refusal names the first wrong destination only: it makes new ones for all
            held.clear()
        return {**_error(exc), "version": receiver.version, "incomplete": receiver.incomplete}
    return {"ok": True, "version": receiver.version, "wrong_destinations": sorted(set(wrong)),
            "digests": engine_digests(held, engine)}
