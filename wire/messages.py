"""Every message kind of the client protocol, the peer protocol and the control protocol.

Naming: client requests that expect an answer carry `rid` (request id) and get `Reply` or
`Fail` with the same rid. Hot-path messages (Publish, Deliver, Ack, Nack, Confirm) carry
batches, never a single message when more are ready: bodies as parallel arrays, acks and
confirms as tag lists and ranges.
"""

from __future__ import annotations

from typing import Any

from .schema import message

PROTOCOL_VERSION = 1

# --- handshake (both ports) ---------------------------------------------------------------


@message("hello")
class Hello:
    """Server -> connecting side, first frame on either port."""
    version: int
    node: str
    nonce: bytes
    max_frame: int


@message("client.auth")
class ClientAuth:
    version: int
    user: str
    password: str
    client_name: str


@message("welcome")
class Welcome:
    """Server accepted a client."""
    node: str
    cluster: str
    max_frame: int


@message("peer.auth")
class PeerAuth:
    """A node (role "peer") or warrenctl (role "ctl") proves the cluster secret."""
    version: int
    node: str
    role: str
    proof: bytes
    nonce: bytes


@message("peer.welcome")
class PeerWelcome:
    """The accepting node proves the secret back, so both sides are authenticated."""
    node: str
    proof: bytes


@message("error")
class Error:
    """Connection-level error; the sender closes the connection after it."""
    code: int
    text: str


# --- client protocol --------------------------------------------------------------------


@message("reply")
class Reply:
    rid: int
    value: Any


@message("fail")
class Fail:
    """A request failed. If ch != 0 the channel is closed, like an AMQP channel exception."""
    rid: int
    ch: int
    code: int
    text: str


@message("channel.open")
class ChannelOpen:
    rid: int
    ch: int


@message("channel.close")
class ChannelClose:
    rid: int
    ch: int


@message("channel.closed")
class ChannelClosed:
    """Server closed a channel on its own (e.g. an ack for an unknown delivery tag)."""
    ch: int
    code: int
    text: str


@message("queue.declare")
class QueueDeclare:
    rid: int
    ch: int
    queue: str
    passive: bool
    durable: bool
    exclusive: bool
    auto_delete: bool
    arguments: dict


@message("queue.delete")
class QueueDelete:
    rid: int
    ch: int
    queue: str
    if_unused: bool
    if_empty: bool


@message("queue.purge")
class QueuePurge:
    rid: int
    ch: int
    queue: str


@message("basic.qos")
class BasicQos:
    rid: int
    ch: int
    prefetch_count: int
    global_qos: bool


@message("confirm.select")
class ConfirmSelect:
    rid: int
    ch: int


@message("tx.select")
class TxSelect:
    """Put the channel in transaction mode: publishes and acks wait for tx.commit."""
    rid: int
    ch: int


@message("tx.commit")
class TxCommit:
    """Apply the channel's pending publishes and acks; answered once every mirror has them."""
    rid: int
    ch: int


@message("tx.rollback")
class TxRollback:
    rid: int
    ch: int


@message("publish")
class Publish:
    """A batch of messages for one queue (the default exchange: routing key = queue name).

    props is nil or an array parallel to bodies whose items are nil or a properties map."""
    ch: int
    queue: str
    bodies: list[bytes]
    props: list | None


@message("confirm")
class Confirm:
    """Publisher confirms for channel ch: inclusive [first, last] sequence-number ranges."""
    ch: int
    acks: list[list[int]]
    nacks: list[list[int]]
    reason: str


@message("basic.consume")
class BasicConsume:
    rid: int
    ch: int
    queue: str
    consumer_tag: str
    no_ack: bool
    exclusive: bool
    arguments: dict


@message("basic.cancel")
class BasicCancel:
    rid: int
    ch: int
    consumer_tag: str


@message("cancelled")
class Cancelled:
    """The server cancelled a consumer (its queue was deleted, its node went down, failover)."""
    ch: int
    consumer_tag: str
    reason: str


