"""Clusters of real `warren-server` processes on 127.0.0.1: the one launcher, its command line,
and the demo that the README's first command runs.

    python -m broker.localcluster start [--nodes 3]   # start n1..nN and join them to n1
    python -m broker.localcluster stop                # SIGTERM every node of the home
    python -m broker.localcluster demo                # start, publish/consume, fail over, stop

The command line keeps its state under ./var/warren (or $WARREN_HOME): node data, logs/NAME.log
and pids.json.  Node i gets client port 5690+i, AMQP port 5671+i (n1..n3: 5672..5674, AMQP's
usual port first) and peer port 25690+i unless --client-base / --amqp-base / --peer-base (or
$WARREN_CLIENT_BASE / $WARREN_AMQP_BASE / $WARREN_PEER_BASE) move them; `start` also gives each
node a management HTTP port (API, /metrics, web UI) 15671+i (n1 on 15672, RabbitMQ's), moved by
--http-base / $WARREN_HTTP_BASE.  `stop` stops the nodes of
pids.json and every other node registered under the home's run/ (a node started by hand with
this WARREN_HOME), and signals a pid only after checking that the process is still warren-server
with that node name (the pid may have been reused since).

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
DEMO_SECRET = "warren-local-demo-secret"
PID_FILE = "pids.json"


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
        for name in self.names:
            self.spawn(name)
        for name in self.names:
            self.wait_status(name, timeout)
        first = self.names[0]
        for name in self.names[1:]:
            if first in self.cluster_status(name)["members"]:
                continue  # already clustered (data kept from an earlier run)
            self.call(name, "stop_app")
            self.call(name, "join_cluster", {"node": first})
            self.call(name, "start_app")
        self.wait_running(first, set(self.names), timeout)
        return self.names

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
        pids = {name: p.pid for name, p in self.procs.items() if p.poll() is None}
        (self.home / PID_FILE).write_text(json.dumps(pids))

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

    def wait_running(self, on: str, expected: set, timeout: float = 20.0) -> dict:
        """Wait until cluster_status on `on` lists exactly `expected` as running_nodes."""
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            try:
                st = self.call(on, "cluster_status", timeout=3.0)
                if set(st["running_nodes"]) == set(expected):
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
          dump_logs: bool = True, amqp_base: int = AMQP_BASE,
          http_base: int | None = None) -> LocalCluster:
    """Start a cluster that outlives this process (stop it with `stop(home)`)."""
    running = running_pids(home)
    if running:
        raise RuntimeError(f"nodes {', '.join(sorted(running))} of {home} are already running: "
                           f"stop them first (make stop, or python -m broker.localcluster stop)")
    cluster = LocalCluster(home, nodes, client_base=client_base, peer_base=peer_base,
                           net_ticktime=ticktime, server_args=server_args, amqp_base=amqp_base,
                           http=http_base is not None, http_base=http_base or HTTP_BASE)
    cluster.start(dump_logs=dump_logs)
    return cluster


def client_addr(i: int, client_base: int = CLIENT_BASE) -> str:
    return f"127.0.0.1:{client_base + i}"


def demo(home: Path, client_base: int = CLIENT_BASE, peer_base: int = PEER_BASE,
         amqp_base: int = AMQP_BASE) -> None:
    """Start a 3-node cluster under HOME, run broker.demo on it, stop it (also on errors)."""
    from broker import demo as demomod

    print(f"== starting a 3-node cluster (logs in {home / 'logs'})")
    cluster = start(home, 3, client_base=client_base, peer_base=peer_base, dump_logs=False,
                    amqp_base=amqp_base)
    try:
        demomod.run(cluster)
    finally:
        print("== stopping the cluster")
        cluster.stop()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"error: {name}={value!r} is not a port number") from None


def main(argv=None) -> None:
    from broker.client.errors import AMQPError

    p = argparse.ArgumentParser(
        prog="python -m broker.localcluster", allow_abbrev=False,
        description="Local clusters of warren-server processes on 127.0.0.1 (make cluster / stop / demo).")
    p.add_argument("action", choices=["start", "stop", "demo"])
    p.add_argument("--nodes", type=int, default=3, help="how many nodes start starts (default 3)")
    p.add_argument("--home", type=Path, default=Path(os.environ.get("WARREN_HOME") or DEFAULT_HOME),
                   help="state directory: data, logs, pids (default $WARREN_HOME or var/warren)")
    p.add_argument("--client-base", type=int, default=_env_int("WARREN_CLIENT_BASE", CLIENT_BASE),
                   help="node i's client port is this + i (default $WARREN_CLIENT_BASE or 5690)")
    p.add_argument("--peer-base", type=int, default=_env_int("WARREN_PEER_BASE", PEER_BASE),
                   help="node i's peer port is this + i (default $WARREN_PEER_BASE or 25690)")
    p.add_argument("--amqp-base", type=int, default=_env_int("WARREN_AMQP_BASE", AMQP_BASE),
                   help="node i's AMQP 0-9-1 port is this + i (default $WARREN_AMQP_BASE or 5671: "
                        "n1 on 5672)")
    p.add_argument("--http-base", type=int, default=_env_int("WARREN_HTTP_BASE", HTTP_BASE),
                   help="node i's management HTTP port (API, /metrics, web UI) is this + i "
                        "(default $WARREN_HTTP_BASE or 15671: n1 on 15672)")
    p.add_argument("--net-ticktime", type=float, default=10.0)
    args, server_args = p.parse_known_args(argv)
    if server_args and args.action != "start":
        p.error(f"unrecognized arguments: {' '.join(server_args)}")
    home = args.home.resolve()
    try:
        if args.action == "start":
            # Options this command does not know are passed on to every warren-server.
            cluster = start(home, args.nodes, args.net_ticktime, args.client_base,
                            args.peer_base, server_args, dump_logs=False, amqp_base=args.amqp_base,
                            http_base=args.http_base)
            secret = cluster.env["WARREN_SECRET"]
            print(f"started {', '.join(cluster.names)}; client ports "
                  f"{', '.join(str(cluster.client_port(n)) for n in cluster.names)}; AMQP ports "
                  f"{', '.join(str(cluster.amqp_port(n)) for n in cluster.names)}; web UI and HTTP API "
                  f"{', '.join(f'http://127.0.0.1:{cluster.http_ports[n]}/' for n in cluster.names)}; "
                  f"logs in {home / 'logs'}")
            print(f"use it from any shell: export WARREN_HOME={shlex.quote(str(home))} "
                  f"WARREN_SECRET={shlex.quote(secret)}; warrenctl -n n1 cluster_status")
        elif args.action == "stop":
            for line in stop(home):
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
