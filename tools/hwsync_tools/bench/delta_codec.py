"""`hwsync bench delta-codec`: the delta codec's diff, apply and digest against the memory-read floor.

On a synthetic transformer-shaped bf16 state dict (transfer.py's shapes), for each density and for bf16
trainer tensors and fp32 master weights cast to bf16: the diff (encode, as a sender runs it, with the
baseline's digest kept), the apply (scatter into a destination), the receiver's digest of every tensor,
and the payload each index code would take. The floor is the issue's: one read of the new tensors and of
the baselines at the single-thread copy speed, measured in the same run next to each row; the wire
floors are the payload over 1 and 10 Gbit/s. Then what a tensor costs beyond its bytes: the diff and the
apply of 512 tensors of 4096 elements, per tensor (a model of thousands of tensors, an MoE's experts, pays
it per tensor). Best of --repeat runs; on a shared machine compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Any, Callable

import torch

from hwsync.delta import CHUNK_ELEMS, DeltaEncoder, apply_into, payload_bytes, tensor_digest, warm
from hwsync.delta.header import BITMAP, BLOCKS, DENSE, SAME, STEPS
from hwsync_tools.bench import tiny_defaults
from hwsync_tools.bench.transfer import model_spec

_LINKS_GBIT = (1, 10)
#: the small tensors timed per tensor (a norm's weight each)
SMALL_TENSORS, SMALL_NUMEL = 512, 4096


def _best(fn: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_gbps(nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """Single-thread host `copy_` bandwidth over `nbytes`, best of `repeat`, in GB/s (threads restored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        return nbytes / _best(lambda: dst.copy_(src), repeat) / 1e9
    finally:
        torch.set_num_threads(threads)


def _perturb(base: torch.Tensor, density: float, master: bool, gen: torch.Generator) -> torch.Tensor:
    """New weights: `density` of the bf16 elements one ulp away; as fp32 masters, with sub-ulp noise everywhere."""
    bits = base.view(torch.int16)
    changed = torch.rand(base.shape, generator=gen) < density
    new_bits = torch.where(changed, bits + 1, bits)
    if not master:
        return new_bits.view(torch.bfloat16)
    # fp32 whose bf16 rounding is new_bits: the bf16 pattern in the top half, 15 random bits below the
    # rounding bit (below half an ulp, so round-to-nearest-even keeps the top half)
    low = torch.randint(0, 1 << 15, base.shape, dtype=torch.int32, generator=gen)
    return ((new_bits.to(torch.int32) << 16) | low).view(torch.float32)


def _sizes(deltas: list[Any], numels: list[int]) -> dict[str, int]:
    """Payload bytes of the whole set under each index code alone (and int32 positions), and as chosen."""
    out = {"chosen": sum(d.payload.numel() for d in deltas), DENSE: 0, BLOCKS: 0, BITMAP: 0, "int32_positions": 0}
    for d, n in zip(deltas, numels):
        k = d.changed if d.changed is not None else n
        out[DENSE] += 2 * n
        out[BLOCKS] += payload_bytes(BLOCKS, n, k, 2) if k else 0
        out[BITMAP] += payload_bytes(BITMAP, n, k, 2) if k else 0
        out["int32_positions"] += 6 * k
    return out


def _warm_up(encoder: DeltaEncoder) -> None:
    """Compile the host kernels (numba, once per machine: cached) before anything is timed."""
    warm.wait()
    for dtype in (torch.bfloat16, torch.float32):
        base = torch.zeros(1 << 17, dtype=dtype)
        for new in (base.clone().fill_(1), base + (torch.arange(base.numel()) % 3 == 0)):
            for trainer in (new, new.float()):
                delta = encoder.encode(trainer, base, base_digest=tensor_digest(base))
                apply_into(base.clone(), delta.header, delta.payload)


def _hash_rates(tensors: list[torch.Tensor], repeat: int) -> dict[str, float]:
    """GB/s of the digest (compiled and torch ops) and of the alternatives, over the same tensors."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    ways: dict[str, Callable[[torch.Tensor], Any]] = {
        "digest": tensor_digest,
        "digest_torch_ops": lambda t: tensor_digest(t, compiled=False),
        "torch.hash_tensor_xor": lambda t: torch.hash_tensor(t.view(-1).view(torch.int64)),
    }
    try:
        import blake3

        ways["blake3_1_thread"] = lambda t: blake3.blake3(t.view(-1).view(torch.uint8).numpy().data).digest()
    except ImportError:
        pass
    return {k: total / _best(partial(_each, f, tensors), repeat) / 1e9 for k, f in ways.items()}


def _best_apply(dests: list[torch.Tensor], bases: list[torch.Tensor], deltas: list[Any], repeat: int,
                gain: bool = False) -> float:
    """Seconds to apply `deltas` into `dests`, best of `repeat`, each time on the base (the step code writes
    differences to it)."""
    best = float("inf")
    for _ in range(repeat):
        for dest, base in zip(dests, bases):
            dest.copy_(base)
        t0 = time.perf_counter()
        for dest, d in zip(dests, deltas):
            apply_into(dest, d.header, d.payload, gain=gain)
        best = min(best, time.perf_counter() - t0)
    return best


def _each(f: Callable[[torch.Tensor], Any], tensors: list[torch.Tensor]) -> list[Any]:
    return [f(t) for t in tensors]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every (mode, density) row; a dict of the figures."""
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    spec = model_spec(int(args.elems * 2), "bf16")
    bases = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _, shape, _ in spec]
    numels = [b.numel() for b in bases]
    digests = [tensor_digest(b) for b in bases]
    encoder = DeltaEncoder(args.chunk_elems or CHUNK_ELEMS, engine=args.engine)
    dests = [b.clone() for b in bases]
    _warm_up(encoder)
    hashes = _hash_rates(dests, args.repeat)
    rows = []
    for mode in args.modes:
        for density in args.densities:
            news = [_perturb(b, density, mode == "fp32-master", gen) for b in bases]
            new_bytes = sum(t.numel() * t.element_size() for t in news)
            base_bytes = sum(b.numel() * 2 for b in bases)
            deltas: list[Any] = []

            # the closures take this iteration's lists as defaults (bound now, freed by the `del` below)
            def diff(news: list[torch.Tensor] = news, deltas: list[Any] = deltas) -> None:
                deltas[:] = [encoder.encode(n, b, base_digest=d) for n, b, d in zip(news, bases, digests)]

            diff_s = _best(diff, args.repeat)
            apply_s = _best_apply(dests, bases, deltas, args.repeat)
            for dest, d in zip(dests, deltas):  # the receiver's check, which also proves the apply exact
                if tensor_digest(dest) != d.header.digest:
                    raise RuntimeError("a destination's digest does not match after applying: the codec is wrong")
            hash_s = _best(lambda: [tensor_digest(t) for t in dests], args.repeat)
            gbps = copy_gbps(args.copy_mib << 20)  # next to the row: the machine's load changes
            floor_s = (new_bytes + base_bytes) / (gbps * 1e9)
            changed = sum(d.changed or 0 for d in deltas)
            sizes = _sizes(deltas, numels)
            codes = {c: sum(d.header.code == c for d in deltas) for c in (SAME, DENSE, BLOCKS, BITMAP, STEPS)}
            rows.append({
                "mode": mode, "density": density, "measured_density": changed / sum(numels),
                "new_bytes": new_bytes, "base_bytes": base_bytes, "copy_gbps": gbps, "floor_s": floor_s,
                "diff_s": diff_s, "diff_vs_floor": diff_s / floor_s, "apply_s": apply_s,
                "apply_vs_floor": apply_s / floor_s, "hash_all_s": hash_s,
                "hash_gbps": base_bytes / hash_s / 1e9, "payload_bytes": sizes, "codes": codes,
                "wire_floor_s": {f"{g}gbit": sizes["chosen"] * 8 / (g * 1e9) for g in _LINKS_GBIT},
            })
            del news, deltas, diff  # the closure holds the lists too
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": args.threads,
            "elements": sum(numels), "tensors": len(bases), "chunk_elems": encoder.chunk_elems,
            "engine": "numba" if encoder.uses_native(torch.device("cpu")) else "torch",
            "repeat": args.repeat, "hash_gbps": hashes, "rows": rows,
            "small_tensor_us": _small_tensors(encoder, args.modes[-1] == "fp32-master", args.densities[0], gen,
                                              args.repeat)}


