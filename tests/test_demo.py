"""The demo of `make demo` (broker/demo.py) tells the truth: it kills the node the cluster reports
as the queue's leader, wherever that is, and says so; a wait that runs out names what it was
waiting for instead of hanging; and run again and again it tells the same story, in a home of
its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import trio

from broker import demo
from broker.client.aio import open_connection
from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 3) as c:
        yield c


def test_it_kills_the_actual_leader_and_says_so(cluster, capsys):
    async def declare_on_n2():
        async with open_connection([cluster.client_addr("n2")]) as conn:
            ch = await conn.channel()
            await ch.queue_declare(demo.FAILOVER, durable=True,
                                   arguments={"x-queue-master-locator": "client-local"})

    trio.run(declare_on_n2)  # led by n2, not n1: the demo must not assume n1
    stats = trio.run(demo.failover_demo, cluster, 1.5, 500, 0.5)
    out = capsys.readouterr().out
    assert stats["leader_before"] == "n2"
    assert not cluster.alive("n2") and cluster.alive("n1") and cluster.alive("n3")
    assert "kill -9 of n2 (the leader of demo.failover)" in out
    assert "== killed n2 (pid" in out
    assert stats["leader_after"] in ("n1", "n3")
    assert f"demo.failover is now led by {stats['leader_after']}" in out
    assert "via n1" in out and "via n3" in out  # the load goes through the nodes that survive
    assert stats["lost"] == 0 and stats["confirmed"] == stats["published"] > 0


def test_a_deadline_names_what_it_waited_for():
    async def never():
        with demo.deadline(0.05, lambda: "something that never comes (3 of 4 so far)"):
            await trio.sleep(10)

    with pytest.raises(TimeoutError, match=r"^timed out after 0.05 s waiting for something that "
                                           r"never comes \(3 of 4 so far\)$"):
        trio.run(never)


def _story(output: str) -> list[str]:
    """What the demo tells, without its figures and without which node got which role: its
    headings, its summaries and its queue rows."""
    kept = [line for line in output.splitlines()
            if line.startswith(("==", "published", "consumed", "policy ", "demo."))]
    return [re.sub(r"\bn[1-9]\b", "nX", re.sub(r"\d[\d,.]*", "#", line)) for line in kept]


def _first_rate(output: str) -> float:
    rate = re.search(r"^published 10,000 x 1 KiB to demo\.orders .*, ([\d,]+) msgs/s$", output, re.M)
    assert rate, output
    return float(rate.group(1).replace(",", ""))


@pytest.mark.timeout(600)
def test_the_demo_tells_the_same_story_three_times_in_a_row(tmp_path):
    """`python -m broker.localcluster demo` (what `make demo` runs), three times in a clone: each
    run starts from a state of its own (var/demo, wiped: the first phase's queue is not mirrored
    by a policy an earlier run left), tells the same story with nothing lost, publishes its first
    10,000 messages at no less than a fifth of the first run's rate (no stall after a restart: the
    stall this catches cost a factor of 300; the suite's other workers move a run by 2-3x), and
    leaves $WARREN_HOME, the home of `make cluster`, as it was."""
    user_home = tmp_path / "var" / "warren"
    user_home.mkdir(parents=True)
    (user_home / "kept").write_text("the user's cluster")
    env = {k: v for k, v in os.environ.items() if k not in ("WARREN_HOME", "WARREN_SECRET", "WARREN_NODE")}
    env["WARREN_HOME"] = str(user_home)
    outputs = []
    for run in range(3):
        r = subprocess.run([sys.executable, "-m", "broker.localcluster", "demo"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, f"run {run + 1}:\n{r.stdout}\n{r.stderr}"
        outputs.append(r.stdout)
    first = _story(outputs[0])
    for run, output in enumerate(outputs, 1):
        assert f"of the demo's own in {tmp_path / 'var' / 'demo'}" in output
        assert "all confirmed" in output and re.search(r", lost 0 \(", output), output
        assert re.search(r"^demo\.orders\ttrue\t\tn\d\t<[^>]+>\t\[\]\t\[\]\t0\t0\t1$", output, re.M), \
            f"run {run}: the first phase's queue has a policy or mirrors:\n{output}"
        assert "demo.failover is now led by" in output
        assert _story(output) == first, f"run {run} tells another story:\n{output}"
        assert _first_rate(output) >= _first_rate(outputs[0]) / 5, \
            f"run {run}'s first phase: {_first_rate(output):,.0f} msgs/s, the first run's " \
            f"{_first_rate(outputs[0]):,.0f}"
    assert sorted(p.name for p in user_home.iterdir()) == ["kept"]
    assert not (tmp_path / "var" / "demo" / "pids.json").exists(), "the demo stops its nodes"
