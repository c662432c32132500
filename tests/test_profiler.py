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


def test_the_slow_step_threshold_is_read_from_the_environment_or_refused_saying_what_is_expected():
    assert profiler.steps_from_env(None) is None
    assert profiler.steps_from_env("") is None
    assert profiler.steps_from_env("/tmp/s, 0.5") == ("/tmp/s", 0.0005)
    for bad in ("/tmp/s", "/tmp/s,", ",1", "/tmp/s,x", "/tmp/s,0", "/tmp/s,-2", "/tmp/s,1,2"):
        with pytest.raises(ValueError, match="expected DIR,MS"):
            profiler.steps_from_env(bad)


def test_slow_steps_are_written_with_their_cpu_time_and_quick_ones_are_not(tmp_path):
    """A step that works 30 ms of CPU shows them; one blocked 30 ms (what a step descheduled
    mid-way looks like from inside) shows next to no CPU; quick steps are left out."""
    import json
    import time

    path = tmp_path / "steps" / "n1.steps"

    async def busy():  # 30 ms of this thread's CPU, however long a loaded machine makes it
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass
        await trio.sleep(0)

    async def blocked():
        time.sleep(0.03)
        await trio.sleep(0)

    async def quick():
        for _ in range(50):
            await trio.sleep(0)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(busy, name="busy")
            n.start_soon(blocked, name="blocked")
            n.start_soon(quick, name="quick")

    trio.run(main, instruments=[profiler.SlowSteps(str(path), 0.01)])
    rows = {r["task"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(rows) == {"busy", "blocked"}, rows
    assert rows["busy"]["cpu_ms"] >= 29 and rows["busy"]["wall_ms"] >= rows["busy"]["cpu_ms"] - 1
    assert rows["blocked"]["wall_ms"] >= 30 and rows["blocked"]["cpu_ms"] < 5


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_node_writes_its_slow_steps_and_refuses_a_bad_setting(tmp_path):
    import json
    import os
    import subprocess
    import time

    from broker.localcluster import executable, free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("WARREN_")}
    env["WARREN_HOME"] = str(tmp_path / "home")
    args = [executable("warren-server"), "--name", "s1", "--secret", "s", "--client-port",
            str(free_port()), "--peer-port", str(free_port())]
    bad = subprocess.run(args, env={**env, "WARREN_SLOW_STEPS": str(tmp_path)}, capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "expected DIR,MS" in bad.stderr and "Traceback" not in bad.stderr
    steps = tmp_path / "steps"
    node = subprocess.Popen(args, env={**env, "WARREN_SLOW_STEPS": f"{steps},0.001"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        path = steps / "s1.steps"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (path.exists() and path.read_text().count("\n") >= 5):
            time.sleep(0.1)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) >= 5
        assert all(set(r) == {"t", "task", "wall_ms", "cpu_ms"} and r["wall_ms"] >= 0.001 for r in rows)
    finally:
        node.terminate()
        node.wait(timeout=20)
