"""broker/profiler.py: WARREN_PROFILE's window is parsed with a clear error, and the profile it
writes covers the work of every task while it runs, and only then."""

import pstats

import pytest
import trio

from broker import profiler


def test_the_window_is_read_from_the_environment_or_refused_saying_what_is_expected():
    assert profiler.window_from_env(None) is None
    assert profiler.window_from_env("  ") is None
    assert profiler.window_from_env("/tmp/p, 12, 5") == ("/tmp/p", 12.0, 5.0)
    for bad in ("/tmp/p", "/tmp/p,12", ",1,2", "/tmp/p,x,5", "/tmp/p,-1,5", "/tmp/p,1,0"):
        with pytest.raises(ValueError, match="expected DIR,AFTER,SECONDS"):
            profiler.window_from_env(bad)


def _before_window():
    return 1


def _inside_window():
    return 2


async def test_the_profile_covers_every_task_inside_the_window_only(tmp_path):
    path = tmp_path / "prof" / "n1.prof"

    async def work():
        _before_window()
        await trio.sleep(0.3)  # the window opens at 0.2
        for _ in range(5):
            _inside_window()
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(work)
        await profiler.profile_window(str(path), 0.2, 0.5)
    names = {func[2] for func in pstats.Stats(str(path)).stats}
    assert "_inside_window" in names
    assert "_before_window" not in names
