"""Cluster metadata: virtual hosts, members, queue definitions, exchanges and bindings,
policies, users and their permissions, and which members are up or down.

Every node holds a copy: the state machine of the metadata log (mirroring/raft.py). A change is
committed to the log by a majority of the members and then applied here, on every node, in the
log's order; a node far behind takes a snapshot instead. The version counts applied changes.

A change is a typed message (mirroring/changes.py) and its records are immutable
(mirroring/records.py). `apply` finds the change's handler by its type (the `_APPLY` table),
validates
and raises MetaError with an AMQP-style code, leaving the state untouched, when it is refused.
Decisions that depend on which nodes are running (placing mirrors, promoting one) are made by
the log's leader only (mirroring/planner.py) and travel inside the change as explicit `updates`
(QueueUpdate: a queue's new placement, or its deletion), so applying a change never depends on
who applies it.

Queues, exchanges and policies live in a vhost and are filed under their key
(mirroring/records.py `qualify`): the plain name in the default vhost "/", which always exists.
Deleting a vhost drops everything filed in it.

Members are `up` with an *incarnation* (a new number every time a node's app starts) or `down`
("failure" or "shutdown"). A node that restarts comes back as a new incarnation: whatever its
replicas held is gone, and the log says so before anything counts on them again. The same run
can be recorded down and then up again (it was cut off, not stopped); `times_down` counts every
run's down records per member, so a node that learns the news from a snapshot still sees it.

`access_version` is the version of the last change to users or permissions (or of the snapshot
the metadata came from): sessions keep their compiled permissions (mirroring/access.py
`Access`) until it moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import msgspec

from wire.errors import NOT_FOUND, PRECONDITION_FAILED, RESOURCE_LOCKED, ProtocolError

from . import changes as c
from . import exchanges as xmod
from .records import (DEFAULT_VHOST, VHOST_SEP, Binding, Exchange, ExchangeBinding, Member,
                      Permission, Policy, QueueDef, QueueUpdate, Snapshot, User, VHost, in_vhost,
                      split_key)


class MetaError(ProtocolError):
    pass


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


_encoder = msgspec.msgpack.Encoder()


class Metadata:
    def __init__(self, cluster_name: str = ""):
        self.version = 0
        self.cluster_name = cluster_name
        self.vhosts: dict[str, VHost] = {DEFAULT_VHOST: VHost(DEFAULT_VHOST, "Default virtual host")}
        self.members: dict[str, Member] = {}  # in join order
        self.queues: dict[str, QueueDef] = {}
        # exchanges (the built-in ones included) and bindings by source exchange (a list per
        # exchange, in binding order: mirroring/exchanges.py routes them)
        self.exchanges: dict[str, Exchange] = xmod.builtin_exchanges()
        self.bindings: dict[str, list[Binding]] = {}
        # exchange-to-exchange bindings by source exchange, in binding order
        self.exchange_bindings: dict[str, list[ExchangeBinding]] = {}
        self._routes: xmod.Routes | None = None
        self.policies: dict[str, Policy] = {}
        self.operator_policies: dict[str, Policy] = {}  # RabbitMQ's operator policies
        self.managed_ha = False  # Amazon MQ's managed HA policy is in force (mirroring/policy.py)
        self.down: dict[str, str] = {}  # member -> "failure" | "shutdown"
        self.up: dict[str, int] = {}  # member -> incarnation, for members recorded running
        # member -> how many times a run of it was recorded down: a node that learns the news
        # from a snapshot sees by it that a run went down even if it came back up since
        self.times_down: dict[str, int] = {}
        # the queues the last change applied created, changed or removed; None when it may
        # have changed what any queue's replicas do (a policy, a member, a node's run)
        self.touched: set[str] | None = None
        self.users: dict[str, User] = {}
        self.permissions: dict[tuple[str, str], Permission] = {}  # (vhost, user) -> permission
        self.access_version = 0

    # --- snapshots and copies ------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The whole state (its records are shared: they are never changed in place)."""
        return Snapshot(self.version, self.cluster_name, dict(self.members), dict(self.queues),
                        dict(self.exchanges), {x: list(b) for x, b in self.bindings.items()},
                        dict(self.policies), dict(self.down), dict(self.up), dict(self.times_down),
                        dict(self.operator_policies), self.managed_ha, dict(self.vhosts),
                        dict(self.users), list(self.permissions.values()),
                        {x: list(b) for x, b in self.exchange_bindings.items()})

    @classmethod
    def from_snapshot(cls, snap) -> Metadata:
        """The metadata of a snapshot: a Snapshot, or one as it came off the wire or out of the
        state file (msgpack-decoded), which is checked field by field."""
        try:
            snap = msgspec.convert(snap, Snapshot)
        except msgspec.ValidationError as exc:
            raise MetaError(PRECONDITION_FAILED, f"bad metadata snapshot: {exc}") from None
        return cls._of(snap, {**xmod.builtin_exchanges(), **snap.exchanges},
                       {(p.vhost, p.user): p for p in snap.permissions}, snap.version)

    def copy(self) -> Metadata:
        """An independent copy. The records are immutable, so the copy shares them: the log's
        leader copies the whole metadata to plan a round of proposals on (a `replan` each
        liveness tick), and with 1,000 queues a deep copy of dict records took 13-20 ms of a
        loop that also serves the queues' clients."""
        return self._of(self, dict(self.exchanges), dict(self.permissions), self.access_version)

    @classmethod
    def _of(cls, src, exchanges: dict, permissions: dict, access_version: int) -> Metadata:
        """A Metadata with `src`'s tables (a Snapshot's or another Metadata's) copied, sharing
        their records, and the given exchanges, permissions and access version."""
        md = cls(src.cluster_name)
        md.version = src.version
        md.members = dict(src.members)
        md.queues = dict(src.queues)
        md.exchanges = exchanges
        md.bindings = {x: list(b) for x, b in src.bindings.items()}
        md.exchange_bindings = {x: list(b) for x, b in src.exchange_bindings.items()}
        md.policies = dict(src.policies)
        md.down = dict(src.down)
        md.up = dict(src.up)
        md.times_down = dict(src.times_down)
        md.operator_policies = dict(src.operator_policies)
        md.managed_ha = src.managed_ha
        md.vhosts = {**md.vhosts, **src.vhosts}
        md.users = dict(src.users)
        md.permissions = permissions
        md.access_version = access_version
        return md

    def digest(self) -> str:
        """A short content hash: two nodes with equal version and digest agree."""
        return hashlib.sha1(_encoder.encode(self.snapshot())).hexdigest()[:12]

    # --- derived ---------------------------------------------------------------------------
    @property
    def routes(self) -> xmod.Routes:
        """The routing structures of this version (rebuilt lazily after every change)."""
        r = self._routes
        if r is None:
            r = self._routes = xmod.Routes(self.exchanges, self.bindings, self.queues,
                                           self.exchange_bindings, self.policies)
        return r

    # --- changes ---------------------------------------------------------------------------
    def apply(self, change: c.Change):
        """Validate and apply one change; bumps the version. Returns a change-specific value."""
        handler = _APPLY.get(type(change))
        if handler is None:
            raise MetaError(PRECONDITION_FAILED, f"unknown metadata change {type(change).__name__}")
        # the kinds that say which queues they touch start from none; any other may touch all
        self.touched = set() if change.names_its_queues else None
        try:
            value = handler(self, change)
        except BaseException:
            self.touched = None  # refused (nothing changed) or a bug: a pass over all is safe
            raise
        self.version += 1
        self._routes = None
        return value

    def _noop(self, change: c.Noop):
        return None

    # --- virtual hosts ---------------------------------------------------------------------
    def _vhost_add(self, change: c.VHostAdd):
        """Create a vhost with its built-in exchanges, or update its description and tracing
        flag (so a proposal retried after a leader change is harmless). The value: created."""
        vhost = change.vhost
        check_vhost_name(vhost.name)
        created = vhost.name not in self.vhosts
        self.vhosts[vhost.name] = vhost
        if created:
            self.exchanges.update(xmod.builtin_exchanges(vhost.name))
        return created

    def _vhost_delete(self, change: c.VHostDelete):
        """A vhost goes with everything in it. The value: the keys of the queues it held."""
        name = change.name
        if name == DEFAULT_VHOST:
            raise MetaError(PRECONDITION_FAILED, f"vhost '{name}' cannot be deleted")
        self.require_vhost(name)
        del self.vhosts[name]
        prefix = name + VHOST_SEP
        dropped = [k for k in self.queues if k.startswith(prefix)]
        for key in dropped:
            self._drop_queue(key)
        for table in (self.exchanges, self.bindings, self.policies, self.operator_policies):
            for key in [k for k in table if k.startswith(prefix)]:
                del table[key]
        gone = [k for k in self.permissions if k[0] == name]  # as RabbitMQ: its permissions too
        for key in gone:
            del self.permissions[key]
        if gone:
            self.access_version = self.version + 1
        return dropped

    def require_vhost(self, name: str) -> None:
        if name not in self.vhosts:
            raise MetaError(NOT_FOUND, f"vhost '{name}' does not exist")

    # --- members -------------------------------------------------------------------------------
    def _member_add(self, change: c.MemberAdd):
        self.members[change.name] = Member(change.peer, change.client)
        if not self.cluster_name:
            self.cluster_name = f"warren@{change.name}"
        return None

    def _member_remove(self, change: c.MemberRemove):
        name = change.name
        if name not in self.members:
            raise MetaError(NOT_FOUND, f"node {name!r} is not a member of the cluster")
        del self.members[name]
        self.down.pop(name, None)
        self.up.pop(name, None)
        for qname in [k for k, q in self.queues.items() if q.leader == name]:
            self._drop_queue(qname)
        for qname, q in self.queues.items():
            if name in q.mirrors:
                self.queues[qname] = msgspec.structs.replace(
                    q, mirrors=tuple(n for n in q.mirrors if n != name),
                    synced=tuple(n for n in q.synced if n != name))
        return None

    def _queue_declare(self, change: c.QueueDeclare):
        """Declare, or check an existing declaration is equivalent (a RabbitMQ-like
        precondition). The value: {"created": bool, "leader": the queue's leader}."""
        qdef = change.queue
        key = qdef.key
        existing = self.queues.get(key)
        if existing is None:
            self.require_vhost(qdef.vhost)
            if qdef.leader not in self.members:
                raise MetaError(NOT_FOUND, f"node {qdef.leader!r} is not a cluster member")
            self.queues[key] = qdef
            self._touch(key)
            return {"created": True, "leader": qdef.leader}
        check_equivalent(existing, qdef)
        return {"created": False, "leader": existing.leader}

    def _queue_delete(self, change: c.QueueDelete):
        """The queue goes; with `leader`, only if it is still led from that node. A client's
        delete (`requester`) is answered by its session when its node applies the change
        (broker/session.py `answer_delete`), so the answer does not depend on the queue's leader
        outliving the commit."""
        q = self.queues.get(change.name)
        if q is None or (change.leader is not None and q.leader != change.leader):
            return False
        self._drop_queue(change.name)
        return True

    def _drop_queue(self, name: str) -> None:
        """A queue goes, and its bindings with it (auto-delete exchanges left with no binding
        go too, as in RabbitMQ)."""
        del self.queues[name]
        self._touch(name)
        for x in [x for x, binds in self.bindings.items() if any(b.queue == name for b in binds)]:
            self.bindings[x] = [b for b in self.bindings[x] if b.queue != name]
            self._binding_gone(x)

    def _touch(self, queue: str) -> None:
        if self.touched is not None:
            self.touched.add(queue)

    def _binding_gone(self, exchange: str) -> None:
        """A binding with `exchange` as its source went: an auto-delete exchange left with none
        goes too."""
        for table in (self.bindings, self.exchange_bindings):
            if not table.get(exchange, True):
                del table[exchange]  # no empty list: an exchange listed here routes by its graph
        if exchange in self.bindings or exchange in self.exchange_bindings:
            return
        x = self.exchanges.get(exchange)
        if x is not None and x.auto_delete and x.name not in xmod.BUILTIN:
            del self.exchanges[exchange]

    # --- exchanges and bindings (idempotent: a proposal retried after a leader change is
    # harmless) ---------------------------------------------------------------------------
    def _exchange_declare(self, change: c.ExchangeDeclare):
        xdef = change.exchange
        existing = self.exchanges.get(xdef.key)
        if existing is None:
            self.require_vhost(xdef.vhost)
            self.exchanges[xdef.key] = xdef
            return {"created": True}
        xmod.check_equivalent(existing, xdef)
        return {"created": False}

    def _exchange_delete(self, change: c.ExchangeDelete):
        name = change.name
        if name not in self.exchanges:
            return False
        xmod.check_deletable(name)
        if change.if_unused and (self.bindings.get(name) or self.exchange_bindings.get(name)):
            raise MetaError(PRECONDITION_FAILED, f"{xmod.describe(name)} in use")
        del self.exchanges[name]
        self.bindings.pop(name, None)
        self.exchange_bindings.pop(name, None)
        # the exchange bindings it was the destination of go with it
        for source in [x for x, binds in self.exchange_bindings.items()
                       if any(b.destination == name for b in binds)]:
            self.exchange_bindings[source] = [b for b in self.exchange_bindings[source]
                                              if b.destination != name]
            self._binding_gone(source)
        return True

    def _check_binding(self, exchange: str, queue: str) -> None:
        xmod.check_bindable(exchange)
        if exchange not in self.exchanges:
            raise xmod.not_found(exchange)
        if queue not in self.queues:
            raise MetaError(NOT_FOUND, f"no {in_vhost('queue', queue)}")

    def _binding_add(self, change: c.BindingAdd):
        self._check_binding(change.exchange, change.binding.queue)
        binds = self.bindings.setdefault(change.exchange, [])
        if change.binding in binds:
            return False
        binds.append(change.binding)
        return True

    def _binding_remove(self, change: c.BindingRemove):
        self._check_binding(change.exchange, change.binding.queue)
        binds = self.bindings.get(change.exchange, [])
        if change.binding not in binds:
            return False
        binds.remove(change.binding)
        self._binding_gone(change.exchange)
        return True

    def _check_exchange_binding(self, source: str, destination: str) -> None:
        for name in (destination, source):  # RabbitMQ names the destination first
            xmod.check_bindable(name)
            if name not in self.exchanges:
                raise xmod.not_found(name)

    def _exchange_binding_add(self, change: c.ExchangeBindingAdd):
        self._check_exchange_binding(change.source, change.binding.destination)
        binds = self.exchange_bindings.setdefault(change.source, [])
        if change.binding in binds:
            return False
        binds.append(change.binding)
        return True

    def _exchange_binding_remove(self, change: c.ExchangeBindingRemove):
        self._check_exchange_binding(change.source, change.binding.destination)
        binds = self.exchange_bindings.get(change.source, [])
        if change.binding not in binds:
            return False
        binds.remove(change.binding)
        self._binding_gone(change.source)
        return True

    # --- placements ----------------------------------------------------------------------------
    def _apply_updates(self, updates: tuple[QueueUpdate, ...]) -> list[str]:
        """Place queues anew, or delete them. Returns the deleted names."""
        deleted = []
        for u in updates:
            q = self.queues.get(u.queue)
            if q is None:
                continue
            if u.placement is None:
                self._drop_queue(u.queue)
                deleted.append(u.queue)
            else:
                # a new record: replicas and sessions holding the old definition notice the
                # change by identity (`qp.qdef is not qdef`) or compare its epoch with the
                # current one
                self.queues[u.queue] = q.placed(u.placement)
                self._touch(u.queue)
        return deleted

    def _queues_update(self, change: c.QueuesUpdate):
        return self._apply_updates(change.updates)

    def _node_down(self, change: c.NodeDown):
        """Run `incarnation` of a member went down; its `updates` are the planner's promotions,
        deletions of non-durable queues and new mirror placements."""
        node = change.node
        if node in self.members and self.up.get(node) == change.incarnation:
            del self.up[node]
            self.down[node] = change.how
            self.times_down[node] = self.times_down.get(node, 0) + 1
        return self._apply_updates(change.updates)

    def _node_up(self, change: c.NodeUp):
        if change.node in self.members:
            self.down.pop(change.node, None)
            self.up[change.node] = change.incarnation
        return self._apply_updates(change.updates)

    def _policy_set(self, change: c.PolicySet):
        self.require_vhost(change.policy.vhost)
        self.policies[change.policy.key] = change.policy
        return self._apply_updates(change.updates)

    def _policy_clear(self, change: c.PolicyClear):
        if change.name not in self.policies:
            raise MetaError(NOT_FOUND, policy_not_found("policy", change.name))
        del self.policies[change.name]
        return self._apply_updates(change.updates)

    def _operator_policy_set(self, change: c.OperatorPolicySet):
        self.require_vhost(change.policy.vhost)
        self.operator_policies[change.policy.key] = change.policy
        return None

    def _operator_policy_clear(self, change: c.OperatorPolicyClear):
        if change.name not in self.operator_policies:
            raise MetaError(NOT_FOUND, policy_not_found("operator policy", change.name))
        del self.operator_policies[change.name]
        return None

    def _managed_ha_enable(self, change: c.ManagedHAEnable):
        self.managed_ha = True
        return None

    # --- users and permissions ---------------------------------------------------------------
    def access(self, user: str, vhost: str) -> Permission | None:
        """The user's permissions in the vhost; None when it has none (or no such user)."""
        if user not in self.users:
            return None
        return self.permissions.get((vhost, user))

    def _access_changed(self) -> None:
        self.access_version = self.version + 1  # the version this change is applied as

    def _need_user(self, name: str) -> None:
        if name not in self.users:
            raise MetaError(NOT_FOUND, f"user '{name}' does not exist")

    def _user_add(self, change: c.UserAdd):
        if change.user.name in self.users:
            raise MetaError(PRECONDITION_FAILED, f"user '{change.user.name}' already exists")
        self.users[change.user.name] = change.user
        self._access_changed()
        return None

    def _user_update(self, change: c.UserUpdate):
        self._need_user(change.user.name)
        self.users[change.user.name] = change.user
        self._access_changed()
        return None

    def _user_delete(self, change: c.UserDelete):
        self._need_user(change.name)
        del self.users[change.name]
        for key in [k for k in self.permissions if k[1] == change.name]:
            del self.permissions[key]
        self._access_changed()
        return None

    def _permission_set(self, change: c.PermissionSet):
        p = change.permission
        self._need_user(p.user)
        if p.vhost not in self.vhosts:
            raise MetaError(NOT_FOUND, f"vhost '{p.vhost}' does not exist")
        self.permissions[(p.vhost, p.user)] = p
        self._access_changed()
        return None

    def _permission_clear(self, change: c.PermissionClear):
        self._need_user(change.user)
        if change.vhost not in self.vhosts:
            raise MetaError(NOT_FOUND, f"vhost '{change.vhost}' does not exist")
        if self.permissions.pop((change.vhost, change.user), None) is not None:
            self._access_changed()
        return None


