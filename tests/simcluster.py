"""A whole warren cluster on SimNetwork, for tests running under trio's MockClock.

Each node runs in its own cancel scope inside the test's nursery, so a node can be "killed"
(its host killed on the network and its tasks cancelled) and started again.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from broker.client.aio import open_connection
from broker.config import NodeConfig
from broker.network import SimNetwork
from broker.node import Node

CLIENT_PORT = 5672
PEER_PORT = 25672
TICKTIME = 8.0


class SimCluster:
    def __init__(self, nursery: trio.Nursery, data_root, names=("n1", "n2", "n3"), seed: int = 0,
                 net_ticktime: float = TICKTIME, persist: bool = False, **node_options):
        self.nursery = nursery
        self.net = SimNetwork(seed)
        self.data_root = data_root
        self.names = list(names)
        self.net_ticktime = net_ticktime
        self.persist = persist
        self.seed = seed
        self.node_options = node_options  # extra NodeConfig fields for every node
        self.nodes: dict[str, Node] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.killed: set[str] = set()
        self.dead_node_errors: list = []

    def config(self, name: str) -> NodeConfig:
        return NodeConfig(name=name, host=name, advertise_host=name, client_port=CLIENT_PORT,
                          peer_port=PEER_PORT, secret=b"s", net_ticktime=self.net_ticktime,
                          data_dir=str(self.data_root / name), **self.node_options).validate()

    def _new_node(self, name: str) -> Node:
        import random
        rng = random.Random(f"{self.seed}/{name}/{len(self.nodes)}/{sorted(self.killed)}")
        return Node(self.config(name), self.net.host(name), persist=self.persist, rng=rng)

    async def start_node(self, name: str) -> Node:
        return await self._launch(name, self._new_node(name))

    async def _launch(self, name: str, node: Node) -> Node:
        """Run `node` in its own cancel scope in the test's nursery (so it can be killed)."""
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
        with trio.fail_after(timeout):
            while not predicate():
                await trio.sleep(0.05)

    async def wait_running(self, names, timeout: float = 60.0) -> None:
        """Until these nodes link to each other and the metadata records them all up."""
        want = set(names)
        await self.wait_for(lambda: all(self.nodes[n].running == want and set(self.nodes[n].md.up) >= want
                                        for n in names), timeout)

    async def _run_node(self, name, node, scope, task_status):
        try:
            with scope:
                await node.run(task_status=task_status)
        except BaseException as exc:  # noqa: BLE001
            if not (scope.cancel_called and name in self.killed):
                raise
            # The process is dead; what its tasks raised while dying cannot matter to the
            # others. Kept for inspection: with trio's strict exception groups, broken peer
            # links raise out of PeerLink.run (see test_dropped_links_detected_at_once).
            self.dead_node_errors.append((name, exc))

    def kill(self, name: str) -> None:
        self.killed.add(name)
        self.net.kill(name)
        self.scopes[name].cancel()

    async def restart(self, name: str) -> Node:
        """Revive a killed host and start the node again (same config, same metadata object)."""
        old = self.nodes[name]
        self.net.revive(name)
        self.killed.discard(name)
        node = self._new_node(name)
        if not self.persist:
            # no disk: the new process starts from the state the old one had saved
            node.cluster.saved = old.cluster.saved
        return await self._launch(name, node)

    @asynccontextmanager
    async def connect(self, name: str, **kw):
        """A client connection to node `name`, dialed from that node's own host (guest is
        loopback-only)."""
        async with open_connection([f"{name}:{CLIENT_PORT}"], network=self.net.host(name),
                                   reconnect=False, **kw) as conn:
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
