"""Every message kind of the client protocol, the peer protocol and the control protocol.

Naming: client requests that expect an answer carry `rid` (request id) and get `Reply` or
`Fail` with the same rid. Hot-path messages (Publish, Deliver, Ack, Nack, Confirm) carry
batches, never a single message when more are ready: bodies as parallel arrays, acks and
confirms as tag lists and ranges.
"""

from __future__ import annotations

from typing import Any

from .schema import Message, register

PROTOCOL_VERSION = 1

# --- handshake (both ports) ---------------------------------------------------------------


@register
class Hello(Message, tag="hello"):
    """Server -> connecting side, first frame on either port."""
    version: int
    node: str
    nonce: bytes
    max_frame: int


@register
class ClientAuth(Message, tag="client.auth"):
    version: int
    user: str
    password: str
    client_name: str


@register
class Welcome(Message, tag="welcome"):
    """Server accepted a client."""
    node: str
    cluster: str
    max_frame: int


@register
class PeerAuth(Message, tag="peer.auth"):
    """A node (role "peer") or warrenctl (role "ctl") proves the cluster secret."""
    version: int
    node: str
    role: str
    proof: bytes
    nonce: bytes


@register
class PeerWelcome(Message, tag="peer.welcome"):
    """The accepting node proves the secret back, so both sides are authenticated."""
    node: str
    proof: bytes


@register
class Error(Message, tag="error"):
    """Connection-level error; the sender closes the connection after it."""
    code: int
    text: str


# --- client protocol --------------------------------------------------------------------


@register
class Reply(Message, tag="reply"):
    rid: int
    value: Any


@register
class Fail(Message, tag="fail"):
    """A request failed. If ch != 0 the channel is closed, like an AMQP channel exception."""
    rid: int
    ch: int
    code: int
    text: str


@register
class ChannelOpen(Message, tag="channel.open"):
    rid: int
    ch: int


@register
class ChannelClose(Message, tag="channel.close"):
    rid: int
    ch: int


@register
class ChannelClosed(Message, tag="channel.closed"):
    """Server closed a channel on its own (e.g. an ack for an unknown delivery tag)."""
    ch: int
    code: int
    text: str


@register
class QueueDeclare(Message, tag="queue.declare"):
    rid: int
    ch: int
    queue: str
    passive: bool
    durable: bool
    exclusive: bool
    auto_delete: bool
    arguments: dict


@register
class QueueDelete(Message, tag="queue.delete"):
    rid: int
    ch: int
    queue: str
    if_unused: bool
    if_empty: bool


@register
class QueuePurge(Message, tag="queue.purge"):
    rid: int
    ch: int
    queue: str


@register
class BasicQos(Message, tag="basic.qos"):
    rid: int
    ch: int
    prefetch_count: int
    global_qos: bool


@register
class ConfirmSelect(Message, tag="confirm.select"):
    rid: int
    ch: int


@register
class TxSelect(Message, tag="tx.select"):
    """Put the channel in transaction mode: publishes and acks wait for tx.commit."""
    rid: int
    ch: int


@register
class TxCommit(Message, tag="tx.commit"):
    """Apply the channel's pending publishes and acks; answered once every mirror has them."""
    rid: int
    ch: int


@register
class TxRollback(Message, tag="tx.rollback"):
    rid: int
    ch: int


@register
class Publish(Message, tag="publish"):
    """A batch of messages for one queue (the default exchange: routing key = queue name).

    props is nil or an array parallel to bodies whose items are nil or a properties map."""
    ch: int
    queue: str
    bodies: list[bytes]
    props: list | None


@register
class Confirm(Message, tag="confirm"):
    """Publisher confirms for channel ch: inclusive [first, last] sequence-number ranges."""
    ch: int
    acks: list[list[int]]
    nacks: list[list[int]]
    reason: str


@register
class BasicConsume(Message, tag="basic.consume"):
    rid: int
    ch: int
    queue: str
    consumer_tag: str
    no_ack: bool
    exclusive: bool
    arguments: dict


@register
class BasicCancel(Message, tag="basic.cancel"):
    rid: int
    ch: int
    consumer_tag: str


@register
class Cancelled(Message, tag="cancelled"):
    """The server cancelled a consumer (its queue was deleted, its node went down, failover)."""
    ch: int
    consumer_tag: str
    reason: str


