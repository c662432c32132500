"""`warren-bench fuzz` (`make fuzz`): many random inputs (bench/fuzz_inputs.py) over every port of
one real node, before and after logging in, while a well-behaved client on the same node
publishes with confirms and consumes; then the verdict.

Each input is one connection: the login it needs (none; guest on the AMQP and client ports;
the cluster secret on the peer port; basic auth on the HTTP port), the input's bytes, a short
wait for an answer, then the end of our sending. The node must close the connection within
`CLOSE_WITHIN` seconds of that (no input may leave a connection hanging), keep running, and
keep serving the well-behaved client. Reported: inputs sent per kind, node crashes (the
process gone), connections left hanging, lines logged as internal failures, the node's file
descriptors and resident memory (/proc/PID) before the inputs, every SAMPLE_EVERY seconds during
them, and after them (once the queues the inputs made are deleted and the node's connections
have ended), the memory blocks its interpreter holds before and after, and what is left of
them and of the resident set after a full collection and a trim (`warrenctl force_gc`), and
the well-behaved client's rounds, failures and slowest round.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

import trio

from broker.client.aio import open_connection
from broker.framed import FramedStream
from broker.localcluster import LocalCluster
from broker.peers import dial_handshake

from . import fuzz_inputs as inp

SECRET = "fuzz-secret"
QUIET = 0.05  # seconds to wait for an answer before our side stops sending
CLOSE_WITHIN = 15.0  # seconds the node has to close a connection once we stopped sending
SAMPLE_EVERY = 10  # seconds between two looks at the node's fds and RSS during the inputs
# After the inputs, the node's last connections may still be ending: the HTTP server keeps a
# connection's task until its keep-alive timer runs out (5 s), after our side saw it closed.
# "after" is measured once the node's fds are back to where they were before the inputs (and
# SETTLE seconds more), or after SETTLE_AT_MOST seconds.
SETTLE, SETTLE_AT_MOST = 10.0, 60.0
# The node's state may grow this much (a fraction of its live blocks before the inputs, both
# measured after a full collection): caches that fill once (compiled patterns, the logs'
# rate limits); 100,000 inputs grew it by 6%. What an input leaves for good grows it with
# the number of inputs, past any fraction.
LIVE_GROWTH = 0.15
KINDS = {  # kind -> (port, the login it needs, the input)
    "amqp": ("amqp", None, inp.amqp_before_login),
    "amqp-open": ("amqp", "amqp", inp.amqp_after_login),
    "client": ("client", None, inp.native_before_login),
    "client-open": ("client", "client", inp.native_after_login),
    "peer": ("peer", None, inp.peer_before_auth),
    "peer-ctl": ("peer", "ctl", inp.ctl_after_auth),
    "peer-link": ("peer", "peer", inp.link_after_auth),
    "http": ("http", None, lambda r: inp.http_request(r, False)),
    "http-auth": ("http", None, lambda r: inp.http_request(r, True)),
}


def proc_usage(pid: int) -> dict:
    """The node's open file descriptors and resident memory, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"fds": fds, "rss_bytes": rss}


