"""The task that runs one queue replica on its node: the leader, or one of its mirrors.

Like an Erlang process: one task, one bounded inbox, so FIFO order and back-pressure come from the
structure. Each wake-up drains a batch of operations from the inbox, applies them to the pure
`QueueState`, then dispatches deliveries and sends every resulting event, grouped per client
session, and one replication batch per mirror, in one go. The rules of replication live in
mirroring/ (queue.py: effects; replication.py: acknowledgements, acceptance, sync status); this
file only moves their inputs and outputs.

Client operations (lists, so they cross peer links unchanged); `owner` is [node, session id, channel]:
  ["publish", owner, pseq, bodies, props]   pseq: the session's publish batch number
  ["consume", owner, rid, tag, no_ack, prefetch, exclusive, arguments]
  ["cancel", owner, rid, tag]
  ["get", owner, rid, no_ack]
  ["ack" | "requeue" | "discard", owner, ids]
  ["owner_gone", owner]          a channel closed
  ["session_gone", node, sid]    a connection closed
  ["purge", owner, rid]
  ["declare_ok", owner, rid]     answer [name, messages, consumers]
  ["delete", owner, rid, if_unused, if_empty]
A mirror parks client operations (they reach it while it is being promoted) and runs them once
it leads. Replication, leader -> mirror:
  ["mstart", epoch, leader_node, snapshot, resume, md_version, seq]   follow me from batch seq + 1
                                                     (resume: [old epoch, seq, base id])
  ["rep", epoch, seq, effects]
and mirror -> leader:
  ["mstate", epoch, node, start_id]   ["rep_ok", epoch, node, seq]
Batch sync (mirroring/sync.py decides what and when; the queue serves nothing else meanwhile):
  ["sync", why]                       (inbox, internal) start a sync after this round
  ["sync_start", epoch, total] ["sync_batch", epoch, n, messages] ["sync_end", epoch, completed]
  ["sync_ok", epoch, node, n]         mirror -> leader, delivered beside the (blocked) inbox
Events sent to sessions:
  ["deliver", ch, consumer_tag, queue, ids, bodies, redelivered_indexes, props]
  ["accepted", queue, pseq]      publishes up to pseq are on every mirror (confirm them)
  ["reply", rid, value] / ["fail", rid, ch, code, text]
  ["consume_ok", ch, rid, tag, queue, no_ack]
  ["get_ok", ch, rid, queue, message-or-nil, remaining]
  ["cancelled", ch, tag, queue, reason]
"""

from __future__ import annotations

import itertools

import trio

from mirroring.planner import ha_for
from mirroring.queue import QueueState
from mirroring.replication import LeaderReplication, MirrorFollow
from mirroring.sync import BatchSync, progress_line
from wire.errors import PRECONDITION_FAILED, ProtocolError

INBOX_SIZE = 512
BATCH = 512
ROUND_BYTES = 2 << 20  # publish bytes per round: a replication batch stays far below the frame limit
_serial = itertools.count(1)
REPLICA_OPS = frozenset({"mstart", "mstate", "rep_ok", "mreset", "sync_start", "sync_batch",
                         "sync_end"})
SYNC_PROGRESS_EVERY = 1.0  # seconds between sync progress log events


