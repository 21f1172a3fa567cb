"""`hwsync bench ...`: benchmarks that print a table (or --json), each against references measured in the same run.

transfer.py (process to process: hwsync vs the stop-and-wait baseline of stop_and_wait.py vs
memory copy bandwidth), tensors.py (the same bytes in many tensors against few, in turns), vllm.py
(into a real vLLM engine), broadcast.py (the disaggregated path, against broadcast_stop_and_wait.py),
delta.py (full against delta syncs across the bed), delta_codec.py, pause.py.

HWSYNC_BENCH_TINY=1 shrinks every bench's sizes (and repeats) and keeps every other default, so that
CI runs each one's own code path in seconds (tests/test_bench_defaults.py); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import os

#: the environment variable that makes every bench tiny
TINY_ENV = "HWSYNC_BENCH_TINY"


def tiny() -> bool:
    """Whether HWSYNC_BENCH_TINY asks for tiny sizes."""
    return os.environ.get(TINY_ENV, "").strip() not in ("", "0")


def tiny_defaults(parser: argparse.ArgumentParser, **sizes: object) -> None:
    """Under HWSYNC_BENCH_TINY=1, `sizes` replace those defaults of `parser` (explicit flags still win)."""
    if tiny():
        parser.set_defaults(**sizes)
