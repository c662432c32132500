"""One replica of one queue, leader or mirror, as a state machine. Pure: no I/O, no clock.

Everything that decides what a replica does with what it receives lives in this file and the
three parts of `Replica` beside it (replica_leading.py: a leader's mirrors, replication batches
and confirms; replica_syncing.py: its batch sync; replica_following.py: a mirror's side), with
the states in replica_states.py (and the queue's contents in queue.py, confirm bookkeeping in
replication.py, sync pacing in sync.py).
broker/queue_process.py is only a pump: typed inputs in, outputs out.

Inputs: the client operations and replication messages of wire/messages.py (`handle`), and the
node's news as small records: `Assign` (what the metadata says about this queue now), `NodeGone`,
`LinkDown`, `LinkUp`, `LinkReplaced`, `SyncRequest`, `SyncCancel`, `Stop`; time comes with every
call as `now`.
Outputs, taken with `take_output()`: `Send` (to the replica on another node), session events
grouped per session, `Propose` (a metadata change), `DeleteQueue`, `AutoDelete`, `Log`; and
`next_deadline()` for the pump's timer.

States (`State`) and what moves between them (`TRANSITIONS`, checked on every change):

    WAITING --RMirrorStart--> MIRROR <--RSyncEnd-- MIRROR_SYNCING <--RSyncBatch-- MIRROR
       ^  (batch missing)       |                                                  |
       +------------------------+---------- Assign: promoted ----------> LEADER <--+
    LEADER --SyncRequest--> LEADER_SYNCING (blocking: client operations wait, the spec's way)
    LEADER --SyncRequest--> LEADER_SYNCING_LIVE (ha-sync-mode background: the queue keeps serving)
    LEADER* --Assign: another replica leads--> WAITING (contents dropped)     any --Stop--> STOPPED

Which inputs a state acts on is the table `ACTS_ON`: client operations are served in LEADER and
LEADER_SYNCING_LIVE and parked elsewhere (a mirror parks what reaches it just before it is
promoted; a blocking sync parks until it ends); replication messages go to the side they are for.

Rules that keep confirmed messages safe (see also replication.py):
* A leader releases a confirm only once every mirror the metadata lists has acknowledged it;
  a mirror leaves that set only through the metadata (a committed `queue.drop_mirror`, or its
  node going down), never because the leader merely lost touch with it.
* A mirror ignores replication from an epoch older than the metadata's (a stale leader).
* A demoted leader drops its contents and confirms nothing more; its clients' sessions resend
  what was in flight to the new leader, which de-duplicates publishes by (session, batch).
* A promoted mirror requeues every unacknowledged message and marks everything it holds as
  possibly delivered (`redeliver_below`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter

from wire import messages as m
from wire.errors import PRECONDITION_FAILED, ProtocolError

from .changes import Change, DropMirror, QueueDelete
from .dead_letter import MAXLEN, ReplicaDeadLetters
from .policy import HA
from .queue import NO_LIMITS, Limits, QueueState
from .records import in_vhost, split_key
from .replica_following import Following
from .replica_leading import SETTLE_LINGER, Leading
from .replica_states import (FOLLOWING, LEADING, RETRY_PROPOSAL_AFTER, SERVING, TRANSITIONS,
                             ReplicaError, S, State)
from .replica_syncing import _SyncJob, Syncing
from .replication import LeaderReplication, MirrorFollow, merge_accepted

ROUND_BYTES = 2 << 20  # publish bytes applied per round: a replication batch stays far below the frame limit
MIRROR_START_RETRY = 1.0
# a message (id, body, props, redelivered), and an unacknowledged entry's message
_msg_id, _msg_body, _msg_props, _msg_redelivered = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)
_entry_msg = itemgetter(2)


# --- inputs from the node ----------------------------------------------------------------------

@dataclass(slots=True)
class Assign:
    """What the metadata says about this queue now."""
    leader: str
    epoch: int
    mirrors: list
    synced: list
    ha: HA
    auto_delete: bool = False
    limits: Limits = NO_LIMITS


@dataclass(slots=True)
class NodeGone:
    """Every client session of `node`'s run `run` (its incarnation; 0: of every run) is gone
    (`forget`: for good)."""
    node: str
    forget: bool
    run: int = 0


@dataclass(slots=True)
class LinkDown:
    """This node lost its link to `node` (it may come back)."""
    node: str


@dataclass(slots=True)
class LinkReplaced:
    """A second link to `node` replaced the first (both nodes dialed at once): what was in
    flight on the first may be lost, though the node never went."""
    node: str


@dataclass(slots=True)
class LinkUp:
    """This node has a link to `node` (again)."""
    node: str


@dataclass(slots=True)
class SyncRequest:
    why: str


@dataclass(slots=True)
class SyncCancel:
    pass


@dataclass(slots=True)
class Stop:
    reason: str
    cancel_consumers: bool = True


# --- outputs -------------------------------------------------------------------------------------

@dataclass(slots=True)
class Send:
    node: str
    msg: object


@dataclass(slots=True)
class Propose:
    change: Change


@dataclass(slots=True)
class DeleteQueue:
    owner: tuple
    rid: int
    count: int


@dataclass(slots=True)
class AutoDelete:
    pass


@dataclass(slots=True)
class Log:
    level: str
    event: str
    fields: dict = field(default_factory=dict)


@dataclass(slots=True)
class ReplicaConfig:
    node: str
    pid: str
    sync_batch_size: int = 4096
    max_sync_bytes: int = 8 << 20
    sync_max_throughput: int = 0
    stall_after: float = 60.0  # a mirror that acknowledges nothing this long is dropped
    dead_letter_sid: int = 0  # the session id of the node's dead-letter publisher


class Replica(Leading, Syncing, Following, ReplicaDeadLetters):
    """One replica of one queue. Its parts by responsibility: this class holds the state, takes
    the inputs, serves client operations, changes leadership and runs a round; a leader's
    replication and confirms are `Leading` (replica_leading.py), its batch sync `Syncing`
    (replica_syncing.py), a mirror's side `Following` (replica_following.py)."""

    def __init__(self, name: str, cfg: ReplicaConfig, assign: Assign, now: float):
        self.name = name
        self.cfg = cfg
        self.me = cfg.node
        self.pid = cfg.pid
        self.state = S.WAITING
        self.q = QueueState(name, assign.limits.max_priority, assign.limits.single_active)
        self.assign = assign
        # whether the metadata, as last seen (an Assign acted on or one already superseded),
        # listed this replica synchronised: what a promotion's log line reports
        self.listed_synced = self.me in assign.synced
        self.epoch = -1  # the epoch we lead (leaders)
        self.reign = -1  # the first epoch of our present leadership (leaders; _restart_epoch keeps it)
        self.follow = MirrorFollow()  # what we follow (mirrors)
        self.leader_node = assign.leader
        self.rep = LeaderReplication()
        self.accepted: dict[tuple, int] = {}  # session -> highest publish batch applied this round
        self.parked: list = []
        self.round_bytes = 0
        # a leader hands out deliveries and confirms only while its node is in step with the
        # metadata log (set by its pump each round; see broker/router.py `may_deliver`); the
        # confirms due meanwhile wait here, {(node, sid): highest pseq}, and are dropped if it
        # stops leading first (their sessions resend to the new leader)
        self.in_step = True
        # its node is stopping (stop_app, a shutdown) and has asked the log to record it going
        # (set by its pump each round): see `_outlives_its_node`
        self.leaving = False
        self._held_confirms: dict = {}
        self.sync: _SyncJob | None = None
        self.last_sync: dict | None = None
        self.sync_wanted = ""  # a sync to start once the current round is done
        self._ack_due = False
        self._told_not_following = (-1, 0.0)  # (epoch, when) we last told its leader we follow nothing
        self._settles_since: float | None = None  # when the acks held back (SETTLE_LINGER) began
        self._settles_seen = 0  # how many of the held effects are known to be acks
        self._events: dict[tuple, list] = {}
        self._out: list = []
        self._synced_check_at = 0.0
        self._periodic_at = -1.0  # next_deadline's once-a-second wake-up while it has mirrors
        self._proposed: dict[tuple, float] = {}  # what we asked the metadata for, and when
        self.last_used = now  # x-expires: when a client last used the queue
        self.qlog = f"Mirrored {in_vhost('queue', name)}"
        self.assign_now(assign, now)

    # --- state changes -----------------------------------------------------------------------
    def _to(self, new: State) -> None:
        if (self.state, new) not in TRANSITIONS:
            raise ReplicaError(f"queue {self.name!r}: no transition {self.state.name} -> {new.name}")
        self.state = new

    @property
    def role(self) -> str:
        return "leader" if self.state in LEADING else "mirror"

    # --- output ------------------------------------------------------------------------------
    def emit(self, owner, event) -> None:
        key = (owner[0], owner[1])
        lst = self._events.get(key)
        if lst is None:
            self._events[key] = [event]
        else:
            lst.append(event)

    def take_output(self) -> tuple[list, dict]:
        out, self._out = self._out, []
        events, self._events = self._events, {}
        return out, events

    def _log(self, event: str, level: str = "info", **fields) -> None:
        self._out.append(Log(level, event, fields))

    def _send(self, node: str, msg) -> None:
        self._out.append(Send(node, msg))

    def _propose_once(self, key: tuple, change: Change, now: float) -> bool:
        """Ask the metadata for a change, again only after RETRY_PROPOSAL_AFTER seconds; True
        if it was asked now."""
        last = self._proposed.get(key)
        if last is not None and now - last < RETRY_PROPOSAL_AFTER:
            return False
        self._proposed[key] = now
        self._out.append(Propose(change))
        return True

    # --- inputs ------------------------------------------------------------------------------
    def handle(self, msg, now: float) -> None:
        """A client operation or a replication message."""
        handler = ACTS_ON[self.state].get(type(msg))
        if handler is not None:
            handler(self, msg, now)
        elif type(msg) in CLIENT_OPS and self.state is not S.STOPPED:
            self.parked.append(msg)
        # else: replication for another side or a stale epoch: nothing to do

    def assign_now(self, a: Assign, now: float) -> None:
        """The metadata changed: lead, follow, or go."""
        old = self.assign
        was_synced, self.listed_synced = self.listed_synced, self.me in a.synced
        self.assign = a
        if self.state is S.STOPPED:
            return
        if a.leader == self.me:
            if self.state in FOLLOWING:
                self._become_leader(a, now, synchronised=was_synced)
            elif a.epoch != self.epoch:
                self._restart_epoch(a, now)
            else:
                self._update_mirrors(now)
                if a.ha.sync_mode != old.ha.sync_mode and a.ha.sync_mode != "manual":
                    self.request_sync(f"ha-sync-mode {a.ha.sync_mode}", now)
        elif self.me in a.mirrors:
            if self.state in LEADING:
                self._demote(a, now)
            self.parked.clear()  # not ours to serve: their sessions resend to the leader
            if self.follow.epoch < 0:
                self.leader_node = a.leader
        else:
            self.stop(Stop("queue moved", cancel_consumers=False), now)

    def assign_superseded(self, a: Assign, now: float) -> None:
        """An Assign that a newer one has overtaken before this replica got to it (its node
        applied several metadata changes at once: catching up after a partition, say). Nothing
        is done on it but noting what it listed: acting on a state the metadata has already
        left could confirm what the newer state makes unsafe (dst seed 53705: a leader cut
        off by a partition caught up, dropped its only synchronised mirror as an older policy
        change said, confirmed 231 messages only it held, and stepped down in the same round
        because a newer change had promoted another replica: they were lost)."""
        self.listed_synced = self.me in a.synced

    def node_gone(self, ev: NodeGone, now: float) -> None:
        if self.state in LEADING:
            self.q.node_gone(ev.node, ev.forget, ev.run)
            self._maybe_auto_delete()

    def link_down(self, ev: LinkDown, now: float) -> None:
        """We lost touch with `node`: its sessions are gone for us (they re-register when the
        link is back); a mirror there must be dropped through the metadata before anything it
        has not acknowledged can be confirmed."""
        if self.state not in LEADING:
            return
        self.q.node_gone(ev.node, False)
        self._maybe_auto_delete()
        if ev.node in self.rep.mirrors:
            self._drop_mirror(ev.node, "lost the link to its node", now)

    def link_replaced(self, ev: LinkReplaced, now: float) -> None:
        """Deliveries to `node`'s sessions, and their acks, may have been lost with the old
        link: everything they had not acknowledged goes back to the queue (flagged) and their
        consumers go, until the sessions register them again over the new link (they do on
        every link up). No auto-delete: those consumers are coming back. A mirror there finds
        out by itself (a replication batch missing).

        A sync with a mirror there starts again. Its batches, and the mirror's answers, may
        have gone with the old link, and neither side would ever hear of it: the answers are
        what the sync waits for, and nothing else is sent while a blocking sync runs. A node
        whose app starts again links to its peers twice at once (each side dials), and in
        ha-sync-mode automatic its mirror's start is answered and the sync sent in that moment:
        the answers went with the link that lost, and the queue stayed blocked for
        net_ticktime, until the leader dropped the mirror as one that stopped answering a sync
        (tests/test_sim_restart_stall.py). Ended (RSyncEnd, over the new link), then started
        again from what the mirrors acknowledged; a mirror takes no batch after a gap
        (`_on_sync_batch`), so a lost batch is never skipped over."""
        if self.state in LEADING:
            self.q.node_gone(ev.node, False)
            if self.sync is not None and ev.node in self.sync.acks:
                self._end_sync(False, now, f"the link to {ev.node} was replaced")
                self.request_sync(f"link to {ev.node} replaced", now)

    def link_up(self, ev: LinkUp, now: float) -> None:
        """A mirror there that never answered its start (it went nowhere): start it again."""
        track = self.rep.mirrors.get(ev.node) if self.state in LEADING else None
        if track is not None and not track.ready:
            self._restart_mirror(ev.node, now)

    def _restart_mirror(self, node: str, now: float) -> None:
        """Send a mirror that has not answered a fresh start. It holds nothing yet, so it is
        not synchronised: what waited for its acknowledgement waits no longer."""
        self._ship(now)
        self._release(self.rep.remove(node))
        self.rep.add(node, self.q.next_id, now)
        self._send(node, m.RMirrorStart(self.name, self.epoch, self.me,
                                        self.q.mirror_snapshot(now=now), None, self.rep.seq))

    def _drop_mirror(self, node: str, why: str, now: float) -> None:
        # logged when asked, not at every round the answer is awaited (a node cut off from the
        # metadata log's leader waits for it a while: dst seed 50115 logged 2,300 lines in 30 s)
        if self._propose_once(("drop", node, self.epoch),
                              DropMirror(self.name, self.epoch, node), now):
            self._log(f"{self.qlog}: asking to drop the mirror on node {node}", reason=why)

    def stop(self, ev: Stop, now: float) -> None:
        if self.state is S.STOPPED:
            return
        if self.state in LEADING:
            if ev.cancel_consumers:
                for c in list(self.q.consumers.values()):
                    self.emit(c.owner, m.EvCancelled(c.owner[2], c.tag, self.name, ev.reason))
                self.q.consumers.clear()
            self._ship(now)
        self._to(S.STOPPED)

    def tick(self, now: float) -> None:
        """Timers: sync pacing, natural-sync checks, mirrors that stopped acknowledging."""
        if self.state not in LEADING:
            return
        for node in self.rep.stalled(now, self.cfg.stall_after):
            self._drop_mirror(node, f"no acknowledgement for {self.cfg.stall_after:g} s", now)
        for t in list(self.rep.mirrors.values()):
            if not t.ready and now - t.progress_at > MIRROR_START_RETRY:
                self._restart_mirror(t.node, now)
        job = self.sync
        if job is not None and job.pacer.sent_batches > job.pacer.acked_batches \
                and now - job.progress_at > self.cfg.stall_after:
            # a target that stopped answering the sync: end it (the queue must not stay blocked)
            # and have the silent mirrors dropped
            silent = [n for n, k in job.acks.items() if k < job.pacer.sent_batches]
            self._end_sync(False, now, f"no answer from {', '.join(silent)}")
            for node in silent:
                self._drop_mirror(node, "it stopped answering a sync", now)
        self._report_synced(now)
        expires = self.assign.limits.expires
        if expires is not None and not self.q.consumers and now - self.last_used >= expires:
            # x-expires: unused that long, the queue goes (through the metadata, like a delete)
            if ("expires", self.epoch) not in self._proposed:
                self._log(f"{in_vhost('queue', self.name)} expired: unused for {expires:g} s "
                          "(x-expires)")
            self._propose_once(("expires", self.epoch), QueueDelete(self.name, self.me), now)

    def next_deadline(self, now: float) -> float | None:
        if self.state not in LEADING:
            return None
        if self.rep.mirrors:
            # at least once a second (tick's checks); kept from round to round, so that the
            # task's timer is not moved by every round (QueueProcess sets it only on a change)
            if self._periodic_at <= now:
                self._periodic_at = now + 1.0
            times = [self._periodic_at]
        else:
            times = []
        if self._settles_since is not None:
            times.append(self._settles_since + SETTLE_LINGER)
        at = self.q.next_expiry()
        if at is not None:
            times.append(max(at, now + 1e-4))
        expires = self.assign.limits.expires
        if expires is not None and not self.q.consumers:
            times.append(max(self.last_used + expires, now + 1e-3))
        if self.sync is not None:
            times.append(self.sync.next_report)
            t = self.sync.pacer.next_time()
            if t is not None:
                times.append(max(t, now + 1e-4))
        return min(times) if times else None

    # --- client operations (leader) ------------------------------------------------------------
    def _op_publish(self, msg: m.QPublish, now: float) -> None:
        owner = msg.owner
        q = self.q
        if msg.epoch < self.epoch and msg.pseq != q.last_pseq.get((owner[0], owner[1]), 0) + 1:
            # Sent to an earlier epoch of the queue (parked here, waiting for this replica to
            # start, or slow on its link), and not the batch that follows the last one applied
            # here: an earlier one of its publisher may be missing. Its session resends it, in
            # order with those, once its route names this epoch. Applied now, it would count
            # as accepted for the missing ones too (confirms are cumulative), and their resend
            # would look already applied (`seen`): confirmed and never enqueued (dst seed
            # 122307: 645 confirmed messages lost; a new leader's replica started with batches
            # 115-130 that had waited for it, then took the resend of 72-130). The batch that
            # follows on is applied (flagged below), as a client publishing to a queue it has
            # just declared, before this node's replica has started, expects.
            return
        self.round_bytes += sum(map(len, msg.bodies))
        if not q.seen(owner, msg.pseq):
            limits = self.assign.limits
            bodies, props = msg.bodies, msg.props
            if limits.reject_publish and limits.bounded:
                refused = q.admit(bodies, limits)
                if refused:
                    # x-overflow reject-publish: these are not enqueued; their publisher nacks them
                    self.emit(owner, m.EvRejected(self.name, msg.pseq, refused))
                    if limits.reject_publish_dlx and limits.dead_letter is not None:
                        self._dead_letter(MAXLEN, limits.dead_letter,
                                          [(0, bodies[i], props[i] if props is not None else None, False)
                                           for i in refused], False)
                    drop = set(refused)
                    bodies = [b for i, b in enumerate(bodies) if i not in drop]
                    if props is not None:
                        props = [p for i, p in enumerate(props) if i not in drop]
            # a batch first sent to an epoch before our reign (parked, or slow on its link) was
            # resent meanwhile to whoever led then, who may have delivered it: flag it too
            resent = msg.resent or msg.epoch < self.reign
            ttl = limits.message_ttl
            if msg.ttl is not None and (ttl is None or msg.ttl / 1000.0 < ttl):
                ttl = msg.ttl / 1000.0  # the message's own expiration, the lower of the two
            q.publish(bodies, props, owner, msg.pseq, resent, now, ttl)
        self.accepted[(owner[0], owner[1])] = msg.pseq

    def _op_settle(self, msg: m.QSettle, now: float) -> None:
        how = msg.how
        if how == m.LACKED:  # that node's mirror could not lend the bodies: send them again
            t = self.rep.mirrors.get(msg.owner[0])
            if t is not None:
                t.lends = False
            how = m.REQUEUE
        if how == m.DISCARD:
            self._reject(tuple(msg.owner), msg.ids)
        else:
            self.q.settle(tuple(msg.owner), how, msg.ids)

    def _op_consume(self, msg: m.QConsume, now: float) -> None:
        self.last_used = now
        owner = tuple(msg.owner)
        if (owner, msg.tag) in self.q.consumers:  # a session re-registering after a failover
            self.emit(owner, m.EvConsumeOk(owner[2], msg.rid, msg.tag, self.name, msg.no_ack))
            return
        try:
            self.q.add_consumer(owner, msg.tag, msg.no_ack, msg.prefetch, msg.exclusive, msg.arguments)
        except ProtocolError as exc:
            self.emit(owner, m.EvFail(msg.rid, owner[2], exc.code, exc.text))
            return
        self.emit(owner, m.EvConsumeOk(owner[2], msg.rid, msg.tag, self.name, msg.no_ack))

    def _op_cancel(self, msg: m.QCancel, now: float) -> None:
        self.last_used = now
        owner = tuple(msg.owner)
        self.q.remove_consumer(owner, msg.tag)
        self.emit(owner, m.EvReply(msg.rid, msg.tag))
        self._maybe_auto_delete()

    def _op_get(self, msg: m.QGet, now: float) -> None:
        self.last_used = now
        owner = tuple(msg.owner)
        q = self.q
        self._expire(now, False)  # an expired head is never handed out
        got = q.get(owner, msg.no_ack)
        if got is not None:
            got = [got[0], got[1], got[2], got[3] or got[0] < self.q.redeliver_below]
        self.emit(owner, m.EvGetOk(owner[2], msg.rid, self.name, got, self.q.message_count))

    def _op_owner_gone(self, msg: m.QOwnerGone, now: float) -> None:
        self.q.owner_gone(tuple(msg.owner))
        self._maybe_auto_delete()

    def _op_session_gone(self, msg: m.QSessionGone, now: float) -> None:
        self.q.session_gone(msg.node, msg.sid)
        self._maybe_auto_delete()

    def _op_purge(self, msg: m.QPurge, now: float) -> None:
        self.emit(msg.owner, m.EvReply(msg.rid, self.q.purge()))

    def _op_declare_ok(self, msg: m.QDeclareOk, now: float) -> None:
        self.last_used = now
        # the name as the client knows it, in its vhost (the key is the vhost's and the name's)
        self.emit(msg.owner, m.EvReply(msg.rid, [split_key(self.name)[1], self.q.message_count,
                                                   len(self.q.consumers)]))

    def _op_delete(self, msg: m.QDelete, now: float) -> None:
        owner = tuple(msg.owner)
        if msg.if_unused and self.q.consumers:
            self.emit(owner, m.EvFail(msg.rid, owner[2], PRECONDITION_FAILED,
                                      f"{in_vhost('queue', self.name)} in use"))
        elif msg.if_empty and self.q.message_count:
            self.emit(owner, m.EvFail(msg.rid, owner[2], PRECONDITION_FAILED,
                                      f"{in_vhost('queue', self.name)} is not empty"))
        else:
            self._out.append(DeleteQueue(owner, msg.rid, self.q.message_count))

    def _maybe_auto_delete(self) -> None:
        if self.assign.auto_delete and self.q.had_consumer and not self.q.consumers:
            self.q.had_consumer = False
            self._out.append(AutoDelete())

    def purge_now(self) -> int:
        """warrenctl purge_queue (through the node, not a client channel)."""
        return self.q.purge() if self.state in LEADING else 0

    # --- leading -----------------------------------------------------------------------------
    def _become_leader(self, a: Assign, now: float, synchronised: bool) -> None:
        """`synchronised`: the metadata listed this mirror as synchronised until now (a
        promotion of one that was not may lose what only the old leader had: the log says so,
        and the chaos checkers allow that loss only where the promote keys let it happen)."""
        promoted = self.state is not S.WAITING or self.follow.epoch >= 0
        resume = None
        if self.follow.epoch >= 0:
            resume = [self.follow.epoch, self.follow.last_seq, self.follow.start_id,
                      self.follow.synced_upto]
        self._to(S.LEADER)
        self.epoch = self.reign = a.epoch
        self.rep = LeaderReplication()
        self.q.effects = []
        failover = promoted or a.epoch > 1
        if failover:
            self._log(f"{self.qlog}: Promoting mirror {self.pid} to leader", epoch=a.epoch,
                      old_leader=self.leader_node, synchronised=synchronised)
        self.leader_node = self.me
        self.last_used = now
        # the mirrors first, then the failover: its requeue is then the first effect of the new
        # epoch, applied by every mirror. A mirror that resumes keeps the state it had under the
        # old leader, and a batch shipped before it was a mirror never reaches it (dst seed 92168:
        # the resumed mirror counted the requeued deliveries twice against the consumer's
        # prefetch, and once promoted it delivered nothing more). A mirror started empty gets
        # the state before the failover and applies the failover, as the resumed one does.
        self._update_mirrors(now, resume)
        if failover:
            for c in self.q.failover():
                self.emit(c.owner, m.EvCancelled(
                    c.owner[2], c.tag, self.name,
                    f"{in_vhost('queue', self.name)} failed over to a new leader "
                    "(x-cancel-on-ha-failover)"))
        parked, self.parked = self.parked, []
        for op in parked:
            self.handle(op, now)

    def _restart_epoch(self, a: Assign, now: float) -> None:
        """Still the leader, but the metadata started a new epoch (our node was counted down
        and came back): every mirror starts again; in-flight publishes are resent by their
        sessions and de-duplicated here, and confirmed once the new epoch's mirrors have
        acknowledged a batch of it.

        What this leader applied and had not confirmed yet (waiting for the old mirrors, or for
        its node to be in step) is carried into the new epoch the same way, not dropped: a
        session that learned of the new epoch first resends *before* this restart, so the
        resends may already be here, and they do not come again (dst seed 31170: 500 publishes
        never confirmed)."""
        self._end_sync(False, now, "a new leader epoch")
        self._ship(now)  # what the old mirrors lack goes to them
        carried = self._held_confirms
        for _, accepted in self.rep.pending:
            merge_accepted(carried, accepted)
        self.epoch = a.epoch
        self.rep = LeaderReplication()
        self.accepted = carried  # shipped with the new epoch's first batch
        self._held_confirms = {}
        self._update_mirrors(now)

    def _demote(self, a: Assign, now: float) -> None:
        self._log(f"{self.qlog}: leader {self.pid} steps down: node {a.leader} leads epoch {a.epoch}",
                  level="warning")
        self.sync = None
        self.q = QueueState(self.name, a.limits.max_priority, a.limits.single_active)
        self.rep = LeaderReplication()
        self.accepted.clear()
        self._held_confirms.clear()
        self.follow = MirrorFollow()
        self._settles_since = None
        self._settles_seen = 0
        self.leader_node = a.leader
        self.epoch = -1
        self._to(S.WAITING)

    # --- a round -----------------------------------------------------------------------------
    def flush(self, now: float) -> bool:
        """End of a round: dispatch deliveries, replicate, run the sync. True if more could be
        dispatched at once (a dispatch stopped at its budget)."""
        self.round_bytes = 0
        if self.state in FOLLOWING:
            if self._ack_due:
                self._ack_due = False
                self._send(self.leader_node, m.RRepOk(self.name, self.follow.epoch, self.me,
                                                      self.follow.last_seq))
            return False
        if self.state is S.STOPPED:
            return False
        more = False
        if self._held_confirms and not self._holds_confirms():
            held, self._held_confirms = self._held_confirms, {}
            self._release(held)
        if self.state in SERVING:
            q = self.q
            limits = self.assign.limits
            if q.expiry or q.expired_upto:
                self._expire(now, False)  # an expired head is never delivered
            batches = q.dispatch() if self.in_step else None
            if batches:
                name = self.name
                below = self.q.redeliver_below
                me = self.me
                tracks = self.rep.mirrors
                for c, batch in batches:
                    # (map over itemgetters: C loops, the batch may hold a thousand messages)
                    ids = list(map(_msg_id, batch))
                    props = list(map(_msg_props, batch))
                    owner = c.owner
                    # a consumer on a node with a mirror that holds these messages gets them
                    # from that mirror: the delivery goes without its bodies (see local_bodies)
                    low = min(ids)
                    t = tracks.get(owner[0]) if owner[0] != me and not c.no_ack else None
                    if t is not None and t.lends and t.ready and (t.synced or low >= t.start_id):
                        bodies = []
                    else:
                        bodies = list(map(_msg_body, batch))
                    if low < below or any(map(_msg_redelivered, batch)):
                        again = [i for i, x in enumerate(batch) if x[3] or x[0] < below]
                    else:
                        again = []
                    self.emit(owner, m.EvDeliver(
                        owner[2], c.tag, name, ids, bodies, again,
                        props if props.count(None) != len(props) else None, self.epoch))
                more = bool(self.q.ready)
            if q.expiry or q.expired_upto:
                self._expire(now, True)  # a TTL of 0: what was not delivered at once goes
            if limits is not NO_LIMITS and limits.bounded and not limits.reject_publish:
                self._trim(limits)  # x-overflow drop-head, after this round's deliveries
        self._ship(now, linger=True)
        if self.rep.mirrors:
            self._report_synced(now)
        if self.sync_wanted and self.sync is None:
            self._start_sync(now)
        if self.sync is not None:
            self._sync_step(now)
        return more

    def local_bodies(self, ids: list) -> list:
        """The bodies of `ids` that this replica holds as delivered and unacknowledged, None for
        each it does not (a mirror that restarted empty, or has not applied that delivery yet).
        A leader sends a delivery to a consumer on a node with one of its mirrors without the
        bodies (`flush`): that mirror already has them, and the replication batch that delivered
        them reached its node first, on the same link. An id names one message for the queue's
        whole life, so whichever delivery of it the entry records, the body is that message's.
        Saves the leader a third copy of every body and the consumer's node reading it again."""
        bodies = self.q.held_bodies(ids)
        if bodies is not None:  # the usual case: one recent run of deliveries
            return bodies
        unacked = self.q.unacked
        entries = list(map(unacked.get, ids))
        if None not in entries:  # the usual case, in C loops: every one held, with its message
            msgs = list(map(_entry_msg, entries))
            if None not in msgs:
                return list(map(_msg_body, msgs))
        out = []
        for mid in ids:
            e = unacked.get(mid)
            out.append(e[2][1] if e is not None and e[2] is not None else None)
        return out

    def stats(self, now: float) -> dict:
        st = {"pid": self.pid, "role": self.role, "state": self.state.value, "node": self.me,
              **self.q.stats()}
        if self.state in LEADING:
            st["synced"] = self.synced_now()
            if self.sync is not None:
                st["sync"] = self.sync.pacer.progress(now)
        return st


