"""The conformance suite's brokers. A case never knows which broker it talks to: it gets a
`Broker` (AMQP URLs and a way to set policies) from the fixtures here, and the broker is chosen by
the environment:

    WARREN_CONFORMANCE_BROKER=warren    (default) real warren-server processes (tests/cluster_procs.py)
    WARREN_CONFORMANCE_BROKER=rabbitmq  Debian's rabbitmq-server 3.10 (rabbitmq_nodes.py); every case
                                        is skipped when it is not installed

`broker` is one node; `mirrored` is a 3-node cluster whose queues named `mirrored.*` are mirrored to
every node (a policy of priority -1, so a case's own policy on such a queue replaces it).
Against warren, the cases named in warren_gaps.GAPS are expected to fail (strict xfail).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: cluster_procs

from warren_gaps import GAPS  # noqa: E402

BROKER_ENV = "WARREN_CONFORMANCE_BROKER"
MIRRORED_PATTERN = r"^mirrored\."


def broker_kind() -> str:
    kind = os.environ.get(BROKER_ENV, "warren")
    if kind not in ("warren", "rabbitmq"):
        raise pytest.UsageError(f"{BROKER_ENV} must be warren or rabbitmq, not {kind!r}")
    return kind


class Broker:
    """What a case may ask of the broker under test: where its nodes listen, and policies."""

    def __init__(self, urls: list[str], set_policy, clear_policy):
        self.urls = urls
        self._set_policy = set_policy
        self._clear_policy = clear_policy

    @property
    def url(self) -> str:
        return self.urls[0]

    def set_policy(self, name: str, pattern: str, definition: dict, priority: int = 0,
                   apply_to: str = "all") -> None:
        """Sets (or replaces) a policy. Cases leave theirs in place: their patterns match only the
        case's own names, and the broker goes when the run ends."""
        self._set_policy(name, pattern, definition, priority, apply_to)

    def clear_policy(self, name: str) -> None:
        self._clear_policy(name)


def _warren_broker(cluster) -> Broker:
    first = cluster.names[0]

    def set_policy(name, pattern, definition, priority, apply_to):
        cluster.call(first, "set_policy", {"name": name, "pattern": pattern,
                                           "definition": json.dumps(definition),
                                           "priority": priority, "apply_to": apply_to})

    def clear_policy(name):
        cluster.call(first, "clear_policy", {"name": name})

    return Broker([cluster.amqp_url(n) for n in cluster.names], set_policy, clear_policy)


def _rabbit_broker(rabbit) -> Broker:
    return Broker([rabbit.amqp_url(i) for i in range(1, rabbit.count + 1)], rabbit.set_policy,
                  rabbit.clear_policy)


@contextlib.contextmanager
def _started(request, tmp_path_factory, nodes: int):
    """A started Broker of `nodes` nodes of the chosen kind, stopped afterwards."""
    if broker_kind() == "rabbitmq":
        import rabbitmq_nodes
        if not rabbitmq_nodes.installed():
            pytest.skip("rabbitmq-server is not installed (apt-get install -y rabbitmq-server)")
        with rabbitmq_nodes.RabbitCluster(nodes) as rabbit:
            yield _rabbit_broker(rabbit)
    else:
        from cluster_procs import running_cluster
        with running_cluster(request, tmp_path_factory, nodes) as cluster:
            yield _warren_broker(cluster)


@pytest.fixture(scope="session")
def broker(request, tmp_path_factory):
    with _started(request, tmp_path_factory, 1) as b:
        yield b


@pytest.fixture(scope="session")
def mirrored(request, tmp_path_factory):
    with _started(request, tmp_path_factory, 3) as b:
        b.set_policy("conformance-mirrored", MIRRORED_PATTERN,
                     {"ha-mode": "all", "ha-sync-mode": "automatic"}, priority=-1, apply_to="queues")
        yield b


@pytest.fixture
def names(request):
    """A unique prefix for the queues and exchanges of one case (the brokers are shared)."""
    return f"c{uuid.uuid4().hex[:10]}."


def pytest_collection_modifyitems(config, items):
    kind = broker_kind()
    here = Path(__file__).resolve().parent
    for item in items:
        if here not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.conformance)
        if {"broker", "mirrored"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.process)  # it runs against a started broker
        if kind == "rabbitmq":
            item.add_marker(pytest.mark.rabbitmq)
            continue
        reason = GAPS.get(item.originalname) or GAPS.get(item.name)
        if reason:
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"warren lacks: {reason}"))
