"""Processes the vLLM tests start: fresh reference engines and a separate trainer.

Both run in spawned processes: a reference engine must not share vLLM's global state with the
engine under test, and the trainer must be a different process from the engine, as in an RL job.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

SPAWN = mp.get_context("spawn")


def checkpoint_tensors(model_dir: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a saved toy checkpoint, in the file's order."""
    from safetensors.torch import load_file

    return list(load_file(os.path.join(model_dir, "model.safetensors")).items())


def _reference_main(model_dirs: list[str], conn: Connection) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: starts in half the time
    torch.set_num_threads(1)
    from vllm import LLM

    from hwsync.cli.toy_model import cpu_engine_env, engine_kwargs, engine_outputs, shutdown_engine

    cpu_engine_env()
    results = []
    for model_dir in model_dirs:
        llm = LLM(**engine_kwargs(model_dir, extension=False))
        results.append(engine_outputs(llm))
        shutdown_engine(llm)
    conn.send(results)
    conn.close()


def reference_outputs(model_dirs: list[str], timeout_s: float = 600.0) -> list[Any]:
    """EngineOutputs of a fresh engine started on each checkpoint, one engine at a time."""
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_reference_main, args=(model_dirs, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"reference engines gave no outputs in {timeout_s}s")
        return parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def _trainer_main(model_dir: str, version: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    from hwsync import WeightSender, manifest_from_tensors

    tensors = checkpoint_tensors(model_dir)
    with WeightSender(timeout_s=60.0) as sender:
        conn.send(sender.endpoint)
        try:
            stats = sender.send(tensors, version=version, manifest=manifest_from_tensors(tensors))
            conn.send({"ok": True, "stats": stats.to_dict()})
        except Exception as exc:
            conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


class TrainerProcess:
    """A separate process that sends one checkpoint's tensors through a WeightSender."""

    def __init__(self, model_dir: str, version: int) -> None:
        self._conn, child = SPAWN.Pipe()
        self._proc = SPAWN.Process(target=_trainer_main, args=(model_dir, version, child), daemon=True)
        self._proc.start()
        child.close()

    def endpoint(self, timeout_s: float = 120.0) -> str:
        """The sender's endpoint, once the trainer has it."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError("the trainer process did not report its endpoint")
        return self._conn.recv()

    def result(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """The trainer's outcome: {"ok": True, "stats": ...} or {"ok": False, "error": ...}."""
        try:
            if not self._conn.poll(timeout_s):
                raise TimeoutError("the trainer process did not finish its send")
            return self._conn.recv()
        finally:
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.kill()


@contextlib.contextmanager
def in_process_engine(**kwargs: Any) -> Iterator[Any]:
    """A vllm.LLM whose engine core runs in this process (starts in half the time), stopped after.

    An in-process engine core freezes vLLM's environment cache; it is released afterwards so
    that later engines of the session read the environment again.
    """
    from hwsync.cli.toy_model import cpu_engine_env, shutdown_engine

    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    cpu_engine_env()
    import vllm.envs
    from vllm import LLM

    vllm.envs.disable_envs_cache()
    llm = None
    try:
        llm = LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            shutdown_engine(llm)
        if previous is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
        vllm.envs.disable_envs_cache()
