"""Start real `warren-server` processes on 127.0.0.1 and cluster them with `warrenctl`.

Plain, synchronous Python so that process tests need no event loop:

    with ProcessCluster(3) as c:
        c.ctl("n1", "cluster_status", "--formatter", "json")
        c.kill9("n1"); c.restart("n1")

Every node gets free ports (found by binding port 0 and closing), a shared temporary WARREN_HOME
and WARREN_SECRET, and its own log file; on failure the tail of each log is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECRET = "process-test-secret"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    """The console script next to the running interpreter, else on PATH."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else (shutil.which(name) or name)


class ProcessCluster:
    def __init__(self, n: int = 3, net_ticktime: float = 5.0, tmpdir: str | None = None):
        self.n = n
        self.names = [f"n{i}" for i in range(1, n + 1)]
        self.net_ticktime = net_ticktime
        self._own_tmp = tmpdir is None
        self.tmp = Path(tmpdir or tempfile.mkdtemp(prefix="warren-proc-"))
        self.home = self.tmp / "home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, WARREN_HOME=str(self.home), WARREN_SECRET=SECRET,
                        PYTHONUNBUFFERED="1")
        self.env.pop("WARREN_NODE", None)
        self.ports = {name: (free_port(), free_port()) for name in self.names}  # (client, peer)
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}

    # --- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "ProcessCluster":
        try:
            self.start()
        except BaseException:
            self.dump_logs()
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.dump_logs()
        self.stop()

    def start(self) -> None:
        for name in self.names:
            self._spawn(name)
        for name in self.names:
            self.wait_status(name)
        for name in self.names[1:]:
            for cmd in (["stop_app"], ["join_cluster", self.names[0]], ["start_app"]):
                self.ctl_ok(name, *cmd)
        self.wait_running(self.names[0], set(self.names))

    def log_path(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def _spawn(self, name: str) -> None:
        client, peer = self.ports[name]
        log = open(self.log_path(name), "ab")
        self._logs[name] = log
        self.procs[name] = subprocess.Popen(
            [_exe("warren-server"), "--name", name, "--client-port", str(client),
             "--peer-port", str(peer), "--net-ticktime", str(self.net_ticktime)],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)

    def kill9(self, name: str) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)

    def restart(self, name: str, wait: bool = True) -> None:
        """Start a (killed) node again with the same ports and WARREN_HOME."""
        self.kill9(name)
        self._spawn(name)
        if wait:
            self.wait_status(name)

    def stop(self) -> None:
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def cleanup(self) -> None:
        self.stop()
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def dump_logs(self, lines: int = 40) -> None:
        for name in self.names:
            path = self.log_path(name)
            if not path.exists():
                continue
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            print(f"----- {name} log ({path}), last {len(tail)} lines -----", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)

    # --- control ---------------------------------------------------------------------------
    def ctl(self, name: str, *args: str, timeout: float = 30.0, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([_exe("warrenctl"), "-n", name, *args], env=env or self.env,
                              capture_output=True, text=True, timeout=timeout)

    def ctl_ok(self, name: str, *args: str) -> str:
        r = self.ctl(name, *args)
        if r.returncode != 0:
            raise RuntimeError(f"warrenctl -n {name} {' '.join(args)} failed ({r.returncode}): "
                               f"{r.stderr.strip() or r.stdout.strip()}")
        return r.stdout

    def ctl_json(self, name: str, *args: str):
        return json.loads(self.ctl_ok(name, *args, "--formatter", "json"))

    def cluster_status(self, name: str) -> dict:
        return self.ctl_json(name, "cluster_status")

    def wait_status(self, name: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            p = self.procs[name]
            if p.poll() is not None:
                raise RuntimeError(f"node {name} exited with {p.returncode} while starting")
            r = self.ctl(name, "status", "-t", "2")
            if r.returncode == 0:
                return
            last = r.stderr.strip()
            time.sleep(0.1)
        raise TimeoutError(f"node {name} did not answer status within {timeout} s: {last}")

    def wait_running(self, on: str, expected: set, timeout: float = 20.0) -> dict:
        """Wait until cluster_status on `on` lists exactly `expected` as running_nodes."""
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            r = self.ctl(on, "cluster_status", "--formatter", "json", "-t", "3")
            if r.returncode == 0:
                st = json.loads(r.stdout)
                if set(st["running_nodes"]) == set(expected):
                    return st
            time.sleep(0.1)
        raise TimeoutError(f"running_nodes on {on} never became {sorted(expected)}: last {st}")

    def client_addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name][0]}"

    def client_port(self, name: str) -> int:
        return self.ports[name][0]

    def all_client_addrs(self) -> list[str]:
        return [self.client_addr(n) for n in self.names]
