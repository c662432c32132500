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
    """A client's login, into virtual host `vhost`."""
    version: int
    user: str
    password: str
    client_name: str
    vhost: str


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

    redelivered lists the indexes (into bodies) whose redelivered flag is set. routes, set for
    warren's client only: nil when every message went through the default exchange with the
    queue's name, else parallel to bodies, each [exchange, routing_key] or nil for that."""
    ch: int
    consumer_tag: str
    first_tag: int
    bodies: list[bytes]
    redelivered: list[int]
    props: list | None
    routes: list | None


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


# --- exchanges and bindings (AMQP 0-9-1's, which warren's client speaks too) -----------------


@register
class PublishTo(Message, tag="publish.to"):
    """A batch of messages to an exchange with one routing key: routed on the node that
    received it (mirroring/exchanges.py) to every queue bound to match. `mandatory`: an
    unroutable message comes back as `Returned`. props is nil or parallel to bodies. From
    warren's client the front end (broker/native.py) puts each item in AMQP's form and reads
    `ttl` and `reply` from the properties itself."""
    ch: int
    exchange: str
    routing_key: str
    mandatory: bool
    bodies: list[bytes]
    props: list | None
    ttl: int | None  # the messages' `expiration` property, in ms (AMQP: one per batch)
    reply: bool  # they ask for direct reply-to (reply_to "amq.rabbitmq.reply-to")


@register
class Returned(Message, tag="returned"):
    """Mandatory messages no queue took (basic.return), sent before their confirm."""
    ch: int
    code: int
    text: str
    exchange: str
    routing_key: str
    bodies: list[bytes]
    props: list | None


@register
class ExchangeDeclare(Message, tag="exchange.declare"):
    rid: int
    ch: int
    exchange: str
    kind: str  # direct, fanout, topic or headers
    passive: bool
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: dict


@register
class ExchangeDelete(Message, tag="exchange.delete"):
    rid: int
    ch: int
    exchange: str
    if_unused: bool


@register
class QueueBind(Message, tag="queue.bind"):
    rid: int
    ch: int
    queue: str
    exchange: str
    routing_key: str
    arguments: dict


@register
class QueueUnbind(Message, tag="queue.unbind"):
    rid: int
    ch: int
    queue: str
    exchange: str
    routing_key: str
    arguments: dict


@register
class ExchangeBind(Message, tag="exchange.bind"):
    """Bind exchange `destination` to exchange `source` (messages `source` routes with a
    matching key go on to `destination`)."""
    rid: int
    ch: int
    destination: str
    source: str
    routing_key: str
    arguments: dict


@register
class ExchangeUnbind(Message, tag="exchange.unbind"):
    rid: int
    ch: int
    destination: str
    source: str
    routing_key: str
    arguments: dict


@register
class BasicRecover(Message, tag="basic.recover"):
    """Requeue every message delivered on the channel and not yet acknowledged."""
    rid: int
    ch: int
    requeue: bool


@register
class ChannelFlow(Message, tag="channel.flow"):
    """Pause (active=false) or resume deliveries to the channel's consumers."""
    rid: int
    ch: int
    active: bool


@register
class Blocked(Message, tag="connection.blocked"):
    """Server -> client: a memory alarm is on (here or on another node of the cluster) and the
    server no longer reads from this connection, because it publishes; `reason` says why.
    Sent to connections that have published; a connection that only consumes is still read."""
    reason: str


@register
class Unblocked(Message, tag="connection.unblocked"):
    """Server -> client: the alarm is over; the server reads from this connection again."""


@register
class ConnectionClose(Message, tag="connection.close"):
    """The client says goodbye; the server answers with Reply(rid) and closes."""
    rid: int


# --- peer protocol: links and the metadata log ------------------------------------------


@register
class Tick(Message, tag="tick"):
    """Heartbeat; any frame counts as a sign of life, ticks only fill silence."""


@register
class LinkHello(Message, tag="link.hello"):
    """First frame on a fresh peer link: which run of the node this is (a new `incarnation`
    every time its app starts, so a restart is never mistaken for the same node coming back)."""
    incarnation: int


@register
class MetaPropose(Message, tag="meta.propose"):
    """Ask the metadata log's leader to commit a change; answered with MetaResult once it is
    committed and applied there (or refused)."""
    rid: int
    change: list