@message("deliver")
class Deliver:
    """Deliveries for one consumer: delivery tags first_tag, first_tag+1, ...

    redelivered lists the indexes (into bodies) whose redelivered flag is set."""
    ch: int
    consumer_tag: str
    first_tag: int
    bodies: list[bytes]
    redelivered: list[int]
    props: list | None


@message("basic.get")
class BasicGet:
    rid: int
    ch: int
    queue: str
    no_ack: bool


@message("ack")
class Ack:
    """Acknowledge the listed delivery tags, and every tag <= multiple_upto when it is > 0."""
    ch: int
    tags: list[int]
    multiple_upto: int


@message("nack")
class Nack:
    """Negatively acknowledge (reject) the listed tags and, if multiple_upto > 0, all up to it."""
    ch: int
    tags: list[int]
    multiple_upto: int
    requeue: bool


@message("connection.close")
class ConnectionClose:
    """The client says goodbye; the server answers with Reply(rid) and closes."""
    rid: int


# --- peer protocol ------------------------------------------------------------------------


@message("tick")
class Tick:
    """Heartbeat; any frame counts as a sign of life, ticks only fill silence."""


@message("meta.propose")
class MetaPropose:
    """Ask the coordinator to apply a metadata change; answered with MetaResult."""
    rid: int
    change: list


@message("meta.result")
class MetaResult:
    rid: int
    ok: bool
    value: Any
    error: str


@message("meta.apply")
class MetaApply:
    """The coordinator's ordered change number `version`."""
    version: int
    change: list


@message("meta.snapshot")
class MetaSnapshot:
    """Full metadata, sent on link-up by the side that has the authoritative copy."""
    state: dict


@message("link.hello")
class LinkHello:
    """First frame on a fresh peer link: my metadata's authority key, version and digest.

    The side with the higher key sends its MetaSnapshot; the other adopts it."""
    key: list
    version: int
    digest: str


@message("to.queue")
class ToQueue:
    """An operation for the replica of `queue` that lives on the receiving node."""
    queue: str
    op: list


@message("to.session")
class ToSession:
    """Events (a batch of ops) for client session `sid` on the receiving node."""
    sid: int
    ops: list


@message("node.rpc")
class NodeRpc:
    """A node-to-node request (e.g. declare a queue on its leader's node)."""
    rid: int
    name: str
    args: dict


@message("node.rpc.reply")
class NodeRpcReply:
    rid: int
    ok: bool
    value: Any
    code: int
    error: str


# --- control protocol (warrenctl, role "ctl" on the peer port) ----------------------------


@message("ctl.command")
class CtlCommand:
    rid: int
    command: str
    args: dict


@message("ctl.reply")
class CtlReply:
    rid: int
    ok: bool
    value: Any
    error: str


# --- the metadata log (Raft, mirroring/raft.py) -------------------------------------------


@message("raft.vote")
class RaftVote:
    """Ask for a vote in `term` (pre: only ask whether a vote would be granted; transfer: the
    leader handed over, so do not ignore it for having heard from that leader lately)."""
    term: int
    last_index: int
    last_term: int
    pre: bool
    transfer: bool


@message("raft.vote.reply")
class RaftVoteReply:
    term: int
    granted: bool
    pre: bool


@message("raft.append")
class RaftAppend:
    """Entries [[term, change], ...] following prev_index; an empty list is a heartbeat."""
    term: int
    prev_index: int
    prev_term: int
    entries: list
    commit: int


@message("raft.append.reply")
class RaftAppendReply:
    """ok: the follower's log matches up to `index`. Not ok: retry from `index`."""
    term: int
    ok: bool
    index: int


@message("raft.snapshot")
class RaftSnapshot:
    """The leader's compacted state up to `index` (a follower too far behind takes it whole)."""
    term: int
    index: int
    last_term: int
    config: list[str]
    data: dict


@message("raft.timeout_now")
class RaftTimeoutNow:
    """Leadership transfer: start an election at once."""
    term: int