# each kind of change applied to the metadata, and its handler (the planner's requests,
# mirroring/planner.py `_PLAN`, have none: they are never committed)
_APPLY: dict[type[c.Change], Callable[[Metadata, c.Change], object]] = {
    c.Noop: Metadata._noop,
    c.VHostAdd: Metadata._vhost_add,
    c.VHostDelete: Metadata._vhost_delete,
    c.MemberAdd: Metadata._member_add,
    c.MemberRemove: Metadata._member_remove,
    c.QueueDeclare: Metadata._queue_declare,
    c.QueueDelete: Metadata._queue_delete,
    c.ExchangeDeclare: Metadata._exchange_declare,
    c.ExchangeDelete: Metadata._exchange_delete,
    c.BindingAdd: Metadata._binding_add,
    c.BindingRemove: Metadata._binding_remove,
    c.ExchangeBindingAdd: Metadata._exchange_binding_add,
    c.ExchangeBindingRemove: Metadata._exchange_binding_remove,
    c.QueuesUpdate: Metadata._queues_update,
    c.NodeDown: Metadata._node_down,
    c.NodeUp: Metadata._node_up,
    c.PolicySet: Metadata._policy_set,
    c.PolicyClear: Metadata._policy_clear,
    c.OperatorPolicySet: Metadata._operator_policy_set,
    c.OperatorPolicyClear: Metadata._operator_policy_clear,
    c.ManagedHAEnable: Metadata._managed_ha_enable,
    c.UserAdd: Metadata._user_add,
    c.UserUpdate: Metadata._user_update,
    c.UserDelete: Metadata._user_delete,
    c.PermissionSet: Metadata._permission_set,
    c.PermissionClear: Metadata._permission_clear,
}


