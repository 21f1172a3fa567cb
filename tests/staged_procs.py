"""Engines that stage: a process that keeps answering requests (reading every weight it holds, under its pause lock)
while a WeightReceiver(stage=True) stages the next version on another thread, and applies it inside the pause.

Each request digests the whole model: what the test checks is that every request an engine answered during a sync
saw one version whole (the previous, or after the apply the new), never a mix and never a staged byte early.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.multiprocessing as mp
import transfer_procs as procs

from hwsync import CrossNodeReceiver, WeightReceiver
from hwsync.backend.registry import get_backend
from hwsync.protocol import Complete, RankComplete

CTX = mp.get_context("spawn")


def start(endpoint: str, mode: str = "into", timeout_s: float = 30.0, env: dict[str, str] | None = None,
          rank: int | None = None):
    """A staging engine process: (process, command queue, result queue); it is up when this returns. `rank`: a
    CrossNodeReceiver of that rank, None: a WeightReceiver."""
    commands, results = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=engine_main, args=(endpoint, mode, timeout_s, env or {}, rank, commands, results),
                       daemon=True)
    proc.start()
    assert results.get(timeout=90) == "up"
    return proc, commands, results


def model_digest(held: dict[str, torch.Tensor]) -> str:
    """One digest of every weight the engine holds (by name)."""
    return procs.hashlib.sha256(repr(sorted((n, procs.digest(t)) for n, t in held.items())).encode()).hexdigest()


class Engine:
    """What the engine holds, the lock its requests and the apply share, and the requests it answered."""

    def __init__(self, mode: str, device: torch.device) -> None:
        self.mode, self.device = mode, device
        self.held: dict[str, torch.Tensor] = {}
        self.lock = threading.Lock()
        self.answered: list[str] = []  # the model digest each request saw
        self.times: list[float] = []  # when each request ended
        self.applies = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                seen = model_digest(self.held) if self.held else ""
            self.answered.append(seen)
            self.times.append(time.time())
            time.sleep(0.002)

    # -- the Loader the receiver calls
    def load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            self.held[name] = tensor.to(self.device, copy=True)

    def into(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        if self.mode != "into":
            return None
        dest = self.held.get(name)
        if dest is None or dest.dtype != dtype or tuple(dest.shape) != tuple(shape):
            dest = self.held[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        return dest

    def pause(self) -> threading.Lock:
        self.applies += 1
        return self.lock

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def engine_main(endpoint: str, mode: str, timeout_s: float, env: dict[str, str], rank: int | None, commands,
                results) -> None:
    """Receive one sync per command: {"receive": True}, optionally {"die_after_staging": True} (SIGKILL right after
    this engine says staged), {"slow_to_say_staged": seconds}, {"serve": seconds} (answer requests only), {"flip":
    name} (a byte of its staged copy changes behind hwsync's back first), {"change_engine_after_staging": name} (a
    byte of the engine's own tensor changes once it said staged, before the commit) or {"stop": True}. Each result: the
    version, the model's digest, and the digests of the requests answered during the sync."""
    os.environ.update(env)
    torch.set_num_threads(1)
    engine = Engine(mode, get_backend().device().torch_device())
    if rank is None:
        receiver = WeightReceiver(endpoint, timeout_s=timeout_s, stage=True)
        channel, staged_frame = receiver._control, Complete
    else:
        receiver = CrossNodeReceiver(endpoint, rank=rank, timeout_s=timeout_s, stage=True)
        channel, staged_frame = receiver._link, RankComplete
    results.put("up")
    send = channel.send
    while not (command := commands.get()).get("stop"):
        channel.send = send
        if "serve" in command:  # answer requests for that long, receiving nothing
            engine.answered.clear()
            time.sleep(command["serve"])
            results.put({"version": receiver.version, "digest": model_digest(engine.held),
                         "answered": sorted(set(engine.answered)), "requests": len(engine.answered),
                         "applies": engine.applies})
            continue
        die, delay = bool(command.get("die_after_staging")), float(command.get("slow_to_say_staged", 0.0))
        changed = command.get("change_engine_after_staging")

        def send_and_then(frame, send=send, die=die, delay=delay, changed=changed):
            if isinstance(frame, staged_frame):  # staged and checked
                # the tests check that the engine answered requests while the sync was in flight: it says staged
                # only once it answered one (a short delta on a loaded machine could end before its serving
                # thread ran at all)
                deadline = time.monotonic() + 30
                while not engine.answered and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(delay)  # the other receivers say so first
            send(frame)
            if die and isinstance(frame, staged_frame):  # said so: killed before every receiver did (no Apply)
                os.kill(os.getpid(), signal.SIGKILL)
            if changed and isinstance(frame, staged_frame):  # the engine's own tensor (the delta's base) changes
                with engine.lock:  # before the Apply (this thread reads it next)
                    engine.held[changed].view(-1).view(torch.uint8)[3] ^= 0x10

        channel.send = send_and_then
        if "flip" in command:
            staged = receiver._staging._tensors[command["flip"]]
            staged.view(-1).view(torch.uint8)[3] ^= 0x10
        engine.answered.clear()
        engine.times.clear()
        try:
            stats = receiver.receive(engine, into=engine.into if mode == "into" else None)
            results.put({"version": receiver.version, "digest": model_digest(engine.held),
                         "answered": sorted(set(engine.answered)), "requests": len(engine.answered),
                         "applies": engine.applies, "stage": stats.stage.__dict__ if stats.stage else None,
                         "timeline": list(zip(engine.times, engine.answered)),
                         "delta": stats.delta.mode if stats.delta else None,
                         "staging_bytes": receiver._staging.held_bytes if receiver._staging else 0})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results.put({"error": f"{type(exc).__name__}: {exc}", "version": receiver.version,
                         "digest": model_digest(engine.held), "answered": sorted(set(engine.answered)),
                         "requests": len(engine.answered), "incomplete": receiver.incomplete,
                         "staging_bytes": receiver._staging.held_bytes if receiver._staging else 0})
    engine.stop()
    receiver.close()
    os._exit(0)


def stepped(step: int) -> dict[str, torch.Tensor]:
    """Version `step` of a small model: each step changes about 1% of most tensors (a delta) and one wholly."""
    from delta_procs import stepped as delta_stepped

    return delta_stepped(step)


def sender_main(commands, out, stall_version: int, stall_after: int, delta: bool = True) -> None:
    """A sender in a process of its own: sends each version it is told (`stepped(version)`) and says it sent it;
    at `stall_version` it stalls after `stall_after` tensors (to be killed), saying "stalling" first. With `delta`,
    a delta is encoded whole before its offer: the stall comes before any receiver was offered the sync."""
    from hwsync import WeightSender
    from hwsync.sync.options import SenderOptions

    torch.set_num_threads(1)
    with WeightSender(num_receivers=2, options=SenderOptions(bucket_bytes=1 << 14, delta=delta, timeout_s=30)) as s:
        out.put(s.endpoint)
        while True:
            version = commands.get()

            def source(version: int = version):
                for i, item in enumerate(stepped(version).items()):
                    if version == stall_version and i == stall_after:
                        out.put("stalling")
                        time.sleep(600)
                    yield item

            s.send(source(), version=version)
            out.put(version)
