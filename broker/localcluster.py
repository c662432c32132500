"""Clusters of real `warren-server` processes on 127.0.0.1: the one launcher, its command line,
and the demo that the README's first command runs.

    python -m broker.localcluster start [--nodes 3]   # start the nodes that are not running
    python -m broker.localcluster start n1            # start node n1 alone, as it was
    python -m broker.localcluster stop                # SIGTERM every node of the home
    python -m broker.localcluster reset               # wipe the home's state (nodes stopped)
    python -m broker.localcluster demo                # a cluster of its own: start, fail over, stop

The command line keeps its state under ./var/warren (or $WARREN_HOME): node data, logs/NAME.log,
pids.json and cluster.json, the settings of the cluster's first start (nodes, ports, ticktime,
server flags, secret) with which every later `start` brings a node back.  Node i gets client
port 5690+i, AMQP port 5671+i (n1..n3: 5672..5674, AMQP's usual port first) and peer port
25690+i unless --client-base / --amqp-base / --peer-base (or $WARREN_CLIENT_BASE /
$WARREN_AMQP_BASE / $WARREN_PEER_BASE) move them; `start` also gives each node a management HTTP
port (API, /metrics, web UI) 15671+i (n1 on 15672, RabbitMQ's), moved by --http-base /
$WARREN_HTTP_BASE.  `stop` stops the nodes of pids.json and every
other node registered under the home's run/ (a node started by hand with this WARREN_HOME), and
signals a pid only after checking that the process is still warren-server with that node name
(the pid may have been reused since).  The demo runs in var/demo on free ports, wiped at its
start, so it never meets the state or the ports of `make cluster`.

`LocalCluster` is the launcher itself, for the command line, the benchmark and the process tests
(tests/cluster_procs.py): node count, home directory, ports (fixed bases or free ports), ticktime,
secret and extra server flags are all parameters, and it can signal, restart and query each node.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CLIENT_BASE = 5690
AMQP_BASE = 5671
HTTP_BASE = 15671  # the management HTTP API: n1 on 15672, RabbitMQ's port
PEER_BASE = 25690
DEFAULT_HOME = Path("var/warren")
DEFAULT_DEMO_HOME = Path("var/demo")
DEMO_SECRET = "warren-local-demo-secret"
PID_FILE = "pids.json"
CLUSTER_FILE = "cluster.json"
# What a home holds for its nodes, and all that `reset` removes (a cookie file and anything else
# put there stay).
STATE_ENTRIES = ("data", "logs", "run", PID_FILE, CLUSTER_FILE)


# Why not bind port 0: the kernel hands out a port from its ephemeral range, and the same range
# supplies the local port of every outgoing connection.  A port picked now and bound seconds later
# (a node started after others, a node restarted after a kill) can by then be the local end of
# some peer link or client socket, and the node fails with "address already in use".  Ports below
# the ephemeral range are never given to outgoing connections, so a free one stays free until a
# listener of ours takes it.
_PORT_FLOOR = 10000
_pick = random.Random()  # its own generator: a test that seeds `random` must not make picks repeat
_picked: set[int] = set()  # this process's earlier picks, not given out twice


FREE_PORTS_ENV = "WARREN_FREE_PORTS"


def _listening_range() -> range:
    """The ports we pick from: $WARREN_FREE_PORTS (LOW-HIGH, both included) when set, else from
    _PORT_FLOOR up to the kernel's ephemeral range. Processes that pick at the same time (the
    test suite's parallel workers, each with its own share of the range) set it so that no two
    of them can pick the same port in the moment before its node binds it."""
    text = os.environ.get(FREE_PORTS_ENV, "").strip()
    if text:
        low, sep, high = text.partition("-")
        try:
            if not sep or not 1024 <= int(low) <= int(high) <= 65535:
                raise ValueError
        except ValueError:
            raise RuntimeError(f"{FREE_PORTS_ENV}={text!r}: expected LOW-HIGH, two ports from 1024 "
                               f"to 65535, LOW first (e.g. 20000-24999)") from None
        return range(int(low), int(high) + 1)
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    return range(_PORT_FLOOR, low) if low - _PORT_FLOOR >= 1000 else range(low, 65536)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_free_ports(count: int, span: int = 1) -> list[int]:
    """`count` ports on 127.0.0.1 (each the first of `span` consecutive free ones) that nothing
    listens on and no outgoing connection will take: picked at random below the ephemeral range."""
    ports: list[int] = []
    candidates = _listening_range()
    for _ in range(2000):
        if len(ports) == count:
            return ports
        base = _pick.choice(candidates[:len(candidates) - span + 1])
        run = range(base, base + span)
        if any(p in _picked for p in run) or not all(_bindable(p) for p in run):
            continue
        _picked.update(run)
        ports.append(base)
    if len(ports) == count:
        return ports
    raise RuntimeError(f"no {count} free runs of {span} port(s) in {candidates}")


def free_port() -> int:
    """One TCP port on 127.0.0.1 that nothing listens on right now (see `pick_free_ports`)."""
    return pick_free_ports(1)[0]


def executable(name: str) -> str:
    """A console script next to the running interpreter, else on PATH."""
    cand = Path(sys.executable).parent / name
    return str(cand) if cand.exists() else (shutil.which(name) or name)


class ControlError(RuntimeError):
    """A control command that a node refused, or that found no node to answer it."""


class LocalCluster:
    """Nodes n1..nN as `warren-server` processes sharing one WARREN_HOME and cluster secret.

    `free_ports=True` picks free ports; otherwise node i listens on client_base+i, amqp_base+i
    (AMQP 0-9-1, `amqp_port(name)`) and peer_base+i.
    `server_args` are extra `warren-server` flags for every node. Each node logs to
    HOME/logs/NAME.log, and HOME/pids.json always names the current pid of each node.
    """

    def __init__(self, home: Path | str, nodes: int = 3, *, free_ports: bool = False,
                 client_base: int = CLIENT_BASE, peer_base: int = PEER_BASE,
                 net_ticktime: float = 10.0, secret: str | None = None,
                 server_args: list[str] | tuple[str, ...] = (), amqp_base: int = AMQP_BASE,
                 http: bool = False, http_base: int = HTTP_BASE):
        self.home = Path(home).resolve()
        self.names = [f"n{i}" for i in range(1, nodes + 1)]
        self.net_ticktime = net_ticktime
        self.server_args = list(server_args)
        if free_ports:
            found = pick_free_ports(3 * nodes)
            self.ports = {name: (found[3 * i], found[3 * i + 1]) for i, name in enumerate(self.names)}
            self.amqp_ports = {name: found[3 * i + 2] for i, name in enumerate(self.names)}
        else:
            self.ports = {name: (client_base + i, peer_base + i)
                          for i, name in enumerate(self.names, 1)}
            self.amqp_ports = {name: amqp_base + i for i, name in enumerate(self.names, 1)}
        # the management HTTP API (`http_port(name)`), when asked for
        self.http_ports: dict[str, int] = {}
        if http:
            self.http_ports = dict(zip(self.names, pick_free_ports(nodes) if free_ports else
                                       range(http_base + 1, http_base + nodes + 1)))
        self.env = dict(os.environ, WARREN_HOME=str(self.home), PYTHONUNBUFFERED="1")
        self.env["WARREN_SECRET"] = secret or os.environ.get("WARREN_SECRET") or DEMO_SECRET
        self.env.pop("WARREN_NODE", None)
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, object] = {}

    # --- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.dump_logs()
        self.stop(kill=True)

    def start(self, timeout: float = 20.0, dump_logs: bool = True) -> list[str]:
        """Start every node, join n2..nN to n1 (unless their saved data already has it), and wait
        until n1 sees them all running. On failure: print the logs (unless `dump_logs` is
        false), kill the nodes, raise."""
        try:
            return self._start(timeout)
        except BaseException:
            if dump_logs:
                self.dump_logs()
            self.stop(kill=True)
            raise

    def _start(self, timeout: float) -> list[str]:
        return self.start_missing(self.names, {}, timeout)

    def start_missing(self, wanted: list[str], running: dict[str, int] | set[str],
                      timeout: float = 20.0) -> list[str]:
        """Start the nodes of `wanted` that are not in `running` (the nodes of the home that run
        now), join each new one that does not yet know the cluster to a running member (n1 for a
        new cluster), and wait until that member sees all of them and those already running.
        Returns the names started."""
        missing = [name for name in wanted if name not in running]
        for name in missing:
            self.spawn(name)
        for name in missing:
            self.wait_status(name, timeout)
        anchor = next((name for name in self.names if name in running), self.names[0])
        for name in missing:
            if name == anchor or anchor in self.cluster_status(name)["members"]:
                continue  # the anchor itself, or clustered already (data kept from an earlier run)
            self.call(name, "stop_app")
            self.call(name, "join_cluster", {"node": anchor})
            self.call(name, "start_app")
        expected = {name for name in self.names if name in running} | set(missing)
        self.wait_running(anchor, expected, timeout, exact=not running)
        return missing

    # --- the settings a home keeps for its later starts -----------------------------------------
    def save_settings(self) -> None:
        """Write HOME/cluster.json: the nodes, their ports, the ticktime, the server flags and the
        secret, so that a later `start` brings any node back as it was (readable by the owner
        only: it holds the cluster secret)."""
        self.home.mkdir(parents=True, exist_ok=True)
        settings = {"nodes": self.names, "ports": self.ports, "amqp_ports": self.amqp_ports,
                    "http_ports": self.http_ports, "net_ticktime": self.net_ticktime,
                    "server_args": self.server_args,
                    "secret": self.env["WARREN_SECRET"]}
        tmp = self.home / (CLUSTER_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(settings, out, indent=1)
        tmp.replace(self.home / CLUSTER_FILE)

    @classmethod
    def from_settings(cls, home: Path | str) -> "LocalCluster | None":
        """The cluster whose settings HOME/cluster.json keeps (None when it has none)."""
        path = Path(home) / CLUSTER_FILE
        try:
            settings = json.loads(path.read_text())
            cluster = cls(home, len(settings["nodes"]), net_ticktime=float(settings["net_ticktime"]),
                          secret=settings["secret"], server_args=settings["server_args"])
            cluster.names = [str(name) for name in settings["nodes"]]
            cluster.ports = {name: tuple(settings["ports"][name]) for name in cluster.names}
            cluster.amqp_ports = {name: int(settings["amqp_ports"][name]) for name in cluster.names}
            cluster.http_ports = {name: int(port) for name, port in settings.get("http_ports", {}).items()}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"{path} is unreadable ({exc!r}): stop the nodes and wipe the home "
                               f"(python -m broker.localcluster reset --home {home})") from None
        return cluster

    def log_path(self, name: str) -> Path:
        return self.home / "logs" / f"{name}.log"

    def spawn(self, name: str, extra_args: list[str] | tuple[str, ...] = ()) -> subprocess.Popen:
        """Start node `name` (not waiting for it) with its ports, the common flags and `extra_args`."""
        self.log_path(name).parent.mkdir(parents=True, exist_ok=True)
        old = self._logs.pop(name, None)
        if old is not None:
            old.close()
        log = open(self.log_path(name), "ab")
        self._logs[name] = log
        self.procs[name] = subprocess.Popen(
            self.node_command(name) + list(extra_args),
            env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self._save_pids()
        return self.procs[name]

    def node_command(self, name: str) -> list[str]:
        """The `warren-server` command line of node `name`: its ports and the common flags."""
        client, peer = self.ports[name]
        return [executable("warren-server"), "--name", name, "--client-port", str(client),
                "--peer-port", str(peer), "--amqp-port", str(self.amqp_ports[name]),
                "--net-ticktime", str(self.net_ticktime),
                *(["--http-port", str(self.http_ports[name])] if name in self.http_ports else []),
                *self.server_args]

    def _save_pids(self) -> None:
        """HOME/pids.json: this launcher's running nodes, and the other nodes it names that still
        run (started by an earlier launcher of the same home)."""
        path = self.home / PID_FILE
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            earlier = {}
        pids = {name: pid for name, pid in earlier.items()
                if name not in self.procs and is_node_process(pid, name)[0]}
        pids.update({name: p.pid for name, p in self.procs.items() if p.poll() is None})
        path.write_text(json.dumps(pids))

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to node `name` if it is running."""
        if self.alive(name):
            os.kill(self.procs[name].pid, sig)

    def kill9(self, name: str) -> None:
        """SIGKILL, and wait until the process is gone."""
        if self.alive(name):
            self.signal(name, signal.SIGKILL)
            self.procs[name].wait(10)

    def sigstop(self, name: str) -> None:
        """Freeze the node (SIGSTOP): its sockets stay open but it answers nothing."""
        self.signal(name, signal.SIGSTOP)

    def sigcont(self, name: str) -> None:
        self.signal(name, signal.SIGCONT)

    def sigterm(self, name: str, wait: bool = True, timeout: float = 15.0) -> int | None:
        """Graceful stop (SIGTERM); with `wait`, the exit code (SIGKILL after `timeout`)."""
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        self.signal(name, signal.SIGCONT)  # a stopped process would not act on SIGTERM
        self.signal(name, signal.SIGTERM)
        if not wait:
            return None
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9(name)
            return p.returncode

    def restart(self, name: str, wait: bool = True, extra_args: list[str] | tuple[str, ...] = ()) -> None:
        """Kill -9 the node if it still runs, start it again with the same ports and WARREN_HOME."""
        self.kill9(name)
        self.spawn(name, extra_args)
        if wait:
            self.wait_status(name)

    def stop(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop every node: SIGTERM (SIGKILL after `timeout`), or SIGKILL at once with `kill`."""
        for name in self.procs:
            if kill:
                self.signal(name, signal.SIGKILL)
            else:
                self.signal(name, signal.SIGCONT)
                self.signal(name, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill9(name)
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        try:
            (self.home / PID_FILE).unlink()
        except FileNotFoundError:
            pass

    def last_log_line(self, name: str) -> str:
        """The last non-empty line of the node's log (where warren-server says why it exited)."""
        try:
            lines = self.log_path(name).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return next((line.strip() for line in reversed(lines) if line.strip()), "(empty log)")

    def dump_logs(self, lines: int = 40) -> None:
        """Print the last `lines` of each node's log to stderr."""
        for name in self.names:
            path = self.log_path(name)
            if not path.exists():
                continue
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            print(f"----- {name} log ({path}), last {len(tail)} lines -----", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)

    # --- control -------------------------------------------------------------------------------
    def ctl(self, name: str, *args: str, timeout: float = 30.0,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """Run `warrenctl -n NAME ARGS...` with this cluster's WARREN_HOME and secret; a
        TimeoutError naming the command when it does not finish within `timeout` seconds."""
        try:
            return subprocess.run([executable("warrenctl"), "-n", name, *args], env=env or self.env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for "
                               f"`warrenctl -n {name} {' '.join(args)}`") from None

    def ctl_ok(self, name: str, *args: str) -> str:
        """warrenctl's stdout; RuntimeError naming the command when it exits non-zero."""
        r = self.ctl(name, *args)
        if r.returncode != 0:
            raise RuntimeError(f"warrenctl -n {name} {' '.join(args)} failed ({r.returncode}): "
                               f"{r.stderr.strip() or r.stdout.strip()}")
        return r.stdout

    def ctl_json(self, name: str, *args: str):
        return json.loads(self.ctl_ok(name, *args, "--formatter", "json"))

    def call(self, name: str, command: str, args: dict | None = None, timeout: float = 10.0):
        """One control command to node `name`, sent from this process over the node's peer port:
        what `warrenctl -n NAME COMMAND` sends, without starting a Python process for it. Each
        warrenctl costs about half a second of CPU, and starting a cluster asks some fifteen
        questions while three nodes start on the same cores. Returns the command's value; raises
        ControlError when the node refuses or cannot be reached in `timeout` seconds.

        The call runs `trio.run` in a thread of its own, so that it works from inside a running
        trio loop too (an async test), where a nested `trio.run` is refused."""
        import threading

        import trio

        from wire.errors import ProtocolError

        from .control import ctl_call
        from .network import TcpNetwork, connect_reason

        secret = self.env["WARREN_SECRET"].encode()
        where = (self.peer_host(name), self.peer_port(name))
        outcome: dict = {}

        def ask() -> None:
            try:
                outcome["value"] = trio.run(ctl_call, TcpNetwork(), *where, f"localcluster-{os.getpid()}",
                                            secret, command, args or {}, timeout)
            except ProtocolError as exc:
                outcome["error"] = exc.text
            except trio.TooSlowError:
                outcome["error"] = f"no answer within {timeout:g} s"
            except OSError as exc:
                outcome["error"] = f"not reachable on its peer port: {connect_reason(exc)}"

        asker = threading.Thread(target=ask, name=f"call-{name}-{command}", daemon=True)
        asker.start()
        asker.join()
        if "error" in outcome:
            raise ControlError(f"{command} on node {name}: {outcome['error']}")
        return outcome["value"]

    def cluster_status(self, name: str) -> dict:
        return self.call(name, "cluster_status")

    def wait_status(self, name: str, timeout: float = 20.0) -> None:
        """Wait until node `name` has started: it answers `status` and has registered under the
        home's run/ with its current pid (the last step of a node's start, after which `warrenctl
        -n NAME` finds it). Fails at once if the process exits."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            p = self.procs[name]
            if p.poll() is not None:
                raise RuntimeError(f"node {name} exited with {p.returncode} while starting: "
                                   f"{self.last_log_line(name)} (log: {self.log_path(name)})")
            try:
                self.call(name, "status", timeout=2.0)
                if self.registered(name):
                    return
                last = f"not registered yet under {self.home / 'run'}"
            except ControlError as exc:
                last = str(exc)
            time.sleep(0.05)
        raise TimeoutError(f"node {name} did not answer status within {timeout} s: {last}")

    def registered(self, name: str) -> bool:
        """Node `name`'s current process has started its app: it wrote its pid to the home's run
        registry (a file left by an earlier process of the node has that one's pid)."""
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return False
        try:
            return json.loads((self.home / "run" / f"{name}.json").read_text()).get("pid") == p.pid
        except (OSError, ValueError, AttributeError):
            return False

    def wait_running(self, on: str, expected: set, timeout: float = 20.0, exact: bool = True) -> dict:
        """Wait until cluster_status on `on` lists exactly `expected` as running_nodes (with
        `exact=False`: at least those)."""
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            try:
                st = self.call(on, "cluster_status", timeout=3.0)
                running = set(st["running_nodes"])
                if running == set(expected) or (not exact and running >= set(expected)):
                    return st
            except ControlError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"running_nodes on {on} never became {sorted(expected)}: last {st}")

    def client_port(self, name: str) -> int:
        return self.ports[name][0]

    def peer_port(self, name: str) -> int:
        return self.ports[name][1]

    def peer_host(self, name: str) -> str:
        """The address node `name` listens on (a subclass may put nodes elsewhere)."""
        return "127.0.0.1"

    def client_addr(self, name: str) -> str:
        return f"127.0.0.1:{self.client_port(name)}"

    def amqp_port(self, name: str) -> int:
        """The node's AMQP 0-9-1 port."""
        return self.amqp_ports[name]

    def amqp_url(self, name: str, user: str = "guest", password: str = "guest") -> str:
        return f"amqp://{user}:{password}@127.0.0.1:{self.amqp_port(name)}/%2F"

    def all_client_addrs(self) -> list[str]:
        return [self.client_addr(n) for n in self.names]


# --- stopping from the pid file ----------------------------------------------------------------

def _cmdline(pid: int) -> list[str] | None:
    """The process's argument vector, or None when no such process exists."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None
    except ProcessLookupError:
        return None
    # No /proc (macOS, BSD): ask ps.
    out = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 and out.stdout.strip() else None


def is_node_process(pid: int, name: str) -> tuple[bool, str]:
    """Whether `pid` is a warren-server running node `name`, and why not."""
    args = _cmdline(pid)
    if args is None:
        return False, f"pid {pid} is gone"
    runs_server = any(Path(a).name == "warren-server" for a in args) or "broker.server" in args
    has_name = any(a == "--name" and b == name for a, b in zip(args, args[1:])) \
        or f"--name={name}" in args
    if runs_server and has_name:
        return True, ""
    shown = " ".join(args)[:200] or "(no command line: a zombie or kernel thread)"
    return False, f"pid {pid} is not warren-server {name} now; it runs: {shown}"


def _registered(home: Path) -> dict[str, int]:
    """The nodes registered under HOME/run/ (every node started with this WARREN_HOME registers
    itself there, also one started by hand) and their pids."""
    found = {}
    for path in sorted((Path(home) / "run").glob("*.json")):
        try:
            data = json.loads(path.read_text())
            found[str(data["name"])] = int(data["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def running_registered(home: Path) -> dict[str, int]:
    """The nodes registered under HOME/run/ whose pid still runs that node (a node killed with
    -9 leaves its entry behind)."""
    return {name: pid for name, pid in _registered(home).items() if is_node_process(pid, name)[0]}


def home_nodes(home: Path) -> dict[str, int]:
    """Every node of HOME and its pid: those of pids.json, then any other registered one."""
    path = Path(home) / PID_FILE
    pids = json.loads(path.read_text()) if path.exists() else {}
    for name, pid in _registered(home).items():
        if name not in pids or (not is_node_process(pids[name], name)[0] and is_node_process(pid, name)[0]):
            pids[name] = pid
    return pids


def stop(home: Path, timeout: float = 10.0) -> list[str]:
    """SIGTERM every node of HOME (pids.json, and the nodes registered under HOME/run/, such as
    one started by hand) that is still that warren-server, SIGKILL those that outlive `timeout`,
    and remove pids.json. Returns one line per node saying what was done."""
    path = Path(home) / PID_FILE
    pids = home_nodes(home)
    if not pids:
        return [f"no node of {home} to stop (no {path}, nothing registered under {Path(home) / 'run'})"]
    report, signalled = [], {}
    for name, pid in pids.items():
        ok, why = is_node_process(pid, name)
        if not ok:
            report.append(f"{name}: skipped, {why}")
            continue
        try:
            os.kill(pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
            os.kill(pid, signal.SIGTERM)
            signalled[name] = pid
        except ProcessLookupError:
            report.append(f"{name}: pid {pid} exited before the signal")
    deadline = time.monotonic() + timeout
    for name, pid in signalled.items():
        while time.monotonic() < deadline and is_node_process(pid, name)[0]:
            time.sleep(0.05)
        if is_node_process(pid, name)[0]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            report.append(f"{name}: pid {pid} ignored SIGTERM for {timeout:.0f}s, sent SIGKILL")
        else:
            report.append(f"{name}: stopped (pid {pid})")
    if path.exists():
        path.unlink()
    return report


def running_pids(home: Path) -> dict[str, int]:
    """The nodes of HOME (pids.json and the run registry) whose pid is still that warren-server."""
    return {name: pid for name, pid in home_nodes(home).items() if is_node_process(pid, name)[0]}


# --- the command line's helpers (also used by the benchmark) -----------------------------------

def start(home: Path, nodes: int = 3, ticktime: float = 10.0, client_base: int = CLIENT_BASE,
          peer_base: int = PEER_BASE, server_args: list[str] | tuple[str, ...] = (),
          dump_logs: bool = True, amqp_base: int = AMQP_BASE, only: list[str] | tuple[str, ...] = (),
          free_ports: bool = False, http_base: int | None = None) -> tuple[LocalCluster, list[str]]:
    """Start the nodes of HOME's cluster that are not running (only those of `only` when given),
    each with the ports and settings of the cluster's first start (HOME/cluster.json), and wait
    until they run in the cluster; a home without that file gets a new cluster of `nodes` nodes
    with the other parameters (`http_base`: management HTTP ports, none without it). Returns the
    cluster and the names started (the nodes outlive this process: stop them with `stop(home)`)."""
    cluster = LocalCluster.from_settings(home)
    running = running_pids(home)
    if cluster is None:
        if only:
            raise RuntimeError(f"{home} has no cluster to restart a node of (no {home / CLUSTER_FILE}): "
                               f"start one first (python -m broker.localcluster start)")
        if running:
            raise RuntimeError(f"nodes {', '.join(sorted(running))} of {home} are already running, "
                               f"started without this launcher: stop them first (make stop, or "
                               f"python -m broker.localcluster stop)")
        cluster = LocalCluster(home, nodes, client_base=client_base, peer_base=peer_base,
                               net_ticktime=ticktime, server_args=server_args, amqp_base=amqp_base,
                               free_ports=free_ports, http=http_base is not None,
                               http_base=http_base or HTTP_BASE)
        cluster.save_settings()
    unknown = [name for name in only if name not in cluster.names]
    if unknown:
        raise RuntimeError(f"the cluster of {home} has no node {', '.join(unknown)}: its nodes are "
                           f"{', '.join(cluster.names)}")
    return cluster, _start_safely(cluster, list(only) or cluster.names, running, dump_logs)


def _start_safely(cluster: LocalCluster, wanted: list[str], running: dict[str, int],
                  dump_logs: bool) -> list[str]:
    """`start_missing`, killing what it started when it fails."""
    try:
        return cluster.start_missing(wanted, running)
    except BaseException:
        if dump_logs:
            cluster.dump_logs()
        for name in list(cluster.procs):
            cluster.kill9(name)
        cluster._save_pids()
        raise


def settings_conflicts(cluster: LocalCluster, given: dict) -> list[str]:
    """The options of `given` (None: not given) that differ from the settings of the cluster's
    first start: a cluster keeps its nodes, ports and flags until it is reset."""
    names = cluster.names
    kept = {"nodes": len(names), "net_ticktime": cluster.net_ticktime,
            "client_base": cluster.client_port(names[0]) - 1, "peer_base": cluster.peer_port(names[0]) - 1,
            "amqp_base": cluster.amqp_port(names[0]) - 1, "server_args": cluster.server_args,
            "http_base": cluster.http_ports[names[0]] - 1 if names[0] in cluster.http_ports else None}
    return [f"--{key.replace('_', '-')} {value!r} (it has {kept[key]!r})" for key, value in given.items()
            if value not in (None, []) and value != kept[key]]


def reset(home: Path) -> list[str]:
    """Wipe HOME's cluster state (STATE_ENTRIES: data, logs, run registry, pids, settings);
    RuntimeError, wiping nothing, while a node of HOME runs. One line per entry removed."""
    running = running_pids(home)
    if running:
        listed = ", ".join(f"{name} (pid {pid})" for name, pid in sorted(running.items()))
        raise RuntimeError(f"not wiping {home}: nodes {listed} are running; stop them first (make "
                           f"stop, or python -m broker.localcluster stop --home {home})")
    removed = []
    for entry in STATE_ENTRIES:
        path = Path(home) / entry
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(f"removed {path}")
    try:
        Path(home).rmdir()  # only when nothing else was kept there
    except OSError:
        pass
    return removed or [f"nothing to wipe in {home}"]


def client_addr(i: int, client_base: int = CLIENT_BASE) -> str:
    return f"127.0.0.1:{client_base + i}"


def demo(home: Path = DEFAULT_DEMO_HOME, client_base: int | None = None, peer_base: int | None = None,
         amqp_base: int | None = None) -> None:
    """Run broker.demo on a new 3-node cluster of its own under HOME (var/demo, never the home
    of `make cluster`): stop the nodes an interrupted demo left there, wipe the home, start the
    cluster (on free ports unless bases are given), run the demo, stop it (also on errors)."""
    from broker import demo as demomod

    home = Path(home).resolve()
    if running_pids(home):
        for line in stop(home):
            print(f"an earlier demo's node: {line}")
    reset(home)
    print(f"== starting a 3-node cluster of the demo's own in {home} (logs in {home / 'logs'})")
    fixed = not all(base is None for base in (client_base, peer_base, amqp_base))
    cluster, _ = start(home, 3, client_base=client_base or CLIENT_BASE, peer_base=peer_base or PEER_BASE,
                       amqp_base=amqp_base or AMQP_BASE, dump_logs=False, free_ports=not fixed)
    try:
        demomod.run(cluster)
    finally:
        print("== stopping the cluster")
        cluster.stop()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"error: {name}={value!r} is not a port number") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m broker.localcluster", allow_abbrev=False,
        description="Local clusters of warren-server processes on 127.0.0.1 (make cluster / stop / "
                    "clean / demo). `start` starts the nodes of the home that are not running, with "
                    "the ports and flags of the cluster's first start (kept in HOME/cluster.json); "
                    "`start n1` starts node n1 alone. `reset` wipes the home's state (its nodes "
                    "stopped). `demo` runs on a cluster of its own in var/demo, wiped at each run.")
    p.add_argument("action", choices=["start", "stop", "reset", "demo"])
    p.add_argument("names", nargs="*", metavar="NODE",
                   help="start: the nodes to start (default: every node that is not running)")
    p.add_argument("--nodes", type=int, help="how many nodes a new cluster has (default 3)")
    p.add_argument("--home", type=Path,
                   help="state directory: data, logs, pids, settings (default $WARREN_HOME or "
                        "var/warren; for demo, var/demo)")
    p.add_argument("--client-base", type=int,
                   help="node i's client port is this + i (default $WARREN_CLIENT_BASE or 5690)")
    p.add_argument("--peer-base", type=int,
                   help="node i's peer port is this + i (default $WARREN_PEER_BASE or 25690)")
    p.add_argument("--amqp-base", type=int,
                   help="node i's AMQP 0-9-1 port is this + i (default $WARREN_AMQP_BASE or 5671: "
                        "n1 on 5672)")
    p.add_argument("--http-base", type=int,
                   help="node i's management HTTP port (API, /metrics, web UI) is this + i "
                        "(default $WARREN_HTTP_BASE or 15671: n1 on 15672)")
    p.add_argument("--net-ticktime", type=float, help="the nodes' net ticktime (default 10)")
    return p


def _start_command(home: Path, args, server_args: list[str]) -> None:
    """`start [NODE...]`: start what is missing and say what runs where."""
    given = {"nodes": args.nodes, "net_ticktime": args.net_ticktime, "client_base": args.client_base,
             "peer_base": args.peer_base, "amqp_base": args.amqp_base, "server_args": server_args,
             "http_base": args.http_base}
    kept = LocalCluster.from_settings(home)
    conflicts = settings_conflicts(kept, given) if kept is not None else []
    if conflicts:
        raise RuntimeError(f"the cluster of {home} keeps the settings of its first start, not "
                           f"{'; '.join(conflicts)}: to start a different one, stop it and wipe it "
                           f"(python -m broker.localcluster reset)")
    env_base = {key: _env_int(f"WARREN_{key.upper()}") for key in ("client_base", "peer_base", "amqp_base")}
    bases = {key: given[key] or env_base[key] or default for key, default in
             (("client_base", CLIENT_BASE), ("peer_base", PEER_BASE), ("amqp_base", AMQP_BASE))}
    http_base = given["http_base"] or _env_int("WARREN_HTTP_BASE") or HTTP_BASE
    cluster, started = start(home, args.nodes or 3, args.net_ticktime or 10.0, server_args=server_args,
                             dump_logs=False, only=args.names, http_base=http_base, **bases)
    wanted = args.names or cluster.names
    already = [name for name in wanted if name not in started]
    if started:
        urls = ", ".join(f"http://127.0.0.1:{cluster.http_ports[n]}/" for n in cluster.names
                         if n in cluster.http_ports)
        print(f"started {', '.join(started)}"
              + (f" ({', '.join(already)} already running)" if already else "")
              + f"; client ports {', '.join(str(cluster.client_port(n)) for n in cluster.names)}; AMQP ports "
              f"{', '.join(str(cluster.amqp_port(n)) for n in cluster.names)}; "
              + (f"web UI and HTTP API {urls}; " if urls else "")
              + f"logs in {home / 'logs'}")
    else:
        print(f"{', '.join(already)} of {home} already running: nothing to start")
    secret = cluster.env["WARREN_SECRET"]
    print(f"use it from any shell: export WARREN_HOME={shlex.quote(str(home))} "
          f"WARREN_SECRET={shlex.quote(secret)}; warrenctl -n {cluster.names[0]} cluster_status")


def main(argv=None) -> None:
    from broker.client.errors import AMQPError

    p = _parser()
    args, server_args = p.parse_known_args(argv)
    if server_args and args.action != "start":
        p.error(f"unrecognized arguments: {' '.join(server_args)}")
    if args.names and args.action != "start":
        p.error(f"{args.action} takes no node names (only start does)")
    if args.home is None:
        args.home = DEFAULT_DEMO_HOME if args.action == "demo" else Path(os.environ.get("WARREN_HOME") or DEFAULT_HOME)
    home = args.home.resolve()
    try:
        if args.action == "start":
            _start_command(home, args, server_args)
        elif args.action == "stop":
            for line in stop(home):
                print(line)
        elif args.action == "reset":
            for line in reset(home):
                print(line)
        else:
            demo(home, args.client_base, args.peer_base, args.amqp_base)
    except (RuntimeError, TimeoutError, AMQPError) as exc:
        where = f" (the nodes' logs are in {home / 'logs'})" if args.action == "demo" else ""
        print(f"error: {exc}{where}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
