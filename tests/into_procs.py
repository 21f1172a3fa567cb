"""Receiver processes for the doorbell and receive(into=...) tests.

One receiver runs a list of syncs, each described by a spec dict, and reports each sync on a
queue: the digests of what arrived (through `into` destinations and through `load`), which
names each callback saw, whether the doorbell was attached, the receiver's stats or the error.

Spec keys (all optional):
  endpoint: connect here (a new WeightReceiver when it differs from the previous sync's)
  set, bucket: the tensor set (transfer_procs.SETS or SETS here) whose destinations to preallocate
  into: pass into= (default False); load: pass load= (default True)
  decline: names into() returns None for
  bad: (kind, name) with kind "dtype", "shape" or "noncontig": into() returns a wrong destination
  layout: "arena" for destinations that are views into one buffer (floating ones nn.Parameters)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp

from hwsync import WeightReceiver

from transfer_procs import SETS as TRANSFER_SETS, digest, dtype_matrix

GARBAGE = 0xA5


def into_set(bucket_bytes: int, seed: int = 4) -> dict[str, torch.Tensor]:
    """Every dtype (scalars, zero-size, non-contiguous sources) plus tensors split over several buckets."""
    g = torch.Generator().manual_seed(seed)
    out = {"split.f32": torch.randn(5 * bucket_bytes // 4 + 13, generator=g)}  # 5x the bucket, odd size
    out.update(dtype_matrix())
    out["split.bf16"] = torch.randn(3, bucket_bytes // 2 + 7, generator=g).to(torch.bfloat16)  # 3x, 2-D
    out["split.int8"] = torch.randint(-128, 127, (2 * bucket_bytes + 1,), generator=g, dtype=torch.int8)
    out["split.c64.t"] = torch.complex(torch.randn(bucket_bytes // 64, 16, generator=g),
                                       torch.randn(bucket_bytes // 64, 16, generator=g)).t()  # 2x, strided
    out["tail.scalar"] = torch.tensor(3.25, dtype=torch.float64)
    return out


def long_names(n: int = 10_000, name_chars: int = 200) -> dict[str, torch.Tensor]:
    """n tiny tensors whose names are `name_chars` characters long (every 97th is zero-size)."""
    g = torch.Generator().manual_seed(5)
    out = {}
    for i in range(n):
        prefix = f"model.layers.{i:05d}."
        out[prefix + "w" * (name_chars - len(prefix))] = torch.randn(0 if i % 97 == 0 else 1 + i % 5, generator=g)
    return out


SETS = {**TRANSFER_SETS, "into": into_set, "into2": lambda bb: into_set(bb, seed=6),
        "long_names": lambda bb: long_names()}


def _wrong_destination(kind: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if kind == "dtype":
        return torch.empty(shape, dtype=torch.float64 if dtype != torch.float64 else torch.float32)
    if kind == "shape":
        numel = 1
        for s in shape:
            numel *= s
        return torch.empty(numel + 1, dtype=dtype)
    if kind == "noncontig":
        assert len(shape) == 2, "pick a 2-D tensor for a non-contiguous destination"
        return torch.empty(shape[1], shape[0], dtype=dtype).t()
    raise ValueError(kind)


def _arena(expected: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Destinations as views into one flat buffer, 8-byte aligned with a guard gap after each (like a
    fused weight or a preallocated pool); floating-point ones as nn.Parameters that require grad.
    Returns (arena, guard mask, destinations)."""
    offsets, end = {}, 0
    for name, t in expected.items():
        offsets[name] = end
        end = (end + t.numel() * t.element_size() + 8 + 7) // 8 * 8  # >= 8 guard bytes after each
    arena = torch.empty(end, dtype=torch.uint8)
    guard = torch.ones(end, dtype=torch.bool)
    dests = {}
    for name, t in expected.items():
        nbytes = t.numel() * t.element_size()
        guard[offsets[name] : offsets[name] + nbytes] = False
        dest = arena[offsets[name] : offsets[name] + nbytes].view(t.dtype).view(t.shape)
        if t.dtype.is_floating_point or t.dtype.is_complex:
            try:
                dest = torch.nn.Parameter(dest, requires_grad=True)
            except RuntimeError:  # a dtype autograd refuses (float8): a plain view then
                pass
        assert dest.data_ptr() == arena.data_ptr() + offsets[name] or nbytes == 0
        dests[name] = dest
    return arena, guard, dests


