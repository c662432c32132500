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
