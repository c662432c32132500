"""Process tests of batch synchronisation: real warren-server processes, warrenctl as a
user runs it, kill -9 and a real restart."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from cluster_procs import publish, running_cluster, wait_until

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]
LIMIT = 500_000  # bytes/s: --mirroring-sync-max-throughput of the sync test


def queue_row(cluster, node: str, queue: str) -> dict:
    rows = cluster.ctl_json(node, "list_queues", "name", "pid", "mirror_pids",
                            "synchronised_mirror_pids", "messages", "state")
    return next(r for r in rows if r["name"] == queue)


def test_sync_queue_and_cancel_sync_queue(request, tmp_path_factory):
    """`rabbitmqctl sync_queue {name}` synchronises; `cancel_sync_queue` stops a sync in progress
    and the mirror stays unsynchronised. The limit is mirroring_sync_max_throughput."""
    with running_cluster(request, tmp_path_factory, 3, net_ticktime=4,
                         server_args=["--mirroring-sync-max-throughput", str(LIMIT)]) as c:
        publish(c, "n1", "two.sync", 2000)  # ~2 MB: about 4 s at LIMIT
        c.ctl_ok("n1", "set_policy", "ha-two", r"^two\.", '{"ha-mode":"exactly","ha-params":2}')
        row = wait_until(lambda: (r := queue_row(c, "n2", "two.sync"))["mirror_pids"] and r,
                         what="a mirror")
        assert row["synchronised_mirror_pids"] == []  # a new mirror starts empty
        # a sync, cancelled after a second
        p = subprocess.Popen(["warrenctl", "-n", "n1", "sync_queue", "two.sync"], env=c.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: queue_row(c, "n3", "two.sync")["state"] == "syncing", what="syncing")
        out = c.ctl_ok("n2", "cancel_sync_queue", "two.sync")
        assert "True" in out or "true" in out
        stdout, stderr = p.communicate(timeout=30)
        assert p.returncode == 1, (stdout, stderr)
        assert "sync cancelled" in stdout
        assert "%" in stdout  # progress lines were shown
        assert queue_row(c, "n1", "two.sync")["synchronised_mirror_pids"] == []
        # the whole sync, measured
        t0 = time.monotonic()
        out = c.ctl_ok("n1", "sync_queue", "two.sync")
        took = time.monotonic() - t0
        assert "sync completed" in out
        row = queue_row(c, "n1", "two.sync")
        assert row["synchronised_mirror_pids"] == row["mirror_pids"] and row["mirror_pids"]
        print(f"sync of the remaining messages at a 500 kB/s limit: {took:.1f} s; {out.strip()}")
        # the limit holds within 5% of body bytes per second, and the wall clock of sync_queue
        # (its own start included) is no shorter than the limit allows
        m = re.search(r"sync completed: ([\d,]+) messages, ([\d,]+) bytes in ([\d.]+) s", out)
        assert m, out
        sent, elapsed = int(m.group(2).replace(",", "")), float(m.group(3))
        assert sent > 500_000, out  # the cancelled sync left most of the ~2 MB to do
        assert 0.95 * LIMIT <= sent / elapsed <= 1.05 * LIMIT, (sent / elapsed, out)
        assert took >= sent / LIMIT, (took, sent)


def test_automatic_sync_after_a_mirror_node_restarts(request, tmp_path_factory):
    """"A mirror whose node restarts ... throws away any ... contents it already has and starts
    empty"; with "ha-sync-mode: automatic" it is synchronised again when it rejoins."""
    with running_cluster(request, tmp_path_factory, 3, net_ticktime=4) as c:
        c.ctl_ok("n1", "set_policy", "ha-all", r"^all\.",
                 '{"ha-mode":"all","ha-sync-mode":"automatic"}')
        publish(c, "n1", "all.auto", 3000)
        wait_until(lambda: len(queue_row(c, "n1", "all.auto")["synchronised_mirror_pids"]) == 2,
                   what="two synchronised mirrors")
        c.kill9("n3")
        wait_until(lambda: len(queue_row(c, "n1", "all.auto")["mirror_pids"]) == 1, what="n3 dropped")
        c.restart("n3")
        row = wait_until(lambda: (r := queue_row(c, "n1", "all.auto")) and
                         len(r["synchronised_mirror_pids"]) == 2 and r, timeout=40,
                         what="n3 back and synchronised")
        assert any(p.startswith("<n3.") for p in row["mirror_pids"])
        assert row["messages"] == 3000
        log = c.log_path("n1").read_text()
        # a new mirror, not the old one: n3's mirror started empty a second time (a process's
        # replica ids restart with it, so the pid string alone may repeat)
        assert log.count("Mirrored queue 'all.auto' in vhost '/': mirror on node n3 started empty") >= 2, log
        assert "Synchronising 3000 messages to mirrors on n3" in log
