"""The compose cluster's load balancer check (docker/haproxy.cfg) against real warren-server
processes, with Debian's haproxy on this machine and no Docker: the file's own check lines,
only its server addresses and listening ports changed. A node whose app is stopped, and a node
paused under pause_minority whose client ports still accept connections, are taken out; each
is put back once it serves again. A node that is only slow to answer (here: frozen for a second
and a half, as a burst of publishes on a loaded machine can hold it) is not taken out, so its
clients are not cut for being busy."""

from __future__ import annotations

import base64
import csv
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cluster_procs import free_port, running_cluster, wait_until

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
CONFIG = Path(__file__).resolve().parents[1] / "docker" / "haproxy.cfg"

pytestmark = [
    pytest.mark.process, pytest.mark.timeout(120),
    pytest.mark.skipif(not Path(HAPROXY).exists(), reason="no haproxy: apt-get install haproxy"),
]


def local_config(c, sock: Path) -> str:
    """docker/haproxy.cfg with the nodes on 127.0.0.1 (the check on each one's HTTP port), the
    frontends on free loopback ports, and a stats socket to read the servers' states from."""
    text = CONFIG.read_text()
    for name in c.names:
        http = c.http_ports[name]
        for container_port, port in (("5673", c.amqp_port(name)), ("5672", c.client_port(name))):
            line = f"server {name} {name}:{container_port}"
            assert text.count(line) == 1, f"{line!r} is not in {CONFIG}"
            text = text.replace(line, f"server {name} 127.0.0.1:{port} port {http}")
    text, binds = re.subn(r"bind :\d+", lambda _: f"bind 127.0.0.1:{free_port()}", text)
    assert binds == 2
    return text + f"\nglobal\n    stats socket {sock}\n"


def server_states(sock: Path) -> dict[tuple[str, str], str]:
    """{(backend, server): status} as HAProxy's `show stat` gives it ("UP", "DOWN", "UP 1/2")."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(b"show stat\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    rows = csv.DictReader(data.decode().lstrip("# ").splitlines())
    return {(r["pxname"], r["svname"]): r["status"] for r in rows if r["svname"] in ("n1", "n2", "n3")}


def states_of(sock: Path, node: str) -> set[str]:
    return {status for (_, server), status in server_states(sock).items() if server == node}


def test_the_balancer_takes_out_a_stopped_and_a_paused_node(request, tmp_path_factory, tmp_path):
    with running_cluster(request, tmp_path_factory, 3, net_ticktime=2, http=True) as c:
        sock = tmp_path / "lb.sock"
        (tmp_path / "haproxy.cfg").write_text(local_config(c, sock))
        auth = base64.b64encode(b"guest:guest").decode()
        lb = subprocess.Popen([HAPROXY, "-db", "-f", str(tmp_path / "haproxy.cfg")],
                              env={"WARREN_LB_CHECK_AUTH": auth}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: sock.exists() and all(
                states_of(sock, n) == {"UP"} for n in c.names), 10, "every node up behind the LB")
            # slow is not down: checks of a frozen n1 wait for its answer (timeout check)
            c.sigstop("n1")
            try:
                seen = set()
                deadline = time.monotonic() + 1.5
                while time.monotonic() < deadline:
                    seen |= states_of(sock, "n1")
                    time.sleep(0.05)
            finally:
                c.sigcont("n1")
            assert seen == {"UP"}, f"a node slow to answer its check was taken out: {seen}"
            c.ctl_ok("n3", "stop_app")
            wait_until(lambda: states_of(sock, "n3") == {"DOWN"}, 5, "n3 (app stopped) out")
            c.ctl_ok("n3", "start_app")
            wait_until(lambda: states_of(sock, "n3") == {"UP"}, 10, "n3 back")
            # n3 alone: paused (pause_minority), its ports still open, its check failing
            for other in ("n1", "n2"):
                c.sigstop(other)
            try:
                wait_until(lambda: c.call("n3", "cluster_status")["paused"], 30, "n3 paused")
                wait_until(lambda: states_of(sock, "n3") == {"DOWN"}, 5, "n3 (paused) out")
                socket.create_connection(("127.0.0.1", c.amqp_port("n3")), timeout=5).close()
            finally:
                for other in ("n1", "n2"):
                    c.sigcont(other)
            wait_until(lambda: states_of(sock, "n3") == {"UP"}, 30, "n3 back after the pause")
        finally:
            lb.terminate()
            lb.wait(timeout=10)
