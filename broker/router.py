"""Routing on one node: where queue operations, replication and session events go, and which
queue replicas this node runs.

* A client operation goes to the queue's leader: the local replica's inbox, or the peer link to
  the leader's node. Replication goes replica to replica; events go to the session (local inbox
  or link). Nothing here waits on a queue: inboxes never block, and publishers are held by their
  sessions' credit window instead (so one busy queue cannot stall a peer link).
* `reconcile` keeps the replicas in line with the metadata after every applied change (once the
  log has recorded this run of the node up: nothing before that is about this run): it starts
  a replica where the metadata places one, tells each what the metadata says now (`Assign`), and
  stops those that should not run here. Members the log records down get `NodeGone`; a peer link
  that breaks gets `LinkDown` (its sessions are gone for us; its mirrors must be dropped through
  the metadata); one replaced by a second link to the same node gets `LinkReplaced` (what was in
  flight on the first may be lost).
* An operation for a queue this node has not heard of yet (its metadata is a moment behind the
  sender's) waits a few seconds for the declaration, then fails with NOT_FOUND. So does the
  leader's replication that a replica stopped for its queue moving away had not handled: it is
  for the mirror the metadata places here next, if any (`_take_back_mirror_input`).
* A leader replica asks `may_deliver` every round: it hands out deliveries and confirms only
  while this node is in step with the metadata log (or the only node recorded running); the
  ones that held are woken when the log says the node is in step again (`in_step`).
* The sessions' side of the same rule: what peers send this node's sessions is handed on only
  while the node is in step, and held (in order) otherwise. A node woken from a freeze reads
  first what waited in its sockets, deliveries among it; if the log counted this run of the
  node down meanwhile, their leaders requeued them, flagged, for other consumers, so the held
  deliveries are given back instead of shown (`counted_down`), and every peer closes its link
  to a node the log counted down, so nothing sent before reaches it later.
* Deliveries for a session this node does not have are answered with the owner gone, so the
  queue's leader stops feeding a consumer nobody reads (`_no_such_session`).
"""

from __future__ import annotations

import trio

from mirroring import replica as rp
from mirroring import changes as c
from mirroring.records import QueueDef, in_vhost, named
from mirroring.policy import effective_definition, effective_policy, ha_settings
from mirroring.queue import limits_from
from wire import messages as m
from wire.errors import INTERNAL_ERROR, NOT_FOUND, ProtocolError

from .framed import CORK, Encoded
from .queue_process import QueueProcess

EARLY_OP_WAIT = 3.0  # seconds an operation for a queue not known yet is kept
QUEUE_OPS = frozenset((m.QPublish, m.QConsume, m.QCancel, m.QGet, m.QSettle, m.QOwnerGone,
                       m.QSessionGone, m.QPurge, m.QDeclareOk, m.QDelete))
REPLICA_MSGS = frozenset((m.RMirrorStart, m.RMirrorReady, m.RRep, m.RRepOk, m.RMirrorReset,
                          m.RSyncBatch, m.RSyncOk, m.RSyncEnd))
ROUTED = QUEUE_OPS | REPLICA_MSGS  # what goes to a queue replica on this node
MIRROR_INPUT = frozenset((m.RMirrorStart, m.RRep, m.RSyncBatch, m.RSyncEnd))  # leader -> mirror
_REQUESTS = (m.QConsume, m.QCancel, m.QGet, m.QPurge, m.QDeclareOk, m.QDelete)


