"""What a session core may ask of its node, declared (`SessionHost`), and the node's answer to
it (`NodeHost`).

The core (broker/session/core.py) never reaches into the node: it looks the metadata up,
routes through exchanges, sends to a queue's leader and registers its routes through these
methods only, so it runs in a test against any object that has them. Queue and exchange
definitions are opaque to the core: whatever it needs to know of one (a queue's leader and
epoch, whether it is locked to another connection, an exchange's type) it asks here, so every
reading of the metadata's records on the session's side is in this file.
"""

from __future__ import annotations

from typing import Any, Protocol

from mirroring.access import Access
from mirroring.changes import Change
from mirroring.records import Binding, Exchange, ExchangeBinding, QueueDef
from wire import messages as m


class SessionHost(Protocol):
    """The node as a session core sees it. Everything here is synchronous; what has to wait
    for the cluster (`propose`, `declare_queue`) and for a peer link (`wait_link_room`) is the
    driver's (broker/session/driver.py)."""

    name: str  # the node's name: the first part of every owner the session sends
    log: Any

    # --- what the driver awaits (off the hot path: looked up on the node at each call) ---
    async def propose(self, change: Change):
        return await self._cluster.propose(change)

    async def declare_queue(self, core, msg: m.QueueDeclare):
        return await self._node.declare_queue(core, msg)

    # --- SessionHost ---
    @property
    def leaving(self) -> bool: ...  # the node's shutdown record is on its way (Node.leaving)

    # --- metadata lookups ---
    def queue(self, name: str) -> Any | None: ...  # the queue's definition, None if there is none
    def queue_route(self, qdef: Any) -> tuple[str, int]: ...  # (its leader, its leader epoch)
    def queue_epoch(self, qdef: Any) -> int: ...  # its leader epoch
    def queue_locked(self, qdef: Any, conn_id: str) -> bool: ...  # exclusive to another connection
    def queue_down_reason(self, qdef: Any) -> str: ...  # why operations on it fail now ("" if not)
    def exchange(self, name: str) -> Any | None: ...
    def exchange_kind(self, xdef: Any) -> tuple[str, bool]: ...  # (its type, internal)
    def bound(self, exchange: str, binding: Binding) -> bool: ...  # the binding is there
    def exchange_bound(self, source: str, binding: ExchangeBinding) -> bool: ...
    def route(self, exchange: str, key: str, headers=None) -> list[str]: ...  # the queues it reaches
    def routes_by_headers(self, exchange: str) -> bool: ...  # its graph reaches a headers exchange
    def linked(self, node: str) -> bool: ...  # this node has a link to `node` now
    def access(self, user: str, vhost: str) -> Access: ...  # the user's compiled permissions there

    @property
    def access_version(self) -> int: ...  # moves when any user or permission changes

    # --- sending to a queue's leader ---
    def to_leader(self, qname: str, op) -> Any: ...
    def link_full(self, qname: str) -> bool: ...  # the link to its remote leader is past its mark
    def mirror_bodies(self, ev: m.EvDeliver) -> list: ...  # bodies this node's mirror holds
    def begin_input(self) -> None: ...  # a batch of input: replicas' rounds run at its end
    def end_input(self) -> None: ...

    # --- the node's index of sessions by the queues they route to ---
    def track_route(self, qname: str, session) -> None: ...
    def untrack_route(self, qname: str, sid: int) -> None: ...

    # --- direct reply-to ---
    def direct_reply(self, node: str, sid: int, ev: m.EvDirectReply) -> bool: ...  # sent (False: nobody)
    def to_session(self, node: str, sid: int, events: list) -> None: ...  # events for a session


class NodeHost:
    """`SessionHost` over a running node (broker/node.py) and its router and metadata log;
    plus the awaiting half the driver uses. The router's methods are bound once, so a publish
    costs no more call frames than when the session held the router itself."""

    def __init__(self, node):
        self._node = node
        self._cluster = node.cluster
        router = node.router
        self.name = node.name
        self.log = node.log
        self.queue_down_reason = node.queue_down_reason
        self.to_leader = router.to_leader
        self.link_full = router.link_full
        self.mirror_bodies = router.mirror_bodies
        self.begin_input = router.begin_input
        self.end_input = router.end_input
        self.wait_link_room = router.wait_link_room
        self.to_session = router.to_session

    # --- what the driver awaits (off the hot path: looked up on the node at each call) ---
    async def propose(self, change: Change):
        return await self._cluster.propose(change)

    async def declare_queue(self, core, msg: m.QueueDeclare):
        return await self._node.declare_queue(core, msg)

    # --- SessionHost ---
    @property
    def leaving(self) -> bool:
        return self._node.leaving

    def queue(self, name: str) -> QueueDef | None:
        return self._cluster.md.queues.get(name)

    def queue_route(self, qdef: QueueDef) -> tuple[str, int]:
        return qdef.leader, qdef.epoch

    def queue_epoch(self, qdef: QueueDef) -> int:
        return qdef.epoch

    def queue_locked(self, qdef: QueueDef, conn_id: str) -> bool:
        return qdef.exclusive and qdef.owner != conn_id

    def exchange(self, name: str) -> Exchange | None:
        return self._cluster.md.exchanges.get(name)

    def exchange_kind(self, xdef: Exchange) -> tuple[str, bool]:
        return xdef.type, xdef.internal

    def bound(self, exchange: str, binding: Binding) -> bool:
        return binding in self._cluster.md.bindings.get(exchange, ())

    def exchange_bound(self, source: str, binding: ExchangeBinding) -> bool:
        return binding in self._cluster.md.exchange_bindings.get(source, ())

    def route(self, exchange: str, key: str, headers=None) -> list[str]:
        routes = self._cluster.md.routes
        return routes.route(exchange, key) if headers is None else routes.route(exchange, key, headers)

    def routes_by_headers(self, exchange: str) -> bool:
        return exchange in self._cluster.md.routes.by_headers

    def direct_reply(self, node: str, sid: int, ev: m.EvDirectReply) -> bool:
        """Replies for a channel of session `sid` on `node`: taken by it now when it is ours
        (False when it has no such consumer), else sent over the link (False: no link)."""
        if node == self.name:
            session = self._node.sessions.get(sid)
            return session is not None and session.take_reply(ev)
        if node not in self._cluster.links:
            return False
        self._node.router.to_session(node, sid, [ev])
        return True

    def linked(self, node: str) -> bool:
        return node in self._cluster.links

    def access(self, user: str, vhost: str) -> Access:
        md = self._cluster.md
        return Access(user, vhost, md.access_version, md.access(user, vhost))

    @property
    def access_version(self) -> int:
        return self._cluster.md.access_version

    def track_route(self, qname: str, session) -> None:
        self._node.routing.setdefault(qname, {})[session.sid] = session

    def untrack_route(self, qname: str, sid: int) -> None:
        routing = self._node.routing
        held = routing.get(qname)
        if held is not None and held.pop(sid, None) is not None and not held:
            del routing[qname]