@register
class Deliver(Message, tag="deliver"):
    """Deliveries for one consumer: delivery tags first_tag, first_tag+1, ...

    redelivered lists the indexes (into bodies) whose redelivered flag is set."""
    ch: int
    consumer_tag: str
    first_tag: int
    bodies: list[bytes]
    redelivered: list[int]
    props: list | None


@register
class BasicGet(Message, tag="basic.get"):
    rid: int
    ch: int
    queue: str
    no_ack: bool


@register
class Ack(Message, tag="ack"):
    """Acknowledge the listed delivery tags, and every tag <= multiple_upto when it is > 0."""
    ch: int
    tags: list[int]
    multiple_upto: int


@register
class Nack(Message, tag="nack"):
    """Negatively acknowledge (reject) the listed tags and, if multiple_upto > 0, all up to it."""
    ch: int
    tags: list[int]
    multiple_upto: int
    requeue: bool


@register
class ConnectionClose(Message, tag="connection.close"):
    """The client says goodbye; the server answers with Reply(rid) and closes."""
    rid: int


# --- peer protocol ------------------------------------------------------------------------


@register
class Tick(Message, tag="tick"):
    """Heartbeat; any frame counts as a sign of life, ticks only fill silence."""


@register
class MetaPropose(Message, tag="meta.propose"):
    """Ask the coordinator to apply a metadata change; answered with MetaResult."""
    rid: int
    change: list


@register
class MetaResult(Message, tag="meta.result"):
    rid: int
    ok: bool
    value: Any
    error: str


@register
class MetaApply(Message, tag="meta.apply"):
    """The coordinator's ordered change number `version`."""
    version: int
    change: list


@register
class MetaSnapshot(Message, tag="meta.snapshot"):
    """Full metadata, sent on link-up by the side that has the authoritative copy."""
    state: dict


@register
class LinkHello(Message, tag="link.hello"):
    """First frame on a fresh peer link: my metadata's authority key, version and digest.

    The side with the higher key sends its MetaSnapshot; the other adopts it."""
    key: list
    version: int
    digest: str


@register
class ToQueue(Message, tag="to.queue"):
    """An operation for the replica of `queue` that lives on the receiving node."""
    queue: str
    op: list


@register
class ToSession(Message, tag="to.session"):
    """Events (a batch of ops) for client session `sid` on the receiving node."""
    sid: int
    ops: list


@register
class NodeRpc(Message, tag="node.rpc"):
    """A node-to-node request (e.g. declare a queue on its leader's node)."""
    rid: int
    name: str
    args: dict


@register
class NodeRpcReply(Message, tag="node.rpc.reply"):
    rid: int
    ok: bool
    value: Any
    code: int
    error: str


# --- control protocol (warrenctl, role "ctl" on the peer port) ----------------------------


@register
class CtlCommand(Message, tag="ctl.command"):
    rid: int
    command: str
    args: dict


@register
class CtlReply(Message, tag="ctl.reply"):
    rid: int
    ok: bool
    value: Any
    error: str


# --- the metadata log (Raft, mirroring/raft.py) -------------------------------------------


@register
class RaftVote(Message, tag="raft.vote"):
    """Ask for a vote in `term` (pre: only ask whether a vote would be granted; transfer: the
    leader handed over, so do not ignore it for having heard from that leader lately)."""
    term: int
    last_index: int
    last_term: int
    pre: bool
    transfer: bool


@register
class RaftVoteReply(Message, tag="raft.vote.reply"):
    term: int
    granted: bool
    pre: bool


@register
class RaftAppend(Message, tag="raft.append"):
    """Entries [[term, change], ...] following prev_index; an empty list is a heartbeat."""
    term: int
    prev_index: int
    prev_term: int
    entries: list
    commit: int


@register
class RaftAppendReply(Message, tag="raft.append.reply"):
    """ok: the follower's log matches up to `index`. Not ok: retry from `index`."""
    term: int
    ok: bool
    index: int


@register
class RaftSnapshot(Message, tag="raft.snapshot"):
    """The leader's compacted state up to `index` (a follower too far behind takes it whole)."""
    term: int
    index: int
    last_term: int
    config: list[str]
    data: dict


@register
class RaftTimeoutNow(Message, tag="raft.timeout_now"):
    """Leadership transfer: start an election at once."""
    term: int