def _one_sync(receiver: WeightReceiver, spec: dict, dests: dict[str, torch.Tensor]) -> dict:
    expected = SETS[spec["set"]](spec.get("bucket", 1 << 16)) if spec.get("set") else {}
    arena = guard = None
    if spec.get("layout") == "arena":
        arena, guard, fresh = _arena(expected)
        dests.update(fresh)
        arena.fill_(GARBAGE ^ 0xFF)
    for name, t in expected.items():
        if name not in dests or dests[name].shape != t.shape or dests[name].dtype != t.dtype:
            dests[name] = torch.empty(t.shape, dtype=t.dtype)  # preallocated, kept across syncs
        with torch.no_grad():
            dests[name].detach().reshape(-1).view(torch.uint8).fill_(GARBAGE)  # whatever is left from before
    decline = set(spec.get("decline", ()))
    bad = spec.get("bad")
    asked: list[str] = []
    given: list[str] = []
    loaded: dict[str, list] = {}
    calls = [0]
    bell_seen: list[bool] = []

    def into(name: str, dtype: torch.dtype, shape: tuple[int, ...]):
        asked.append(name)
        bell_seen.append(receiver._doorbell is not None)
        if name in decline:
            return None
        if bad and bad[1] == name:
            return _wrong_destination(bad[0], dtype, shape)
        dest = dests.get(name)
        if dest is not None:
            given.append(name)
        return dest

    def load(pairs):
        calls[0] += 1
        bell_seen.append(receiver._doorbell is not None)
        for name, t in pairs:
            loaded[name] = digest(t)

    kwargs = {"into": into} if spec.get("into") else {}
    result: dict = {}
    try:
        stats = receiver.receive(load if spec.get("load", True) else None, **kwargs)
        result["stats"] = {k: getattr(stats, k) for k in ("bucket_bytes", "num_buffers", "buckets", "tensors",
                                                            "bytes", "version")}
        result["version"] = receiver.version
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result.update(asked=asked, loaded=loaded, load_calls=calls[0], incomplete=receiver.incomplete,
                  into_digests={n: digest(dests[n].detach()) for n in given}, doorbell_seen=bell_seen)
    if arena is not None:
        result["guard_intact"] = bool((arena[guard] == (GARBAGE ^ 0xFF)).all())
        result["parameters"] = sorted(n for n in given if isinstance(dests[n], torch.nn.Parameter))
    return result


def receive_syncs(endpoint: str, specs: list[dict], q, timeout_s: float = 30.0) -> None:
    """Receive one sync per spec; put each one's report on `q`."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(endpoint, timeout_s=timeout_s)
    dests: dict[str, torch.Tensor] = {}
    for spec in specs:
        if spec.get("endpoint", endpoint) != endpoint:
            receiver.close()
            endpoint = spec["endpoint"]
            receiver = WeightReceiver(endpoint, timeout_s=timeout_s)
        q.put(_one_sync(receiver, spec, dests))
    receiver.close()


@contextmanager
def start_receiver(endpoint: str, specs: list[dict], timeout_s: float = 30.0) -> Iterator:
    """A receive_syncs process; yields its report queue, and never leaves the process behind."""
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=receive_syncs, args=(endpoint, specs, q),
                                        kwargs={"timeout_s": timeout_s})
    p.start()
    try:
        yield q
        p.join(30)
        assert p.exitcode == 0, f"receiver process exited with {p.exitcode}"
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
