"""`hwsync bench pause --verbose`: a timeline of each staged commit, from every process that takes part in it.

With `--verbose` the bench sets PAUSE_TRACE_ENV to a file; each process appends one line per mark to it (the
monotonic clock is the kernel's, so marks from the front end and the worker compare, on the bed's hosts too: they
are namespaces of one kernel). The front end marks vLLM's pause, weight-version and resume calls, the commit's RPCs
and its garbage collections; the worker (a process of its own: vLLM's multiprocess executor) marks each model step
with the CPU its other threads used meanwhile, hwsync_stage, hwsync_apply and its garbage collections. `timeline`
then prints, for each staged commit, every mark from the last output before the pause to the first one after the
resume, in milliseconds from that last output, and splits the gap into its parts.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hwsync.integrations.vllm.worker import HwsyncWorkerExtension
from hwsync_tools.bench.plain_gemm import PlainGemm

#: the file each process appends its marks to (unset: no marks)
PAUSE_TRACE_ENV = "HWSYNC_BENCH_PAUSE_TRACE"
#: the worker extension that marks steps and applies, with oneDNN's GEMM or the plain one
TRACED_EXTENSION = "hwsync_tools.bench.pause_trace.TracedExtension"
TRACED_PLAIN_EXTENSION = "hwsync_tools.bench.pause_trace.TracedPlainExtension"


def mark(label: str) -> None:
    """Append `label` at the monotonic clock's now to the trace file, if there is one."""
    path = os.environ.get(PAUSE_TRACE_ENV)
    if path:
        line = f"{time.monotonic():.6f} {os.getpid()} {label}\n".encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)  # one write of a short line: whole even with other processes appending
        finally:
            os.close(fd)


def trace_gc(who: str) -> None:
    """Mark each garbage collection of this process that takes over a millisecond: its generation and length."""
    import gc

    began: list[float] = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.monotonic()
        elif time.monotonic() - began[0] > 1e-3:
            mark(f"{who} gc gen {info.get('generation')} {1e3 * (time.monotonic() - began[0]):.0f} ms "
                 f"({info.get('collected')} collected)")
    gc.callbacks.append(callback)