class QueueProcess:
    def __init__(self, node, qdef: dict, role: str):
        self.node = node
        self.qdef = qdef
        self.name = qdef["name"]
        self.role = role  # "leader" | "mirror"
        self.state = QueueState(self.name)
        self.pid = f"<{node.name}.{next(_serial)}.0>"
        self.inbox, self._recv = trio.open_memory_channel(INBOX_SIZE)
        self.out: dict[tuple, list] = {}
        self.scope = trio.CancelScope()
        self.stopped = False
        self.log = node.log.bind(queue=self.name)
        # leader side
        self.epoch = qdef.get("epoch", 1) if role == "leader" else -1
        self.rep = LeaderReplication()
        self.accepted: dict[tuple, int] = {}  # (node, sid) -> pseq, applied in this round
        self._round_bytes = 0
        self.base_id = 0  # the oldest id this replica could hold (its start id when it was a mirror)
        self._sync_proposed: list | None = None
        self.sync: BatchSync | None = None  # a batch sync in progress
        self.sync_acks: dict[str, int] = {}
        self.last_sync: dict | None = None
        self._sync_request = ""
        self._sync_wake = trio.Event()
        # mirror side
        self.follow = MirrorFollow()
        self.leader_node = qdef["leader"]
        self.parked: list = []
        self._ack_due = False
        self.min_version = 0  # the metadata version that listed this mirror (from its mstart)
        self.synced_upto = 0  # the highest old message id a (possibly cancelled) sync gave us
        if role == "leader":
            self.update_mirrors(qdef)

    # --- the task --------------------------------------------------------------------------
    async def run(self) -> None:
        recv = self._recv
        more = False
        with self.scope:
            while True:
                try:
                    op = recv.receive_nowait()
                except trio.WouldBlock:
                    # with deliveries left over (a dispatch stopped at its budget) go on without
                    # waiting for an operation: an auto-ack consumer sends none
                    op = None if more else await recv.receive()
                if op is not None:
                    self.handle(op)
                for _ in range(BATCH):
                    if self._round_bytes >= ROUND_BYTES:
                        break
                    try:
                        op = recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self.handle(op)
                self._round_bytes = 0
                more = self.flush()
                if self._sync_request:
                    await self._run_sync()
                    more = self.flush()
                if more:
                    await trio.lowlevel.checkpoint()

    def stop(self, reason: str, cancel_consumers: bool = True) -> None:
        """End the task. A deleted queue cancels its consumers; a replica that merely moved away
        (hand-over, demotion, mirror dropped) leaves them to the new leader."""
        if self.stopped:
            return
        self.stopped = True
        if self.role == "leader" and cancel_consumers:
            for c in list(self.state.consumers.values()):
                self.emit(c.owner, ["cancelled", c.owner[2], c.tag, self.name, reason])
            self.state.consumers.clear()
        if self.role == "leader":
            self.flush()
        self.scope.cancel()

    # --- operations ------------------------------------------------------------------------
    def handle(self, op: list) -> None:
        kind = op[0]
        if kind == "publish":
            if self.role != "leader":
                self.parked.append(op)
                return
            _, owner, pseq, bodies, props = op
            self._round_bytes += sum(map(len, bodies))
            state = self.state
            if not state.seen(owner, pseq):
                state.publish(bodies, props, owner[:2], pseq)
            self.accepted[(owner[0], owner[1])] = pseq
            return
        if kind == "rep":
            self._on_rep(op[1], op[2], op[3])
            return
        handler = getattr(self, "_op_" + kind, None)
        if handler is None:
            self.log.warning("unknown queue operation", op=kind)
            return
        if self.role != "leader" and kind not in REPLICA_OPS:
            self.parked.append(op)
            return
        handler(*op[1:])

    def _op_ack(self, owner, ids):
        self.state.ack(tuple(owner), ids)

    def _op_requeue(self, owner, ids):
        self.state.requeue(tuple(owner), ids)

    def _op_discard(self, owner, ids):
        self.state.discard(tuple(owner), ids)

    def _op_consume(self, owner, rid, tag, no_ack, prefetch, exclusive, arguments):
        owner = tuple(owner)
        if (owner, tag) in self.state.consumers:  # a resend after a failover: already here
            self.emit(owner, ["consume_ok", owner[2], rid, tag, self.name, no_ack])
            return
        try:
            self.state.add_consumer(owner, tag, no_ack, prefetch, exclusive, arguments)
        except ProtocolError as exc:
            self.emit(owner, ["fail", rid, owner[2], exc.code, exc.text])
            return
        self.emit(owner, ["consume_ok", owner[2], rid, tag, self.name, no_ack])

    def _op_cancel(self, owner, rid, tag):
        owner = tuple(owner)
        self.state.remove_consumer(owner, tag)
        self.emit(owner, ["reply", rid, tag])
        self._maybe_auto_delete()

    def _op_get(self, owner, rid, no_ack):
        owner = tuple(owner)
        msg = self.state.get(owner, no_ack)
        self.emit(owner, ["get_ok", owner[2], rid, self.name,
                          list(msg) if msg is not None else None, self.state.message_count])

    def _op_owner_gone(self, owner):
        self.state.owner_gone(tuple(owner))
        self._maybe_auto_delete()

    def _op_session_gone(self, node, sid):
        self.state.session_gone(node, sid)
        self._maybe_auto_delete()

    def _op_purge(self, owner, rid):
        self.emit(owner, ["reply", rid, self.state.purge()])

    def _op_declare_ok(self, owner, rid):
        self.emit(owner, ["reply", rid, [self.name, self.state.message_count, len(self.state.consumers)]])

    def _op_delete(self, owner, rid, if_unused, if_empty):
        if if_unused and self.state.consumers:
            self.emit(owner, ["fail", rid, owner[2], PRECONDITION_FAILED,
                              f"queue '{self.name}' in vhost '/' in use"])
        elif if_empty and self.state.message_count:
            self.emit(owner, ["fail", rid, owner[2], PRECONDITION_FAILED,
                              f"queue '{self.name}' in vhost '/' is not empty"])
        else:
            count = self.state.message_count
            self.node.spawn(self.node.delete_queue_then_reply, self.name, owner, rid, count)

    def node_down(self, node: str) -> None:
        """Consumers and unacked deliveries of sessions on a node that went down; a mirror there
        no longer holds up publishes."""
        if self.role != "leader":
            return
        self._release(self.rep.remove(node))
        if node in self.sync_acks:
            del self.sync_acks[node]
            self._sync_wake.set()
        self.state.node_gone(node)
        self._maybe_auto_delete()
        if self.sync is None:
            self.flush()  # during a sync the queue is blocked: the sync loop flushes at its end

    def _maybe_auto_delete(self):
        if self.qdef.get("auto_delete") and self.state.had_consumer and not self.state.consumers:
            self.state.had_consumer = False
            self.node.spawn(self.node.auto_delete_queue, self.name)

    # --- leader: mirrors -------------------------------------------------------------------
    def update_mirrors(self, qdef: dict, resume: list | None = None) -> None:
        """Follow the metadata's mirror list: start new mirrors, forget removed ones."""
        self.qdef = qdef
        wanted = [n for n in qdef.get("mirrors", ()) if n != self.node.name]
        self._ship()
        for node in list(self.rep.mirrors):
            if node not in wanted:
                self._release(self.rep.remove(node))
                self.log.info(f"Mirrored queue '{self.name}' in vhost '/': Dropping mirror on node {node}")
        new = [n for n in wanted if n not in self.rep.mirrors]
        if new:
            snap = self.state.mirror_snapshot()
            for node in new:
                self.rep.add(node, self.state.next_id)
                self.node.to_replica(node, self.name, ["mstart", self.epoch, self.node.name, snap, resume,
                                                       self.node.md.version, self.rep.seq])
                self.log.info(f"Mirrored queue '{self.name}' in vhost '/': Adding mirror on node {node}")
        self.state.effects = [] if self.rep.mirrors else None
        self._check_sync()
        if new and self.role == "leader" and ha_for(self.node.md.policies, qdef).sync_mode == "automatic":
            oldest = self.state.oldest_id()
            if oldest is not None and oldest < self.state.next_id:
                self.request_sync("ha-sync-mode automatic")

    def _op_mreset(self, node):
        """A mirror lost track (a batch went missing): start it again from scratch."""
        if self.role == "leader" and node in self.rep.mirrors:
            self._release(self.rep.remove(node))
            self.update_mirrors(self.qdef)

    def restart_epoch(self, qdef: dict) -> None:
        """The metadata gave this leader a new epoch (its node came back): mirrors start again."""
        self._ship()
        self.epoch = qdef.get("epoch", 1)
        for node in list(self.rep.mirrors):
            self._release(self.rep.remove(node))
        self.update_mirrors(qdef)

    def _op_mstate(self, epoch, node, start_id):
        if epoch == self.epoch:
            self.rep.mirror_state(node, start_id)
            self._check_sync()

    def _op_rep_ok(self, epoch, node, seq):
        if epoch == self.epoch and self.role == "leader":
            self._release(self.rep.acknowledged(node, seq))

    def _release(self, accepted: dict) -> None:
        name = self.name
        for key, pseq in accepted.items():
            self.emit(key, ["accepted", name, pseq])

    def _ship(self) -> None:
        """Send the effects applied so far to every mirror (one batch) and accept what can be."""
        effects = self.state.effects
        accepted, self.accepted = self.accepted, {}
        if effects:
            self.state.effects = []
            seq, now = self.rep.record(accepted)
            msg = ["rep", self.epoch, seq, effects]
            for node in self.rep.mirrors:
                self.node.to_replica(node, self.name, msg)
            self._release(now)
        elif accepted:
            if self.rep.mirrors:
                _, now = self.rep.record(accepted)
                self._release(now)
            else:
                self._release(accepted)

    def _check_sync(self) -> None:
        if self.role != "leader":
            return
        if any(not t.synced for t in self.rep.mirrors.values()):
            for node in self.rep.newly_synced(self.state.oldest_id()):
                self.log.info(f"Mirrored queue '{self.name}' in vhost '/': Synchronised mirror on node {node}")
        synced = sorted(self.rep.synced())
        if synced != sorted(self.qdef.get("synced", ())) and synced != self._sync_proposed:
            self._sync_proposed = synced
            self.node.spawn(self.node.report_synced, self.name, self.epoch, synced)

    # --- leader: batch sync ----------------------------------------------------------------
    def request_sync(self, why: str) -> bool:
        """Start a batch sync of the unsynchronised mirrors (False: nothing to do)."""
        if self.role != "leader" or not any(not t.synced for t in self.rep.mirrors.values()):
            return False
        self._sync_request = why
        self.node._to_inbox(self, ["sync", why])  # wakes the task if it waits for operations
        return True

    def _op_sync(self, why):
        pass  # request_sync already asked; this op only woke the task

    def cancel_sync(self) -> bool:
        if self.sync is None:
            return False
        self.sync.cancelled = True
        self._sync_wake.set()
        return True

    def _op_sync_ok(self, epoch, node, n, upto=0):
        track = self.rep.mirrors.get(node)
        if track is not None and epoch == self.epoch:
            track.synced_upto = max(track.synced_upto, upto)
        if epoch != self.epoch or self.sync is None or node not in self.sync_acks:
            return
        self.sync_acks[node] = max(self.sync_acks[node], n)
        low = min(self.sync_acks.values())
        self.sync.acked(low - self.sync.acked_batches)
        self._sync_wake.set()

    def on_sync_ok(self, op: list) -> None:
        self._op_sync_ok(*op[1:])

    async def _run_sync(self) -> None:
        """The spec's batch synchronisation: the queue serves nothing else until it is done or
        cancelled (its inbox waits; publishers are held, not failed)."""
        why, self._sync_request = self._sync_request, ""
        targets = [t for t in self.rep.mirrors.values() if not t.synced]
        if self.role != "leader" or not targets:
            return
        cfg = self.node.config
        ha = ha_for(self.node.md.policies, self.qdef)
        low = max(t.start_id for t in targets)
        done = min(t.synced_upto for t in targets)  # a cancelled sync already sent these
        state = self.state
        older = [m for m in state.ready if done < m[0] < low]
        older += [e[2] for e in state.unacked.values() if e[2] is not None and done < e[2][0] < low]
        older.sort()
        clock = trio.current_time
        batch_size = ha.sync_batch_size or cfg.mirroring_sync_batch_size
        # about 8192 messages unacknowledged at most, in at least 4 batches: small batches
        # still keep the link busy
        job = BatchSync(older, batch_size, cfg.max_frame - 65536, cfg.mirroring_sync_max_throughput,
                        clock(), window=max(4, min(4096, 8192 // batch_size)))
        self.sync = job
        self.sync_acks = {t.node: 0 for t in targets}
        names = sorted(self.sync_acks)
        q = f"Mirrored queue '{self.name}' in vhost '/'"
        self.log.info(f"{q}: Synchronising {job.total_msgs} messages to mirrors on {', '.join(names)}",
                      reason=why, batch_size=job.batch_size, max_throughput=job.max_rate,
                      bytes=job.total_bytes)
        for node in names:
            self.node.to_replica(node, self.name, ["sync_start", self.epoch, job.total_msgs])
        next_report = clock() + SYNC_PROGRESS_EVERY
        try:
            while not job.done and not job.cancelled and self.sync_acks:
                batch = job.next_batch(clock())
                if batch is not None:
                    msg = ["sync_batch", self.epoch, job.sent_batches, [list(m) for m in batch]]
                    for node in self.sync_acks:
                        self.node.to_replica(node, self.name, msg)
                    continue
                self._sync_wake = trio.Event()
                with trio.move_on_after(job.wait_time(clock()) or SYNC_PROGRESS_EVERY):
                    await self._sync_wake.wait()
                if clock() >= next_report:
                    next_report = clock() + SYNC_PROGRESS_EVERY
                    self.log.info(f"{q}: Synchronising: {progress_line(job.progress(clock()))}",
                                  **job.progress(clock()))
        finally:
            completed = job.done and not job.cancelled and bool(self.sync_acks)
            job.finished_at = clock()
            for node in self.sync_acks:
                self.node.to_replica(node, self.name, ["sync_end", self.epoch, completed])
            if completed:
                for node in self.sync_acks:
                    self.rep.mirror_state(node, 0)
            self.last_sync = {**job.progress(clock()), "status": "completed" if completed else
                              ("cancelled" if job.cancelled else "stopped"), "reason": why}
            self.sync, self.sync_acks = None, {}
            how = "complete" if completed else self.last_sync["status"]
            self.log.info(f"{q}: Synchronisation {how}: {job.msgs_sent} messages, "
                          f"{job.body_bytes_sent} bytes in {self.last_sync['elapsed']:.3f} s",
                          **self.last_sync)
            self._check_sync()

    # --- mirror ----------------------------------------------------------------------------
    def _op_sync_start(self, epoch, total):
        pass  # the batches carry everything; the log line is the leader's

    def _op_sync_batch(self, epoch, n, msgs):
        if epoch != self.follow.epoch or self.role == "leader":
            return
        start, upto = self.follow.start_id, self.synced_upto  # ids up to `upto` came in an earlier sync
        fresh = [m for m in msgs if upto < m[0] < start]
        if fresh:
            self.state.add_synced_messages(fresh)
            self.synced_upto = fresh[-1][0]
        self.node.to_replica(self.leader_node, self.name, ["sync_ok", epoch, self.node.name, n,
                                                           self.synced_upto])

    def _op_sync_end(self, epoch, completed):
        if epoch == self.follow.epoch and completed:
            self.follow.start_id = 0  # we hold everything the leader holds

    def _op_mstart(self, epoch, leader, snap, resume, md_version=0, seq=0):
        if self.role == "leader" or epoch < self.follow.epoch:
            return
        self.min_version = max(self.min_version, md_version)
        if resume is not None and self.follow.can_resume(*resume):
            how = "resumed"
        else:
            self.state.reset_as_mirror(snap)
            self.follow.start_id = snap["next_id"]
            self.synced_upto = 0
            how = "started empty"
        # the next batch is the leader's seq + 1 (a mirror added to a leader that has already
        # replicated to others does not start at batch 1)
        self.follow.epoch, self.follow.last_seq = epoch, seq
        self.leader_node = leader
        self.node.to_replica(leader, self.name, ["mstate", epoch, self.node.name, self.follow.start_id])
        self.log.info("mirror following leader", leader=leader, epoch=epoch, how=how)

    def _on_rep(self, epoch, seq, effects):
        if self.role == "leader":
            return
        ok = self.follow.accepts(epoch, seq)
        if ok:
            self.state.apply_effects(effects)
            self.follow.last_seq = seq
            self._ack_due = True
        elif ok is None:
            self.log.warning("replication batch missing; mirror restarts", epoch=epoch, seq=seq,
                             last=self.follow.last_seq)
            self.follow.epoch = -1
            self.node.to_replica(self.leader_node, self.name, ["mreset", self.node.name])

    def promote(self, qdef: dict, old_leader: str) -> None:
        """This mirror becomes the leader (spec, "Mirrored Queue Implementation and Semantics")."""
        resume = [self.follow.epoch, self.follow.last_seq, self.follow.start_id]
        self.role = "leader"
        self.epoch = qdef.get("epoch", 1)
        self.base_id = self.follow.start_id
        self.log.info(f"Mirrored queue '{self.name}' in vhost '/': Promoting mirror {self.pid} to leader",
                      old_leader=old_leader, epoch=self.epoch)
        self.update_mirrors(qdef, resume)
        if self.state.effects is None:
            self.state.effects = []
        cancelled = self.state.failover(old_leader)
        for c in cancelled:
            self.emit(c.owner, ["cancelled", c.owner[2], c.tag, self.name,
                                f"queue '{self.name}' in vhost '/' failed over to a new leader "
                                "(x-cancel-on-ha-failover)"])
        if not self.rep.mirrors:
            self.state.effects = None
        parked, self.parked = self.parked, []
        for op in parked:
            self.handle(op)
        self.flush()

    # --- output ----------------------------------------------------------------------------
    def emit(self, owner, event: list) -> None:
        key = (owner[0], owner[1])
        lst = self.out.get(key)
        if lst is None:
            self.out[key] = [event]
        else:
            lst.append(event)

    def flush(self) -> bool:
        """Dispatch deliveries, replicate, and send all pending events; True if more could be
        dispatched."""
        if self.role != "leader":
            if self._ack_due:
                self._ack_due = False
                self.node.to_replica(self.leader_node, self.name,
                                     ["rep_ok", self.follow.epoch, self.node.name, self.follow.last_seq])
            return False
        batches = self.state.dispatch()
        name = self.name
        for c, batch in batches:
            props = [m[2] for m in batch]
            self.emit(c.owner, [
                "deliver", c.owner[2], c.tag, name, [m[0] for m in batch], [m[1] for m in batch],
                [i for i, m in enumerate(batch) if m[3]],
                props if any(p is not None for p in props) else None,
            ])
        self._ship()
        if self.rep.mirrors and any(not t.synced for t in self.rep.mirrors.values()):
            self._check_sync()
        if self.out:
            out, self.out = self.out, {}
            to_session = self.node.to_session
            for (node, sid), events in out.items():
                to_session(node, sid, events)
        return bool(batches) and bool(self.state.ready)
