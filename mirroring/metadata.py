"""Cluster metadata: members, queue definitions, exchanges and bindings, policies, and which
members are up or down.

Every node holds a copy: the state machine of the metadata log (mirroring/raft.py). A change is
committed to the log by a majority of the members and then applied here, on every node, in the
log's order; a node far behind takes a snapshot instead. The version counts applied changes.

A change is a list `[kind, ...args]` so it crosses the wire as it is. `apply` validates and
raises MetaError with an AMQP-style code, leaving the state untouched, when it is refused.
Decisions that depend on which nodes are running (placing mirrors, promoting one) are made by
the log's leader only (mirroring/planner.py) and travel inside the change as explicit
`updates` ([[queue, fields or None], ...]), so applying a change never depends on who applies it.

Members are `up` with an *incarnation* (a new number every time a node's app starts) or `down`
("failure" or "shutdown"). A node that restarts comes back as a new incarnation: whatever its
replicas held is gone, and the log says so before anything counts on them again. The same run
can be recorded down and then up again (it was cut off, not stopped); `times_down` counts every
run's down records per member, so a node that learns the news from a snapshot still sees it.
"""

from __future__ import annotations

import copy
import hashlib

import msgpack

from wire.errors import NOT_FOUND, PRECONDITION_FAILED, RESOURCE_LOCKED, ProtocolError

from . import exchanges as xmod

VHOST = "/"


class MetaError(ProtocolError):
    pass


QUEUE_PROPS = ("durable", "exclusive", "auto_delete", "arguments")


def client_delete(queue: str, node: str, session: int, rid: int, count: int) -> list:
    """The log change for a client's queue.delete: it names the request (the node and session
    that asked, the request id and the message count to answer with), so that session answers it
    when its node applies the change (`delete_asked_by`)."""
    return ["queue.delete", queue, None, [node, session, rid, count]]


def delete_asked_by(change: list, node: str) -> tuple[int, int, int] | None:
    """(session, rid, count) of a client's queue.delete asked through `node` that `change`
    applies; None for any other change."""
    if change[0] != "queue.delete" or len(change) < 4 or change[3][0] != node:
        return None
    _, session, rid, count = change[3]
    return session, rid, count


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def clone(x):
    """A deep copy of plain data (dicts, lists, tuples, sets of scalars), about three times as
    fast as copy.deepcopy: the leader copies the whole metadata for every round of proposals
    (a `replan` each liveness tick), and with 1,000 queues deepcopy's two copies took 18 ms of a
    loop that also serves the queues' clients. Anything else goes to copy.deepcopy."""
    t = type(x)
    if t is dict:
        return {k: clone(v) for k, v in x.items()}
    if t is list:
        return [clone(v) for v in x]
    if t is str or t is int or t is float or t is bool or x is None or t is bytes:
        return x
    if t is tuple:
        return tuple(clone(v) for v in x)
    if t is set:
        return {clone(v) for v in x}
    return copy.deepcopy(x)