class Fuzz:
    """One campaign against one node (`ports`: kind of port -> number)."""

    def __init__(self, ports: dict, seed: int, inputs: int, concurrency: int, kinds=tuple(KINDS)):
        self.ports = ports
        self.kinds = list(kinds)
        self.secret = SECRET.encode()  # the node's cluster secret (the peer port's logins)
        self.seed = seed
        self.inputs = inputs
        self.concurrency = concurrency
        self.sent = dict.fromkeys(KINDS, 0)
        self.answered = 0  # inputs the node answered or closed on within QUIET
        self.hangs: list = []  # (kind, seed) of connections the node did not close
        self.errors = dict.fromkeys(KINDS, 0)  # our side could not even connect or log in
        self.rounds = 0
        self.round_failures: list = []
        self.slowest_round = 0.0
        self.done = False
        self.samples: list = []  # proc_usage every SAMPLE_EVERY seconds during the run

    async def sample(self, pid: int) -> None:
        """The node's fds and RSS every SAMPLE_EVERY seconds while the inputs go (growth or a
        plateau), with the inputs sent so far."""
        ticks = 0
        while not self.done:
            if ticks % SAMPLE_EVERY == 0:
                self.samples.append(proc_usage(pid) | {"inputs": sum(self.sent.values())})
            ticks += 1
            await trio.sleep(1)

    async def run(self, pid: int | None = None) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.well_behaved)
            if pid is not None:
                nursery.start_soon(self.sample, pid)
            await trio.sleep(1)  # the well-behaved client is going
            async with trio.open_nursery() as workers:
                share = -(-self.inputs // len(self.kinds))  # at least `inputs` in all
                for i, kind in enumerate(self.kinds):
                    per = [share // self.concurrency + (1 if w < share % self.concurrency else 0)
                           for w in range(self.concurrency)]
                    for w, n in enumerate(per):
                        workers.start_soon(self.worker, kind, n, (self.seed, i, w))
            self.done = True

    async def worker(self, kind: str, n: int, seed: tuple) -> None:
        r = random.Random(repr(seed))
        for k in range(n):
            case = f"{seed}/{k}"
            data = KINDS[kind][2](r)
            await self.one(kind, data, case)
            self.sent[kind] += 1

    async def one(self, kind: str, data: bytes, case: str) -> None:
        port_kind, login, _ = KINDS[kind]
        stream = await self.connect(port_kind)
        if stream is None:
            self.errors[kind] += 1
            return
        async with stream:
            try:
                with trio.fail_after(CLOSE_WITHIN):
                    if login is not None:
                        await self.log_in(stream, login)
            except Exception:  # noqa: BLE001 - counted: our side could not log in
                self.errors[kind] += 1
                return
            try:
                await stream.send_all(data)
                with trio.move_on_after(QUIET):
                    await stream.receive_some(65536)
                    self.answered += 1
                await stream.send_eof()
                with trio.fail_after(CLOSE_WITHIN):
                    while await stream.receive_some(65536):
                        pass
            except trio.TooSlowError:
                self.hangs.append((kind, case))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # closed (reset) by the node: fine

    async def connect(self, port_kind: str):
        """A connection to the port; a few tries (a management listener may be starting again)."""
        for _ in range(5):
            try:
                return await trio.open_tcp_stream("127.0.0.1", self.ports[port_kind])
            except OSError:
                await trio.sleep(0.2)
        return None

    async def log_in(self, stream, login: str) -> None:
        if login == "amqp":
            await _amqp_login(stream)
        elif login == "client":
            await _native_login(stream)
        else:
            await dial_handshake(FramedStream(stream), "fuzzer", self.secret, login)

    async def well_behaved(self) -> None:
        """Publish with confirms and consume, one message a round, until the inputs are all sent."""
        queue = f"wellbehaved-{random.Random(self.seed).randrange(1 << 32):x}"
        try:
            async with open_connection(f"127.0.0.1:{self.ports['client']}", reconnect=False) as conn:
                ch = await conn.channel()
                await ch.queue_declare(queue)
                await ch.confirm_delivery()
                while not self.done:
                    start = time.monotonic()
                    with trio.fail_after(30):
                        body = f"round {self.rounds}".encode()
                        await ch.basic_publish("", queue, body)
                        got = None
                        while got is None:
                            got = await ch.basic_get(queue, auto_ack=True)
                        if got.body != body:
                            raise AssertionError(f"got {got.body!r}, sent {body!r}")
                    self.rounds += 1
                    self.slowest_round = max(self.slowest_round, time.monotonic() - start)
                    await trio.sleep(0.05)
        except Exception as exc:  # noqa: BLE001 - every failure is part of the verdict
            self.round_failures.append(f"after {self.rounds} rounds: {exc!r}")


async def _read_amqp_method(stream, buf: bytearray) -> bytes:
    while True:
        if len(buf) >= 7:
            size = int.from_bytes(buf[3:7], "big")
            if len(buf) >= 8 + size:
                payload = bytes(buf[7:7 + size])
                del buf[:8 + size]
                return payload
        data = await stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError("closed during the login")
        buf += data


async def _amqp_login(stream) -> None:
    from pamqp import commands as C
    from pamqp import frame
    buf = bytearray()
    await stream.send_all(b"AMQP\x00\x00\x09\x01")
    await _read_amqp_method(stream, buf)  # start
    await stream.send_all(frame.marshal(C.Connection.StartOk({}, "PLAIN", "\0guest\0guest"), 0))
    await _read_amqp_method(stream, buf)  # tune
    await stream.send_all(frame.marshal(C.Connection.TuneOk(0, 131072, 0), 0)
                          + frame.marshal(C.Connection.Open("/"), 0) + frame.marshal(C.Channel.Open(), 1))
    await _read_amqp_method(stream, buf)  # open-ok
    await _read_amqp_method(stream, buf)  # channel.open-ok


async def _native_login(stream) -> None:
    from wire import messages as m
    framed = FramedStream(stream)
    await framed.receive(frozenset({"hello"}))
    await framed.send_now(m.ClientAuth(m.PROTOCOL_VERSION, "guest", "guest", "fuzzer", "/"))
    await framed.receive(frozenset({"welcome"}))


def _logged(path: Path) -> tuple[int, int]:
    """Lines logged as internal failures, and management connections hypercorn gave up on."""
    text = path.read_text(errors="replace")
    failures = sum(text.count(s) for s in ("Traceback", "connection failed", "request failed"))
    return failures, text.count("management connection ended by an error")


def _delete_fuzz_queues(cluster: LocalCluster) -> int:
    names = [q["name"] for q in cluster.call("n1", "list_queues", {"columns": ["name"]})]
    for name in names:
        if not name.startswith("wellbehaved-"):
            cluster.call("n1", "delete_queue", {"queue": name})
    return len(names) - 1


def _connections_of(pid: int, ports: dict) -> list[dict]:
    """The node's TCP connections (not its listeners), from /proc: the kind of port each came
    in on, and its state."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    kind_of = {port: kind for kind, port in ports.items()}
    states = {"01": "established", "06": "time_wait", "07": "close", "08": "close_wait", "09": "last_ack",
              "0A": "listen", "04": "fin_wait1", "05": "fin_wait2"}
    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[9] in inodes and f[3] != "0A":
            local, remote = int(f[1].split(":")[1], 16), int(f[2].split(":")[1], 16)
            out.append({"port": kind_of.get(local, local), "remote_port": kind_of.get(remote, remote),
                        "state": states.get(f[3], f[3]), "recv_q": int(f[4].split(":")[1], 16)})
    return out


def _python_blocks(cluster: LocalCluster) -> dict:
    """The memory blocks the node's interpreter holds (`warrenctl status`), and what is left of
    them after a full collection (`warrenctl force_gc`): the node's state without the garbage
    that waits for its collector. Unlike the resident set, neither counts what the allocators
    keep once a burst is freed; the resident set after that collection and a trim is the
    floor of what they keep."""
    held = cluster.call("n1", "status", {})["memory_python_blocks"]
    collected = cluster.call("n1", "force_gc", {})
    return {"python_blocks": held, "python_blocks_live": collected["python_blocks_after"],
            "rss_bytes_collected": collected["rss_after"]}


def _settle(pid: int, fds: int) -> float:
    """Wait until the node holds no more fds than `fds` (its connections from the inputs are
    gone), then SETTLE seconds; returns the seconds waited."""
    start = time.monotonic()
    while proc_usage(pid)["fds"] > fds and time.monotonic() - start < SETTLE_AT_MOST:
        time.sleep(0.5)
    time.sleep(SETTLE)
    return round(time.monotonic() - start, 1)


def run(inputs: int, seed: int, concurrency: int, out: Path | None, kinds=tuple(KINDS)) -> dict:
    """Start a node, fuzz it, return (and write to `out`) the verdict."""
    with tempfile.TemporaryDirectory(prefix="warren-fuzz-") as tmp:
        cluster = LocalCluster(Path(tmp) / "home", 1, free_ports=True, secret=SECRET, http=True,
                               net_ticktime=10)
        with cluster:
            pid = cluster.procs["n1"].pid
            ports = {"amqp": cluster.amqp_port("n1"), "client": cluster.client_port("n1"),
                     "peer": cluster.peer_port("n1"), "http": cluster.http_ports["n1"]}
            # what the inputs publish stays bounded (their queues' growth is not the node's)
            cluster.call("n1", "set_policy", {"name": "fuzz-bounded", "pattern": "^(?!wellbehaved-)",
                                              "definition": json.dumps({"max-length": 100})})
            time.sleep(1)
            before = proc_usage(pid) | _python_blocks(cluster)
            fuzz = Fuzz(ports, seed, inputs, concurrency, kinds)
            started = time.monotonic()
            trio.run(fuzz.run, pid)
            seconds = time.monotonic() - started
            alive = cluster.alive("n1")
            deleted = _delete_fuzz_queues(cluster) if alive else 0
            settled = _settle(pid, before["fds"]) if alive else None
            after = proc_usage(pid) | _python_blocks(cluster) if alive else None
            # what still holds an fd the inputs opened: the port of each connection left
            still_open = _connections_of(pid, ports) if alive and after["fds"] > before["fds"] else []
            failures, http_restarts = _logged(cluster.log_path("n1"))
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(cluster.log_path("n1"), out.with_suffix(".n1.log"))
    result = {
        "inputs": sum(fuzz.sent.values()), "per_kind": fuzz.sent, "seconds": round(seconds, 1),
        "seed": seed, "concurrency": concurrency, "kinds": list(kinds), "node_crashes": 0 if alive else 1,
        "hanging_connections": len(fuzz.hangs), "hangs": fuzz.hangs[:20],
        "answered_within_quiet": fuzz.answered, "login_errors_on_our_side": fuzz.errors,
        "internal_failures_logged": failures, "http_connections_failed_logged": http_restarts, "fuzz_queues_deleted": deleted,
        "before": before, "after": after, "settled_s": settled, "connections_open_after": still_open[:20],
        "during": fuzz.samples,
        "well_behaved": {"rounds": fuzz.rounds, "failures": fuzz.round_failures,
                         "slowest_round_s": round(fuzz.slowest_round, 3)},
        "machine": f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}",
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result


def verdict(result: dict) -> bool:
    """The campaign passed: no crash, no hang, the node's fds back to where they were, its
    state (the interpreter's live blocks after a full collection) grown by at most
    LIVE_GROWTH, nothing logged as an internal failure, and the well-behaved client never
    failed."""
    before, after = result["before"], result["after"]
    return (result["node_crashes"] == 0 and result["hanging_connections"] == 0
            and after["fds"] <= before["fds"]
            and after["python_blocks_live"] <= before["python_blocks_live"] * (1 + LIVE_GROWTH)
            and result["internal_failures_logged"] == 0 and not result["well_behaved"]["failures"]
            and result["well_behaved"]["rounds"] > 0)
