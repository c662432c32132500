"""A mirror's side of replication: starting (empty, or resuming what it held under an earlier
leader), applying its leader's replication batches in order, and taking a batch sync. Mixed
into `Replica` (mirroring/replica.py), whose state it shares."""

from __future__ import annotations

from wire import messages as m

from .replica_states import S


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
            self._send(self.leader_node, m.RMirrorReset(self.name, msg.epoch, self.me))
            self._to(S.WAITING)

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