CLIENT_OPS = {
    m.QPublish: Replica._op_publish,
    m.QSettle: Replica._op_settle,
    m.QConsume: Replica._op_consume,
    m.QCancel: Replica._op_cancel,
    m.QGet: Replica._op_get,
    m.QOwnerGone: Replica._op_owner_gone,
    m.QSessionGone: Replica._op_session_gone,
    m.QPurge: Replica._op_purge,
    m.QDeclareOk: Replica._op_declare_ok,
    m.QDelete: Replica._op_delete,
}
LEADER_REPLICATION = {
    m.RMirrorReady: Replica._on_mirror_ready,
    m.RRepOk: Replica._on_rep_ok,
    m.RMirrorReset: Replica._on_mirror_reset,
    m.RSyncOk: Replica._on_sync_ok,
}
MIRROR_REPLICATION = {
    m.RMirrorStart: Replica._on_mirror_start,
    m.RRep: Replica._on_rep,
    m.RSyncBatch: Replica._on_sync_batch,
    m.RSyncEnd: Replica._on_sync_end,
}
# what each state acts on; anything else is parked (client operations) or ignored
ACTS_ON: dict[State, dict] = {
    S.WAITING: {m.RMirrorStart: Replica._on_mirror_start, m.RRep: Replica._on_batch_not_following,
                m.RSyncBatch: Replica._on_batch_not_following},
    S.MIRROR: MIRROR_REPLICATION,
    S.MIRROR_SYNCING: MIRROR_REPLICATION,
    S.LEADER: {**CLIENT_OPS, **LEADER_REPLICATION},
    S.LEADER_SYNCING: LEADER_REPLICATION,  # the spec: the queue serves nothing else meanwhile
    S.LEADER_SYNCING_LIVE: {**CLIENT_OPS, **LEADER_REPLICATION},
    S.STOPPED: {},
}
