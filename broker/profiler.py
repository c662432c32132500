"""Two looks at where a node's time goes under a benchmark, both off unless their environment
variable is set in a `warren-server`'s environment (a benchmark's nodes inherit it).

`WARREN_PROFILE=DIR,AFTER,SECONDS` runs cProfile from AFTER seconds after the node starts, for
SECONDS, and writes DIR/NAME.prof; read it with `python -m pstats DIR/NAME.prof`. Every task of
the node runs in one thread, so the profile covers them all. While it runs, the profiler costs
the node much of its speed, so what it gives are shares and call counts, not timings.

`WARREN_SLOW_STEPS=DIR,MS` writes DIR/NAME.steps, one JSON line for every step of a trio task
(the run from one `await` to the next) that took MS milliseconds or more of wall time: when it
ended, the task's name, its wall time and the thread's CPU time over it. A step whose CPU time
is near its wall time did that much work (a big batch, a slow function); one whose CPU time is
a small part of it was descheduled in the middle, waiting for a core (docs/measurements.md,
"ninth stop": on two shared cores most long steps are of that kind). It costs two clock reads
per step, so the timings stay close to a node's own.
"""

from __future__ import annotations

import cProfile
import json
import os
import time

import trio

ENV = "WARREN_PROFILE"
STEPS_ENV = "WARREN_SLOW_STEPS"


def _from_env(name: str, text: str | None, convert, expected: str):
    """`convert` of the comma-separated parts of an environment variable's value; None when it
    is unset or blank; ValueError saying what is `expected` when `convert` refuses them."""
    if not text or not text.strip():
        return None
    try:
        return convert([p.strip() for p in text.split(",")])
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected {expected}") from None


def _window(parts: list[str]) -> tuple[str, float, float]:
    if len(parts) != 3 or not parts[0]:
        raise ValueError
    after, seconds = float(parts[1]), float(parts[2])
    if after < 0 or seconds <= 0:
        raise ValueError
    return parts[0], after, seconds


def window_from_env(text: str | None) -> tuple[str, float, float] | None:
    """WARREN_PROFILE's value -> (directory, after, seconds), None when unset; ValueError saying
    what is expected otherwise."""
    return _from_env(ENV, text, _window, "DIR,AFTER,SECONDS (a directory, then seconds to wait "
                                         "and seconds to profile, e.g. /tmp/prof,12,5)")


async def profile_window(path: str, after: float, seconds: float) -> None:
    """Profile the whole process from `after` seconds from now for `seconds`, then write the
    statistics to `path` (also when the node stops first)."""
    await trio.sleep(after)
    prof = cProfile.Profile()
    prof.enable()
    try:
        await trio.sleep(seconds)
    finally:
        prof.disable()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        prof.dump_stats(path)


def _steps(parts: list[str]) -> tuple[str, float]:
    if len(parts) != 2 or not parts[0]:
        raise ValueError
    ms = float(parts[1])
    if not ms > 0:
        raise ValueError
    return parts[0], ms / 1000


def steps_from_env(text: str | None) -> tuple[str, float] | None:
    """WARREN_SLOW_STEPS's value -> (directory, threshold in seconds), None when unset;
    ValueError saying what is expected otherwise."""
    return _from_env(STEPS_ENV, text, _steps, "DIR,MS (a directory, then the wall time in "
                                              "milliseconds from which a task's step is written, "
                                              "e.g. /tmp/steps,0.5)")


class SlowSteps(trio.abc.Instrument):
    """A trio instrument that writes every task step of `threshold` seconds or more to `path`
    (see above). Lines are written as they come, so a node killed mid-run keeps them."""

    def __init__(self, path: str, threshold: float):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the node's life
        self._threshold = threshold
        self._wall = 0.0
        self._cpu = 0.0

    def before_task_step(self, task) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()

    def after_task_step(self, task) -> None:
        wall = time.perf_counter() - self._wall
        if wall >= self._threshold:
            cpu = time.thread_time() - self._cpu
            self._out.write(json.dumps({"t": round(time.time(), 6), "task": task.name,
                                        "wall_ms": round(wall * 1000, 3), "cpu_ms": round(cpu * 1000, 3)}) + "\n")
