"""Ranks of the cross-node path inside bed hosts (targets of hwsync_tools.bed.spawn: JSON in, JSON out).

Each rank runs a list of phases (a CrossNodeSender or CrossNodeReceiver each, with its own endpoint
and timeout) and in each phase a list of syncs. The test drives the pace through files in a shared
folder, which every host sees (the hosts share the machine's file system):
- the rank writes `up-WHO` once imported, and `res-WHO-P-V.json` after sync V of phase P (its outcome);
- it starts sync V of phase P only once `go-P-V` exists, so the test can cut a link or change a rate between syncs;
- a receiver writes `loaded-WHO-P-V` once it loaded (or staged) the first bucket of a sync: the moment for a fault
  mid-sync.

A phase may also make the senders late (`late_s`: they wait that long after `go` before each first sync of the
phase), let receivers call receive() again after a timeout (`retries`, after `retry_pause_s[rank]` seconds: a
user's retry loop), bind sender 0's hub to every address of its host (`hub_wildcard`: tcp://0.0.0.0), and make the
receivers stage (`stage`: CrossNodeReceiver(stage=True); their load runs only at the commit).

A receiver's outcome says whether the sync was exact (`exact`: what its engine serves, the tensors every load gave it
in this phase, is that version bit-exact) and, after a failed sync, which version its engine still serves bit-exact
(`serves`, None for a mix) and what its staging still holds (`staged`, `staging_bytes`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from hwsync.sync.options import CrossNodeOptions

LOG_KEYS = ("built its group", "joined sender")  # the one line per group build that names the interface


def tensors(version: int, mb: float) -> list[tuple[str, Any]]:
    """About `mb` MB, deterministic per version: bf16, int8, bool, empty, then a large fp32 tensor chunked over
    buckets."""
    import torch

    g = torch.Generator().manual_seed(1000 + version)
    big = max(1, int(mb * 1e6) // 4 - 40_000)
    # small ones first: the first bucket holds whole tensors
    return [("w_bf16", torch.randn(64, 257, generator=g).to(torch.bfloat16)),
            ("i8", torch.randint(-128, 127, (4099,), generator=g, dtype=torch.int8)),
            ("mask", torch.rand(77, generator=g) > 0.5),
            ("empty", torch.empty(0, 3)),
            ("embed", torch.randn(big, generator=g)),
            ("tail", torch.randn(30_000, generator=g))]


def _wait_file(path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _write(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if any(key in msg for key in LOG_KEYS):
            self.lines.append(msg)


def _setup(folder: str, who: str) -> _Lines:
    import torch

    import hwsync  # noqa: F401 - imported before "up": the import's time never counts against a timeout

    torch.set_num_threads(1)
    handler = _Lines()
    logger = logging.getLogger("hwsync")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    _write(os.path.join(folder, f"up-{who}"), os.getpid())
    return handler


def _outcome(folder: str, who: str, p: int, v: int, t0: float, ok: bool, **extra: Any) -> dict:
    out = {"phase": p, "version": v, "ok": ok, "start": t0, "end": time.time(), **extra}
    _write(os.path.join(folder, f"res-{who}-{p}-{v}.json"), out)
    return out


def sender(folder: str, rank: int, phases: list[dict], wait_s: float = 120.0) -> dict:
    """Sender rank `rank` through every phase; its outcomes and the log lines that name its interface."""
    from hwsync.disaggregated import CrossNodeSender

    who = f"s{rank}"
    lines = _setup(folder, who)
    outcomes = []
    for p, phase in enumerate(phases):
        endpoint = phase["endpoint"]
        if rank == 0 and phase.get("hub_wildcard"):  # bound to every address; the others connect to the real one
            endpoint = "tcp://0.0.0.0:" + endpoint.partition("#")[0].rpartition(":")[2] + endpoint[endpoint.index("#"):]
        options = CrossNodeOptions(bucket_bytes=phase["bucket_bytes"], timeout_s=phase["timeout_s"],
                                   secret_key=phase.get("secret") if rank == 0 else None)
        tx = CrossNodeSender(endpoint, rank=rank, num_senders=phase["senders"], num_receivers=phase["receivers"],
                             options=options)
        try:
            for i, v in enumerate(phase["versions"]):
                _wait_file(os.path.join(folder, f"go-{p}-{v}"), wait_s)
                if i == 0:
                    time.sleep(phase.get("late_s", 0.0))
                t0 = time.time()
                try:
                    stats = tx.send(tensors(v, phase["mb"]), version=v)
                except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                    outcomes.append(_outcome(folder, who, p, v, t0, False, error=f"{type(exc).__name__}: {exc}"))
                    continue
                outcomes.append(_outcome(folder, who, p, v, t0, True, seconds=stats.total_s, bytes=stats.bytes,
                                         epoch=tx.group_epoch))
        finally:
            tx.close()
    return {"outcomes": outcomes, "log": lines.lines, "group_host": tx.group_host}


def _equal(got: dict[str, Any], want: list[tuple[str, Any]]) -> bool:
    import torch

    return set(got) == {n for n, _ in want} and all(
        got[n].dtype == t.dtype and got[n].shape == t.shape and torch.equal(got[n], t) for n, t in want)


def receiver(folder: str, rank: int, phases: list[dict], wait_s: float = 120.0) -> dict:
    """Receiver rank `rank` through every phase; each sync checked bit-exact against what the senders send."""
    from hwsync.disaggregated import CrossNodeReceiver

    who = f"r{rank}"
    lines = _setup(folder, who)
    outcomes = []
    for p, phase in enumerate(phases):
        rx = CrossNodeReceiver(phase["endpoint"], rank=rank, timeout_s=phase["timeout_s"],
                               stage=phase.get("stage", False))
        serving: dict[str, Any] = {}  # the engine's tensors: what every load of this phase gave it
        marker = [""]
        send = rx._link.send

        def progress(frame: Any, send: Any = send, marker: list = marker) -> None:
            # each bucket loaded or staged is reported to sender 0: the first one marks the sync as under way
            send(frame)
            if type(frame).__name__ == "Progress" and not os.path.exists(marker[0]):
                _write(marker[0], time.time())

        rx._link.send = progress  # type: ignore[method-assign]

        def load(pairs: list, serving: dict = serving) -> None:
            for name, t in pairs:
                serving[name] = t.clone()

        try:
            for v in phase["versions"]:
                _wait_file(os.path.join(folder, f"go-{p}-{v}"), wait_s)
                marker[0] = os.path.join(folder, f"loaded-{who}-{p}-{v}")
                t0 = time.time()
                failed: list[str] = []  # the calls that timed out before the one that returned
                stats = None
                while stats is None:
                    try:
                        stats = rx.receive(load)
                    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
                        failed.append(f"{type(exc).__name__}: {exc}")
                        if "Timeout" not in type(exc).__name__ or len(failed) > phase.get("retries", 0):
                            break
                        time.sleep(phase.get("retry_pause_s", [0.0] * (rank + 1))[rank])
                if stats is None:
                    end = time.time()  # when it raised: what follows checks what the engine serves
                    serves = next((u for u in phase["versions"] if _equal(serving, tensors(u, phase["mb"]))), None)
                    staging = rx._staging
                    outcomes.append(_outcome(folder, who, p, v, t0, False, error=failed[-1], failed=failed,
                                             end=end, serves=serves, staged=rx.staged,
                                             staging_bytes=None if staging is None else staging.held_bytes))
                    continue
                waits = getattr(rx._link, "hub_waits_for", None)  # whom the hub said it waited for, if it said
                outcomes.append(_outcome(folder, who, p, v, t0, True, exact=_equal(serving, tensors(v, phase["mb"])),
                                         seconds=stats.total_s, epoch=rx.group_epoch, failed=failed,
                                         hub_waits_for=waits))
        finally:
            rx.close()
    return {"outcomes": outcomes, "log": lines.lines}
