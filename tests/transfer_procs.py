"""Processes for the transfer tests: senders and receivers that run in children of their own."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import multiprocessing as mp

import torch

from hwsync import WeightReceiver, WeightSender
from hwsync.sync.planner import EngineState
from hwsync.sync.report import ReceiverState
from hwsync.sync.options import SenderOptions


def dtype_matrix() -> dict[str, torch.Tensor]:
    """Every fixed-size dtype, with zero-size, scalar and non-contiguous shapes."""
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]
    for dt in dtypes:
        base = torch.randn(37, 29, generator=g) * 50
        if dt == torch.bool:
            full = base > 0
        elif dt == torch.complex64:
            full = torch.complex(base, base.flip(0))
        else:
            full = base.to(dt)
        name = str(dt).removeprefix("torch.")
        out[f"{name}.matrix"] = full
        out[f"{name}.transposed"] = full.t()  # non-contiguous
        out[f"{name}.strided"] = full[::3, 1::2]
        out[f"{name}.scalar"] = full[0, 0].clone()
        out[f"{name}.empty"] = full[:0]
        out[f"{name}.empty3d"] = torch.empty(4, 0, 2, dtype=dt)
    return out


def big_and_small(bucket_bytes: int) -> dict[str, torch.Tensor]:
    """One tensor 5x the bucket, with small ones around it."""
    g = torch.Generator().manual_seed(2)
    return {"before": torch.randn(100, generator=g),
            "huge": torch.randn(5 * bucket_bytes // 4 + 13, generator=g),
            "after": torch.randn(3, 3, generator=g).to(torch.bfloat16)}


def many_small(n: int = 10_000) -> dict[str, torch.Tensor]:
    """n tiny tensors of varied sizes."""
    g = torch.Generator().manual_seed(3)
    return {f"layer.{i}.w": torch.randn(1 + i % 17, generator=g) for i in range(n)}


def versioned(version: int) -> dict[str, torch.Tensor]:
    """A small state dict whose contents depend on the version."""
    g = torch.Generator().manual_seed(100 + version)
    return {f"w{i}": torch.randn(256, 64, generator=g) for i in range(8)}


SETS = {"matrix": lambda bb: dtype_matrix(), "big": big_and_small, "many": lambda bb: many_small(),
        "v1": lambda bb: versioned(1), "v2": lambda bb: versioned(2), "v3": lambda bb: versioned(3)}


def digest(t: torch.Tensor) -> list:
    """dtype, shape and a hash of the exact bytes (copied to the host first: numpy() refuses device tensors)."""
    flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return [str(t.dtype), list(t.shape), hashlib.sha256(flat.cpu().numpy().tobytes()).hexdigest()]


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """Digest of every tensor."""
    return {n: digest(t) for n, t in tensors.items()}


def start_receiver(target, endpoint: str, syncs: int = 1, **kwargs):
    """Spawn `target(endpoint, syncs, q, **kwargs)` in a fresh process; (the process, its result queue)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(endpoint, syncs, q), kwargs=kwargs)
    p.start()
    return p, q


def receive_n(endpoint: str, syncs: int, q, fail_in_load: str | None = None, timeout_s: float = 30.0,
              fail_delay_s: float = 0.0) -> None:
    """Receive `syncs` syncs; report each one's digests, version and stats, or the exception text."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(endpoint, timeout_s=timeout_s)
    for _ in range(syncs):
        got: dict[str, list] = {}
        calls = [0]

        def load(pairs):
            calls[0] += 1
            for name, t in pairs:
                if fail_in_load and name == fail_in_load:
                    time.sleep(fail_delay_s)
                    raise RuntimeError(f"engine cannot load {name}: out of memory (test)")
                got[name] = digest(t)

        try:
            stats = receiver.receive(load)
            q.put({"digests": got, "version": receiver.version, "buckets": stats.buckets, "loads": calls[0],
                   "incomplete": receiver.incomplete})
        except Exception as exc:
            q.put({"error": f"{type(exc).__name__}: {exc}", "version": receiver.version,
                   "incomplete": receiver.incomplete})
    receiver.close()


def slow_receiver_main(endpoint: str) -> None:
    """A receiver that stalls in load forever (to be killed); prints when it has started loading."""
    receiver = WeightReceiver(endpoint, timeout_s=30)

    def load(pairs):
        print("loading", flush=True)
        time.sleep(600)

    receiver.receive(load)


def sender_main(set_name: str, bucket_bytes: int, stall_after: int) -> None:
    """A sender in a process of its own: prints its endpoint, then sends, stalling after some tensors."""
    tensors = SETS[set_name](bucket_bytes)

    def source():
        for i, item in enumerate(tensors.items()):
            if i == stall_after:
                print("stalling", flush=True)
                time.sleep(600)
            yield item

    with WeightSender(options=SenderOptions(bucket_bytes=bucket_bytes, timeout_s=30)) as sender:
        print(json.dumps({"endpoint": sender.endpoint, "pid": os.getpid()}), flush=True)
        sender.send(source(), version=7)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "sender":
        sender_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif role == "slow_receiver":
        slow_receiver_main(sys.argv[2])


def receive_with_states(endpoint: str, states: list[dict], q) -> None:
    """One sync per reported engine state; report the names and bytes that arrived."""
    receiver = WeightReceiver(endpoint, timeout_s=30)
    for state in states:
        names: list[str] = []
        announced: list[str] = []
        nbytes = [0]

        def count(pairs):
            for name, t in pairs:
                names.append(name)
                nbytes[0] += t.numel() * t.element_size()

        class Collect:  # a Loader: the manifest as announced, and each bucket's tensors
            load = staticmethod(count)

            @staticmethod
            def accept(version: int, specs: list) -> None:
                announced.extend(s.name for s in specs or [])

        stats = receiver.receive(Collect(), state=ReceiverState(engine=EngineState.from_dict(state) if state else None))
        q.put({"names": names, "announced": announced, "bytes": nbytes[0], "transport_bytes": stats.bytes})
    receiver.close()


def receive_with_slow_checks(endpoint: str, syncs: int, q) -> None:
    """receive_n with the doorbell wait's liveness checks an hour apart: a frame must be read as it comes."""
    import hwsync.colocated.doorbell as doorbell

    doorbell.DOORBELL_FIRST_CHECK_S = doorbell.DOORBELL_CHECK_S = 3600.0  # type: ignore[misc]
    receive_n(endpoint, syncs, q, timeout_s=20.0)
