"""The records of the cluster metadata: virtual hosts, members, queue definitions, exchanges,
bindings, policies, users and their permissions, and the planner's decisions about where a
queue's replicas are; and the keys (`qualify`) that name a queue, exchange or policy of a vhost
in the tables and messages.

Every record is an immutable msgspec Struct. They are read by attribute and never changed in
place: a change to a queue replaces its definition with a new one (`msgspec.structs.replace`),
so a copy of the metadata shares its records with the original and copying costs one pointer
per record (the log's leader copies the metadata to plan on, mirroring/metadata.py `copy`), and
replicas and sessions holding an old definition notice the change by identity.

They cross the peer wire inside the log's changes (mirroring/changes.py) and are saved in the
state file and in snapshots: msgspec encodes them as msgpack maps and checks their fields on the
way back in.
"""

from __future__ import annotations

import msgspec

DEFAULT_VHOST = "/"
# joins a vhost to a name in the tables' keys: refused in every name and vhost name, so a key
# of another vhost never equals a name of the default vhost
VHOST_SEP = "\x00"


def qualify(vhost: str, name: str) -> str:
    """The key of `name` in `vhost` in the metadata's tables and in every message that names a
    queue: the plain name in the default vhost (so its state and messages are the same as when
    warren had one vhost), `vhost` NUL `name` in any other."""
    return name if vhost == DEFAULT_VHOST else vhost + VHOST_SEP + name


def split_key(key: str) -> tuple[str, str]:
    """(vhost, name) of a key made by `qualify`."""
    vhost, sep, name = key.partition(VHOST_SEP)
    return (vhost, name) if sep else (DEFAULT_VHOST, key)


def shown(key: str) -> str:
    """A key as a listing shows it: the name in the default vhost, "name (vhost v)" in another."""
    vhost, name = split_key(key)
    return name if vhost == DEFAULT_VHOST else f"{name} (vhost {vhost})"


def named(key: str) -> dict:
    """{"queue": name, "vhost": vhost} of a queue's key: the fields that name it in a structured
    log line or an event, as RabbitMQ names a queue by both."""
    vhost, name = split_key(key)
    return {"queue": name, "vhost": vhost}


def in_vhost(what: str, key: str) -> str:
    """"queue 'q' in vhost 'v'" for a key (RabbitMQ's way of naming a resource)."""
    vhost, name = split_key(key)
    return f"{what} '{name}' in vhost '{vhost}'"


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every metadata record."""


class VHost(Record):
    """A virtual host: queues, exchanges, bindings and policies live in one."""
    name: str
    description: str = ""
    tracing: bool = False


class Member(Record):
    """A cluster member's addresses: `peer` (peer and control port) and `client`."""
    peer: tuple[str, int]
    client: tuple[str, int]


class QueueDef(Record):
    """A queue's definition and where its replicas are.

    leader   the node of the leader replica
    mirrors  mirror nodes, oldest first (the order in which they were added)
    synced   the mirrors known to be synchronised
    epoch    increases whenever the leader replica changes (promotion, hand-over, restart), so
             replication messages of an old leader are recognised and ignored
    owner    the connection (`node/session`) that owns an exclusive queue, None otherwise
    vhost    the virtual host it lives in; `key` names it in the tables and messages
    """
    name: str
    durable: bool
    exclusive: bool
    auto_delete: bool
    arguments: dict
    leader: str
    owner: str | None = None
    mirrors: tuple[str, ...] = ()
    synced: tuple[str, ...] = ()
    epoch: int = 1
    vhost: str = DEFAULT_VHOST

    @property
    def key(self) -> str:
        return qualify(self.vhost, self.name)

    def placed(self, p: Placement) -> QueueDef:
        """This definition with its replicas where `p` says (a new record)."""
        return msgspec.structs.replace(self, leader=p.leader, mirrors=p.mirrors, synced=p.synced,
                                       epoch=p.epoch)


class Placement(Record, array_like=True):
    """Where one queue's replicas are: the planner's decision (see QueueDef for the fields)."""
    leader: str
    mirrors: tuple[str, ...]
    synced: tuple[str, ...]
    epoch: int


class QueueUpdate(Record, array_like=True):
    """The planner's word on one queue: its new placement, or None: it is deleted."""
    queue: str
    placement: Placement | None


class Exchange(Record):
    """An exchange's definition (`type`: direct, fanout, topic or headers)."""
    name: str
    type: str
    durable: bool = False
    auto_delete: bool = False
    internal: bool = False
    arguments: dict = {}
    vhost: str = DEFAULT_VHOST

    @property
    def key(self) -> str:
        return qualify(self.vhost, self.name)


class Binding(Record, array_like=True):
    """A queue bound to an exchange (the exchange is the key it is filed under). Both are in
    one vhost, the exchange's: `queue` is the queue's key (`qualify`)."""
    queue: str
    key: str
    arguments: dict


class ExchangeBinding(Record, array_like=True):
    """An exchange bound to an exchange (`exchange.bind`): messages the source (the exchange it
    is filed under) routes with a matching key go on to `destination`."""
    destination: str
    key: str
    arguments: dict


class Policy(Record):
    """A validated policy (mirroring/policy.py `make_policy` builds them; `make_operator_policy`
    builds operator policies). `set_by`: "user"; "managed-ha" for the managed HA's system policy;
    "user+managed-ha" for a user's policy whose HA keys the managed HA added or replaced."""
    name: str
    pattern: str
    definition: dict
    priority: int
    apply_to: str
    set_by: str = "user"
    vhost: str = DEFAULT_VHOST

    @property
    def key(self) -> str:
        return qualify(self.vhost, self.name)


class DeleteRequester(Record, array_like=True):
    """Who asked for a client's queue.delete: the session on `node` that answers request `rid`
    with the message count `count` when its node applies the deletion."""
    node: str
    session: int
    rid: int
    count: int


class User(Record):
    """A user: `password_hash` as mirroring/access.py `hash_password` makes it (never the
    password), and its management tags (administrator, monitoring, policymaker, management)."""
    name: str
    password_hash: str
    tags: tuple[str, ...] = ()


class Permission(Record):
    """What `user` may do in `vhost`: three regular expressions over resource names
    (mirroring/access.py)."""
    user: str
    vhost: str
    configure: str
    write: str
    read: str


class Snapshot(Record):
    """The whole metadata at one version: what the log keeps in place of the changes it has
    compacted, and what a follower too far behind is sent."""
    version: int
    cluster_name: str
    members: dict[str, Member]
    queues: dict[str, QueueDef]
    exchanges: dict[str, Exchange]
    bindings: dict[str, list[Binding]]
    policies: dict[str, Policy]
    down: dict[str, str]
    up: dict[str, int]
    times_down: dict[str, int]
    operator_policies: dict[str, Policy] = {}
    managed_ha: bool = False
    vhosts: dict[str, VHost] = {}
    users: dict[str, User] = {}
    permissions: list[Permission] = []
    exchange_bindings: dict[str, list[ExchangeBinding]] = {}
