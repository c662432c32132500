"""Replication bookkeeping between a queue's leader and its mirrors. Pure: no I/O, no clock.

Theory of operation (the messages themselves are sent by broker/queue_process.py):

* The leader numbers each batch of effects it sends (`seq`, per leader epoch). A mirror applies
  batches in order and answers with the highest seq it has applied (`rep_ok`); a gap makes it
  restart empty, so a number is only ever taken by a batch that is sent (`record`).
  Acceptances with nothing to replicate (resends the leader had applied) wait under the last
  number sent (`after_sent`).
* Publishes are *accepted* (confirmed to the publisher, and released from the publishing
  session's flow-control window) only once every mirror that was following when they were
  applied has acknowledged their batch (spec: "a message will only be confirmed to the
  publisher when it has been accepted by all of the mirrors"). A mirror that stalls therefore
  holds publishers, until its node is declared down and it is removed.
* A mirror holds every message from its *start id* on (the first id it received from the
  leader), plus the older ones up to `synced_upto` that a (maybe cancelled) batch sync gave it.
  It is synchronised once the leader holds no message it lacks (natural sync: the head drained),
  or after a completed sync (start id 0: it holds everything).
* A mirror is only ever dropped by the metadata (a committed change); the leader never releases
  a confirm because a mirror merely went quiet. So a leader cut off from the majority holds its
  publishers instead of confirming what only it has.
* On a promotion the new leader offers its remaining mirrors to *resume*: a mirror that had
  applied exactly the same batches of the old leader as the new leader, and holds nothing the
  new leader lacks, keeps its state; any other mirror restarts empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def merge_accepted(into: dict, more: dict) -> dict:
    """Acceptances {session key: highest publish batch}: `more` folded into `into` (the higher
    batch wins, as an EvAccepted covers every batch up to it); returns `into`."""
    for key, pseq in more.items():
        if into.get(key, 0) < pseq:
            into[key] = pseq
    return into


@dataclass(slots=True)
class MirrorTrack:
    node: str
    start_id: int  # the leader's view of the mirror's start id (see module doc)
    acked: int  # highest batch seq the mirror acknowledged
    synced: bool = False
    synced_upto: int = 0  # the highest old id an earlier (cancelled) sync already gave it
    ready: bool = False  # the mirror answered its start (RMirrorReady)
    since: int = 0  # the batch seq it was started at (names its start among restarts)
    progress_at: float = 0.0  # when it last acknowledged something (or was added)
    # deliveries to consumers on its node go without their bodies, which it holds (Replica.
    # local_bodies); False once that node said it lacked some (until the mirror starts again)
    lends: bool = True


class LeaderReplication:
    """The leader's side: who follows, what they acknowledged, what can be accepted."""

    def __init__(self) -> None:
        self.seq = 0
        self.mirrors: dict[str, MirrorTrack] = {}
        self.pending: deque[tuple[int, dict]] = deque()  # (seq, {session key: pseq})

    def add(self, node: str, start_id: int, now: float = 0.0) -> MirrorTrack:
        """A mirror starts following from the next batch: earlier batches do not wait for it.
        ("The oldest mirror" is the metadata's mirror order, not kept here.)"""
        track = MirrorTrack(node, start_id, self.seq, False, progress_at=now, since=self.seq)
        self.mirrors[node] = track
        return track

    def remove(self, node: str) -> dict:
        """A mirror went away; returns what no longer waits for anyone."""
        self.mirrors.pop(node, None)
        return self._release()

    def record(self, accepted: dict) -> tuple[int, dict]:
        """A batch of effects is about to be sent. Returns its seq and what is accepted now
        (everything, when there is no mirror to wait for)."""
        self.seq += 1
        if not self.mirrors:
            return self.seq, accepted
        if accepted:
            self.pending.append((self.seq, accepted))
        return self.seq, {}

    def after_sent(self, accepted: dict) -> dict:
        """Acceptances that need no batch of their own (resent publishes this leader had
        applied already): they wait for every mirror to acknowledge what was sent so far, under
        no new seq, for a seq no batch carries is a gap to every mirror (which then restarts
        empty: dst seed 36073). Returns what is accepted now."""
        if not self.mirrors:
            return accepted
        if accepted:
            self.pending.append((self.seq, accepted))
        return self._release()

    def acknowledged(self, node: str, seq: int, now: float = 0.0) -> dict:
        track = self.mirrors.get(node)
        if track is None or seq <= track.acked:
            return {}
        track.acked = min(seq, self.seq)
        track.progress_at = now
        return self._release()

    def stalled(self, now: float, after: float) -> list[str]:
        """Mirrors that owe acknowledgements and have shown no progress for `after` seconds."""
        return [t.node for t in self.mirrors.values()
                if t.ready and t.acked < self.seq and now - t.progress_at > after]

    def _release(self) -> dict:
        if not self.pending:
            return {}
        low = min((t.acked for t in self.mirrors.values()), default=self.seq)
        out: dict = {}
        pending = self.pending
        while pending and pending[0][0] <= low:
            merge_accepted(out, pending.popleft()[1])
        return out

    def mirror_state(self, node: str, start_id: int, synced_upto: int = 0, now: float = 0.0) -> None:
        """The mirror told us what it holds (after its start, a resume or a completed sync): it
        is progress, so its silence is counted from `now` (a blocking sync of minutes leaves the
        mirror's last acknowledgement far behind, and batches sent during it are acknowledged
        only after it: counted from before, the mirror would be dropped as stalled at once)."""
        track = self.mirrors.get(node)
        if track is not None:
            track.progress_at = now
            track.start_id = start_id
            track.synced_upto = synced_upto
            track.ready = True
            if start_id:
                track.synced = False

    def newly_synced(self, holds_between) -> list[str]:
        """Mirrors that hold everything now. `holds_between(lo, hi)` says whether the leader
        holds a message with lo < id < hi (one the mirror lacks)."""
        out = []
        for t in self.mirrors.values():
            if not t.synced and t.ready and (t.start_id <= t.synced_upto + 1
                                             or not holds_between(t.synced_upto, t.start_id)):
                t.synced = True
                out.append(t.node)
        return out

    def synced(self) -> list[str]:
        return [t.node for t in self.mirrors.values() if t.synced]


@dataclass(slots=True)
class MirrorFollow:
    """The mirror's side: which leader epoch it follows, how far it has applied, and which
    messages it holds (every id from `start_id` on, and the old ones up to `synced_upto`)."""
    epoch: int = -1
    last_seq: int = 0
    start_id: int = 0
    synced_upto: int = 0
    sync_batch: int = 0  # the last batch of the leader's current sync taken (0: none yet)

    def accepts(self, epoch: int, seq: int) -> bool | None:
        """True: apply this batch. False: ignore it (an old leader's). None: a batch is missing
        (the mirror must restart)."""
        if epoch != self.epoch:
            return False
        if seq == self.last_seq + 1:
            return True
        if seq <= self.last_seq:
            return False
        return None

    def can_resume(self, old_epoch: int, old_seq: int, start_id: int, synced_upto: int) -> bool:
        """A new leader offers to continue: only if we applied exactly what it applied of the
        old leader, and hold no message it lacks. It holds ids up to `synced_upto` and from
        `start_id` on (all of them when start_id <= synced_upto + 1)."""
        if self.epoch != old_epoch or self.last_seq != old_seq:
            return False
        if start_id <= synced_upto + 1:
            return True
        return self.start_id >= start_id and self.synced_upto <= synced_upto