class Router:
    """Where operations, replication and events go on this node, and its replicas (see the
    module docstring). It is the `ReplicaHost` of every replica task it starts
    (broker/queue_process.py), and the routing half of its sessions' host
    (broker/session/host.py `NodeHost`)."""

    def __init__(self, node):
        self.node = node
        self.name = node.name
        self.log = node.log
        self.replicas: dict[str, QueueProcess] = {}
        self._early: dict[str, list] = {}
        self._up: dict[str, int] = {}  # the metadata's running members as last reconciled
        self._counted = False  # this run of the app is recorded up in the metadata
        self._pids = 0
        self._held: set[QueueProcess] = set()  # leaders holding deliveries until in step
        self.batch: list | None = None  # replicas due a round at the end of this peer batch
        self.batch_now = 0.0  # the clock when the open batch began: its rounds' time
        self._for_sessions: list = []  # this peer batch's ToSession messages, for its end
        self._held_for_sessions: list = []  # ToSession messages from peers held until in step

    @property
    def cluster(self):
        return self.node.cluster

    # --- replicas ------------------------------------------------------------------------------
    def may_deliver(self, qp: QueueProcess, now: float) -> bool:
        """May the leader replica `qp` hand out new deliveries? Only while this node is in step
        with the metadata log (broker/cluster.py `in_step`): a node woken from a freeze may
        have been replaced meanwhile, and what it would deliver then has gone, flagged
        redelivered, to other consumers. Or while the metadata records no other node running
        (the last node of a full restart, its peers' stops recorded): it is out of step, but no
        one else can lead its queues. `qp` is woken again once the node is in step."""
        if self._in_step(now):
            return True
        self._held.add(qp)
        return False

    @property
    def leaving(self) -> bool:
        """This node is stopping and has asked the log to record it going (`Node.leaving`):
        its leaders confirm only what a mirror they could hand over to holds (replica.py
        `_outlives_its_node`)."""
        return self.node.leaving

    def _in_step(self, now: float | None = None) -> bool:
        cluster = self.node.cluster
        return cluster.in_step(now) or set(cluster.md.up) <= {self.name}

    def in_step(self) -> None:
        """The log says this node is in step: wake the leaders that held their deliveries, and
        hand on what the sessions' peers sent meanwhile."""
        if self._held:
            held, self._held = self._held, set()
            for qp in held:
                qp.kick()
        if self._held_for_sessions:
            self._to_sessions([])

    def counted_down(self) -> None:
        """The log records this very run of the node down: every leader requeues (flagged) what
        it had sent our sessions, once it applies the same record, drops their consumers until
        they register again, and closes its link to us (broker/cluster.py
        `_close_link_to_counted_down`). What is held here came before that record (a node
        applies it before it is in step again): give its deliveries back rather than show them
        (dst seed 68350: a node paused for 1.7 s, counted down 1.3 s into it by a peer whose
        silence began with a partition, showed its consumer 50 deliveries that another
        consumer had been given, flagged, meanwhile). A leader that no longer holds them as
        ours ignores them; one that has not applied the record yet requeues them."""
        held, self._held_for_sessions = self._held_for_sessions, []
        for msg in held:
            self._to_local_session(msg.sid, msg.events, superseded=True)

    def _config(self) -> rp.ReplicaConfig:
        cfg = self.node.config
        self._pids += 1
        return rp.ReplicaConfig(node=self.name, pid=f"<{self.name}.{self._pids}.0>",
                                sync_batch_size=cfg.mirroring_sync_batch_size,
                                max_sync_bytes=cfg.max_frame - 65536,
                                sync_max_throughput=cfg.mirroring_sync_max_throughput,
                                stall_after=cfg.net_ticktime,
                                dead_letter_sid=self.node.dead_letters.sid)

    def _assign(self, qdef: QueueDef, md) -> rp.Assign:
        policy = effective_policy(md.policies, qdef.name, qdef.vhost)  # its ha keys
        # its limits: the policy's merged with the operator policy's
        limits = effective_definition(md.policies, md.operator_policies, qdef.name, qdef.vhost)
        return rp.Assign(qdef.leader, qdef.epoch, list(qdef.mirrors), list(qdef.synced),
                         ha_settings(policy, qdef.exclusive), qdef.auto_delete,
                         limits_from(qdef.arguments, limits))

    def reconcile(self, touched: set[str] | None = None) -> None:
        """Bring the replicas on this node in line with the metadata: those of the queues in
        `touched` (the ones the change just applied names: `Metadata.touched`), or of every
        queue (None). A change to one queue used to pass over every queue here, so declaring
        N queues cost N² on every node."""
        if not self.node.app_running:
            return
        md = self.cluster.md
        me = self.name
        if not self._counted:
            # What the metadata says of this node until the log records this run of it up was
            # said of an earlier run: the queues it led then are led by nobody now (its memory is
            # new), and a replica started on that word would confirm publishes as a leader the
            # log is about to replace (found by `warren-bench dst`, seed 1109: a full restart
            # lost 16 confirmed messages). The planner bumps every such queue's epoch, or
            # promotes another replica, in the very change that records this run up.
            if md.up.get(me) != self.cluster.incarnation:
                return
            self._counted = True
            touched = None  # the first pass starts every replica this node holds
        # node -> its run that went (down, or replaced by a new run): only that run's sessions
        # are gone; a new run's may have registered already (dst seed 1554)
        gone = {n: run for n, run in self._up.items() if md.up.get(n) != run}
        self._up = dict(md.up)
        if gone:
            touched = None  # every replica hears of it
        queues = md.queues
        for qname in (queues if touched is None else sorted(touched)):
            qdef = queues.get(qname)
            if qdef is None or (qdef.leader != me and me not in qdef.mirrors):
                continue
            qp = self.replicas.get(qname)
            assign = self._assign(qdef, md)
            if qp is None:
                qp = self._start(qname, assign)
            else:
                qp.reassign(assign)
            for node, run in gone.items():
                qp.deliver(rp.NodeGone(node, True, run))
        held = self.replicas
        for qname, qp in (list(held.items()) if touched is None
                          else [(q, held[q]) for q in sorted(touched) if q in held]):
            qdef = queues.get(qname)
            if qdef is None:
                qp.deliver(rp.Stop(f"{in_vhost('queue', qname)} was deleted", True))
                del self.replicas[qname]
            elif qdef.leader != me and me not in qdef.mirrors:
                self._take_back_mirror_input(qp)
                qp.deliver(rp.Stop("queue moved", False))
                del self.replicas[qname]

    def _take_back_mirror_input(self, qp: QueueProcess) -> None:
        """A replica stopped because its queue moved off this node gives back the leader's
        replication it has not handled yet (a start, batches, a sync's): it is for the mirror on
        this node, which from now on is the replica the metadata places here next, if any. A
        node applying several changes at once (after a restart or a freeze) can stop its mirror
        (a change drops it) and start a new one (a later change adds it back) in one go, with
        the leader's start for the mirror added back already in the inbox of the replica being
        stopped. Handled there, it was answered: the leader counted the mirror following, and
        the new replica, which never had a start, ignored every batch; confirms waited
        net_ticktime, until the leader gave up on the mirror (seed 23 of
        tests/test_sim_restart_stall.py; a second `make demo` stalled 10 s). Kept as for a
        queue not known yet: the replica started next gets it, in order; with none within
        EARLY_OP_WAIT, it goes. A start the old replica had handled before its stop came is the
        new replica's to report (mirroring/replica.py `_on_batch_not_following`)."""
        inbox = qp.inbox
        if not any(type(item) in MIRROR_INPUT for item in inbox):
            return
        kept = []
        for item in inbox:
            if type(item) in MIRROR_INPUT:
                self._keep_early(item)
            else:
                kept.append(item)
        inbox.clear()
        inbox.extend(kept)

    def _start(self, qname: str, assign: rp.Assign) -> QueueProcess:
        replica = rp.Replica(qname, self._config(), assign, trio.current_time())
        qp = QueueProcess(self, replica)
        self.replicas[qname] = qp
        self.node.spawn(qp.run)
        for msg in self._early.pop(qname, ()):
            qp.deliver(msg)
        return qp

    def replica_ended(self, qp: QueueProcess) -> None:
        if self.replicas.get(qp.name) is qp:
            del self.replicas[qp.name]

    def stop_all(self) -> None:
        for qp in self.replicas.values():
            qp.scope.cancel()
        self.replicas.clear()
        self._early.clear()
        self._up = {}
        self._counted = False

    def leaders(self) -> list[QueueProcess]:
        return [qp for qp in self.replicas.values() if qp.replica.state in rp.LEADING]

    # --- sending -------------------------------------------------------------------------------
    def to_node(self, node: str, msg, encoded: Encoded | None = None) -> None:
        """Replication (or any queue traffic) for the replica on `node`; dropped if it is
        unreachable (the protocol notices: a missing batch, a mirror dropped). `encoded`: the
        same message already encoded (one replication batch for several mirrors)."""
        if node == self.name:
            self._local(msg)
            return
        link = self.cluster.links.get(node)
        if link is not None:
            link.send(msg if encoded is None else encoded)

    def encode_once(self, msg) -> Encoded:
        return Encoded(msg, self.node.config.max_frame)

    def leader_of(self, qname: str) -> str | None:
        qdef = self.cluster.md.queues.get(qname)
        return None if qdef is None else qdef.leader

    def to_leader(self, qname: str, msg) -> bool:
        """A client operation for the queue's leader; False if it cannot be sent now (the
        session resends when the route comes back or moves)."""
        leader = self.leader_of(qname)
        if leader is None:
            return False
        if leader == self.name:
            self._local(msg)
            return True
        link = self.cluster.links.get(leader)
        if link is None:
            return False
        link.send(msg)
        return True

    def _leader_link(self, qname: str):
        """The peer link to the queue's leader, when that leader is on another node."""
        leader = self.leader_of(qname)
        return self.cluster.links.get(leader) if leader not in (None, self.name) else None

    def link_full(self, qname: str) -> bool:
        """Whether the link to the queue's (remote) leader is past its writer's high watermark."""
        link = self._leader_link(qname)
        return link is not None and link.outbox.full

    async def wait_link_room(self, qname: str) -> None:
        """Back-pressure for publishes to a remote leader: wait while that link's writer is full."""
        link = self._leader_link(qname)
        if link is not None:
            await link.outbox.wait_below_watermark()

    def to_session(self, node: str, sid: int, events: list) -> None:
        if node == self.name:
            self._to_local_session(sid, events)
            return
        link = self.cluster.links.get(node)
        if link is not None:
            link.send(m.ToSession(sid, events))
        else:
            self._deliveries_lost(node, events)

    def _deliveries_lost(self, node: str, events: list) -> None:
        """Events for a node this one has no link to go nowhere, yet a leader counts the
        deliveries among them in flight: a leader promoted while that node was frozen, on a
        node that restarted meanwhile, may never have had a link to it, so no link-down ever
        gave them back (dst seed 67947: 50 messages sat with a sleeping node's consumer until
        the end). Give them back as for a replaced link: requeued, flagged, and that node's
        consumers dropped until its sessions register them again, which they do when the link
        comes up."""
        for qname in {ev.queue for ev in events if type(ev) is m.EvDeliver}:
            qp = self.replicas.get(qname)
            if qp is not None:
                self.log.info("no link to the node of a delivery: given back to the queue",
                              queue=qname, peer=node)
                qp.deliver(rp.LinkReplaced(node))

    def mirror_bodies(self, ev: m.EvDeliver) -> list:
        """The bodies of a delivery its leader sent without them, from this node's mirror of
        the queue (None for each it lacks). The replication batch that gave the mirror that
        delivery came first on the link, but may still wait in the mirror's inbox (the reader
        runs queue rounds at the end of its batch): apply it now and look again."""
        qp = self.replicas.get(ev.queue)
        if qp is None:
            return [None] * len(ev.ids)
        bodies = qp.replica.local_bodies(ev.ids)
        if None in bodies and qp.catch_up():
            bodies = qp.replica.local_bodies(ev.ids)
        return bodies

    def _local(self, msg) -> None:
        qp = self.replicas.get(msg.queue)
        if qp is not None:
            qp.deliver(msg)
            return
        if type(msg) in ROUTED:
            # the sender's metadata is ahead of ours: keep it (in order) until ours catches up
            self._keep_early(msg)

    def _keep_early(self, msg) -> None:
        early = self._early.get(msg.queue)
        if early is None:
            early = self._early[msg.queue] = []
            self.node.spawn(self._expire_early, msg.queue)
        early.append(msg)

    async def _expire_early(self, qname: str) -> None:
        await trio.sleep(EARLY_OP_WAIT)
        for msg in self._early.pop(qname, ()):
            if isinstance(msg, _REQUESTS) and msg.rid:
                owner = msg.owner
                self.to_session(owner[0], owner[1], [m.EvFail(msg.rid, owner[2], NOT_FOUND,
                                                              f"no {in_vhost('queue', qname)}")])

    # --- receiving -----------------------------------------------------------------------------
    def peer_messages(self, link, msgs: list) -> None:
        """Queue, replica and session traffic from one read of a peer link. Replicas that get
        input run their round at the end, here, when their task is idle (QueueProcess
        `after_batch`), and everything the batch produced is written at its end (the Cork)."""
        self.begin_input(link.last_heard)
        try:
            for msg in msgs:
                if type(msg) is m.ToSession:
                    # after the batch's queue rounds: a delivery sent without its bodies finds
                    # them in this node's mirror once the batch before it on the link is applied
                    self._for_sessions.append(msg)
                else:
                    self.peer_message(link, msg)
        finally:
            self.end_input()

    def begin_input(self, now: float | None = None) -> None:
        """Open a batch of input (one read of a peer link, or a client's run of publishes and
        acks, Session.handle_now): replicas it feeds while their task waits run their round at
        `end_input`, in this task, and what the batch sends is written then (the Cork). Nothing
        may await between the two: another reader would find this batch open. `now`: the clock's
        time, if the caller has just read it (the batch's rounds run at that time)."""
        if self.batch is not None:
            raise RuntimeError("a batch of input is already open: something awaited inside one")
        CORK.__enter__()
        self.batch = []
        self.batch_now = trio.current_time() if now is None else now

    def end_input(self) -> None:
        batch, self.batch = self.batch, None
        try:
            for qp in batch:
                qp.after_batch()
            if self._for_sessions:
                msgs, self._for_sessions = self._for_sessions, []
                self._to_sessions(msgs)
        finally:
            CORK.__exit__(None, None, None)

    def _to_sessions(self, msgs: list) -> None:
        """Hand peers' ToSession messages on, after any held before them; hold them all while
        this node is out of step with the metadata log (`counted_down`)."""
        if self._held_for_sessions:
            msgs, self._held_for_sessions = self._held_for_sessions + msgs, []
        if not self._in_step():
            self._held_for_sessions = msgs
            return
        for msg in msgs:
            self._to_local_session(msg.sid, msg.events)

    def peer_message(self, link, msg) -> None:
        t = type(msg)
        if t in ROUTED:
            self._local(msg)
        elif t is m.NodeAlarm:  # not queue traffic, but checked after it: off the hot path
            self.node.memory.peer_alarm(link.name, msg)
        else:
            link.close(f"unexpected message {msg.KIND!r} on a peer link")

    def _to_local_session(self, sid: int, events: list, superseded: bool = False) -> None:
        """`superseded`: sent before a record of this node down (`counted_down`)."""
        s = self.node.sessions.get(sid)
        if s is None:
            self._no_such_session(sid, events)
        elif superseded:
            s.superseded(events)
        else:
            s.queue_events(events)

    def _no_such_session(self, sid: int, events: list) -> None:
        """Deliveries for a session this node does not have (it ended, or this node restarted
        since: a leader promoted from a mirror while the node was away may still count that
        session's consumers, and would hold their prefetch unacknowledged for ever: dst seed
        9550 kept 400 messages so). Tell the queue's leader the owner is gone: its consumers go
        and its messages are requeued for the consumers that are there."""
        told = set()
        for ev in events:
            if type(ev) is m.EvDeliver and (ev.queue, ev.ch) not in told:
                told.add((ev.queue, ev.ch))
                self.to_leader(ev.queue, m.QOwnerGone(ev.queue, (self.name, sid, ev.ch)))
            elif type(ev) is m.EvDirectReply and ev.rid and ev.sender is not None:
                # direct replies whose publisher waits to hear that nobody took them
                self.to_session(ev.sender[0], ev.sender[1], [m.EvReplyTaken(ev.rid, False)])

    def link_down(self, node: str) -> None:
        for qp in self.replicas.values():
            qp.deliver(rp.LinkDown(node))
        for s in list(self.node.sessions.values()):
            s.route_changed(node)

    def link_replaced(self, node: str) -> None:
        for qp in self.replicas.values():
            qp.deliver(rp.LinkReplaced(node))

    def link_up(self, node: str) -> None:
        for qp in self.replicas.values():
            qp.deliver(rp.LinkUp(node))
        for s in list(self.node.sessions.values()):
            s.route_changed(node)

    # --- what replicas ask the node for --------------------------------------------------------
    def propose(self, change: c.Change) -> None:
        self.cluster.propose_soon(change)

    def delete_for_client(self, qname: str, owner: tuple, rid: int, count: int) -> None:
        """A client's queue.delete, through the log; the change names the request, and the
        client's session answers it when its node applies the change."""
        node, session, channel = owner

        async def go():
            try:
                await self.cluster.propose(c.client_delete(qname, node, session, rid, count))
            except (ProtocolError, trio.TooSlowError) as exc:
                self.to_session(node, session, [m.EvFail(rid, channel, INTERNAL_ERROR, str(exc))])
                return
            self.log.info("queue deleted", **named(qname))
        self.node.spawn(go)

    def dead_letter(self, qname: str, d) -> None:
        self.node.dead_letters.publish(qname, d)

    def auto_delete(self, qname: str) -> None:
        async def go():
            try:
                await self.cluster.propose(c.QueueDelete(qname, self.name))
            except (ProtocolError, trio.TooSlowError):
                return
            self.log.info("auto-delete queue deleted after its last consumer left", **named(qname))
        self.node.spawn(go)

    async def ask(self, qname: str, fn):
        """Run `fn(replica, now)` inside the replica's task and return its value."""
        qp = self.replicas.get(qname)
        if qp is None:
            raise ProtocolError(NOT_FOUND, f"no {in_vhost('queue', qname)} on {self.name}")
        done = trio.Event()
        box: list = []

        def call(replica, now):
            box.append(fn(replica, now))
            done.set()

        qp.deliver(call)
        with trio.fail_after(10):
            await done.wait()
        return box[0]
