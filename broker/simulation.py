"""A whole warren cluster in one process on the simulated network, replayable from one seed.

This is the second I/O shell of the broker (the first is real TCP, broker/network.py
`TcpNetwork`): the same `Node` code runs on `SimNetwork` under trio's `MockClock`, so a
60-second net_ticktime scenario takes milliseconds, and faults are made by the test, not by
luck: kill a node (its host dies, its tasks are cancelled), restart it, pause it (its traffic is
held both ways, as a SIGSTOPped process's would be), partition and heal, drop and delay links.

Determinism: `deterministic(seed)` seeds everything that could differ between two runs of one
seed: trio's scheduler (the order in which ready tasks run: trio shuffles it with a
`random.Random` that it lets tests seed), the mock clock's offset (from the same generator), every
node's random choices (incarnations, session ids, election timeouts: `Node(rng=...)`), and the
network's jitter. What is left to chance is nothing, provided the process's string hashing is
fixed (PYTHONHASHSEED) so that set iteration orders agree: the fault explorer's command line
sees to that.

    with deterministic(seed):
        trio.run(scenario, clock=MockClock(autojump_threshold=0))
"""

from __future__ import annotations

import contextlib
import random
from contextlib import asynccontextmanager

import trio
import trio.testing

from .client.aio import open_connection
from .config import NodeConfig
from .memory import SimMemory
from .network import SimNetwork
from .node import Node


CLIENT_PORT = 5672
PEER_PORT = 25672
TICKTIME = 8.0
SIM_USER = ("sim", "sim")  # clients on hosts of their own are not loopback: guest would be refused


@contextlib.contextmanager
def deterministic(seed: int):
    """Make trio's scheduling order (and MockClock's offset) a function of `seed` for the
    `trio.run` calls inside the block."""
    from trio._core import _run

    saved_flag = _run._ALLOW_DETERMINISTIC_SCHEDULING
    saved_state = _run._r.getstate()
    _run._ALLOW_DETERMINISTIC_SCHEDULING = True
    _run._r.seed(seed)
    try:
        yield
    finally:
        _run._ALLOW_DETERMINISTIC_SCHEDULING = saved_flag
        _run._r.setstate(saved_state)


