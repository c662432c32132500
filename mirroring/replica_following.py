"""A mirror's side of replication: starting (empty, or resuming what it held under an earlier
leader), applying its leader's replication batches in order, and taking a batch sync. Mixed
into `Replica` (mirroring/replica.py), whose state it shares."""

from __future__ import annotations

from wire import messages as m

from .replica_states import RETRY_PROPOSAL_AFTER, S


class Following:
    """The mirror's side (a part of `Replica`)."""

    def _on_mirror_start(self, msg: m.RMirrorStart, now: float) -> None:
        if msg.epoch < self.follow.epoch or msg.epoch < self.assign.epoch:
            return  # an older leader's
        f = self.follow
        if msg.resume is not None and f.can_resume(*msg.resume):
            how = "resumed"
        else:
            self.q.reset_as_mirror(msg.snapshot, now)
            f.start_id = msg.snapshot["next_id"]
            f.synced_upto = 0
            how = "started empty"
        f.epoch, f.last_seq, f.sync_batch = msg.epoch, msg.seq, 0
        self.leader_node = msg.leader
        self._to(S.MIRROR)
        self._send(msg.leader, m.RMirrorReady(self.name, msg.epoch, self.me, f.start_id,
                                              f.synced_upto, how == "resumed", msg.seq))
        self._log("mirror following leader", leader=msg.leader, epoch=msg.epoch, how=how, pid=self.pid)

    def _on_rep(self, msg: m.RRep, now: float) -> None:
        ok = self.follow.accepts(msg.epoch, msg.seq)
        if ok:
            self.q.apply_effects(msg.effects, now, msg.now)
            self.follow.last_seq = msg.seq
            self._ack_due = True
        elif ok is None:
            self._log("replication batch missing; mirror restarts", level="warning",
                      epoch=msg.epoch, seq=msg.seq, last=self.follow.last_seq)
            self.follow.epoch = -1
            self._told_not_following = (msg.epoch, now)  # (the batches behind it need no word)
            self._send(self.leader_node, m.RMirrorReset(self.name, msg.epoch, self.me))
            self._to(S.WAITING)

    def _on_batch_not_following(self, msg: m.RRep | m.RSyncBatch, now: float) -> None:
        """A replication or sync batch reached this replica while it follows nobody (WAITING),
        from the leader of an epoch the metadata names: that leader counts a mirror here as
        following, and it is not this replica. A node applying several metadata changes at once
        (after a restart, a freeze, or a start_app that catches up on what happened while its
        app was down) can stop its mirror and start a new one for the same queue; a start of
        the leader's that the old replica handled just before its stop came was answered by it
        (broker/router.py `_take_back_mirror_input` covers one still in its inbox), and the new
        replica never hears of one. Silent, it held every confirm until the leader gave up on
        it after net_ticktime (tests/test_process_restart_stall.py: 10 s). A sync batch is the
        same case: in ha-sync-mode automatic the leader starts a blocking sync the moment the
        mirror answers its start, and while it syncs it sends nothing else (client operations
        wait), so the sync's batches may be all this replica sees; ignored, the sync would
        wait net_ticktime for their acknowledgement with the queue blocked, then drop the
        mirror as one that stopped answering a sync. So either batch
        gets RMirrorReset, as for a missing batch: the leader drops the mirror through the
        metadata (a mirror leaves the set that confirms and a sync wait for only that way) and
        the planner adds it again, started afresh. Said again only after RETRY_PROPOSAL_AFTER
        (the leader's proposal may not have been committed), not for every batch behind the
        first."""
        epoch, when = self._told_not_following
        if msg.epoch < self.assign.epoch or self.me not in self.assign.mirrors \
                or (msg.epoch == epoch and now - when < RETRY_PROPOSAL_AFTER):
            return  # an old leader's batch, or its leader was told a moment ago
        self._told_not_following = (msg.epoch, now)
        kind = "sync" if isinstance(msg, m.RSyncBatch) else "replication"
        self._log(f"{kind} batch for a mirror that is not following; asking to start again",
                  level="warning", epoch=msg.epoch, leader=self.leader_node)
        self._send(self.leader_node, m.RMirrorReset(self.name, msg.epoch, self.me))

    def _on_sync_batch(self, msg: m.RSyncBatch, now: float) -> None:
        f = self.follow
        if msg.epoch != f.epoch or msg.n != f.sync_batch + 1:
            # (a batch after a gap: one went with a link its node replaced, and the leader
            # starts the sync again, ending this one first: see `link_replaced`)
            return
        f.sync_batch = msg.n
        if self.state is S.MIRROR:
            self._to(S.MIRROR_SYNCING)
        fresh = [x for x in msg.messages if f.synced_upto < x[0] < f.start_id]
        if fresh:
            self.q.add_synced_messages(fresh)
        if msg.upto > f.synced_upto:
            f.synced_upto = min(msg.upto, f.start_id - 1)
        self._send(self.leader_node, m.RSyncOk(self.name, msg.epoch, self.me, msg.n, f.synced_upto))

    def _on_sync_end(self, msg: m.RSyncEnd, now: float) -> None:
        if msg.epoch != self.follow.epoch:
            return
        self.follow.sync_batch = 0
        if msg.completed:
            self.follow.start_id = 0  # we hold everything the leader holds
            self.follow.synced_upto = 0
        self._to(S.MIRROR)

    def batches_alone(self, msgs, now: float) -> bool:
        """A mirror's round of nothing but replication batches (`msgs` must all be RRep): each
        applied as in a round, then the one acknowledgement the round ends with (`flush`), so
        the leader hears at once. Only for a mirror following its leader (MIRROR); False,
        having done nothing, otherwise. A follower's round has no timers and no dispatch, and
        the node's step with the metadata log matters only to a leader: nothing else is due."""
        if self.state is not S.MIRROR:
            return False
        for msg in msgs:
            self.handle(msg, now)  # (a missing batch turns us WAITING: the rest are then ignored)
        self.flush(now)
        return True
