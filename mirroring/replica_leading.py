"""A leading replica's side of replication: starting and dropping its mirrors, shipping each
round's effects to them as one batch, releasing confirms once every mirror has acknowledged
them (or holding them while its node is out of step or leaving), and reporting which mirrors
are synchronised. Mixed into `Replica` (mirroring/replica.py), whose state it shares."""

from __future__ import annotations

from wire import messages as m

from .changes import QueueSynced
from .policy import choose_promotion
from .replica_states import LEADING, S
from .replication import merge_accepted

SYNCED_CHECK_EVERY = 0.05  # seconds between natural-sync checks (they cost O(unacked))
# Acks alone do not make a replication batch at once: they wait up to this long to ride with the
# next batch that carries publishes (nothing waits on them; a failover within the window only
# redelivers, flagged, what was acked in it). At a steady moderate rate this halves the batches,
# and so the mirrors' answers and every node's wake-ups (see "Acks ride with publishes").
SETTLE_LINGER = 0.004


class Leading:
    """The leader's replication and confirms (a part of `Replica`)."""

    def _update_mirrors(self, now: float, resume: list | None = None) -> None:
        """Follow the metadata's mirror list: start new mirrors, forget removed ones."""
        wanted = [n for n in self.assign.mirrors if n != self.me]
        self._ship(now)
        for node in list(self.rep.mirrors):
            if node not in wanted:
                self._release(self.rep.remove(node))
                if self.sync is not None:
                    self.sync.acks.pop(node, None)
                self._log(f"{self.qlog}: Dropping mirror on node {node}")
        new = [n for n in wanted if n not in self.rep.mirrors]
        if new:
            snap = self.q.mirror_snapshot(now=now)
            for node in new:
                self.rep.add(node, self.q.next_id, now)
                self._send(node, m.RMirrorStart(self.name, self.epoch, self.me, snap, resume,
                                                self.rep.seq))
                self._log(f"{self.qlog}: Adding mirror on node {node}")
        self.q.effects = [] if self.rep.mirrors else None
        if self.sync is not None and not self.sync.acks:
            self._end_sync(False, now, "no mirror left to synchronise")
        if new and self.assign.ha.sync_mode in ("automatic", "background"):
            self.request_sync(f"ha-sync-mode {self.assign.ha.sync_mode}", now)

    def _on_mirror_ready(self, msg: m.RMirrorReady, now: float) -> None:
        track = self.rep.mirrors.get(msg.node)
        if msg.epoch != self.epoch or track is None or msg.since != track.since:
            return  # an answer to an earlier start of this mirror
        self.rep.mirror_state(msg.node, msg.start_id, msg.synced_upto, now)
        how = "resumed" if msg.resumed else "started empty"
        self._log(f"{self.qlog}: mirror on node {msg.node} {how}", start_id=msg.start_id)
        self._synced_check_at = 0.0
        if self.assign.ha.sync_mode in ("automatic", "background") and not self.sync_wanted:
            self.request_sync(f"ha-sync-mode {self.assign.ha.sync_mode}", now)

    def _on_rep_ok(self, msg: m.RRepOk, now: float) -> None:
        if msg.epoch == self.epoch:
            self._release(self.rep.acknowledged(msg.node, msg.seq, now))

    def acks_alone(self, msgs, now: float) -> bool:
        """A round of nothing but mirrors' acknowledgements, taken without the rest of a round
        (its timers, dispatch, replication, the sync's step), when they could not have anything
        to do: the commonest round of a leader under a steady load (one per mirror per batch),
        and the one its confirms wait for. Only for a leader neither syncing nor about to
        start one, with no confirms held back; `msgs` must all be RRepOk. The confirms they
        release are emitted as in a round (`in_step` and `leaving` set by the caller first).
        False, having done nothing: the caller runs an ordinary round.

        Why nothing else can be due: an acknowledgement changes only the mirror's track (how
        far it acknowledged, when it last showed progress) and which confirms are released.
        Dispatch depends on ready messages and consumers' credit, replication on effects of
        operations, the sync on its own answers and clock, and the timers come back through
        `next_deadline`, which an acknowledgement does not move."""
        if self.state is not S.LEADER or self.sync is not None or self.sync_wanted \
                or self._held_confirms:
            return False
        epoch, rep = self.epoch, self.rep
        for msg in msgs:
            if msg.epoch == epoch:
                self._release(rep.acknowledged(msg.node, msg.seq, now))
        return True

    def _on_mirror_reset(self, msg: m.RMirrorReset, now: float) -> None:
        if msg.epoch == self.epoch and msg.node in self.rep.mirrors:
            self._drop_mirror(msg.node, "it lost track of the replication stream", now)

    def _outlives_its_node(self) -> bool:
        """Will what this leader confirms outlive its node, which is leaving? Only if a mirror
        that holds it will lead once the node has gone: the leader's replica goes with its node
        (in memory), so with no mirror the log may promote on a controlled stop
        (ha-promote-on-shutdown), a confirm would be for a message about to be lost. Such
        confirms are held: the publish is resent by its session to wherever the queue goes on,
        or nacked if it has nowhere to go (dst seed 111127: a node was promoted in the middle of
        its own stop_app, held the queue's only replica, confirmed 500 publishes and lost them
        with its app a moment later). A confirmed publish is on every mirror the leader tracks."""
        mirrors = list(self.rep.mirrors)
        return choose_promotion(self.assign.ha, mirrors, set(self.assign.synced), set(mirrors),
                                shutdown=True) is not None

    def _holds_confirms(self) -> bool:
        """Must confirms wait (in `_held_confirms`)? While this node is out of step with the
        metadata log, or leaving with nothing that would outlive it (`_outlives_its_node`)."""
        return not self.in_step or self.leaving and not self._outlives_its_node()

    def _release(self, accepted: dict) -> None:
        if self._holds_confirms():
            merge_accepted(self._held_confirms, accepted)
            return
        name = self.name
        for key, pseq in accepted.items():
            self.emit(key, m.EvAccepted(name, pseq))

    def _holds_settles(self, now: float) -> bool:
        """Keep this round's effects for a later batch? Only when they are all acks, no publish
        waits for the batch, and the first of them is younger than SETTLE_LINGER."""
        effects = self.q.effects
        if self.accepted or not self.rep.mirrors:
            return False
        seen = self._settles_seen
        for i in range(seen, len(effects)):
            if type(effects[i]) is not m.ESettle:
                return False
        self._settles_seen = len(effects)
        if self._settles_since is None:
            self._settles_since = now
        return now < self._settles_since + SETTLE_LINGER

    def _ship(self, now: float, linger: bool = False) -> None:
        """Send the effects applied so far to every mirror (one batch) and accept what can be.
        `linger`: the end of an ordinary round, where acks alone may wait (SETTLE_LINGER)."""
        q = self.q
        effects = q.effects
        if effects and linger and self._holds_settles(now):
            return
        self._settles_since = None
        self._settles_seen = 0
        accepted, self.accepted = self.accepted, {}
        if effects:
            q.effects = []
            seq, released = self.rep.record(accepted)
            msg = m.RRep(self.name, self.epoch, seq, effects, now)
            for node in self.rep.mirrors:
                self._send(node, msg)
            self._release(released)
        elif accepted:  # resends recognised: nothing to replicate, no batch number to use
            self._release(self.rep.after_sent(accepted))

    def holds_between(self, lo: int, hi: int) -> bool:
        """Does this replica hold a message with lo < id < hi?"""
        q = self.q
        return bool(q.ready_between(lo, hi, 1)) or any(lo < mid < hi for mid in q.unacked)

    def _report_synced(self, now: float) -> None:
        if now - self._synced_check_at < SYNCED_CHECK_EVERY and self._synced_check_at:
            return
        self._synced_check_at = now
        if any(not t.synced for t in self.rep.mirrors.values()):
            for node in self.rep.newly_synced(self.holds_between):
                self._log(f"{self.qlog}: Synchronised mirror on node {node}")
        synced = sorted(self.rep.synced())
        if synced != sorted(self.assign.synced):
            self._propose_once(("synced", tuple(synced), self.epoch),
                               QueueSynced(self.name, self.epoch, tuple(synced)), now)

    def synced_now(self) -> list:
        return sorted(self.rep.synced()) if self.state in LEADING else []