class SimCluster:
    """Nodes n1..nN on one SimNetwork, each running in its own cancel scope inside the caller's
    nursery, so a node can be killed (its host killed on the network and its tasks cancelled)
    and started again with what it had saved."""

    def __init__(self, nursery: trio.Nursery, data_root, names=("n1", "n2", "n3"), seed: int = 0,
                 net_ticktime: float = TICKTIME, persist: bool = False, **node_options):
        self.nursery = nursery
        self.seed = seed
        self.net = SimNetwork(seed)
        self.data_root = data_root
        self.names = list(names)
        self.net_ticktime = net_ticktime
        self.persist = persist
        self.node_options = node_options  # extra NodeConfig fields for every node
        self.nodes: dict[str, Node] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.killed: set[str] = set()
        self.paused: set[str] = set()
        self.dead_node_errors: list = []
        self._starts = 0
        # each node's memory as its alarm sees it (the nodes share this process: a test sets
        # `memory[name].used_bytes` to put a node above its high watermark)
        self.memory: dict[str, SimMemory] = {n: SimMemory() for n in self.names}

    def config(self, name: str, **extra) -> NodeConfig:
        options = {"users": {"guest": "guest", SIM_USER[0]: SIM_USER[1]}, **self.node_options, **extra}
        return NodeConfig(name=name, host=name, advertise_host=name, client_port=CLIENT_PORT,
                          peer_port=PEER_PORT, secret=b"s", net_ticktime=self.net_ticktime,
                          data_dir=str(self.data_root / name), **options).validate()

    def _new_node(self, name: str, **extra) -> Node:
        self._starts += 1
        rng = random.Random(f"{self.seed}/{name}/{self._starts}")
        memory = self.memory.setdefault(name, SimMemory())
        # every simulated schedule checks the log leader's planning copy (broker/cluster.py)
        return Node(self.config(name, **extra), self.net.host(name), persist=self.persist, rng=rng,
                    memory_probe=memory, check_planning_copy=True)

    async def start_node(self, name: str) -> Node:
        return await self._launch(name, self._new_node(name))

    async def _launch(self, name: str, node: Node) -> Node:
        """Run `node` in its own cancel scope in the caller's nursery (so it can be killed)."""
        scope = trio.CancelScope()

        async def runner(task_status=trio.TASK_STATUS_IGNORED):
            await self._run_node(name, node, scope, task_status)

        self.nodes[name] = node
        self.scopes[name] = scope
        await self.nursery.start(runner)
        return node

    async def form(self) -> None:
        """Start every node and join the others to the first; wait until all run together."""
        first = self.names[0]
        for name in self.names:
            await self.start_node(name)
        for name in self.names[1:]:
            node = self.nodes[name]
            await node.stop_app()
            await node.join_cluster(first, PEER_PORT)
            await node.start_app()
        await self.wait_running(self.names)

    async def wait_for(self, predicate, timeout: float = 60.0, what: str = "condition") -> None:
        try:
            with trio.fail_after(timeout):
                while not predicate():
                    await trio.sleep(0.05)
        except trio.TooSlowError:
            raise trio.TooSlowError(f"timed out after {timeout:g} s waiting for {what}") from None

    async def wait_running(self, names, timeout: float = 60.0) -> None:
        """Until these nodes link to each other and the metadata records them all up."""
        want = set(names)
        await self.wait_for(lambda: all(self.nodes[n].running == want and set(self.nodes[n].md.up) >= want
                                        for n in names), timeout, f"nodes {sorted(want)} running")

    async def _run_node(self, name, node, scope, task_status):
        started = False

        class Status:
            def started(self, value=None):
                nonlocal started
                started = True
                task_status.started(value)
        try:
            with scope:
                await node.run(task_status=Status())
        except BaseException as exc:  # noqa: BLE001
            if not (scope.cancel_called and name in self.killed):
                raise
            # The process is dead; what its tasks raised while dying cannot matter to the
            # others. Kept for inspection.
            self.dead_node_errors.append((name, exc))
        if not started and name in self.killed:
            # killed while it started (a full restart's SIGTERM that came while another fault
            # restarted it: dst seed 50524): to whoever started it, a process that started and
            # died, as `warren-server` would be
            task_status.started(node)

    # --- faults ------------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        """kill -9: the host dies (every connection breaks at once) and the node's tasks stop."""
        self.killed.add(name)
        self.paused.discard(name)
        self.net.kill(name)
        self.scopes[name].cancel()

    async def restart(self, name: str, **extra) -> Node:
        """Revive a killed host and start the node again with what it had saved (`extra`:
        NodeConfig fields this start changes)."""
        old = self.nodes[name]
        if old.config.cluster_seed and not old.cluster.has_state():
            # it never joined: it keeps trying its cluster seed (in the background), as
            # warren-server would
            return self.start_fresh(name, old.config.cluster_seed.rsplit(":", 1)[0])
        self.net.revive(name)
        self.killed.discard(name)
        node = self._new_node(name, **extra)
        if not self.persist:
            node.cluster.saved = old.cluster.saved  # no disk: what the old process had saved
        return await self._launch(name, node)

    def start_fresh(self, name: str, seed: str) -> Node:
        """A node with nothing saved, started in the background with `cluster_seed`: it joins
        the cluster of node `seed` (retrying until it answers) before its app starts, as a node
        of docker-compose does. For a node that was forgotten and comes back as a new one."""
        self.net.revive(name)
        self.killed.discard(name)
        node = self._new_node(name, cluster_seed=f"{seed}:{PEER_PORT}")
        scope = trio.CancelScope()
        self.nodes[name] = node
        self.scopes[name] = scope

        async def runner():
            await self._run_node(name, node, scope, trio.TASK_STATUS_IGNORED)

        self.nursery.start_soon(runner)
        return node

    def pause(self, name: str) -> None:
        """SIGSTOP, as the others see it: the node falls silent (its traffic is held, not
        lost, and no connection breaks) until `resume`. (Its own timers go on running, so it
        notices the silence during the pause rather than at SIGCONT: the same decisions, a
        little earlier.)"""
        self.paused.add(name)
        self.net.pause(name)

    def resume(self, name: str) -> None:
        self.paused.discard(name)
        self.net.resume(name)

    # --- clients -----------------------------------------------------------------------------
    @asynccontextmanager
    async def connect(self, name: str, **kw):
        """A client connection to node `name`, dialed from that node's own host (guest is
        loopback-only)."""
        async with open_connection([f"{name}:{CLIENT_PORT}"], network=self.net.host(name),
                                   reconnect=False, **kw) as conn:
            yield conn

    @asynccontextmanager
    async def client(self, host: str, nodes: list[str], **kw):
        """A client on a host of its own, connected through a list of nodes, reconnecting as a
        user's would (the `sim` user: not loopback-only)."""
        kw.setdefault("reconnect", True)
        async with open_connection([f"{n}:{CLIENT_PORT}" for n in nodes], network=self.net.host(host),
                                   user=SIM_USER[0], password=SIM_USER[1], **kw) as conn:
            yield conn


@asynccontextmanager
async def sim_cluster(data_root, **kw):
    async with trio.open_nursery() as nursery:
        c = SimCluster(nursery, data_root, **kw)
        await c.form()
        try:
            yield c
        finally:
            nursery.cancel_scope.cancel()


@contextlib.contextmanager
def traced(trace: list):
    """Route every log event to `trace` as (mock time, event, fields) instead of printing it:
    a run's trace, whose hash tells whether two runs of one seed did the same things."""
    import structlog

    def record(_logger, _method, event: dict):
        try:
            now = trio.current_time()
        except RuntimeError:
            now = None
        name = event.pop("event", "")
        trace.append((now, name, sorted((k, repr(v)) for k, v in event.items())))
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(processors=[structlog.processors.add_log_level, record],
                        wrapper_class=structlog.make_filtering_bound_logger(0),
                        cache_logger_on_first_use=False)
    try:
        yield trace
    finally:
        structlog.configure(**old)


def trace_digest(trace: list) -> str:
    import hashlib
    return hashlib.sha256(repr(trace).encode()).hexdigest()[:16]
