"""Checks of docker-compose.yml that need no Docker engine.

One test asks docker-compose itself whether the file is valid; the others
read the YAML and check the shape of the cluster: three warren nodes from
one image, distinct node names, n2 and n3 seeded from n1.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
NODES = ("n1", "n2", "n3")
PEER_PORT = "25672"
CLIENT_PORT = "5672"
AMQP_PORT = "5673"
HOST_PORTS = {"n1": 5681, "n2": 5682, "n3": 5683}
HOST_AMQP_PORTS = {"n1": 5684, "n2": 5685, "n3": 5686}
HTTP_PORT = "15672"
HTTP_HOST_PORT = 15672

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?-(?P<default>[^}]*))?\}")


def _defaults(value: str) -> str:
    """Compose's ${VAR:-default} interpolation, taking every default."""
    return _VAR.sub(lambda m: m.group("default") or "", value)


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the "KEY=value" list form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: _defaults(str(value)) for key, value in env.items()}


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    with COMPOSE_FILE.open() as f:
        doc = yaml.safe_load(f)
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc["services"]


@pytest.fixture(scope="module")
def warren_nodes(services) -> dict[str, dict]:
    """The services that run a warren node (they carry WARREN_NODE_NAME)."""
    return {
        name: service
        for name, service in services.items()
        if "WARREN_NODE_NAME" in _environment(service)
    }


def test_compose_config_is_valid():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip(
            "docker-compose is not installed "
            "(`apt-get install docker-compose` or `make docker-engine`)"
        )
    proc = subprocess.run(
        [exe, "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"docker-compose config -q failed:\n{proc.stderr}"


def test_three_nodes_from_one_image(services, warren_nodes):
    assert sorted(warren_nodes) == list(NODES), (
        f"expected exactly the warren nodes {NODES}, got {sorted(warren_nodes)}"
    )
    raw = {str(service.get("image")) for service in warren_nodes.values()}
    assert len(raw) == 1, f"nodes must share one image, got {raw}"
    assert {_defaults(image) for image in raw} == {"warren:latest"}, raw
    assert raw.pop().startswith("${WARREN_IMAGE"), "the docker test picks its own image tag"
    for name, service in warren_nodes.items():
        command = service.get("command")
        if isinstance(command, str):
            command = command.split()
        assert command and command[0] == "warren-server", f"{name} runs {command!r}"


def test_node_names_are_distinct_and_match_hosts(warren_nodes):
    names = [_environment(s)["WARREN_NODE_NAME"] for s in warren_nodes.values()]
    assert len(set(names)) == len(names) == 3, f"node names not distinct: {names}"
    for service_name, service in warren_nodes.items():
        env = _environment(service)
        # The node advertises its service name, which Docker's DNS resolves
        # on the compose network.
        assert env["WARREN_NODE_NAME"] == service_name
        assert env["WARREN_ADVERTISE_HOST"] == service_name
        assert service.get("hostname", service_name) == service_name


def test_common_settings(warren_nodes):
    envs = {name: _environment(s) for name, s in warren_nodes.items()}
    for name, env in envs.items():
        assert env["WARREN_HOST"] == "0.0.0.0", name
        assert env["WARREN_CLIENT_PORT"] == CLIENT_PORT, name
        assert env["WARREN_AMQP_PORT"] == AMQP_PORT, name
        assert env["WARREN_PEER_PORT"] == PEER_PORT, name
        assert env["WARREN_NET_TICKTIME"] == "10", name
        assert env["WARREN_LOG_FORMAT"] == "json", name
        assert env.get("WARREN_SECRET"), f"{name} has no WARREN_SECRET"
    secrets = {env["WARREN_SECRET"] for env in envs.values()}
    assert len(secrets) == 1, "all nodes must share one secret"
    raw = {
        str((s.get("environment") or {}).get("WARREN_SECRET", ""))
        for s in warren_nodes.values()
    }
    assert all(value.startswith("${WARREN_SECRET") for value in raw), (
        "the secret must be overridable from the host environment"
    )


def test_seed_points_at_n1(warren_nodes):
    envs = {name: _environment(s) for name, s in warren_nodes.items()}
    assert "WARREN_CLUSTER_SEED" not in envs["n1"], "n1 founds the cluster: no seed"
    for name in ("n2", "n3"):
        assert envs[name].get("WARREN_CLUSTER_SEED") == f"n1:{PEER_PORT}", name
    # The seed must name a node that exists and listens on that peer port.
    seed_host, seed_port = envs["n2"]["WARREN_CLUSTER_SEED"].rsplit(":", 1)
    assert seed_host in warren_nodes
    assert envs[seed_host]["WARREN_PEER_PORT"] == seed_port


def test_client_ports_published_on_loopback_only(warren_nodes):
    for name, service in warren_nodes.items():
        ports = [_defaults(str(p)) for p in service.get("ports") or []]
        # n1 also publishes its management HTTP port (API, /metrics, web UI), on loopback too
        http = [f"127.0.0.1:{HTTP_HOST_PORT}:{HTTP_PORT}"] if name == "n1" else []
        assert ports == [f"127.0.0.1:{HOST_PORTS[name]}:{CLIENT_PORT}",
                         f"127.0.0.1:{HOST_AMQP_PORTS[name]}:{AMQP_PORT}", *http], (
            f"{name} publishes {ports}"
        )
        assert _environment(service)["WARREN_HTTP_PORT"] == HTTP_PORT, name


def test_a_user_that_works_from_the_host(warren_nodes):
    """Connections through a published port do not come from the container's loopback, so
    guest (a loopback user by default) is refused from the host: the nodes define a second user
    that is not a loopback user, with a password the host environment can set."""
    from broker.config import parse_names, parse_users

    for name, service in warren_nodes.items():
        env = _environment(service)
        users = parse_users(env["WARREN_USERS"])
        loopback = parse_names(env["WARREN_LOOPBACK_USERS"]) if "WARREN_LOOPBACK_USERS" in env else ["guest"]
        assert users.get("warren") == "warren", f"{name}: {users}"
        assert "warren" not in loopback, name
        raw = str((service.get("environment") or {})["WARREN_USERS"])
        assert "warren:${WARREN_PASSWORD" in raw, "the password must be overridable from the host"


def test_the_load_balancer_checks_each_nodes_is_in_service_endpoint(services, warren_nodes):
    """The lb's health check is HTTP, on the nodes' management port, logged in as the host user
    with the password the nodes get: a node whose app is stopped or that is paused keeps its
    process (and maybe its client ports) up, and only its answer takes it out."""
    cfg = (REPO / "docker" / "haproxy.cfg").read_text()
    assert "option httpchk" in cfg
    assert "uri /api/health/checks/is-in-service" in cfg
    assert re.search(r"default-server check port " + HTTP_PORT + r"\b", cfg)
    assert '"Basic ${WARREN_LB_CHECK_AUTH}"' in cfg
    lb = services["lb"]
    assert _environment(lb)["WARREN_PASSWORD"] == "warren"
    command = " ".join(lb["command"])
    assert "export WARREN_LB_CHECK_AUTH=" in command and "warren:%s" in command
    for service in warren_nodes.values():
        assert "warren:${WARREN_PASSWORD:-warren}" in str(service["environment"]["WARREN_USERS"])
