"""The docker-compose cluster for real: three containers form one cluster,
and a killed node drops out of running_nodes but stays a member.

Needs a Docker engine (`make docker-engine`) and the warren:latest image
(`make docker-image`); skips with that advice otherwise.  It runs its own
compose project, "warrentest", on free host ports, so it does not collide
with a cluster started by `make docker-up`, and always takes it down.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.docker,
    pytest.mark.timeout(360),
    pytest.mark.skipif(os.environ.get("WARREN_DOCKER_TESTS") != "1",
                       reason="docker cluster test is opt-in: `make docker-engine docker-image`, "
                              "then WARREN_DOCKER_TESTS=1 (it is flaky when another compose run "
                              "shares the engine)"),
]

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker-compose.yml"
PROJECT = "warrentest"
IMAGE = "warren:latest"
NODES = ("n1", "n2", "n3")
FORM_TIMEOUT = 60.0
DOWN_TIMEOUT = 60.0
# Two runs at once would share the compose project: the leftover-cleaning
# `down` of the second stops the first one's containers.  A lock file makes
# runs on this machine take turns.
LOCK_FILE = Path("/tmp/warren-docker-cluster-test.lock")
LOCK_TIMEOUT = 180.0


def _run(args, *, timeout=60.0, env=None, check=False):
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=check
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _require_docker() -> str:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client installed: run `make docker-engine`")
    try:
        info = _run([docker, "info"], timeout=30)
    except subprocess.TimeoutExpired:
        pytest.skip("no Docker engine running (`docker info` hung): run `make docker-engine`")
    if info.returncode != 0:
        pytest.skip("no Docker engine running: run `make docker-engine`")
    if _run([docker, "image", "inspect", IMAGE]).returncode != 0:
        pytest.skip(f"the {IMAGE} image is missing: run `make docker-image`")
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed: run `make docker-engine`")
    return docker


@contextlib.contextmanager
def _exclusive_run():
    with LOCK_FILE.open("a") as f:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.skip(
                        f"another run of the docker cluster test held {LOCK_FILE} "
                        f"for {LOCK_TIMEOUT:.0f}s"
                    )
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cluster_status(docker: str, container: str) -> dict | str:
    """n1's view as parsed JSON, or the reason it could not be had."""
    try:
        proc = _run(
            [docker, "exec", container,
             "warrenctl", "-n", "127.0.0.1:25672", "cluster_status", "--formatter", "json"],
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        return "warrenctl timed out"
    if proc.returncode != 0:
        return f"warrenctl exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError:
        # Tolerate stray lines around the JSON document.
        for line in reversed(proc.stdout.splitlines()):
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                return doc
        return f"not JSON: {proc.stdout.strip()[-500:]!r}"


def _wait_for(docker, container, predicate, timeout, what):
    deadline = time.monotonic() + timeout
    last: dict | str = "never asked"
    while time.monotonic() < deadline:
        last = _cluster_status(docker, container)
        if isinstance(last, dict) and predicate(last):
            return last
        if isinstance(last, str) and "is not running" in last:
            break  # n1's container exited: waiting longer cannot help
        time.sleep(1.0)
    pytest.fail(f"{what} within {timeout:.0f}s; n1's last cluster_status: {last}")


def _container_state(docker: str, container: str) -> str:
    proc = _run([docker, "inspect", "-f", "{{.State.Status}}", container])
    return proc.stdout.strip() or proc.stderr.strip()


def test_cluster_forms_and_notices_a_killed_node():
    docker = _require_docker()
    with _exclusive_run():
        _cluster_scenario(docker)


def _cluster_scenario(docker: str) -> None:
    env = dict(os.environ)
    env.update({f"WARREN_PORT_{n.upper()}": str(_free_port()) for n in NODES})
    compose = ["docker-compose", "-f", str(COMPOSE_FILE), "-p", PROJECT]

    # Leftovers of an interrupted earlier run would confuse the test.
    _run(compose + ["down", "--remove-orphans", "-t", "5"], timeout=120, env=env)
    try:
        up = _run(compose + ["up", "-d"], timeout=180, env=env)
        assert up.returncode == 0, f"docker-compose up failed:\n{up.stderr}"
        ids = {}
        for node in NODES:
            ps = _run(compose + ["ps", "-q", node], env=env)
            ids[node] = ps.stdout.strip()
            assert ids[node], f"no container for {node}: {ps.stderr}"

        try:
            status = _wait_for(
                docker, ids["n1"],
                lambda s: sorted(s.get("running_nodes", [])) == list(NODES),
                FORM_TIMEOUT, "the three nodes did not all run",
            )
            assert sorted(status["members"]) == list(NODES), status

            kill = _run([docker, "kill", ids["n3"]])
            assert kill.returncode == 0, f"docker kill n3 failed: {kill.stderr}"
            assert _container_state(docker, ids["n3"]) != "running"

            status = _wait_for(
                docker, ids["n1"],
                lambda s: "n3" not in s.get("running_nodes", []) and "n3" in s.get("members", []),
                DOWN_TIMEOUT, "n1 did not see n3 go down (while keeping it a member)",
            )
            assert sorted(status["running_nodes"]) == ["n1", "n2"], status
            assert sorted(status["members"]) == list(NODES), status
        except BaseException:
            states = {node: _container_state(docker, cid) for node, cid in ids.items()}
            logs = _run(compose + ["logs", "--no-color", "--tail", "40"], env=env)
            print(f"--- containers: {states}")
            print(f"--- docker-compose logs ---\n{logs.stdout}\n{logs.stderr}")
            raise
    finally:
        _run(compose + ["down", "--remove-orphans", "-t", "5"], timeout=120, env=env)
