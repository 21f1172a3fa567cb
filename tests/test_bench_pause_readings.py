"""The readings `hwsync bench pause` takes from the load's outputs: the stall (the longest gap between two outputs)
and vLLM's paused time (from the last output before the pause returned to the resume's return)."""

from __future__ import annotations

import asyncio

from hwsync_tools.bench.pause import Load


class _Engine:
    """The two AsyncLLM calls the bench times, doing nothing."""

    async def pause_generation(self, **kwargs: object) -> None:
        return None

    async def resume_generation(self) -> None:
        return None


def _load_with(outputs: list[list[float]]) -> Load:
    load = Load(_Engine(), lanes=len(outputs), max_tokens=8)
    # each request: its submission (time, 0 tokens), then one output per time
    load.requests = [[(times[0] - 1.0, 0)] + [(t, i + 1) for i, t in enumerate(times)] for times in outputs]
    return load


def test_the_paused_time_runs_from_the_last_output_before_the_pause_to_the_resume():
    # two requests, outputs every 0.25 s; the pause returns at 10.52, the resume at 10.80, the next step ends 11.05
    load = _load_with([[10.0, 10.25, 10.50, 11.05], [10.05, 10.30, 10.49, 11.06]])
    load.clock.pauses.append(10.52)
    load.clock.resumes.append(10.80)
    assert abs(load.paused(9.0, 12.0) - (10.80 - 10.50)) < 1e-9
    assert abs(load.stall(9.0, 12.0) - (11.06 - 10.49)) < 1e-9  # the gap holds the first step after the resume


def test_no_pause_in_the_window_gives_no_paused_time():
    load = _load_with([[10.0, 10.25, 10.50]])
    load.clock.pauses.append(20.0)
    load.clock.resumes.append(20.3)
    assert load.paused(9.0, 12.0) is None


def test_the_engine_calls_are_timed_when_they_return():
    engine = _Engine()
    load = Load(engine, lanes=1, max_tokens=8)
    asyncio.run(engine.pause_generation(mode="keep"))
    asyncio.run(engine.resume_generation())
    assert len(load.clock.pauses) == 1 and len(load.clock.resumes) == 1
    assert load.clock.pauses[0] <= load.clock.resumes[0]
