"""A profile of one window of a node's life, to see where its time goes under a benchmark.

`WARREN_PROFILE=DIR,AFTER,SECONDS` in a `warren-server`'s environment (a benchmark's nodes
inherit it) runs cProfile from AFTER seconds after the node starts, for SECONDS, and writes
DIR/NAME.prof; read it with `python -m pstats DIR/NAME.prof`. Every task of the node runs in one
thread, so the profile covers them all. Off unless set: while it runs, the profiler costs the
node much of its speed, so what it gives are shares and call counts, not timings.
"""

from __future__ import annotations

import cProfile
import os

import trio

ENV = "WARREN_PROFILE"


def window_from_env(text: str | None) -> tuple[str, float, float] | None:
    """WARREN_PROFILE's value -> (directory, after, seconds), None when unset; ValueError saying
    what is expected otherwise."""
    if not text or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    try:
        if len(parts) != 3 or not parts[0]:
            raise ValueError
        after, seconds = float(parts[1]), float(parts[2])
        if after < 0 or seconds <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: expected DIR,AFTER,SECONDS (a directory, then seconds "
                         f"to wait and seconds to profile, e.g. /tmp/prof,12,5)") from None
    return parts[0], after, seconds


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
