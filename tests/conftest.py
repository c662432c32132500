"""Settings for the whole suite.

Under pytest-xdist (`make test` runs the files on parallel workers), each worker picks the free
ports of its clusters from its own share of the range (WARREN_FREE_PORTS, read by
broker/localcluster.py `pick_free_ports`, inherited by every process a test starts): two
workers starting clusters at the same moment can then never pick the same port before a node
binds it.
"""

from __future__ import annotations

import os

from broker import localcluster


def _share_the_ports() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ... under xdist
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return
    whole = localcluster._listening_range()
    share = len(whole) // count
    first = whole.start + int(worker[2:]) * share
    os.environ[localcluster.FREE_PORTS_ENV] = f"{first}-{first + share - 1}"


_share_the_ports()


# make test's workers take whole files (--dist loadfile --no-loadscope-reorder) in collection
# order. These files take longest (most start processes, Docker or Spark, or run many simulated
# schedules), longest first as a `--durations` run measured them: they go first, so that no
# worker is left running one of them alone once the short files are done. The other files
# follow in their usual order, and every file keeps its own tests' order.
SLOW_FILES_FIRST = (
    "test_docker_cluster.py", "test_dst.py", "test_analysis.py", "test_dst_regressions.py", "test_demo.py",
    "test_bench_runner.py", "test_process_faults.py", "test_chaos_smoke.py",
    "test_localcluster.py", "test_process_rolling.py", "test_process_mirroring.py",
    "test_process_cluster.py", "test_sim_restart_stall.py", "test_process_operator_policy.py",
    "test_process_tls.py", "test_process_sync.py", "test_amqp_failover.py",
    "test_bench_loadgen.py", "test_tutorial.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files keep their order
