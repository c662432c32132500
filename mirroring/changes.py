"""Every kind of change to the cluster metadata, as a typed message.

A change is a msgspec Struct tagged with its kind, `class NodeUp(Change, tag="node.up")`, like the
wire's messages (wire/schema.py): encoded as a msgpack array `[kind, field1, ...]`, and checked
field by field when it comes back in (`decode_change`, `decode_entries`). Changes are the entries
of the metadata log (mirroring/raft.py): they cross the peer wire in proposals and appends, and
are saved in the node's state file (broker/statefile.py).

Some kinds are requests only the log's leader turns into the changes it commits
(mirroring/planner.py: `Replan`, `QueueSynced`, `DropMirror`); the others are applied by every
node (mirroring/metadata.py). A new kind is one class here and its handler there, listed in that
module's table of handlers by type (`_APPLY`, or the planner's `_PLAN`). `names_its_queues`: applying it records in `Metadata.touched` every queue it creates,
changes or removes; the other kinds may change what any queue's replicas do (a member, a node's
run, a policy).

A change that names a queue, exchange or policy by a string names it by its key
(mirroring/records.py `qualify`: the plain name in the default vhost).
"""

from __future__ import annotations

import typing

import msgspec

from wire.errors import COMMAND_INVALID, SYNTAX_ERROR, ProtocolError

from .records import (Binding, DeleteRequester, Exchange, ExchangeBinding, Permission, Policy,
                      QueueDef, QueueUpdate, User, VHost)


