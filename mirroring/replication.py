"""Replication bookkeeping between a queue's leader and its mirrors. Pure: no I/O, no clock.

Theory of operation (the messages themselves are sent by broker/queue_process.py):

* The leader numbers each batch of effects it sends (`seq`, per leader epoch). A mirror applies
  batches in order and answers with the highest seq it has applied (`rep_ok`).
* Publishes are *accepted* (confirmed to the publisher, and released from the publishing
  session's flow-control window) only once every mirror that was following when they were
  applied has acknowledged their batch (spec: "a message will only be confirmed to the
  publisher when it has been accepted by all of the mirrors"). A mirror that stalls therefore
  holds publishers, until its node is declared down and it is removed.
* A mirror knows its *start id*: the first message id it received from the leader. It is
  synchronised once the leader holds no message older than that (natural sync), or after a
  full sync has filled in the older messages (start id 0).
* On a promotion the new leader offers its remaining mirrors to *resume*: a mirror that had
  applied exactly the same batches of the old leader as the new leader, and lacks nothing the
  new leader has, keeps its state (and stays synchronised); any other mirror restarts empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class MirrorTrack:
    node: str
    start_id: int  # the leader's view of the mirror's start id (see module doc)
    acked: int  # highest batch seq the mirror acknowledged
    synced: bool = False
    synced_upto: int = 0  # the highest old id an earlier (cancelled) sync already gave it


class LeaderReplication:
    """The leader's side: who follows, what they acknowledged, what can be accepted."""

    def __init__(self) -> None:
        self.seq = 0
        self.mirrors: dict[str, MirrorTrack] = {}
        self.pending: deque[tuple[int, dict]] = deque()  # (seq, {session key: pseq})

    def add(self, node: str, start_id: int) -> MirrorTrack:
        """A mirror starts following from the next batch: earlier batches do not wait for it.
        ("The oldest mirror" is the metadata's mirror order, not kept here.)"""
        track = MirrorTrack(node, start_id, self.seq, False)
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

    def acknowledged(self, node: str, seq: int) -> dict:
        track = self.mirrors.get(node)
        if track is None or seq <= track.acked:
            return {}
        track.acked = min(seq, self.seq)
        return self._release()

    def _release(self) -> dict:
        if not self.pending:
            return {}
        low = min((t.acked for t in self.mirrors.values()), default=self.seq)
        out: dict = {}
        pending = self.pending
        while pending and pending[0][0] <= low:
            _, acc = pending.popleft()
            for key, pseq in acc.items():
                if out.get(key, 0) < pseq:
                    out[key] = pseq
        return out

    def mirror_state(self, node: str, start_id: int) -> None:
        """The mirror told us its real start id (after a resume or a reset)."""
        track = self.mirrors.get(node)
        if track is not None:
            track.start_id = start_id

    def newly_synced(self, oldest_id: int | None) -> list[str]:
        """Mirrors that hold everything now; `oldest_id` is the leader's oldest message id."""
        out = []
        for t in self.mirrors.values():
            if not t.synced and (oldest_id is None or oldest_id >= t.start_id):
                t.synced = True
                out.append(t.node)
        return out

    def synced(self) -> list[str]:
        return [t.node for t in self.mirrors.values() if t.synced]


@dataclass(slots=True)
class MirrorFollow:
    """The mirror's side: which leader epoch it follows and how far it has applied."""
    epoch: int = -1
    last_seq: int = 0
    start_id: int = 0

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

    def can_resume(self, old_epoch: int, old_seq: int, base_id: int) -> bool:
        """A new leader offers to continue: only if we applied exactly what it applied of the
        old leader, and hold nothing older than what it holds (`base_id`, its own start id)."""
        return self.epoch == old_epoch and self.last_seq == old_seq and self.start_id >= base_id
