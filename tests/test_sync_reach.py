"""How far a sync reaches into hwsync: the files a packed same-host full sync enters, on each side.

The sender of such a sync enters at most 16 of hwsync's files, and neither side enters the delta codec
(hwsync/delta/): a full sync of a sender that never asked for a delta runs none of it. Each side records the
files whose functions run during one warm sync (sys.setprofile on every thread), the receiver in its own process.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

import hwsync

ROOT = str(Path(hwsync.__file__).parent) + os.sep
CTX = mp.get_context("spawn")
#: the most hwsync files the sender of a packed same-host full sync may enter (issue 47: it entered 26, then 15;
#: 16 since the sync holds Python's collector back, sync/collector.py)
MAX_SENDER_FILES = 16


def entered(call: Callable[[], object]) -> list[str]:
    """hwsync's files (relative to the package) whose functions run during `call()`, on any thread."""
    seen: set[str] = set()

    def profile(frame, event, arg):  # noqa: ANN001 - the profiler's signature
        if event == "call" and frame.f_code.co_filename.startswith(ROOT):
            seen.add(frame.f_code.co_filename[len(ROOT):])

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen)


def _receiver(endpoint: str, q) -> None:  # noqa: ANN001 - a spawn target
    from hwsync import WeightReceiver

    held: dict[str, torch.Tensor] = {}

    def load(pairs: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            held[name] = tensor.clone()

    with WeightReceiver(endpoint) as receiver:
        receiver.receive(load)  # the first sync sets the session up: the second is the steady state
        q.put(entered(lambda: receiver.receive(load)))


def test_a_packed_full_sync_reaches_few_files_and_no_delta_code(monkeypatch):
    monkeypatch.setenv("HWSYNC_BACKEND", "cpu")
    from hwsync import WeightSender
    from hwsync.backend.registry import reset_backend_cache

    reset_backend_cache()
    tensors = [(f"t{i}", torch.randn(1000)) for i in range(20)]
    with WeightSender() as sender:
        q = CTX.Queue()
        proc = CTX.Process(target=_receiver, args=(sender.endpoint, q), daemon=True)
        proc.start()
        sender.send(tensors, version=1)
        sent = entered(lambda: sender.send(tensors, version=2))
        received = q.get(timeout=60)
        proc.join(30)
    reset_backend_cache()
    for side, files in (("sender", sent), ("receiver", received)):
        assert not [f for f in files if f.startswith("delta" + os.sep)], f"the {side} entered the delta codec: {files}"
    assert len(sent) <= MAX_SENDER_FILES, f"the sender entered {len(sent)} files: {sent}"
    assert "sync/sender.py" in sent and "colocated/carrier.py" in sent, sent  # the pipeline and its carrier ran