class Change(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Base of every kind of metadata change; the tag is its kind."""

    names_its_queues: typing.ClassVar[bool] = False

    @property
    def kind(self) -> str:
        return self.__struct_config__.tag


class Noop(Change, tag="noop"):
    """A new log leader's first entry (it commits what came before)."""
    names_its_queues = True


class MemberAdd(Change, tag="member.add"):
    """A node joins (or a member's addresses changed). Changes the log's voters."""
    name: str
    peer: tuple[str, int]
    client: tuple[str, int]


class MemberRemove(Change, tag="member.remove"):
    """A member is forgotten. Changes the log's voters; the planner first moves its queues."""
    name: str


class VHostAdd(Change, tag="vhost.add"):
    """Create a virtual host (its built-in exchanges come with it), or change its description
    and tracing flag."""
    vhost: VHost


class VHostDelete(Change, tag="vhost.delete"):
    """Delete a virtual host and everything in it: queues (with their replicas on every node),
    exchanges, bindings, policies and operator policies."""
    names_its_queues = True
    name: str


class QueueDeclare(Change, tag="queue.declare"):
    """Declare a queue, or check an existing one is declared alike. Proposed with `queue.leader`
    the declaring node and `locator` that node's queue_leader_locator; the log's leader commits
    it with the queue placed (planner.plan_declare)."""
    names_its_queues = True
    queue: QueueDef
    locator: str = ""


class QueueDelete(Change, tag="queue.delete"):
    """Delete a queue; with `leader`, only if it is still led from that node. `requester`
    names a client's queue.delete, which its session answers when its node applies this."""
    names_its_queues = True
    name: str
    leader: str | None = None
    requester: DeleteRequester | None = None


class QueuesUpdate(Change, tag="queues.update"):
    """The planner's new placements (and deletions) of queues."""
    names_its_queues = True
    updates: tuple[QueueUpdate, ...]


class ExchangeDeclare(Change, tag="exchange.declare"):
    names_its_queues = True
    exchange: Exchange


class ExchangeDelete(Change, tag="exchange.delete"):
    names_its_queues = True
    name: str
    if_unused: bool = False


class BindingAdd(Change, tag="binding.add"):
    names_its_queues = True
    exchange: str
    binding: Binding


class BindingRemove(Change, tag="binding.remove"):
    names_its_queues = True
    exchange: str
    binding: Binding


class ExchangeBindingAdd(Change, tag="exchange_binding.add"):
    """exchange.bind: `binding.destination` takes what `source` routes with a matching key."""
    names_its_queues = True  # it names none: no queue's replicas change
    source: str
    binding: ExchangeBinding


class ExchangeBindingRemove(Change, tag="exchange_binding.remove"):
    """exchange.unbind (a binding that is not there is no error, as in RabbitMQ)."""
    names_its_queues = True
    source: str
    binding: ExchangeBinding


class NodeDown(Change, tag="node.down"):
    """Run `incarnation` of a member went down (`how`: "failure" or "shutdown"); `updates` are
    the planner's promotions, deletions of non-durable queues and new mirror placements."""
    node: str
    incarnation: int
    how: str = "failure"
    updates: tuple[QueueUpdate, ...] = ()


class NodeUp(Change, tag="node.up"):
    """Run `incarnation` of a member is running; `updates`: the planner's placements."""
    node: str
    incarnation: int
    updates: tuple[QueueUpdate, ...] = ()


class PolicySet(Change, tag="policy.set"):
    policy: Policy
    updates: tuple[QueueUpdate, ...] = ()


class PolicyClear(Change, tag="policy.clear"):
    name: str
    updates: tuple[QueueUpdate, ...] = ()


class OperatorPolicySet(Change, tag="operator_policy.set"):
    """An operator policy (limits only: no queue's replicas move, so no updates)."""
    policy: Policy


class OperatorPolicyClear(Change, tag="operator_policy.clear"):
    name: str


class ManagedHAEnable(Change, tag="managed_ha.enable"):
    """Turn on the managed HA (a node started with `managed_ha` proposes it). The log's leader
    commits it with the system policy and the HA keys of every user policy put in line."""


class UserAdd(Change, tag="user.add"):
    """A new user (refused if the name is taken)."""
    user: User


class UserUpdate(Change, tag="user.update"):
    """An existing user's new password hash or tags (refused if there is no such user)."""
    user: User


class UserDelete(Change, tag="user.delete"):
    """A user goes, and its permissions in every vhost with it."""
    name: str


class PermissionSet(Change, tag="permission.set"):
    """Set a user's permissions in a vhost (both must exist)."""
    permission: Permission


class PermissionClear(Change, tag="permission.clear"):
    user: str
    vhost: str


class Replan(Change, tag="replan"):
    """Request: bring every queue's placement in line (the leader's liveness check)."""


class QueueSynced(Change, tag="queue.synced"):
    """Request: the leader of `queue` in `epoch` reports which mirrors are synchronised."""
    queue: str
    epoch: int
    synced: tuple[str, ...]


class DropMirror(Change, tag="queue.drop_mirror"):
    """Request: the leader of `queue` in `epoch` drops its mirror on `node`."""
    queue: str
    epoch: int
    node: str


def _kinds(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_kinds(sub))
    return out


KINDS: dict[str, type[Change]] = {k.__struct_config__.tag: k for k in _kinds(Change)}
AnyChange = typing.Union[tuple(KINDS.values())]  # noqa: UP007
_Entries = list[tuple[int, AnyChange]]


def client_delete(queue: str, node: str, session: int, rid: int, count: int) -> QueueDelete:
    """The log change for a client's queue.delete: it names the request (the node and session
    that asked, the request id and the message count to answer with), so that session answers it
    when its node applies the change (`delete_asked_by`)."""
    return QueueDelete(queue, None, DeleteRequester(node, session, rid, count))


def delete_asked_by(change: Change, node: str) -> DeleteRequester | None:
    """The request of a client's queue.delete asked through `node` that `change` applies;
    None for any other change."""
    if type(change) is not QueueDelete or change.requester is None or change.requester.node != node:
        return None
    return change.requester


def _invalid(what: str, exc: msgspec.ValidationError, value) -> ProtocolError:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], str) \
            and value[0] not in KINDS:
        return ProtocolError(COMMAND_INVALID, f"unknown metadata change {value[0][:64]!r}")
    return ProtocolError(SYNTAX_ERROR, f"{what}: {exc}")


def decode_change(value) -> Change:
    """A change as it came off the wire (msgpack-decoded) -> its typed message, or
    ProtocolError. A typed change passes through."""
    try:
        return msgspec.convert(value, AnyChange)
    except msgspec.ValidationError as exc:
        raise _invalid("bad metadata change", exc, value) from None


def decode_entries(value) -> list[tuple[int, Change]]:
    """Log entries [[term, change], ...] as they came off the wire -> [(term, change)], or
    ProtocolError."""
    try:
        return msgspec.convert(value, _Entries)
    except msgspec.ValidationError as exc:
        raise ProtocolError(SYNTAX_ERROR, f"bad metadata log entries: {exc}") from None
