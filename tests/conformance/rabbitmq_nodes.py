"""RabbitMQ nodes for the conformance suite: Debian's `rabbitmq-server` (3.10) started as the
current user in a temporary directory, on free ports, under node names no other run uses, with
its own Erlang cookie in a temporary HOME; a cluster of N of them joined to the first.

    with RabbitCluster(3) as rabbit:
        rabbit.amqp_url(1); rabbit.set_policy(...); rabbit.ctl(1, "cluster_status")

The first node runs the management plugin, on a free port too: a policy set over its HTTP API
takes milliseconds, where each rabbitmqctl call starts an Erlang VM (seconds on a busy machine).

The environment of a node is the one bench/rabbitmq/cluster.sh gives its nodes, with the ports and
names picked here so that a benchmark cluster and the suite can run side by side.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from broker.localcluster import pick_free_ports

SBIN = Path("/usr/lib/rabbitmq/bin")


def installed() -> bool:
    return (SBIN / "rabbitmq-server").exists() and (SBIN / "rabbitmqctl").exists()


class RabbitCluster:
    def __init__(self, nodes: int = 1, start_timeout: float = 90.0):
        self.count = nodes
        self.start_timeout = start_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="warren-conformance-rabbit-"))
        self.home = self.dir / "home"
        tag = uuid.uuid4().hex[:8]
        self.names = [f"conformance-{tag}-{i}@localhost" for i in range(1, nodes + 1)]
        ports = pick_free_ports(2 * nodes + 1)
        self.amqp_ports = ports[:nodes]
        self.dist_ports = ports[nodes:2 * nodes]
        self.management_port = ports[-1]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "RabbitCluster":
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def amqp_url(self, i: int = 1) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_ports[i - 1]}/%2F"

    def _node_dir(self, i: int) -> Path:
        return self.dir / f"node-{i}"

    def _env(self, i: int) -> dict[str, str]:
        node = self._node_dir(i)
        env = dict(os.environ)
        env.update({
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.names[i - 1],
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_ports[i - 1]),
            "RABBITMQ_DIST_PORT": str(self.dist_ports[i - 1]),
            "RABBITMQ_MNESIA_BASE": str(node / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node / "log"),
            "RABBITMQ_PID_FILE": str(node / "pid"),
            "RABBITMQ_CONFIG_FILE": str(node / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node / "enabled_plugins"),
            "RABBITMQ_ENABLED_PLUGINS": "rabbitmq_management" if i == 1 else "",
            "ERL_CRASH_DUMP": str(node / "log" / "erl_crash.dump"),
            # a small shared machine: no busy-waiting schedulers
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "+sbwt none +sbwtdcpu none +sbwtdio none",
        })
        return env

    def ctl(self, i: int, *args: str, timeout: float = 60.0) -> str:
        """`rabbitmqctl -n NODE ARGS` against node i; its stdout, or RuntimeError."""
        env = dict(os.environ, HOME=str(self.home), ERL_CRASH_DUMP="/dev/null")
        done = subprocess.run([str(SBIN / "rabbitmqctl"), "-n", self.names[i - 1], *args], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {self.names[i - 1]}: "
                               f"{done.stdout}{done.stderr}")
        return done.stdout

    def _http(self, method: str, path: str, body: dict | None = None) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.management_port}/api/{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"content-type": "application/json",
                     "authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()

    def set_policy(self, name: str, pattern: str, definition: dict, priority: int = 0,
                   apply_to: str = "all") -> None:
        self._http("PUT", "policies/%2F/" + urllib.parse.quote(name, safe=""),
                   {"pattern": pattern, "definition": definition, "priority": priority,
                    "apply-to": apply_to})

    def clear_policy(self, name: str) -> None:
        self._http("DELETE", "policies/%2F/" + urllib.parse.quote(name, safe=""))

    def start(self) -> None:
        self.home.mkdir(parents=True)
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex)
        cookie.chmod(0o400)
        for i in range(1, self.count + 1):
            node = self._node_dir(i)
            (node / "log").mkdir(parents=True)
            (node / "mnesia").mkdir()
            conf = "vm_memory_high_watermark.relative = 0.2\n"
            if i == 1:
                conf += f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {self.management_port}\n"
            (node / "rabbitmq.conf").write_text(conf)
            (node / "enabled_plugins").write_text("[rabbitmq_management].\n" if i == 1 else "[].\n")
            with open(node / "log" / "console.log", "wb") as console:
                self.procs.append(subprocess.Popen([str(SBIN / "rabbitmq-server")], env=self._env(i),
                                                   stdout=console, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        for i in range(1, self.count + 1):
            self._await_startup(i)
        for i in range(2, self.count + 1):
            self.ctl(i, "stop_app")
            self.ctl(i, "join_cluster", self.names[0])
            self.ctl(i, "start_app")

    def _await_startup(self, i: int) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.procs[i - 1].poll() is not None:
                raise RuntimeError(f"{self.names[i - 1]} exited; see {self._node_dir(i) / 'log'}")
            try:
                self.ctl(i, "await_startup", "--timeout", "10", timeout=30)
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.names[i - 1]} did not start; "
                                       f"see {self._node_dir(i) / 'log'}") from None
                time.sleep(0.5)

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                # the server script runs the VM in the foreground: signal its whole group
                try:
                    os.killpg(proc.pid, 15)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
