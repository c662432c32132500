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
        f.epoch, f.last_seq = msg.epoch, msg.seq
        self.leader_node = msg.leader
        self._to(S.MIRROR)
        self._send(msg.leader, m.RMirrorReady(self.name, msg.epoch, self.me, f.start_id,
                                              f.synced_upto, how == "resumed", msg.seq))
        self._log("mirror following leader", leader=msg.leader, epoch=msg.epoch, how=how)

    def _on_rep(self, msg: m.RRep, now: float) -> None:
        ok = self.follow.accepts(msg.epoch, msg.seq)
        if ok:
            self.q.apply_effects(msg.effects, now)
            self.follow.last_seq = msg.seq
            self._ack_due = True
        elif ok is None:
            self._log("replication batch missing; mirror restarts", level="warning",
                      epoch=msg.epoch, seq=msg.seq, last=self.follow.last_seq)
            self.follow.epoch = -1
            self._told_not_following = (msg.epoch, now)  # (the batches behind it need no word)
            self._send(self.leader_node, m.RMirrorReset(self.name, msg.epoch, self.me))
            self._to(S.WAITING)

    def _on_rep_not_following(self, msg: m.RRep, now: float) -> None:
        """A replication batch reached this replica while it follows nobody (WAITING), from
        the leader of an epoch the metadata names: that leader counts a mirror here as
        following, and it is not this replica. A node applying several metadata changes at once
        (after a restart or a freeze) can stop its mirror and start a new one for the same
        queue; a start of the leader's that the old replica handled just before its stop came
        was answered by it (broker/router.py `_take_back_mirror_input` covers one still in its
        inbox), and the new replica never hears of one. Silent, it held every confirm until the
        leader gave up on it after net_ticktime (tests/test_process_restart_stall.py: 10 s). So
        it says so with RMirrorReset, as for a missing batch: the leader drops it through the
        metadata (a mirror leaves the set that confirms wait for only that way) and the planner
        adds it again, started afresh. Said again only after RETRY_PROPOSAL_AFTER (the leader's
        proposal may not have been committed), not for every batch behind the first."""
        epoch, when = self._told_not_following
        if msg.epoch < self.assign.epoch or self.me not in self.assign.mirrors \
                or (msg.epoch == epoch and now - when < RETRY_PROPOSAL_AFTER):
            return  # an old leader's batch, or its leader was told a moment ago
        self._told_not_following = (msg.epoch, now)
        self._log("replication batch for a mirror that is not following; asking to start again",
                  level="warning", epoch=msg.epoch, seq=msg.seq, leader=self.leader_node)
        self._send(self.leader_node, m.RMirrorReset(self.name, msg.epoch, self.me))

    def _on_sync_batch(self, msg: m.RSyncBatch, now: float) -> None:
        f = self.follow
        if msg.epoch != f.epoch:
            return
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