def check_vhost_name(name: str) -> None:
    """A vhost's name: not empty, and without the character that joins it to names in keys."""
    if not name or VHOST_SEP in name:
        raise MetaError(PRECONDITION_FAILED, f"invalid vhost name {name!r}")


def policy_not_found(what: str, key: str) -> str:
    """RabbitMQ's text for clearing a policy that is not there."""
    vhost, name = split_key(key)
    return f"{what} '{name}' not found in vhost '{vhost}'"


def check_equivalent(existing: QueueDef, wanted: QueueDef) -> None:
    """Raise the RabbitMQ-style errors for a re-declare that does not match."""
    name = in_vhost("queue", existing.key)
    if existing.exclusive and wanted.owner != existing.owner:
        raise MetaError(
            RESOURCE_LOCKED,
            f"cannot obtain exclusive access to locked {name}. It could "
            "be originally declared on another connection or the exclusive property value does "
            "not match that of the original declaration.",
        )
    for prop in ("durable", "exclusive", "auto_delete"):
        if getattr(existing, prop) != getattr(wanted, prop):
            raise MetaError(
                PRECONDITION_FAILED,
                f"inequivalent arg '{prop}' for {name}: "
                f"received '{_fmt(getattr(wanted, prop))}' but current is "
                f"'{_fmt(getattr(existing, prop))}'",
            )
    old_args, new_args = existing.arguments, wanted.arguments
    for key in sorted(set(old_args) | set(new_args)):
        if old_args.get(key) != new_args.get(key):
            raise MetaError(
                PRECONDITION_FAILED,
                f"inequivalent arg '{key}' for {name}: "
                f"received {_fmt(new_args.get(key, 'none'))!r} but current is "
                f"{_fmt(old_args.get(key, 'none'))!r}",
            )