class Metadata:
    def __init__(self, cluster_name: str = ""):
        self.version = 0
        self.cluster_name = cluster_name
        self.members: dict[str, dict] = {}  # name -> {"peer": [h, p], "client": [h, p]}, join order
        self.queues: dict[str, dict] = {}
        # exchanges (the built-in ones included) and bindings by source exchange:
        # {exchange: [[queue, routing key, arguments], ...]} (mirroring/exchanges.py routes them)
        self.exchanges: dict[str, dict] = xmod.builtin_exchanges()
        self.bindings: dict[str, list] = {}
        self._routes: xmod.Routes | None = None
        self.policies: dict[str, dict] = {}
        self.down: dict[str, str] = {}  # member -> "failure" | "shutdown"
        self.up: dict[str, int] = {}  # member -> incarnation, for members recorded running
        # member -> how many times a run of it was recorded down: a node that learns the news
        # from a snapshot sees by it that a run went down even if it came back up since
        self.times_down: dict[str, int] = {}
        # the queues the last change applied created, changed or removed; None when it may
        # have changed what any queue's replicas do (a policy, a member, a node's run)
        self.touched: set[str] | None = None

    # --- snapshots -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {
            "version": self.version,
            "cluster_name": self.cluster_name,
            "members": [[n, m] for n, m in self.members.items()],
            "queues": clone(self.queues),
            "exchanges": clone(self.exchanges),
            "bindings": clone(self.bindings),
            "policies": clone(self.policies),
            "down": dict(self.down),
            "up": dict(self.up),
            "times_down": dict(self.times_down),
        }

    @classmethod
    def from_snapshot(cls, snap: dict) -> "Metadata":
        md = cls(snap.get("cluster_name", ""))
        md.version = snap["version"]
        md.members = {n: dict(m) for n, m in snap["members"]}
        md.queues = clone(snap["queues"])
        md.exchanges = {**xmod.builtin_exchanges(), **clone(snap.get("exchanges", {}))}
        md.bindings = clone(snap.get("bindings", {}))
        md.policies = clone(snap.get("policies", {}))
        md.down = dict(snap.get("down", {}))
        md.up = dict(snap.get("up", {}))
        md.times_down = dict(snap.get("times_down", {}))
        return md

    def copy(self) -> "Metadata":
        """An independent copy (one copy of each part, not a snapshot's two)."""
        md = Metadata(self.cluster_name)
        md.version = self.version
        md.members = {n: dict(m) for n, m in self.members.items()}
        md.queues = clone(self.queues)
        md.exchanges = clone(self.exchanges)
        md.bindings = clone(self.bindings)
        md.policies = clone(self.policies)
        md.down = dict(self.down)
        md.up = dict(self.up)
        md.times_down = dict(self.times_down)
        return md

    def digest(self) -> str:
        """A short content hash: two nodes with equal version and digest agree."""
        return hashlib.sha1(msgpack.packb(self.snapshot(), use_bin_type=True)).hexdigest()[:12]

    # --- derived ---------------------------------------------------------------------------
    def seniority(self, node: str) -> int:
        """0 for the founding member, larger for later joiners; unknown nodes last."""
        for i, name in enumerate(self.members):
            if name == node:
                return i
        return len(self.members) + 1

    def queues_led_by(self, node: str) -> list[dict]:
        return [q for q in self.queues.values() if q["leader"] == node]

    @property
    def routes(self) -> xmod.Routes:
        """The routing structures of this version (rebuilt lazily after every change)."""
        r = self._routes
        if r is None:
            r = self._routes = xmod.Routes(self.exchanges, self.bindings, self.queues)
        return r

    def bindings_of(self, queue: str) -> list[list]:
        """[[exchange, routing key, arguments], ...] of one queue (the default binding aside)."""
        return [[x, key, args] for x, binds in self.bindings.items()
                for q, key, args in binds if q == queue]

    # --- changes ---------------------------------------------------------------------------
    def apply(self, change: list):
        """Validate and apply one change; bumps the version. Returns a change-specific value."""
        kind, *args = change
        handler = getattr(self, "_c_" + kind.replace(".", "_").replace("-", "_"), None)
        if handler is None:
            raise MetaError(PRECONDITION_FAILED, f"unknown metadata change {kind!r}")
        # the kinds that say which queues they touch start from none; any other may touch all
        self.touched = set() if kind in _NAMES_WHAT_IT_TOUCHES else None
        try:
            value = handler(*args)
        except BaseException:
            self.touched = None  # refused (nothing changed) or a bug: a pass over all is safe
            raise
        self.version += 1
        self._routes = None
        return value

    def _c_noop(self):
        return None

    def _c_member_add(self, name: str, peer: list, client: list):
        self.members[name] = {"peer": list(peer), "client": list(client)}
        if not self.cluster_name:
            self.cluster_name = f"warren@{name}"
        return None

    def _c_member_remove(self, name: str):
        if name not in self.members:
            raise MetaError(NOT_FOUND, f"node {name!r} is not a member of the cluster")
        del self.members[name]
        self.down.pop(name, None)
        self.up.pop(name, None)
        for qname in [q["name"] for q in self.queues_led_by(name)]:
            self._drop_queue(qname)
        for q in self.queues.values():
            if name in q.get("mirrors", ()):
                q["mirrors"] = [n for n in q["mirrors"] if n != name]
                q["synced"] = [n for n in q.get("synced", ()) if n != name]
        return None

    def _c_queue_declare(self, qdef: dict):
        """Declare, or check an existing declaration is equivalent (a RabbitMQ-like precondition)."""
        name = qdef["name"]
        existing = self.queues.get(name)
        if existing is None:
            if qdef["leader"] not in self.members:
                raise MetaError(NOT_FOUND, f"node {qdef['leader']!r} is not a cluster member")
            self.queues[name] = dict(qdef)
            self._touch(name)
            return {"created": True, "queue": dict(qdef)}
        check_equivalent(existing, qdef)
        return {"created": False, "queue": dict(existing)}

    def _c_queue_delete(self, name: str, leader: str | None = None, requester: list | None = None):
        """Delete a queue; with `leader`, only if it is still led from that node. `requester`
        names the client's queue.delete that asked (`client_delete`): its session answers it
        when its node applies the change (broker/session.py `answer_delete`), so the answer
        does not depend on the queue's leader outliving the commit."""
        q = self.queues.get(name)
        if q is None or (leader is not None and q["leader"] != leader):
            return False
        self._drop_queue(name)
        return True

    def _drop_queue(self, name: str) -> None:
        """A queue goes, and its bindings with it (auto-delete exchanges left with no binding
        go too, as in RabbitMQ)."""
        del self.queues[name]
        self._touch(name)
        for x in [x for x, binds in self.bindings.items() if any(b[0] == name for b in binds)]:
            self.bindings[x] = [b for b in self.bindings[x] if b[0] != name]
            self._binding_gone(x)

    def _touch(self, queue: str) -> None:
        if self.touched is not None:
            self.touched.add(queue)

    def _binding_gone(self, exchange: str) -> None:
        if self.bindings.get(exchange):
            return
        self.bindings.pop(exchange, None)
        x = self.exchanges.get(exchange)
        if x is not None and x["auto_delete"] and exchange not in xmod.BUILTIN:
            del self.exchanges[exchange]

    # --- exchanges and bindings (idempotent: a proposal retried after a leader change is
    # harmless) ---------------------------------------------------------------------------
    def _c_exchange_declare(self, xdef: dict):
        name = xdef["name"]
        existing = self.exchanges.get(name)
        if existing is None:
            self.exchanges[name] = xmod.make_exchange(name, xdef["type"], xdef["durable"],
                                                      xdef["auto_delete"], xdef["internal"],
                                                      xdef.get("arguments"))
            return {"created": True}
        xmod.check_equivalent(existing, xdef)
        return {"created": False}

    def _c_exchange_delete(self, name: str, if_unused: bool = False):
        if name not in self.exchanges:
            return False
        xmod.check_deletable(name)
        if if_unused and self.bindings.get(name):
            raise MetaError(PRECONDITION_FAILED, f"{xmod.describe(name)} in use")
        del self.exchanges[name]
        self.bindings.pop(name, None)
        return True

    def _c_binding_add(self, exchange: str, queue: str, key: str, arguments: dict):
        xmod.check_bindable(exchange)
        if exchange not in self.exchanges:
            raise xmod.not_found(exchange)
        if queue not in self.queues:
            raise MetaError(NOT_FOUND, f"no queue '{queue}' in vhost '{VHOST}'")
        binds = self.bindings.setdefault(exchange, [])
        entry = [queue, key, dict(arguments or {})]
        if entry in binds:
            return False
        binds.append(entry)
        return True

    def _c_binding_remove(self, exchange: str, queue: str, key: str, arguments: dict):
        xmod.check_bindable(exchange)
        if exchange not in self.exchanges:
            raise xmod.not_found(exchange)
        if queue not in self.queues:
            raise MetaError(NOT_FOUND, f"no queue '{queue}' in vhost '{VHOST}'")
        binds = self.bindings.get(exchange, [])
        entry = [queue, key, dict(arguments or {})]
        if entry not in binds:
            return False
        binds.remove(entry)
        self._binding_gone(exchange)
        return True

    def _apply_updates(self, updates: list) -> list:
        """[[queue, fields or None], ...]: merge replica fields, or delete. Returns deleted names."""
        deleted = []
        for name, fields in updates:
            q = self.queues.get(name)
            if q is None:
                continue
            if fields is None:
                self._drop_queue(name)
                deleted.append(name)
            else:
                # a new dict, never an in-place update: replicas and sessions holding the old
                # definition notice the change by identity (`qp.qdef is not qdef`) or compare
                # its epoch with the current one
                self.queues[name] = {**q, **fields}
                self._touch(name)
        return deleted

    def _c_queues_update(self, updates: list):
        return self._apply_updates(updates)

    def _c_node_down(self, node: str, incarnation: int, kind: str = "failure", updates: list = ()):
        """Incarnation `incarnation` of a member went down (kind "failure" or "shutdown");
        `updates` are the planner's promotions, deletions of non-durable queues and new mirror
        placements."""
        if node in self.members and self.up.get(node) == incarnation:
            del self.up[node]
            self.down[node] = kind
            self.times_down[node] = self.times_down.get(node, 0) + 1
        return self._apply_updates(list(updates))

    def _c_node_up(self, node: str, incarnation: int, updates: list = ()):
        if node in self.members:
            self.down.pop(node, None)
            self.up[node] = incarnation
        return self._apply_updates(list(updates))

    def _c_policy_set(self, record: dict, updates: list = ()):
        self.policies[record["name"]] = dict(record)
        return self._apply_updates(list(updates))

    def _c_policy_clear(self, name: str, updates: list = ()):
        if name not in self.policies:
            raise MetaError(NOT_FOUND, f"policy '{name}' not found in vhost '{VHOST}'")
        del self.policies[name]
        return self._apply_updates(list(updates))


