"""Processes the vLLM tests start: fresh reference engines and a separate trainer.

Both run in spawned processes: a reference engine must not share vLLM's global state with the
engine under test, and the trainer must be a different process from the engine, as in an RL job.
A reference process starts before the engine under test and works while it starts (most of an
engine's start on a CPU is importing vLLM, on one core): tests read its outputs when they need them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import Any

import torch
from hwsync.sync.options import SenderOptions

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
    for model_dir in model_dirs:
        if conn.poll():  # told to stop: no test will read the rest
            break
        llm = LLM(**engine_kwargs(model_dir, extension=False))
        conn.send(engine_outputs(llm))  # each checkpoint's as soon as it is known: the first test waits the least
        shutdown_engine(llm)
    conn.close()


class References(Mapping[str, Any]):
    """EngineOutputs of a fresh engine started on each named checkpoint, one engine at a time, in a spawned process.

    The process starts at once and runs while the engine under test starts and serves: reading a name waits only
    for the checkpoints up to that one (in the given order). Its engines share nothing with the engine under test
    (nor with anything an earlier test did in this process); on a 2-core machine the two start side by side.
    """

    def __init__(self, model_dirs: dict[str, str], timeout_s: float = 600.0) -> None:
        self._names = list(model_dirs)
        self._outputs: dict[str, Any] = {}
        self._timeout_s = timeout_s
        self._conn, child = SPAWN.Pipe()
        self._proc = SPAWN.Process(target=_reference_main, args=(list(model_dirs.values()), child), daemon=True)
        self._proc.start()
        child.close()

    def __getitem__(self, name: str) -> Any:
        if name not in self._names:
            raise KeyError(name)
        while name not in self._outputs:
            waiting_for = self._names[len(self._outputs)]
            try:
                if not self._conn.poll(self._timeout_s):
                    raise TimeoutError(f"the reference engine on {waiting_for} gave no outputs in {self._timeout_s}s")
                self._outputs[waiting_for] = self._conn.recv()
            except EOFError:
                self._proc.join(10)
                raise RuntimeError(f"the reference process ended (exit code {self._proc.exitcode}) before its "
                                   f"engine on {waiting_for} gave outputs (its error: in the output)") from None
        return self._outputs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def close(self) -> None:
        """Stop the reference process (after its current engine, where it still has checkpoints to go)."""
        try:
            self._conn.send("stop")
        except (BrokenPipeError, OSError):  # it has ended already
            pass
        self._proc.join(120)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()


def _trainer_main(model_dir: str, version: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    from hwsync import WeightSender
    from hwsync.sync.spec import manifest_from_tensors

    tensors = checkpoint_tensors(model_dir)
    with WeightSender(options=SenderOptions(timeout_s=60.0)) as sender:
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


#: a prompt longer than one KV block on CPU (128 tokens): only such a prompt is served from the prefix cache
LONG_PROMPT = [(7 * i + 3) % 1000 + 1 for i in range(200)]


def greedy_tokens(llm: Any, prompt: list[int], lora_request: Any = None, max_tokens: int = 8) -> list[int]:
    """Greedy tokens without prompt logprobs (a request asking for them never reads the prefix cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False, lora_request=lora_request)
    return list(out[0].outputs[0].token_ids)


def _lora_reference_main(model_dir: str, engine_args: dict[str, Any], conn: Connection) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from hwsync.cli.toy_model import cpu_engine_env, engine_kwargs, engine_outputs, shutdown_engine

    cpu_engine_env()
    llm = LLM(**engine_kwargs(model_dir, extension=False), **engine_args)
    conn.send("ready")
    ids: dict[str, int] = {}
    while True:
        adapter_dir = conn.recv()
        if adapter_dir is None:
            break
        request = None
        if adapter_dir:  # a fresh id per directory: vLLM reads each adapter from disk once
            request = LoRARequest(f"disk-{len(ids) + 1}", ids.setdefault(adapter_dir, len(ids) + 1), adapter_dir)
        conn.send((engine_outputs(llm, lora_request=request), greedy_tokens(llm, LONG_PROMPT, request)))
    shutdown_engine(llm)
    conn.close()


class LoraReference:
    """A fresh engine on the base checkpoint in its own process, loading adapters from disk as vLLM does."""

    def __init__(self, model_dir: str, **engine_args: Any) -> None:
        self._conn, child = SPAWN.Pipe()
        self._proc = SPAWN.Process(target=_lora_reference_main, args=(model_dir, engine_args, child), daemon=True)
        self._proc.start()
        child.close()
        self._ready = False

    def outputs(self, adapter_dir: str | None, timeout_s: float = 600.0) -> tuple[Any, list[int]]:
        """(EngineOutputs of the fixed prompt, greedy tokens of LONG_PROMPT) under the adapter saved in `adapter_dir`."""
        if not self._ready:
            if not self._conn.poll(timeout_s) or self._conn.recv() != "ready":
                raise TimeoutError("the reference engine did not start")
            self._ready = True
        self._conn.send(adapter_dir or "")
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"the reference engine gave no outputs for {adapter_dir}")
        return self._conn.recv()

    def close(self) -> None:
        """Stop the reference engine."""
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