def _small_tensors(encoder: DeltaEncoder, master: bool, density: float, gen: torch.Generator, repeat: int,
                   count: int = SMALL_TENSORS, numel: int = SMALL_NUMEL) -> dict[str, Any]:
    """Microseconds per tensor to diff and to apply `count` tensors of `numel` elements (a norm's weight): what
    each tensor costs beyond its bytes, which a model of thousands of tensors (an MoE's experts) pays per tensor."""
    bases = [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(count)]
    digests = [tensor_digest(b) for b in bases]
    news = [_perturb(b, density, master, gen) for b in bases]
    deltas = [encoder.encode(n, b, base_digest=d) for n, b, d in zip(news, bases, digests)]
    diff_s = _best(lambda: [encoder.encode(n, b, base_digest=d) for n, b, d in zip(news, bases, digests)], repeat)
    # as a receiver that checks from the changes applies
    apply_s = _best_apply([b.clone() for b in bases], bases, deltas, repeat, gain=True)
    return {"numel": numel, "tensors": count, "density": density, "mode": "fp32-master" if master else "bf16",
            "diff": diff_s / count * 1e6, "apply": apply_s / count * 1e6}


def add_bench_delta_codec_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `hwsync bench delta-codec`."""
    parser.add_argument("--elems", type=float, default=320e6,
                        help="bf16 elements in the state dict, rounded to whole layers (default: 327M in 26 tensors)")
    parser.add_argument("--densities", type=lambda s: [float(x) for x in s.split(",")],
                        default=[0.001, 0.01, 0.05, 0.3], help="fractions of elements changed, comma-separated")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["bf16", "fp32-master"],
                        help="bf16 (trainer tensors in bf16) and/or fp32-master (fp32 cast to the bf16 baseline)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    parser.add_argument("--chunk-elems", type=int, default=None, help="the diff's chunk (default: the codec's)")
    parser.add_argument("--engine", choices=["auto", "torch", "numba"], default="auto",
                        help="the diff's host engine: the compiled kernel (numba, when installed) or torch ops")
    parser.add_argument("--copy-mib", type=int, default=1024, help="MiB copied to measure the copy speed")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    tiny_defaults(parser, elems=1e6, repeat=1, copy_mib=8)


def run_bench_delta_codec(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON); 0 on success."""
    if any(m not in ("bf16", "fp32-master") for m in args.modes) or args.repeat < 1 or args.threads < 1:
        raise SystemExit("--modes takes bf16,fp32-master; --repeat and --threads must be at least 1")
    r = measure(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"hwsync bench delta-codec: {r['cpus']} CPUs, torch {r['torch']}, {r['threads']} thread(s), "
          f"{r['elements'] / 1e6:.0f}M bf16 elements in {r['tensors']} tensors, diff engine {r['engine']}, "
          f"chunks of {r['chunk_elems']}, "
          f"best of {r['repeat']}; floor = (new + baseline bytes) / single-thread copy speed")
    print(f"{'mode':12} {'dens':>6} {'payload MB':>10} {'floor s':>8} {'diff s':>7} {'/floor':>6} {'apply s':>7} "
          f"{'/floor':>6} {'hash s':>7} {'hash GB/s':>9} {'wire 1G s':>9} {'10G s':>6}  codes")
    for x in r["rows"]:
        codes = " ".join(f"{c}:{n}" for c, n in x["codes"].items() if n)
        print(f"{x['mode']:12} {x['density']:6.2%} {x['payload_bytes']['chosen'] / 1e6:10.1f} {x['floor_s']:8.3f} "
              f"{x['diff_s']:7.3f} {x['diff_vs_floor']:5.2f}x {x['apply_s']:7.3f} {x['apply_vs_floor']:5.2f}x "
              f"{x['hash_all_s']:7.3f} {x['hash_gbps']:9.2f} {x['wire_floor_s']['1gbit']:9.3f} "
              f"{x['wire_floor_s']['10gbit']:6.3f}  {codes}")
    print("hash GB/s over the set (digest = hwsync.delta's, which the receiver runs on what it holds): " +
          ", ".join(f"{k} {v:.1f}" for k, v in r["hash_gbps"].items()))
    small = r["small_tensor_us"]
    print(f"per tensor, over {small['tensors']} tensors of {small['numel']} elements at {small['density']:.2%} "
          f"({small['mode']}): diff {small['diff']:.1f} us, apply {small['apply']:.1f} us")
    print("payload MB of the whole set under one index code (block: uint16 offsets + a count per 65536; "
          "bitmap: a bit per element; int32 positions) and as chosen per tensor:")
    for x in r["rows"]:
        if x["mode"] == r["rows"][0]["mode"]:
            print(f"  {x['density']:6.2%}: " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in x["payload_bytes"].items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hwsync_tools.bench.delta_codec`."""
    parser = argparse.ArgumentParser(prog="hwsync bench delta-codec", description=__doc__.splitlines()[0])
    add_bench_delta_codec_arguments(parser)
    return run_bench_delta_codec(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
