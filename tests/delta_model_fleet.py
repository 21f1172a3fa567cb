"""The processes the delta model checker drives (tests/delta_model_procs.py), kept alive across examples: starting
one costs seconds, a sync milliseconds. A process that died, was killed or did not answer is replaced when next
needed. Replies that do not come are a hang (`Stuck`), reported as the checker's own failure."""

from __future__ import annotations

import os
import queue
import signal
import time
from typing import Any

import delta_model_procs as procs

#: how long a process may take to start (spawn, import torch and hwsync)
START_S = 120.0


class Stuck(AssertionError):
    """A process gave no reply in time: hwsync hung (every wait of hwsync's has a timeout: it must not)."""


class Proc:
    """One process of delta_model_procs, its command queue and its reply queue."""

    def __init__(self, target: Any) -> None:
        self.commands, self.results = procs.CTX.Queue(), procs.CTX.Queue()
        self.process = procs.CTX.Process(target=target, args=(self.commands, self.results), daemon=True)
        self.process.start()
        self.pid = self.process.pid
        self.get(START_S, "starting")

    def put(self, **command: Any) -> None:
        """Send a command; its reply comes through get()."""
        self.commands.put(command)

    def get(self, timeout_s: float, what: str) -> dict[str, Any]:
        """The next reply; Stuck when none comes in time, RuntimeError when the process died without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.results.get(timeout=0.2)
            except queue.Empty:
                if not self.process.is_alive():
                    try:  # a reply may have been queued just before it exited
                        return self.results.get(timeout=0.5)
                    except queue.Empty:
                        raise RuntimeError(f"process {self.pid} exited ({self.process.exitcode}) while {what}") \
                            from None
                if time.monotonic() > deadline:
                    raise Stuck(f"process {self.pid} gave no reply within {timeout_s:.0f}s while {what}; its threads "
                                f"then:\n{self.stacks()}") from None

    def stacks(self) -> str:
        """Every thread's stack in the process now (faulthandler, on SIGUSR1), the innermost frames last."""
        path = procs.stacks_path(self.pid)
        try:
            os.kill(self.pid, signal.SIGUSR1)
            time.sleep(1.0)
            with open(path) as f:
                return f.read()[-6000:] or "(none written)"
        except OSError as exc:
            return f"(none: {exc})"

    def call(self, wait_s: float = 60.0, **command: Any) -> dict[str, Any]:
        """A command and its reply; a reply that says the harness itself failed raises RuntimeError."""
        self.put(**command)
        reply = self.get(wait_s, f"answering {command['cmd']!r}")
        if "crash" in reply:
            raise RuntimeError(f"process {self.pid} failed at {command['cmd']!r}:\n{reply['crash']}")
        return reply

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL, at once (mid-sync: nothing of the process's own cleanup runs)."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(30)
        try:
            os.unlink(procs.stacks_path(self.pid))
        except OSError:
            pass

    def stop(self) -> None:
        """Ask it to end; kill it if it does not."""
        if self.process.is_alive():
            self.put(cmd="stop")
            self.process.join(20)
        self.kill()


class Fleet:
    """One trainer process and up to `size` engine processes, reused across the examples of a test session."""

    def __init__(self, size: int = 2) -> None:
        self._sender: Proc | None = None
        self._receivers: list[Proc | None] = [None] * size
        self.started = 0  # processes started (each costs seconds: the budget's largest part)

    def sender(self) -> Proc:
        """The trainer process (a fresh one if the last died or was killed)."""
        if self._sender is None or not self._sender.alive():
            self._sender = Proc(procs.sender_main)
            self.started += 1
        return self._sender

    def receiver(self, index: int) -> Proc:
        """Engine process `index` (a fresh one if it died or was killed)."""
        proc = self._receivers[index]
        if proc is None or not proc.alive():
            proc = self._receivers[index] = Proc(procs.receiver_main)
            self.started += 1
        return proc

    def kill_sender(self) -> None:
        """Kill the trainer process now."""
        if self._sender is not None:
            self._sender.kill()
            self._sender = None

    def kill_receiver(self, index: int) -> None:
        """Kill engine process `index` now."""
        proc = self._receivers[index]
        if proc is not None:
            proc.kill()
            self._receivers[index] = None

    def quiet(self) -> None:
        """Between examples: close every WeightSender and WeightReceiver; kill any process that does not answer."""
        for index, proc in enumerate(self._receivers):
            if proc is not None and not _closed(proc):
                self.kill_receiver(index)
        if self._sender is not None and not _closed(self._sender):
            self.kill_sender()

    def stop(self) -> None:
        """End every process."""
        for proc in [self._sender, *self._receivers]:
            if proc is not None:
                proc.stop()
        self._sender, self._receivers = None, [None] * len(self._receivers)


def _closed(proc: Proc) -> bool:
    """Close its hwsync object; whether it answered (a stalled or dead process does not)."""
    if not proc.alive():
        return False
    try:
        while True:  # a reply left over from a step that failed midway
            proc.results.get_nowait()
    except queue.Empty:
        pass
    try:
        return bool(proc.call(wait_s=30.0, cmd="close").get("ok"))
    except (Stuck, RuntimeError):
        return False