def _usage() -> tuple[float, float, float, float, float]:
    """Wall, this thread's CPU, this process's CPU seconds, its minor page faults and involuntary switches so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (time.monotonic(), time.thread_time(), time.process_time(), float(usage.ru_minflt),
            float(usage.ru_nivcsw))


def _thread_times() -> dict[str, float]:
    """CPU seconds of each thread of this process so far, by `name/tid` (Linux's /proc; empty elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    times = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            times[f"{names.get(int(tid), name)}/{tid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        pass
    return times


def marked(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """`fn` (plain or async), marking `label` when called and when it returns."""
    if _is_async(fn):
        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            mark(f"{label} called")
            try:
                return await fn(*args, **kwargs)
            finally:
                mark(f"{label} returned")
        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{label} called")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(f"{label} returned")
    return wrapper


def _is_async(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def trace_front_end(engine: Any) -> None:
    """Mark the AsyncLLM's pause, weight-version, resume and RPC calls (the commit's, on the front end)."""
    for name in ("pause_generation", "resume_generation", "update_weight_version"):
        setattr(engine, name, marked(getattr(engine, name), f"front {name}"))
    rpc = engine.collective_rpc

    async def collective_rpc(method: str, *args: Any, **kwargs: Any) -> Any:
        mark(f"front rpc {method} called")
        try:
            return await rpc(method, *args, **kwargs)
        finally:
            mark(f"front rpc {method} returned")
    engine.collective_rpc = collective_rpc
    trace_gc("front")


def trace_sender(sender: Any) -> None:
    """Mark the same-host sender's commit (the Apply to the workers, and their answers)."""
    sender.commit = marked(sender.commit, "front sender.commit")


class Traced:
    """Mixed in before a worker extension: marks each model step (with its wall, thread and process CPU seconds,
    page faults and involuntary context switches), hwsync_stage, hwsync_apply and the worker's garbage collections."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls)
        if os.environ.get(PAUSE_TRACE_ENV):
            for name in ("execute_model", "sample_tokens", "hwsync_apply", "hwsync_stage"):
                method = getattr(self, name, None)
                if method is not None:
                    setattr(self, name, marked(method, f"worker {name}"))
            step = getattr(self, "execute_model")  # noqa: B009 - the worker's (the mixin declares none)

            def execute_model(*args: Any, **kwargs: Any) -> Any:  # what else ran in this process during a step
                before, threads = _usage(), _thread_times()
                try:
                    return step(*args, **kwargs)
                finally:
                    mark("worker step usage " + " ".join(f"{a - b:.3f}" for a, b in zip(_usage(), before)))
                    own = f"/{threading.get_native_id()}"
                    busy = {k: v - threads.get(k, 0.0) for k, v in _thread_times().items() if not k.endswith(own)}
                    others = [f"{k}={v:.2f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1])[:3] if v >= 0.02]
                    if others:  # the threads that ran beside the step's own, and their CPU seconds
                        mark("worker step beside " + " ".join(others))
            setattr(self, "execute_model", execute_model)  # noqa: B010 - as above
            trace_gc("worker")
        return self


class TracedExtension(Traced, HwsyncWorkerExtension):
    """HwsyncWorkerExtension with the trace's marks."""


class TracedPlainExtension(Traced, PlainGemm, HwsyncWorkerExtension):
    """HwsyncWorkerExtension with vLLM's CPU GEMM on torch's linear and the trace's marks."""


def read(path: str) -> list[tuple[float, int, str]]:
    """The marks in `path`, in time order: (time, pid, label)."""
    marks = []
    with open(path) as f:
        for line in f:
            t, pid, label = line.rstrip("\n").split(" ", 2)
            marks.append((float(t), int(pid), label))
    return sorted(marks)


def commit_timeline(outputs: list[list[tuple[float, int]]], start: float, end: float, title: str,
                    file: Any = sys.stderr) -> None:
    """Under --verbose: print the marks of the commit in [start, end] from this run's trace file."""
    timeline(read(os.environ[PAUSE_TRACE_ENV]), outputs, start, end, title, file=file)


def timeline(marks: list[tuple[float, int, str]], outputs: list[list[tuple[float, int]]], start: float,
             end: float, title: str, file: Any = sys.stderr) -> None:
    """Print the marks around the pause of the commit in [start, end]: from the last output before the front end's
    pause_generation returned (the step in flight when it was called still ends) to the first one after its
    resume_generation returned, in ms from that last output."""
    window = [m for m in marks if start <= m[0] <= end]
    pause = next((m[0] for m in window if m[2] == "front pause_generation returned"), None)
    resume = next((m[0] for m in window if m[2] == "front resume_generation returned"), None)
    if pause is None or resume is None:
        print(f"{title}: no pause in the trace", file=file)
        return
    times = sorted(t for events in outputs for t, _ in events[1:])
    before = max((t for t in times if t <= pause), default=pause)
    after = min((t for t in times if t >= resume), default=resume)
    applied = next((m[0] for m in window if m[2] == "front rpc hwsync_apply returned"), pause)
    steps = _steps(marks, start, end + 5.0)  # the steps after the resume began after the sync returned
    usual = sorted(d for t, d in steps if t < pause - 1.0)  # the row's steps well before the pause
    first = next((d for t, d in steps if t >= resume - 0.05), None)
    ms = 1e3
    print(f"{title}: the gap around the commit {ms * (after - before):.0f} ms = last output to pause returned "
          f"{ms * (pause - before):.0f} + pause to apply returned {ms * (applied - pause):.0f} + to resume returned "
          f"{ms * (resume - applied):.0f} + resume to the next output {ms * (after - resume):.0f}; model steps "
          f"(execute_model) before the pause: median {ms * _median(usual):.0f} ms, max "
          f"{ms * max(usual, default=0.0):.0f} ms ({len(usual)}); the first after the resume "
          f"{'-' if first is None else f'{ms * first:.0f}'} ms", file=file)
    shown = [(t, pid, label) for t, pid, label in marks if before - 0.3 <= t <= after + 0.05]
    shown += [(t, 0, "output") for t in times if before - 0.3 <= t <= after + 0.05]
    for t, pid, label in sorted(shown):
        print(f"  {ms * (t - before):8.1f}  {pid:>7}  {label}", file=file)


def _steps(marks: list[tuple[float, int, str]], start: float, end: float) -> list[tuple[float, float]]:
    """The worker's model steps that began in [start, end]: (began, seconds)."""
    steps, began = [], None
    for t, _, label in marks:
        if label == "worker execute_model called":
            began = t
        elif label == "worker execute_model returned" and began is not None:
            if start <= began <= end:
                steps.append((began, t - began))
            began = None
    return steps


def _median(values: list[float]) -> float:
    return values[len(values) // 2] if values else 0.0
