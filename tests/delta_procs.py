"""Receivers for the delta tests, in processes of their own: an engine that holds its tensors (into) or loads
them (load), told what to do before each sync through a command queue, reporting what it holds after."""

from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp

from hwsync import ReceiverState, WeightReceiver
from hwsync.sync.report import DtypeReport
from hwsync.backend.registry import get_backend
from hwsync.sync.options import SenderOptions

import transfer_procs as procs

CTX = mp.get_context("spawn")


def start(endpoint: str, mode: str, dtypes: dict | None = None, timeout_s: float = 60.0):
    """A delta receiver process: (process, command queue, result queue); it is up when this returns."""
    commands, results = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=receiver_main, args=(endpoint, mode, dtypes, timeout_s, commands, results), daemon=True)
    proc.start()
    assert results.get(timeout=90) == "up"
    return proc, commands, results


def receiver_main(endpoint: str, mode: str, dtypes: dict | None, timeout_s: float, commands, results) -> None:
    """Receive one sync per command: {"receive": True}, optionally {"flip": name}, {"renew": [names]} or {"copy":
    [names]} first (a byte flipped; the tensors made anew, of zeros or of what they held), or {"fail_after": seconds}
    (the sync fails that long after its last tensor), or {"stop": True}.

    `mode`: "load", "into" (a destination of the announced spec, made anew when the spec changes) or "into-rigid"
    (the tensor it holds under that name, whatever spec is announced: an engine with fixed parameters)."""
    torch.set_num_threads(1)
    device = get_backend().device().torch_device()
    held: dict[str, torch.Tensor] = {}
    receiver = WeightReceiver(endpoint, timeout_s=timeout_s)
    state = ReceiverState(dtypes=DtypeReport.from_wire(dtypes)) if dtypes is not None else None
    results.put("up")

    def into(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        dest = held.get(name)
        if dest is None or (mode != "into-rigid" and (dest.dtype != dtype or tuple(dest.shape) != tuple(shape))):
            dest = held[name] = torch.empty(shape, dtype=dtype, device=device)
        return dest  # "into-rigid": an engine's fixed tensor, whatever the sender now sends

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            held[name] = tensor.clone()

    while not (command := commands.get()).get("stop"):
        if "flip" in command:  # a byte of a destination changed behind hwsync's back
            flat = held[command["flip"]].view(-1).view(torch.uint8)
            flat[3] ^= 0x10
        for name in command.get("renew", ()):  # the engine made that tensor anew: new memory, zeros
            held[name] = torch.zeros_like(held[name])
        for name in command.get("copy", ()):  # ... new memory, holding what the old held
            held[name] = held[name].clone()
        try:
            loader: object = load if mode == "load" else None
            if "fail_after" in command:  # this engine fails its sync late, after the others completed theirs
                class Failing:  # a Loader whose done() fails
                    def load(self, pairs: list) -> None:
                        if mode == "load":
                            load(pairs)

                    def done(self, after: float = command["fail_after"]) -> None:
                        time.sleep(after)
                        raise RuntimeError("this engine failed at the end of its sync (told to)")
                loader = Failing()
            stats = receiver.receive(loader, into=None if mode == "load" else into, state=state)
            results.put({"version": receiver.version, "digests": procs.digests(held), "bytes": stats.bytes,
                         "at": time.time()})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put({"error": f"{type(exc).__name__}: {exc}", "version": receiver.version,
                         "incomplete": receiver.incomplete})
    receiver.close()
    os._exit(0)  # a spawned child: nothing of its parent's to clean up


def slow_load_receiver(endpoint: str, q, pause_s: float) -> None:
    """A load receiver that reports 'loading' at its first bucket of the third sync and then stalls (to be killed
    with its sender or itself), after two syncs that it reports."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(endpoint, timeout_s=30)
    held: dict[str, torch.Tensor] = {}
    q.put("up")
    told = []
    for sync in range(3):
        def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
            for name, tensor in pairs:
                held[name] = tensor.clone()
            if sync == 2 and not told:
                told.append(q.put("loading"))
                time.sleep(pause_s)
        try:
            receiver.receive(load)
            q.put({"version": receiver.version, "digests": procs.digests(held)})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            q.put({"error": f"{type(exc).__name__}: {exc}", "version": receiver.version,
                   "incomplete": receiver.incomplete})
    receiver.close()


def delta_sender_main(q, steps: int) -> None:
    """A delta sender in a process of its own: sends `steps` syncs of `stepped(step)`, reporting its endpoint first."""
    from hwsync import WeightSender

    torch.set_num_threads(1)
    with WeightSender(options=SenderOptions(bucket_bytes=1 << 14, delta=True, timeout_s=30)) as sender:
        q.put(sender.endpoint)
        for step in range(1, steps + 1):
            sender.send(stepped(step).items(), version=step)
    os._exit(0)


def stepped(step: int, n: int = 6) -> dict[str, torch.Tensor]:
    """A state dict that changes a little at each step: a few elements of most tensors, one tensor entirely."""
    g = torch.Generator().manual_seed(7)
    out = {f"w{i}": torch.randn(128, 64, generator=g) for i in range(n)}
    for s in range(2, step + 1):
        gs = torch.Generator().manual_seed(1000 + s)
        for i, t in enumerate(out.values()):
            if i == 0:
                t.copy_(torch.randn(t.shape, generator=gs))  # changes entirely: goes dense
            elif i % 2:
                idx = torch.randint(0, t.numel(), (t.numel() // 100,), generator=gs)
                t.view(-1)[idx] += 1.0  # about 1% changed: goes sparse
    return out