@register
class MetaResult(Message, tag="meta.result"):
    """ok: `value` is the change's result. Not ok: `code` and `error` say why ("not-leader"
    means: ask again, the leader moved)."""
    rid: int
    ok: bool
    value: Any
    code: int
    error: str


@register
class NodeAlarm(Message, tag="node.alarm"):
    """The sending node's `resource` alarm ("memory") went on or off; `detail` says why (it goes
    into the blocked reason of the receiver's publishers). Sent whenever it changes and on every
    new link while it is on; a node forgets a peer's alarm when the link to it goes."""
    resource: str
    on: bool
    detail: str


@register
class NodePaused(Message, tag="node.paused"):
    """The sending node paused its clients under pause_minority (`paused`), or resumed them.
    Sent whenever that changes and on every new link while paused; a node forgets a peer's
    pause when the link to it goes. Only shown (the management API's nodes), never acted on."""
    paused: bool


@register
class NodeRpc(Message, tag="node.rpc"):
    """A node-to-node request (listings, sync commands, purge)."""
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


# --- queue operations: a client session -> the queue's leader ------------------------------
# `owner` is (node, session id, channel): where the replies and deliveries go.

Owner = tuple[str, int, int]


@register
class QPublish(Message, tag="q.publish"):
    """A batch of messages; `pseq` numbers the session's batches, so a batch resent to a new
    leader after a failover is recognised and not enqueued twice. `resent`: sent again after
    the route to the leader changed (the old leader may have delivered it). `epoch`: the leader
    epoch the sender's metadata named when it sent the batch."""
    queue: str
    owner: Owner
    pseq: int
    bodies: list[bytes]
    props: list | None
    resent: bool
    epoch: int
    ttl: int | None  # the messages' `expiration` property, in ms (None: none set)


@register
class QConsume(Message, tag="q.consume"):
    queue: str
    owner: Owner
    rid: int
    tag: str
    no_ack: bool
    prefetch: int
    exclusive: bool
    arguments: dict


@register
class QCancel(Message, tag="q.cancel"):
    queue: str
    owner: Owner
    rid: int
    tag: str


@register
class QGet(Message, tag="q.get"):
    queue: str
    owner: Owner
    rid: int
    no_ack: bool


ACK, REQUEUE, DISCARD, LACKED = 0, 1, 2, 3
# LACKED: requeue, from a consumer's node whose mirror lacked the bodies of a delivery its leader
# sent without them (mirroring/replica.py local_bodies); that leader sends the node's deliveries
# with their bodies from then on, until its mirror starts again


@register
class QSettle(Message, tag="q.settle"):
    """Acknowledge (how=ACK), requeue (REQUEUE, LACKED) or drop (DISCARD) delivered message ids."""
    queue: str
    owner: Owner
    how: int
    ids: list[int]


@register
class QOwnerGone(Message, tag="q.owner_gone"):
    """A channel closed: its consumers go and its unacknowledged messages are requeued."""
    queue: str
    owner: Owner


@register
class QSessionGone(Message, tag="q.session_gone"):
    """A client connection closed: all its channels are gone."""
    queue: str
    node: str
    sid: int


@register
class QPurge(Message, tag="q.purge"):
    queue: str
    owner: Owner
    rid: int


@register
class QDeclareOk(Message, tag="q.declare_ok"):
    """Answer a (re)declare with [name, messages, consumers]."""
    queue: str
    owner: Owner
    rid: int


@register
class QDelete(Message, tag="q.delete"):
    queue: str
    owner: Owner
    rid: int
    if_unused: bool
    if_empty: bool


# --- replication: a queue's leader <-> its mirrors ------------------------------------------
# Effects: what the leader did, applied by every mirror in the leader's order
# (mirroring/queue.py records them). One effect per call, never one per message.


class Effect(Message):
    """Base of the replicated effects (not top-level messages)."""


class EEnqueue(Effect, tag="enq"):
    """`ttl`: the batch's TTL in seconds (the queue's, or its messages' own expiration), or
    None; `at`: the deadline the leader gave it, on the leader's clock (a mirror moves it to its
    own clock by the batch's `RRep.now`, so a promoted mirror keeps the leader's deadlines)."""
    first: int
    bodies: list[bytes]
    props: list | None
    origin: tuple[str, int] | None
    pseq: int
    redelivered: bool
    ttl: float | None = None
    at: float | None = None


