"""Peers for tests: spawned processes on the simulated node that run commands one at a time.

A test drives them to play the other side of what it checks: a consumer that maps an export,
holds it, reads it again, closes it, or dies without closing; a rank of a simccl group on its
own device. Process start-up (importing torch) is what costs, so start several together and
reuse them across tests.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.multiprocessing as mp

from hwsync.backend import load_backend
from hwsync_sim import sharing
from hwsync_sim.simccl import SimProcessGroup

CTX = mp.get_context("spawn")


class Peer:
    """A spawned process on the simulated node that runs commands (see `serve`)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.conn, theirs = CTX.Pipe()
        self.process = CTX.Process(target=serve, args=(theirs, env or {}), daemon=True)
        self.process.start()
        self.pid = self.process.pid

    def send(self, command: str, *args: Any) -> None:
        """Start a command without waiting for its answer."""
        self.conn.send((command, args))

    def recv(self) -> Any:
        """The answer to the last command; a failure in the peer is raised here."""
        if not self.conn.poll(60):
            raise TimeoutError("the peer did not answer within 60 s")
        answer = self.conn.recv()
        if isinstance(answer, tuple) and answer and answer[0] == "error":
            raise RuntimeError(f"peer {self.pid}: {answer[1]}")
        return answer

    def call(self, command: str, *args: Any) -> Any:
        """Run a command and return its answer."""
        self.send(command, *args)
        return self.recv()

    def die(self) -> None:
        """End the peer at once, without any clean-up (as a kill would)."""
        self.send("die")
        self.process.join(30)

    def close(self) -> None:
        """End the peer (if it still runs) and reap it."""
        if self.process.is_alive():
            self.send("exit")
        self.process.join(30)


def serve(conn: Any, env: dict[str, str]) -> None:
    """A peer's loop: one command at a time, each answered (a failure as ("error", text))."""
    os.environ.update(env)  # before the sim starts in this process: HWSYNC_SIM_* are read then
    backend = load_backend("sim")
    device = backend.device()
    state: dict = {}
    while True:
        command, args = conn.recv()
        if command == "exit":
            return
        if command == "die":
            os._exit(0)
        try:
            conn.send(_run(command, args, backend, device, state))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _run(command: str, args: tuple, backend: Any, device: Any, state: dict) -> Any:
    if command == "devices":  # this (main) thread's device, and a new thread's
        seen = []
        thread = threading.Thread(target=lambda: seen.append(device.current_index()))
        thread.start()
        thread.join()
        return [device.current_index(), seen[0]]
    if command == "map":  # by default as the sim_ipc receiver does: on this process's index of the sender's device
        handles, index = args[0], (args[1] if len(args) > 1 else None)
        device.set_index(device.local_index(handles["physical_id"]) if index is None else index)
        state["mapped"] = sharing.open_shared(handles["buffers"][0], index)
        command = "read"
    if command == "device of mapped":
        return str(state["mapped"].device)
    if command == "read":
        return state["mapped"][:4].cpu().tolist()
    if command == "close":
        del state["mapped"]
        return "closed"
    if command == "hold":
        device.set_index(0)
        state["held"] = torch.empty(args[0], dtype=torch.uint8, device=device.torch_device())
        return "allocated"
    if command == "free":
        del state["held"]
        return "freed"
    if command in ("join", "join second"):  # address, rank, world: one device per rank, as NCCL needs
        device.set_index(args[1])
        state["comm" if command == "join" else "second"] = backend.communicator(*args, timeout_s=20)
        return "joined"
    if command == "all_reduce second then first":
        for key in ("second", "comm"):
            state[key].all_reduce(torch.zeros(4, device=device.torch_device()))
        return "queued"
    if command == "abort":
        for group in SimProcessGroup.live():
            group.abort()
        state.clear()
        return "aborted"
    if command == "barrier":
        state["comm"].barrier()
        device.synchronize()
        return "passed"
    if command == "all_reduce then synchronize":  # a barrier as all_reduce().wait(): the device waits, not the host
        state["comm"]._group.allreduce([torch.zeros(1, dtype=torch.int32, device=device.torch_device())]).wait()
        device.synchronize()
        return "passed"
    if command == "broadcast":  # queue one broadcast from rank 0 and return at once
        state["comm"].broadcast(torch.zeros(8, dtype=torch.uint8, device=device.torch_device()), 0)
        return "queued"
    if command == "destroy":
        state.pop("comm").destroy()
        return "destroyed"
    raise ValueError(f"unknown command {command!r}")
