"""The brokers under test: how the runner starts, inspects, configures and breaks a cluster.

This module owns everything the runner does to a cluster *from the outside*, as an operator
would: start/stop (warren through `broker.localcluster`, RabbitMQ through
`bench/rabbitmq/cluster.sh`), policies (`set_policy`/`clear_policy` with rabbitmqctl's syntax),
`list_queues` to find a queue's leader and its mirrors, and the faults (signals to the node's OS
process, `stop_app`/`start_app`, restart, add a node, `sync_queue`). It never imports broker
internals beyond the local-cluster helpers and the client.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

RABBIT_SCRIPT = Path(__file__).parent / "rabbitmq" / "cluster.sh"


class TargetError(RuntimeError):
    pass


class Unsupported(TargetError):
    """The broker cannot do what the scenario needs (e.g. no set_policy yet)."""


def proc_rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` in MiB (VmRSS), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by `pid` and its waited-for children, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick


def proc_runq(pid: int | str = "self") -> tuple[float, int] | None:
    """(seconds spent waiting for a CPU, time slices run) of every thread of `pid` so far, from
    /proc/PID/task/*/schedstat (the kernel's run_delay and pcount), or None where the kernel
    does not keep them. A process that waits for a CPU once it is woken is late by that wait:
    on a machine whose cores the broker and its clients share, it is the part of a latency
    that no code of the broker's own spends."""
    wait = slices = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        for tid in tasks:
            fields = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            wait += int(fields[1])
            slices += int(fields[2])
    except (OSError, IndexError, ValueError):
        return None
    return wait / 1e9, slices


class Target:
    name = "?"
    nodes: list[str]  # node names, in order
    lists_mirrors = True  # `queues()` shows each queue's synchronised mirrors

    def addresses(self) -> list[str]: ...
    def version(self) -> str | None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def pid(self, node: str) -> int | None: ...
    def ctl(self, node: str, *args: str, timeout: float = 60) -> str: ...

    # --- shared helpers ---------------------------------------------------------------------
    def running_node(self) -> str:
        for n in self.nodes:
            if n not in self.down:
                return n
        raise TargetError("no running node left")

    def cpu(self) -> dict:
        out = {}
        for n in self.nodes:
            pid = self.pid(n)
            if pid:
                out[n] = _proc_cpu(pid)
        return out

    def runq(self) -> dict:
        """Node -> (seconds waited for a CPU, time slices) so far (`proc_runq`)."""
        out = {}
        for n in self.nodes:
            pid = self.pid(n)
            got = proc_runq(pid) if pid else None
            if got is not None:
                out[n] = got
        return out

    def rss(self) -> dict:
        """Resident memory (MiB) of each node's OS process."""
        out = {}
        for n in self.nodes:
            pid = self.pid(n)
            if pid:
                out[n] = proc_rss_mib(pid)
        return out

    def signal(self, node: str, sig: int) -> dict:
        pid = self.pid(node)
        if not pid:
            raise TargetError(f"no process id known for node {node}")
        os.kill(pid, sig)
        return {"pid": pid}

    def set_policy(self, name: str, pattern: str, definition: dict) -> None:
        self.ctl(self.running_node(), "set_policy", "--apply-to", "queues", "--priority", "10",
                 name, pattern, json.dumps(definition))

    def clear_policy(self, name: str) -> None:
        try:
            self.ctl(self.running_node(), "clear_policy", name)
        except TargetError:
            pass

    def sync_queue(self, queue: str) -> str:
        return self.ctl(self.running_node(), "sync_queue", queue, timeout=600)


# --- warren ---------------------------------------------------------------------------------

def warren_amqp_support() -> str | None:
    """None when this warren's nodes take --amqp-port (the AMQP 0-9-1 listener), else why not."""
    try:
        out = subprocess.run(["warren-server", "--help"], check=False, capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"warren-server --help failed: {exc}"
    if "--amqp-port" not in out.stdout:
        return "this warren has no AMQP 0-9-1 port yet (warren-server takes no --amqp-port)"
    return None


class _AmqpCluster:
    """A LocalCluster whose every node also listens for AMQP 0-9-1 on a free port of its own."""

    @staticmethod
    def make(home: Path, size: int):
        from broker import localcluster

        class Cluster(localcluster.LocalCluster):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.amqp_ports = {n: localcluster.free_port() for n in self.names}

            def spawn(self, name, extra_args=()):
                if name not in self.amqp_ports:
                    self.amqp_ports[name] = localcluster.free_port()
                return super().spawn(name, [*extra_args, "--amqp-port", str(self.amqp_ports[name])])

        return Cluster(home, size, free_ports=True)


class WarrenTarget(Target):
    """warren nodes: a local cluster started here (`broker.localcluster.LocalCluster` on free
    ports), or named nodes already running under $WARREN_HOME. protocol "native" drives them
    through warren's own client (target `warren-native`), "amqp" through their AMQP 0-9-1 port
    (target `warren-amqp`; given nodes then need `amqp_addresses`)."""

    def __init__(self, nodes: list[str] | None = None, size: int = 3, home: Path | None = None,
                 protocol: str = "native", amqp_addresses: list[str] | None = None):
        if protocol not in ("native", "amqp"):
            raise ValueError(f"protocol must be native or amqp, got {protocol!r}")
        self.protocol = protocol
        self.name = f"warren-{protocol}"
        self.amqp_given = amqp_addresses
        self.given = nodes
        self.size = size
        self.home = (home or Path(os.environ.get("WARREN_HOME", "var/warren")).resolve()) if nodes else home
        self.owned = False
        self.cluster = None  # the LocalCluster when we started it
        self.nodes = list(nodes or [])
        self.down: set[str] = set()

    def start(self) -> None:
        from broker import localcluster
        if self.given:
            return
        if self.protocol == "amqp":
            why = warren_amqp_support()
            if why:
                raise Unsupported(why)
        self.home = Path(tempfile.mkdtemp(prefix="warren-bench-"))
        # free ports: the benchmark must not collide with a demo cluster or a test on 5691..
        if self.protocol == "amqp":
            self.cluster = _AmqpCluster.make(self.home, self.size)
        else:
            self.cluster = localcluster.LocalCluster(self.home, self.size, free_ports=True)
        try:
            self.nodes = list(self.cluster.start())
        except BaseException as exc:  # noqa: BLE001 - LocalCluster.start has killed its nodes; report
            self.cluster = None
            raise TargetError(f"could not start a local warren cluster: {exc} (logs in {self.home}/logs)") from None
        self.owned = True
        self.down.clear()

    def stop(self) -> None:
        if self.owned and self.cluster is not None:
            self.cluster.stop()  # SIGCONT + SIGTERM every node it knows, SIGKILL after 10 s
            shutil.rmtree(self.home, ignore_errors=True)
            self.cluster = None
            self.owned = False

    def _registry(self, node: str) -> dict | None:
        try:
            return json.loads((self.home / "run" / f"{node}.json").read_text())
        except (OSError, ValueError, TypeError):
            return None

    def addresses(self) -> list[str]:
        if self.protocol == "amqp":
            if self.cluster is not None:
                return [f"127.0.0.1:{self.cluster.amqp_ports[n]}" for n in self.nodes]
            if not self.amqp_given or len(self.amqp_given) != len(self.nodes):
                raise TargetError("warren-amqp on given nodes needs --amqp-addresses HOST:PORT,... "
                                  "(one per node, in the order of --nodes)")
            return list(self.amqp_given)
        if self.cluster is not None:
            return [self.cluster.client_addr(n) for n in self.nodes]
        out = []
        for n in self.nodes:
            reg = self._registry(n)
            if reg is None:
                raise TargetError(f"node {n} is not registered under {self.home}/run (is it running?)")
            out.append(f"{reg['client'][0]}:{reg['client'][1]}")
        return out

    def pid(self, node: str) -> int | None:
        if self.cluster is not None and node in self.cluster.procs:
            return self.cluster.procs[node].pid
        reg = self._registry(node)
        return int(reg["pid"]) if reg else None

    def version(self) -> str | None:
        try:
            from importlib.metadata import version
            return version("warren")
        except ImportError:
            return None
        except Exception:  # noqa: BLE001 - PackageNotFoundError and kin: the version is optional
            return None

    def _env(self) -> dict:
        if self.cluster is not None:
            return dict(self.cluster.env)
        env = dict(os.environ)
        env["WARREN_HOME"] = str(self.home)
        return env

    def ctl(self, node: str, *args: str, timeout: float = 60) -> str:
        try:
            out = subprocess.run(["warrenctl", "-n", node, *args], env=self._env(), capture_output=True,
                                 check=False, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TargetError(f"warrenctl -n {node} {' '.join(args)}: no answer in {timeout:g} s") from None
        if out.returncode != 0:
            msg = (out.stderr or out.stdout).strip().splitlines()
            raise TargetError(f"warrenctl -n {node} {' '.join(args)}: {msg[-1] if msg else out.returncode}")
        return out.stdout

    def set_policy(self, name, pattern, definition) -> None:
        try:
            super().set_policy(name, pattern, definition)
        except TargetError as exc:
            if "invalid choice" in str(exc):
                raise Unsupported("this warren has no set_policy yet (mirroring has not landed)") from None
            raise

    def sync_queue(self, queue: str) -> str:
        try:
            return super().sync_queue(queue)
        except TargetError as exc:
            if "invalid choice" in str(exc):
                raise Unsupported(f"this warren has no sync_queue yet ({exc})") from None
            raise

    def queues(self, columns=("name", "pid", "leader", "mirror_pids", "synchronised_mirror_pids",
                              "messages")) -> dict[str, dict]:
        cols = list(columns)
        try:
            rows = json.loads(self.ctl(self.running_node(), "list_queues", *cols, "--formatter", "json"))
        except TargetError as exc:
            if "unknown queue info" not in str(exc):
                raise
            cols = [c for c in cols if c in ("name", "pid", "leader", "messages")]
            rows = json.loads(self.ctl(self.running_node(), "list_queues", *cols, "--formatter", "json"))
        return {r["name"]: r for r in rows}

    def leader(self, queue: str) -> str:
        row = self.queues(("name", "leader")).get(queue)
        if row is None:
            raise TargetError(f"queue {queue} not found by list_queues")
        return _node_of(row["leader"])

    def mirrors(self, queue: str) -> tuple[list[str], list[str]]:
        row = self.queues().get(queue, {})
        return ([_node_of(p) for p in row.get("mirror_pids") or []],
                [_node_of(p) for p in row.get("synchronised_mirror_pids") or []])

    # --- faults that need a process ---------------------------------------------------------
    def kill(self, node: str) -> dict:
        detail = self.signal(node, signal.SIGKILL)
        self.down.add(node)
        return detail

    def restart(self, node: str) -> dict:
        """SIGTERM (unless already down) and start again with the same ports and home."""
        pid = self.pid(node)
        if self.cluster is None or node not in self.cluster.ports:
            raise TargetError(f"can only restart nodes of a cluster this run started, not {node}")
        if node not in self.down:
            self.cluster.sigterm(node)
        self.cluster.restart(node)  # kill -9 if still running (it is not), spawn, wait for status
        self.down.discard(node)
        return {"old_pid": pid, "pid": self.pid(node)}

    def add_node(self) -> dict:
        from broker import localcluster
        if self.cluster is None:
            raise TargetError("add_node needs a cluster this run started")
        name = f"n{len(self.nodes) + 1}"
        self.cluster.ports[name] = (localcluster.free_port(), localcluster.free_port())
        self.cluster.names.append(name)
        self.cluster.spawn(name)
        self.cluster.wait_status(name)
        self.ctl(name, "stop_app")
        self.ctl(name, "join_cluster", self.running_node())
        self.ctl(name, "start_app")
        self.nodes.append(name)
        return {"pid": self.pid(name), "node": name}


def _port_open(host: str, port: int) -> bool:
    import socket
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _node_of(pid_text) -> str:
    """A node name from a queue pid ('<rabbit-1@localhost.1.2.3>', 'n1' or 'n1/...')."""
    s = str(pid_text).strip("<>")
    m = re.match(r"([A-Za-z0-9_-]+@[A-Za-z0-9_.-]+?)\.\d+\.\d+\.\d+$", s)
    if m:
        return m.group(1)
    return re.split(r"[/.:]", s, maxsplit=1)[0] if "@" not in s else s


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return  # our child, now reaped
        except ChildProcessError:
            pass  # not our child: kill(pid, 0) tells
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


# --- RabbitMQ -------------------------------------------------------------------------------

def amqp_client_available() -> str | None:
    """None when the AMQP load generator can run (it needs pamqp), else why not."""
    import importlib.util
    if importlib.util.find_spec("pamqp") is None:
        return "pamqp (the AMQP codec of the load generator) is not installed (pip install -e .)"
    return None


def rabbitmq_available() -> str | None:
    """None when RabbitMQ can run here, else why not."""
    if not Path("/usr/lib/rabbitmq/bin/rabbitmq-server").exists():
        return "rabbitmq-server is not installed (Debian: apt-get install -y rabbitmq-server)"
    return amqp_client_available()


class RabbitTarget(Target):
    """A RabbitMQ cluster started by bench/rabbitmq/cluster.sh (or one already started in DIR)."""

    name = "rabbitmq"
    AMQP_BASE = 5700

    def __init__(self, size: int = 3, dir: Path | None = None):
        self.size = size
        self.dir = dir
        self.owned = False
        self.nodes = []
        self.down: set[str] = set()

    def _script(self, *args: str, timeout: float = 180) -> str:
        out = subprocess.run(["sh", str(RABBIT_SCRIPT), *args], check=False, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise TargetError(f"cluster.sh {' '.join(args)}: {(out.stderr or out.stdout).strip()[-500:]}")
        return out.stdout

    def start(self) -> None:
        if self.dir is None:
            busy = _port_open("127.0.0.1", self.AMQP_BASE + 1)
            if busy:
                raise TargetError(f"port {self.AMQP_BASE + 1} is taken: a RabbitMQ bench cluster is already "
                                  f"running (use --rabbitmq-dir DIR, or stop it: cluster.sh stop DIR)")
            self.dir = Path(tempfile.mkdtemp(prefix="warren-bench-rabbitmq-"))
            try:
                self._script("start", str(self.dir), str(self.size))
            except BaseException:
                self._script("stop", str(self.dir))
                shutil.rmtree(self.dir, ignore_errors=True)
                self.dir = None
                raise
            self.owned = True
        else:
            self.size = int((self.dir / "nodes").read_text())
        self.nodes = [f"rabbit-{i}@localhost" for i in range(1, self.size + 1)]
        self.down.clear()

    def stop(self) -> None:
        if self.owned and self.dir:
            for n in self.nodes:
                pid = self.pid(n)
                if pid:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            self._script("stop", str(self.dir))
            shutil.rmtree(self.dir, ignore_errors=True)
            self.owned = False
            self.dir = None

    def _index(self, node: str) -> int:
        return int(node.split("@")[0].rsplit("-", 1)[1])

    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{self.AMQP_BASE + self._index(n)}" for n in self.nodes]

    def pid(self, node: str) -> int | None:
        try:
            return int((self.dir / f"rabbit-{self._index(node)}" / "pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def version(self) -> str | None:
        try:
            out = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"],
                                 check=False, capture_output=True, text=True)
            return out.stdout.strip() or None
        except OSError:
            return None

    def ctl(self, node: str, *args: str, timeout: float = 60) -> str:
        try:
            return self._script("ctl", str(self.dir), str(self._index(node)), *args, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TargetError(f"rabbitmqctl -n {node} {' '.join(args)}: no answer in {timeout:g} s") from None

    def queues(self) -> dict[str, dict]:
        # the table format, not json: json shows pids without their node (#PID<11016.1950.0>)
        cols = ["name", "pid", "slave_pids", "synchronised_slave_pids", "messages"]
        out = self.ctl(self.running_node(), "list_queues", "-q", "--no-table-headers", *cols)
        rows = {}
        for line in out.splitlines():
            cells = line.split("\t")
            if len(cells) != len(cols):
                continue
            row = dict(zip(cols, cells))
            for k in ("slave_pids", "synchronised_slave_pids"):
                row[k] = re.findall(r"<[^>]+>", row[k])
            row["messages"] = int(row["messages"]) if row["messages"].isdigit() else 0
            rows[row["name"]] = row
        return rows

    def leader(self, queue: str) -> str:
        row = self.queues().get(queue)
        if row is None:
            raise TargetError(f"queue {queue} not found by list_queues")
        return _node_of(row["pid"])

    def mirrors(self, queue: str) -> tuple[list[str], list[str]]:
        row = self.queues().get(queue, {})
        return ([_node_of(p) for p in row.get("slave_pids", [])],
                [_node_of(p) for p in row.get("synchronised_slave_pids", [])])

    def kill(self, node: str) -> dict:
        detail = self.signal(node, signal.SIGKILL)
        self.down.add(node)
        return detail

    def restart(self, node: str) -> dict:
        pid = self.pid(node)
        if pid and node not in self.down:
            try:
                os.kill(pid, signal.SIGTERM)
                _wait_gone(pid, 30)
            except ProcessLookupError:
                pass
        self._script("start-node", str(self.dir), str(self._index(node)))
        self.down.discard(node)
        return {"old_pid": pid, "pid": self.pid(node)}

    def add_node(self) -> dict:
        i = len(self.nodes) + 1
        self._script("add-node", str(self.dir), str(i))
        name = f"rabbit-{i}@localhost"
        self.nodes.append(name)
        self.size = len(self.nodes)
        (self.dir / "nodes").write_text(str(self.size))
        return {"pid": self.pid(name), "node": name}


# --- the null broker --------------------------------------------------------------------------

class NullTarget(Target):
    """The null AMQP broker of `bench.nullbroker` (one process, `size` ports as pretend nodes):
    what the load generator can do when the broker costs next to nothing. Policies are ignored.
    With `mirrors` (the `floor` target) every queue is mirrored to that many null mirror
    processes, whatever the policy, all of them on trio: the floor of a mirrored confirm for a
    Python broker on this machine."""

    lists_mirrors = False

    def __init__(self, size: int = 3, mirrors: int = 0):
        self.size = size
        self.mirrors = mirrors
        self.name = "floor" if mirrors else "null"
        self.proc: subprocess.Popen | None = None
        self.mirror_procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.nodes = []
        self.down: set[str] = set()
        self.owned = False

    def _spawn(self, *args: str) -> subprocess.Popen:
        import sys
        return subprocess.Popen([sys.executable, "-m", "bench.nullbroker", *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait_open(self, procs, ports) -> None:
        deadline = time.monotonic() + 20
        while not all(_port_open("127.0.0.1", p) for p in ports):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                self.stop()
                raise TargetError("the null broker did not start (python -m bench.nullbroker)")
            time.sleep(0.05)

    def start(self) -> None:
        from broker.localcluster import free_port
        mports = [free_port() for _ in range(self.mirrors)]
        self.mirror_procs = [self._spawn("--mirror", "--ports", str(p)) for p in mports]
        self._wait_open(self.mirror_procs, mports)
        self.ports = [free_port() for _ in range(self.size)]
        args = ["--ports", ",".join(map(str, self.ports))]
        if mports:
            args += ["--mirrors", ",".join(map(str, mports))]
        self.proc = self._spawn(*args)
        self._wait_open([self.proc, *self.mirror_procs], self.ports)
        self.nodes = [f"null-{i}" for i in range(1, self.size + 1)]
        self.owned = True

    def stop(self) -> None:
        for proc in [self.proc, *self.mirror_procs]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.proc = None
        self.mirror_procs = []
        self.owned = False

    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def pid(self, node: str) -> int | None:
        # one process plays every node (count its CPU once, as the first's); the mirrors, if
        # any, are counted as the nodes after it
        if self.proc is None or node not in self.nodes:
            return None
        i = self.nodes.index(node)
        if i == 0:
            return self.proc.pid
        return self.mirror_procs[i - 1].pid if i - 1 < len(self.mirror_procs) else None

    def version(self) -> str | None:
        return "null"

    def ctl(self, node: str, *args: str, timeout: float = 60) -> str:
        raise Unsupported("the null broker has no control commands")

    def set_policy(self, name, pattern, definition) -> None:
        pass  # nothing is mirrored: the null broker measures the generator

    def clear_policy(self, name) -> None:
        pass

    def queues(self, *a) -> dict:
        return {}

    def leader(self, queue: str) -> str:
        raise TargetError("the null broker has no leaders")