class EDrop(Effect, tag="drop"):
    """The leader dropped every ready message with an id up to `upto`: they `expired`
    (x-message-ttl: every id up to it has, so a requeued one is dropped too), or the queue was
    over its length limit (x-overflow drop-head)."""
    upto: int
    expired: bool


class EDeliver(Effect, tag="dlv"):
    """One dispatch round: [(owner, consumer tag, [ids]), ...], and the body bytes it took
    (`size`: a mirror that holds the same run need not add them up again; 0 when unknown)."""
    rounds: list[tuple[Owner, str, list[int]]]
    size: int = 0


class EGet(Effect, tag="get"):
    owner: Owner
    id: int
    no_ack: bool


class EDeadHead(Effect, tag="dlh"):
    """As EDrop (every ready message up to `upto` goes; `expired` as there), but the queue
    dead-letters them: the messages `ids` are held as unacknowledged by `holder`, its leader's
    node's dead-letter publisher, until the dead-letter exchange's queues confirm them."""
    upto: int
    expired: bool
    ids: list[int]
    holder: Owner


class EDropIds(Effect, tag="dri"):
    """A priority queue's x-overflow drop-head: the leader took the ready messages `ids` from
    the head in delivery order (its highest priority first, as RabbitMQ's priority queues
    drop), not up to an id; with a `holder` it dead-letters them, held as unacknowledged by
    `holder` as EDeadHead's are, else they are dropped."""
    ids: list[int]
    holder: Owner | None


class EDeadSettle(Effect, tag="dls"):
    """`owner` rejected `ids` without requeue and the queue dead-letters them: they pass to
    `holder` (see EDeadHead)."""
    owner: Owner
    ids: list[int]
    holder: Owner


class ESettle(Effect, tag="stl"):
    owner: Owner
    how: int
    ids: list[int]


class EConsume(Effect, tag="con"):
    owner: Owner
    tag: str
    no_ack: bool
    prefetch: int
    exclusive: bool
    arguments: dict


class ECancel(Effect, tag="can"):
    owner: Owner
    tag: str


class EOwnerGone(Effect, tag="og"):
    owner: Owner


class ESessionGone(Effect, tag="sg"):
    node: str
    sid: int


class ENodeGone(Effect, tag="ng"):
    """Every owner on `node` is gone; `forget_publishers`: its sessions will not come back (the
    node is down in the metadata), so their de-duplication marks go too. `run`: only the
    sessions of this run of the node (its incarnation) are gone; 0: those of every run."""
    node: str
    forget_publishers: bool
    run: int = 0


class EPurge(Effect, tag="pur"):
    pass


class EFailover(Effect, tag="fo"):
    """A new leader took over: every unacknowledged message is requeued, and every message
    below `redeliver_below` is delivered with the redelivered flag (the old leader may have
    delivered it already)."""
    redeliver_below: int


AnyEffect = EEnqueue | EDeliver | EGet | ESettle | EConsume | ECancel | EOwnerGone | \
    ESessionGone | ENodeGone | EPurge | EFailover | EDrop | EDeadHead | EDropIds | EDeadSettle


@register
class RMirrorStart(Message, tag="r.mirror_start"):
    """Leader -> new mirror: follow me from batch `seq` + 1. `snapshot` holds the consumers,
    unacknowledged ids and publish marks (not the messages: those come by sync, or the mirror
    starts empty). `resume` (a promotion): [old epoch, old seq, base id, synced upto] - a
    mirror that applied exactly what the new leader applied keeps its contents."""
    queue: str
    epoch: int
    leader: str
    snapshot: dict
    resume: list | None
    seq: int


@register
class RMirrorReady(Message, tag="r.mirror_ready"):
    """Mirror -> leader: I follow epoch `epoch`; I hold every message from `start_id` on, and
    the old ones up to `synced_upto`."""
    queue: str
    epoch: int
    node: str
    start_id: int
    synced_upto: int
    resumed: bool
    since: int  # the `seq` of the RMirrorStart this answers


@register
class RRep(Message, tag="r.rep"):
    """Leader -> mirror: replication batch number `seq` of this epoch, sent at `now` on the
    leader's clock."""
    queue: str
    epoch: int
    seq: int
    effects: list[AnyEffect]
    now: float