# changes that record in `Metadata.touched` every queue they create, change or remove (the
# rest may change what every queue's replicas do: a node's run, a policy, a member)
_NAMES_WHAT_IT_TOUCHES = frozenset({"noop", "queue.declare", "queue.delete", "queues.update",
                                    "exchange.declare", "exchange.delete", "binding.add",
                                    "binding.remove"})


def check_equivalent(existing: dict, wanted: dict) -> None:
    """Raise the RabbitMQ-style errors for a re-declare that does not match."""
    name = existing["name"]
    if existing["exclusive"] and wanted.get("owner") != existing.get("owner"):
        raise MetaError(
            RESOURCE_LOCKED,
            f"cannot obtain exclusive access to locked queue '{name}' in vhost '{VHOST}'. It could "
            "be originally declared on another connection or the exclusive property value does "
            "not match that of the original declaration.",
        )
    for prop in ("durable", "exclusive", "auto_delete"):
        if bool(existing[prop]) != bool(wanted[prop]):
            raise MetaError(
                PRECONDITION_FAILED,
                f"inequivalent arg '{prop}' for queue '{name}' in vhost '{VHOST}': "
                f"received '{_fmt(wanted[prop])}' but current is '{_fmt(existing[prop])}'",
            )
    old_args, new_args = existing.get("arguments") or {}, wanted.get("arguments") or {}
    for key in sorted(set(old_args) | set(new_args)):
        if old_args.get(key) != new_args.get(key):
            raise MetaError(
                PRECONDITION_FAILED,
                f"inequivalent arg '{key}' for queue '{name}' in vhost '{VHOST}': "
                f"received {_fmt(new_args.get(key, 'none'))!r} but current is "
                f"{_fmt(old_args.get(key, 'none'))!r}",
            )