@register
class RRepOk(Message, tag="r.rep_ok"):
    """Mirror -> leader: I have applied every batch up to `seq`."""
    queue: str
    epoch: int
    node: str
    seq: int


@register
class RMirrorReset(Message, tag="r.mirror_reset"):
    """Mirror -> leader: a batch went missing; start me again."""
    queue: str
    epoch: int
    node: str


@register
class RSyncBatch(Message, tag="r.sync_batch"):
    """Leader -> mirror: batch `n` of a sync: messages [id, body, props, redelivered] older than
    the mirror's start, in id order, covering every id up to `upto`."""
    queue: str
    epoch: int
    n: int
    messages: list
    upto: int


@register
class RSyncOk(Message, tag="r.sync_ok"):
    queue: str
    epoch: int
    node: str
    n: int
    upto: int


@register
class RSyncEnd(Message, tag="r.sync_end"):
    """The sync is over; `completed`: the mirror now holds everything the leader holds."""
    queue: str
    epoch: int
    completed: bool


# --- events: a queue -> a client session -----------------------------------------------------


class Event(Message):
    """Base of the events a queue sends to a client session."""


class EvDeliver(Event, tag="deliver"):
    """Deliveries for one consumer; `redelivered` lists indexes into ids/bodies; `epoch` is the
    leader epoch that sent them (a session drops what a deposed leader sent late)."""
    ch: int
    tag: str
    queue: str
    ids: list[int]
    bodies: list[bytes]
    redelivered: list[int]
    props: list | None
    epoch: int


class EvAccepted(Event, tag="accepted"):
    """Every publish batch of this session up to `pseq` is on every mirror: confirm it."""
    queue: str
    pseq: int


class EvRejected(Event, tag="rejected"):
    """Messages of publish batch `pseq` (their indexes in the batch) that the queue refused
    (x-overflow reject-publish on a full queue): nack them, whatever the rest of the batch."""
    queue: str
    pseq: int
    indexes: list[int]


class EvReply(Event, tag="reply"):
    rid: int
    value: Any


class EvFail(Event, tag="fail"):
    rid: int
    ch: int
    code: int
    text: str


class EvConsumeOk(Event, tag="consume_ok"):
    ch: int
    rid: int
    tag: str
    queue: str
    no_ack: bool


class EvGetOk(Event, tag="get_ok"):
    """`msg` is [id, body, props, redelivered] or None (the queue was empty)."""
    ch: int
    rid: int
    queue: str
    msg: list | None
    remaining: int


class EvCancelled(Event, tag="cancelled"):
    ch: int
    tag: str
    queue: str
    reason: str


class EvDirectReply(Event, tag="direct_reply"):
    """Replies published to a direct reply-to name (`amq.rabbitmq.reply-to.<token>`), for the
    reply consumer of channel `ch` if its `key` is still the channel's. `rid` (not 0): the
    publishing session, `sender` (node, session), waits for `EvReplyTaken` to confirm them or
    return them."""
    ch: int
    key: str
    routing_key: str
    bodies: list[bytes]
    props: list | None
    rid: int = 0
    sender: tuple[str, int] | None = None


class EvReplyTaken(Event, tag="reply_taken"):
    """The answer to an `EvDirectReply` with a rid: `taken` false, there was no such consumer."""
    rid: int
    taken: bool


AnyEvent = EvDeliver | EvAccepted | EvReply | EvFail | EvConsumeOk | EvGetOk | EvCancelled | \
    EvRejected | EvDirectReply | EvReplyTaken


@register
class ToSession(Message, tag="to.session"):
    """Events for client session `sid` on the receiving node."""
    sid: int
    events: list[AnyEvent]


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
    """Entries [[term, change], ...] following prev_index; an empty list is a heartbeat.
    `sent`: the leader's clock when it sent this; `echo`: the follower's own clock from the
    latest reply the leader had from it (so the follower knows how fresh the word is, whatever
    waited in a socket: mirroring/raft.py `in_step`)."""
    term: int
    prev_index: int
    prev_term: int
    entries: list
    commit: int
    sent: float
    echo: float


@register
class RaftAppendReply(Message, tag="raft.append.reply"):
    """ok: the follower's log matches up to `index`. Not ok: retry from `index`. `sent`: the
    follower's clock when it answered; `echo`: the leader's clock from the append answered."""
    term: int
    ok: bool
    index: int
    sent: float
    echo: float


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
