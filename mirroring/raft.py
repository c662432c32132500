"""The cluster's metadata log: Raft, as a pure state machine.

Everything that decides who leads the metadata log, what is in it and what is committed lives in
this file. It does no I/O, reads no clock and draws no random numbers of its own: time comes in as
`now`, randomness from the `rng` it is given (so a simulation replays it from a seed), and what
it wants done comes out as data for the caller (broker/cluster.py) to carry out:

* `out`: messages to send, `[(peer, message), ...]`;
* `dirty`: the persistent state changed; save `persistent()` BEFORE sending `out` (a vote or an
  acknowledged entry must survive a crash, or two leaders could share a term);
* `take_committed()`: committed entries (and snapshots) to apply to the metadata, in order.

Theory of operation (the Raft paper, with the usual production extensions):

* Every cluster member is a voter. A change is committed once a majority of the voters hold it,
  so two sides of a partition can never both commit: the metadata cannot fork.
* Terms and elections as in Raft, with *pre-vote* (a node first asks whether it could win, so
  a node coming back from a partition does not disrupt a healthy leader), *leader stickiness*
  (a voter that heard from a leader within the election timeout grants no vote) and
  *check-quorum* (a leader that has not heard from a majority within the election timeout steps
  down, so an isolated leader knows it is isolated).
* `peer_down` is the failure detector's news (a broken link, or `net_ticktime` of silence): when
  the leader is the one that went, followers start a pre-vote at once (after a short random
  delay) instead of waiting for the election timeout. That is what makes a kill -9 of the
  leader's node a sub-100 ms affair.
* Membership is part of the log: `member.add` / `member.remove` entries change the voter set as
  soon as they are *appended* (Raft's single-server change), one change at a time, and only
  after the leader has committed an entry of its own term.
* The log is compacted into a snapshot of the metadata (`compact`); a follower that is behind
  the snapshot receives it whole (`RaftSnapshot`).
* `in_step(now)` is this node's *read index*: it knows the metadata as the cluster has it now.
  A follower is in step when an append of the current leader came within the election timeout
  and it holds and has handed out everything that append said is committed; a leader, while a
  majority answered within the election timeout. "Within" is measured on the node's own clock
  by a round trip, not by when a message was read: every append echoes the follower's clock
  from its latest reply the leader had (`echo`), every reply the leader's clock from the
  append it answers. A node woken from a freeze reads first what waited in its sockets, sent
  before the freeze; those echoes are old, so it stays out of step until a leader's word comes
  *after* the freeze, and what it does on the strength of the metadata (a queue leader's
  deliveries, a session showing them) waits until it knows whether it was replaced meanwhile.
  The price: a node whose round trip to the log's leader takes longer than the election timeout
  less a heartbeat is out of step for as long as the link is that slow (its queue leaders hold
  deliveries and confirms; it cannot tell a slow link from a freeze).
* `transfer_leadership` hands the leadership to an up-to-date voter (`RaftTimeoutNow`), for a
  controlled stop of the leader's node.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from wire import messages as m

from .changes import Change, MemberAdd, MemberRemove, Noop, decode_entries

NOOP = Noop()
MAX_APPEND = 256  # entries per append message


class Role(enum.Enum):
    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre-candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


class NotLeader(Exception):
    """Proposals go to the leader; `leader` is who that is, if known."""

    def __init__(self, leader: str | None):
        super().__init__(f"not the leader (leader: {leader or 'unknown'})")
        self.leader = leader


class ChangeInProgress(Exception):
    """A membership change is already under way; propose the next one after it commits."""


def config_after(config: tuple, change: Change) -> tuple:
    """The voter set after a membership change (other changes leave it alone)."""
    t = type(change)
    if t is MemberAdd and change.name not in config:
        return (*config, change.name)
    if t is MemberRemove and change.name in config:
        return tuple(n for n in config if n != change.name)
    return config


def is_membership(change: Change) -> bool:
    return type(change) in (MemberAdd, MemberRemove)


@dataclass(slots=True)
class Persistent:
    """What must survive a restart: the term, the vote, the snapshot and the log after it."""
    term: int = 0
    voted_for: str | None = None
    snap_index: int = 0
    snap_term: int = 0
    snap_config: tuple = ()
    # the metadata's snapshot (mirroring/metadata.py `snapshot`: a records.Snapshot, or one as
    # it came off the wire or out of the state file)
    snap_data: object = None
    entries: list = field(default_factory=list)  # [(term, change)], index snap_index + 1 on

    def to_dict(self) -> dict:
        return {"term": self.term, "voted_for": self.voted_for, "snap_index": self.snap_index,
                "snap_term": self.snap_term, "snap_config": list(self.snap_config),
                "snap_data": self.snap_data, "entries": [[t, c] for t, c in self.entries]}

    @classmethod
    def from_dict(cls, d: dict) -> "Persistent":
        """The state `to_dict` gave, or that as it came off the wire or out of the state file
        (the entries' changes are checked and typed: ProtocolError if they are not changes)."""
        return cls(d["term"], d["voted_for"], d["snap_index"], d["snap_term"],
                   tuple(d["snap_config"]), d["snap_data"], decode_entries(d["entries"]))


class Raft:
    def __init__(self, me: str, state: Persistent, *, rng: random.Random, now: float,
                 election_timeout: float = 1.0, heartbeat: float | None = None,
                 quick_election: float = 0.02):
        self.me = me
        self.rng = rng
        self.timeout = election_timeout
        self.heartbeat = heartbeat if heartbeat is not None else election_timeout / 4
        self.quick = quick_election
        self.term = state.term
        self.voted_for = state.voted_for
        self.snap_index = state.snap_index
        self.snap_term = state.snap_term
        self.snap_config = tuple(state.snap_config)
        self.snap_data = state.snap_data
        self.log: list = list(state.entries)
        self.role = Role.FOLLOWER
        self.leader: str | None = None
        self.commit = self.snap_index
        self._taken = self.snap_index  # committed entries already handed out by take_committed
        self._snapshot_due = state.snap_data is not None
        self.out: list = []
        self.dirty = False
        self._configs: list[tuple[int, tuple]] = []
        self._rebuild_configs()
        # follower / candidate
        self._heard_leader_at = -1e18
        self._leader_commit = 0  # the commit index the leader's last append told us of
        self._in_step_until = -1e18  # in step until then, if caught up with that commit
        self._reply_to = (-1e18, now)  # (the leader's clock on the append we answer, ours)
        self._echo_for: dict[str, float] = {}  # leader: each follower's clock on its last reply
        # a node that boots knows of no leader: ask soon (pre-vote makes an early ask harmless)
        self._election_at = now if self.voters == (me,) else now + self._soon()
        self._votes: set[str] = set()
        # leader
        self._next: dict[str, int] = {}
        self._match: dict[str, int] = {}
        self._acked_at: dict[str, float] = {}
        self._quorum_until = -1e18  # _quorum_heard's kept answer: heard until then, for these voters
        self._quorum_for: tuple | None = None
        self._heartbeat_at = now
        self._transferring = False
        self._now = now

    # --- the log -----------------------------------------------------------------------------
    @property
    def last_index(self) -> int:
        return self.snap_index + len(self.log)

    @property
    def last_term(self) -> int:
        return self.log[-1][0] if self.log else self.snap_term

    def term_at(self, index: int) -> int | None:
        if index == self.snap_index:
            return self.snap_term
        if index < self.snap_index or index > self.last_index:
            return None
        return self.log[index - self.snap_index - 1][0]

    def _rebuild_configs(self) -> None:
        configs = [(self.snap_index, self.snap_config)]
        for i, (_, change) in enumerate(self.log, self.snap_index + 1):
            if is_membership(change):
                configs.append((i, config_after(configs[-1][1], change)))
        self._configs = configs

    @property
    def voters(self) -> tuple:
        """The latest voter set in the log, committed or not (single-server changes)."""
        return self._configs[-1][1]

    def _majority(self) -> int:
        return len(self.voters) // 2 + 1

    def _append(self, change: Change) -> int:
        self.log.append((self.term, change))
        index = self.last_index
        if is_membership(change):
            self._configs.append((index, config_after(self.voters, change)))
        self.dirty = True
        return index

    def _truncate_from(self, index: int) -> None:
        del self.log[index - self.snap_index - 1:]
        while self._configs and self._configs[-1][0] >= index:
            self._configs.pop()
        self.dirty = True

    def persistent(self) -> Persistent:
        self.dirty = False
        return Persistent(self.term, self.voted_for, self.snap_index, self.snap_term,
                          self.snap_config, self.snap_data, list(self.log))

    # --- what the caller applies -------------------------------------------------------------
    def take_committed(self) -> list:
        """Newly committed items, in order: ("snapshot", index, data) when a snapshot replaced
        the state, then ("entry", index, change) for each entry."""
        out = []
        if self._snapshot_due:
            self._snapshot_due = False
            out.append(("snapshot", self.snap_index, self.snap_data))
            self._taken = max(self._taken, self.snap_index)
        while self._taken < self.commit:
            self._taken += 1
            out.append(("entry", self._taken, self.log[self._taken - self.snap_index - 1][1]))
        return out

    def unapplied(self) -> list:
        """The changes in the log the caller has not yet applied (`take_committed`), committed
        or not, in order."""
        return [change for _, change in self.log[max(self._taken - self.snap_index, 0):]]

    def compact(self, index: int, data) -> None:
        """Replace the log up to `index` (already applied) with a snapshot of the metadata."""
        if index <= self.snap_index or index > self._taken:
            return
        term = self.term_at(index)
        config = self.voters_at(index)
        del self.log[:index - self.snap_index]
        self.snap_index, self.snap_term, self.snap_config, self.snap_data = index, term, config, data
        self._rebuild_configs()
        self.dirty = True

    def voters_at(self, index: int) -> tuple:
        config = self.snap_config
        for i, c in self._configs:
            if i <= index:
                config = c
        return config

    # --- time --------------------------------------------------------------------------------
    def _timeout(self) -> float:
        return self.timeout * (1.0 + self.rng.random())

    def _soon(self) -> float:
        """A short random delay: quick elections when a failure is seen, spread out enough
        that two followers seldom ask at the same moment (a split vote)."""
        return self.quick * (1.0 + 4.0 * self.rng.random())

    def _turn_after_leader_lost(self, lost: str) -> float:
        """When the leader's link breaks, every surviving voter sees it at about the same moment.
        Rather than each waiting a random 20-100 ms, they take turns in the order of their
        names: the first asks after 5-15 ms (long enough for the others to have seen the break
        too, or they would refuse to unseat a leader they still trust), the next 30 ms later,
        and so on. The first usually wins at once; a later one asks only if it has not heard
        of a new leader by its turn (the first was behind in the log, or is gone too)."""
        survivors = sorted(v for v in self.voters if v != lost)
        rank = survivors.index(self.me) if self.me in survivors else len(survivors)
        return self.quick * (0.25 + 1.5 * rank + 0.5 * self.rng.random())

    def next_deadline(self) -> float:
        if self.role is Role.LEADER:
            return self._heartbeat_at
        return self._election_at

    def tick(self, now: float) -> None:
        self._now = now
        if self.role is Role.LEADER:
            if not self._quorum_heard(now):
                self._become_follower(self.term, None, now)
                return
            if now >= self._heartbeat_at:
                self._broadcast_append(now)
            return
        if now >= self._election_at:
            if self.me in self.voters:
                self._start_pre_vote(now)
            else:  # not (or no longer) a voter: nothing to do but wait to hear from a leader
                self._election_at = now + self._timeout()

    def _quorum_heard(self, now: float) -> bool:
        # Asked at every round of every queue leader (`in_step`), so the answer is kept: the
        # time until which the majority heard from stays heard. It only moves later while the
        # voters and the record of who acknowledged when stay as they are (acknowledgements
        # only ever raise a time); whatever lowers one (a peer down, a new term) drops it.
        voters = self.voters
        if now < self._quorum_until and voters is self._quorum_for:
            return True
        acked = self._acked_at
        times = sorted((1e18 if p == self.me else acked.get(p, -1e18) for p in voters), reverse=True)
        until = times[self._majority() - 1] + self.timeout
        self._quorum_until, self._quorum_for = until, voters
        return now <= until

    def has_quorum_contact(self, now: float) -> bool:
        """Is this node in touch with a working majority (a leader it heard from lately, or
        being that leader)? A node that is not pauses its clients (pause_minority)."""
        if self.role is Role.LEADER:
            return self._quorum_heard(now)
        return self.leader is not None and now - self._heard_leader_at <= self.timeout * 2

    def in_step(self, now: float) -> bool:
        """Does this node know the metadata as the cluster has it now (see the module's theory)?"""
        if self.role is Role.LEADER:
            return self._quorum_heard(now)
        return now < self._in_step_until and self._taken >= self._leader_commit

    def peer_down(self, now: float, peer: str) -> None:
        """The failure detector says `peer` is gone (its link broke or fell silent)."""
        if peer == self.leader and self.role is not Role.LEADER:
            self.leader = None
            self._heard_leader_at = -1e18
            self._election_at = min(self._election_at, now + self._turn_after_leader_lost(peer))
        elif self.role is Role.LEADER:
            self._acked_at.pop(peer, None)
            self._quorum_until = -1e18

    def peer_up(self, now: float, peer: str) -> None:
        """A link to `peer` came up: a leader brings it up to date at once."""
        if self.role is Role.LEADER and peer in self.voters and peer != self.me:
            self._acked_at[peer] = now
            self._send_append(peer, heartbeat=True)
        elif self.role is not Role.LEADER and self.leader is None:
            # no leader known (booting, or it just went): someone new to ask a vote of
            self._election_at = min(self._election_at, now + self._soon())

    # --- elections ---------------------------------------------------------------------------
    def _up_to_date(self, last_index: int, last_term: int) -> bool:
        return (last_term, last_index) >= (self.last_term, self.last_index)

    def _sticky(self, now: float) -> bool:
        """Heard from a live leader lately: refuse to help unseat it."""
        if self.role is Role.LEADER:
            return True
        return self.leader is not None and now - self._heard_leader_at < self.timeout

    def _start_pre_vote(self, now: float) -> None:
        self.role = Role.PRE_CANDIDATE
        self.leader = None
        self._votes = {self.me}
        self._election_at = now + self._timeout()
        msg = m.RaftVote(self.term + 1, self.last_index, self.last_term, True, False)
        for p in self.voters:
            if p != self.me:
                self.out.append((p, msg))
        self._check_votes(now)

    def _start_election(self, now: float, transfer: bool = False) -> None:
        self.role = Role.CANDIDATE
        self.term += 1
        self.voted_for = self.me
        self.leader = None
        self.dirty = True
        self._votes = {self.me}
        # a majority answered the pre-vote, so a failed election is a split vote: retry soon
        self._election_at = now + self._soon() * 2
        msg = m.RaftVote(self.term, self.last_index, self.last_term, False, transfer)
        for p in self.voters:
            if p != self.me:
                self.out.append((p, msg))
        self._check_votes(now)

    def _check_votes(self, now: float) -> None:
        if len(self._votes & set(self.voters)) < self._majority():
            return
        if self.role is Role.PRE_CANDIDATE:
            self._start_election(now)
        elif self.role is Role.CANDIDATE:
            self._become_leader(now)

    def _become_follower(self, term: int, leader: str | None, now: float) -> None:
        if term > self.term:
            self.term = term
            self.voted_for = None
            self.dirty = True
        self.role = Role.FOLLOWER
        self.leader = leader
        self._transferring = False
        if leader is not None:
            self._heard_leader_at = now
        self._election_at = now + self._timeout()

    def _become_leader(self, now: float) -> None:
        self.role = Role.LEADER
        self.leader = self.me
        self._transferring = False
        self._next = {p: self.last_index + 1 for p in self.voters if p != self.me}
        self._match = {p: 0 for p in self._next}
        self._acked_at = {p: now for p in self._next}
        self._quorum_until = -1e18
        self._append(NOOP)  # commits everything before it, and allows membership changes
        self._broadcast_append(now)
        self._advance_commit()

    def _on_vote(self, now: float, peer: str, msg: m.RaftVote) -> None:
        if msg.pre:
            granted = (msg.term >= self.term and not self._sticky(now)
                       and self._up_to_date(msg.last_index, msg.last_term))
            self.out.append((peer, m.RaftVoteReply(msg.term if granted else self.term, granted, True)))
            return
        if msg.term < self.term or (self._sticky(now) and not msg.transfer and msg.term > self.term):
            self.out.append((peer, m.RaftVoteReply(self.term, False, False)))
            return
        if msg.term > self.term:
            self._become_follower(msg.term, None, now)
        granted = (self.voted_for in (None, peer)
                   and self._up_to_date(msg.last_index, msg.last_term))
        if granted:
            self.voted_for = peer
            self.dirty = True
            self._election_at = now + self._timeout()
        self.out.append((peer, m.RaftVoteReply(self.term, granted, False)))

    def _on_vote_reply(self, now: float, peer: str, msg: m.RaftVoteReply) -> None:
        if msg.pre:
            if self.role is Role.PRE_CANDIDATE and msg.granted and msg.term == self.term + 1:
                self._votes.add(peer)
                self._check_votes(now)
            elif msg.term > self.term:
                self._become_follower(msg.term, None, now)
            return
        if msg.term > self.term:
            self._become_follower(msg.term, None, now)
        elif self.role is Role.CANDIDATE and msg.term == self.term and msg.granted:
            self._votes.add(peer)
            self._check_votes(now)

    # --- replication -------------------------------------------------------------------------
    def propose(self, change: Change, send: bool = True) -> int:
        """Append a change (leader only); returns its index. It is committed once
        take_committed hands it out. `send=False` leaves it for `replicate`, so that a round of
        proposals goes to each follower as one append, not one append per change."""
        if self.role is not Role.LEADER or self._transferring:
            raise NotLeader(None if self._transferring else self.leader)
        if is_membership(change):
            if self._configs[-1][0] > self.commit:
                raise ChangeInProgress("a membership change is still being committed")
            if self.term_at(self.commit) != self.term:
                raise ChangeInProgress("the new leader has not committed an entry of its own yet")
            if type(change) is MemberAdd and change.name not in self.voters:
                self._next[change.name] = self.last_index + 1
                self._match[change.name] = 0
                # a joining node is counted as heard from now: check-quorum gives it an election
                # timeout to start (with two members, its acknowledgement is the majority)
                self._acked_at[change.name] = self._now
        index = self._append(change)
        if send:
            self.replicate()
        self._advance_commit()
        return index

    def replicate(self) -> None:
        """Send each follower the entries it has not been sent yet (up to MAX_APPEND in one
        append; its reply brings the rest)."""
        for p in self.voters:
            if p != self.me:
                self._send_append(p)

    def _broadcast_append(self, now: float) -> None:
        self._heartbeat_at = now + self.heartbeat
        for p in self.voters:
            if p != self.me:
                self._send_append(p, heartbeat=True)

    def _send_append(self, peer: str, heartbeat: bool = False) -> None:
        nxt = self._next.setdefault(peer, self.last_index + 1)
        self._match.setdefault(peer, 0)
        if nxt <= self.snap_index:
            self.out.append((peer, m.RaftSnapshot(self.term, self.snap_index, self.snap_term,
                                                  list(self.snap_config), self.snap_data or {})))
            self._next[peer] = self.snap_index + 1
            return
        if nxt > self.last_index and not heartbeat:
            return
        prev = nxt - 1
        lo = nxt - self.snap_index - 1
        entries = [[t, c] for t, c in self.log[lo:lo + MAX_APPEND]]
        self.out.append((peer, m.RaftAppend(self.term, prev, self.term_at(prev), entries, self.commit,
                                            self._now, self._echo_for.get(peer, -1e18))))
        self._next[peer] = nxt + len(entries)  # pipelined: a refusal winds it back

    def _advance_commit(self) -> None:
        matches = sorted((self.last_index if p == self.me else self._match.get(p, 0))
                         for p in self.voters)
        if not matches:
            return
        n = matches[len(matches) - self._majority()]
        if n > self.commit and self.term_at(n) == self.term:
            self.commit = n
            for p in self.voters:  # followers learn the commit now, not at the next heartbeat
                if p != self.me:
                    self._send_append(p, heartbeat=True)
            if self.me not in self.voters_at(self.commit):
                # our own removal is committed: hand over to whoever the others elect
                self.role = Role.FOLLOWER
                self.leader = None

    def _refuse_stale(self, now: float, peer: str) -> None:
        """Answer a leader of an older term with ours (it steps down); the reply echoes no clock
        of its, so it credits that leader with nothing."""
        self.out.append((peer, m.RaftAppendReply(self.term, False, 0, now, -1e18)))

    def _on_append(self, now: float, peer: str, msg: m.RaftAppend) -> None:
        if msg.term < self.term:
            self._refuse_stale(now, peer)
            return
        self._become_follower(msg.term, peer, now)
        self._leader_commit = msg.commit
        # fresh only as of our own reply the leader had heard when it sent this: an append that
        # waited in a socket through a freeze says nothing about now
        self._in_step_until = min(msg.echo, now) + self.timeout
        self._reply_to = (msg.sent, now)
        prev = msg.prev_index
        if prev > self.last_index:
            self._reply(peer, False, self.last_index + 1)
            return
        entries = msg.entries
        if prev < self.snap_index:  # the start is already in our snapshot (committed): skip it
            skip = self.snap_index - prev
            entries = entries[skip:]
            prev = self.snap_index
            if msg.prev_index + len(msg.entries) < self.snap_index:
                self._reply(peer, True, self.snap_index)
                return
        elif self.term_at(prev) != msg.prev_term:
            # a conflict: retry from the first index of our conflicting term
            bad = self.term_at(prev)
            back = prev
            while back > self.snap_index + 1 and self.term_at(back - 1) == bad:
                back -= 1
            self._reply(peer, False, max(back, self.commit + 1))
            return
        index = prev
        for term, change in entries:
            index += 1
            if index <= self.last_index:
                if self.term_at(index) == term:
                    continue
                self._truncate_from(index)
            self.log.append((term, change))
            if is_membership(change):
                self._configs.append((index, config_after(self.voters, change)))
            self.dirty = True
        if msg.commit > self.commit:
            self.commit = min(msg.commit, index)
        self._reply(peer, True, index)

    def _reply(self, peer: str, ok: bool, index: int) -> None:
        """Answer the leader's latest append or snapshot, echoing the clock it was sent at."""
        sent, now = self._reply_to
        self.out.append((peer, m.RaftAppendReply(self.term, ok, index, now, sent)))

    def _on_append_reply(self, now: float, peer: str, msg: m.RaftAppendReply) -> None:
        if msg.term > self.term:
            self._become_follower(msg.term, None, now)
            return
        if self.role is not Role.LEADER or msg.term != self.term:
            return
        # heard as of the append this answers (a reply that waited in a socket is old news)
        heard = min(msg.echo, now)
        if heard > self._acked_at.get(peer, -1e18):
            self._acked_at[peer] = heard
        if msg.sent > self._echo_for.get(peer, -1e18):
            self._echo_for[peer] = msg.sent
        if msg.ok:
            if msg.index > self._match.get(peer, 0):
                self._match[peer] = msg.index
                self._advance_commit()
            if self._next.get(peer, 0) <= msg.index:
                self._next[peer] = msg.index + 1
            if self._next[peer] <= self.last_index and self._next[peer] == msg.index + 1:
                self._send_append(peer)
        else:
            self._next[peer] = max(1, min(msg.index, self.last_index + 1))
            self._send_append(peer, heartbeat=True)

    def _on_snapshot(self, now: float, peer: str, msg: m.RaftSnapshot) -> None:
        if msg.term < self.term:
            self._refuse_stale(now, peer)
            return
        self._become_follower(msg.term, peer, now)
        self._reply_to = (-1e18, now)  # a snapshot carries no clock: its reply credits nothing
        if msg.index <= self.commit:
            self._reply(peer, True, self.commit)
            return
        if self.term_at(msg.index) == msg.last_term:
            del self.log[:msg.index - self.snap_index]  # keep what follows it
        else:
            self.log = []
        self.snap_index, self.snap_term = msg.index, msg.last_term
        self.snap_config, self.snap_data = tuple(msg.config), msg.data
        self._rebuild_configs()
        self.commit = max(self.commit, msg.index)
        self._taken = min(self._taken, msg.index)
        self._snapshot_due = True
        self.dirty = True
        self._reply(peer, True, msg.index)

    def _on_timeout_now(self, now: float, peer: str, msg: m.RaftTimeoutNow) -> None:
        if msg.term == self.term and self.me in self.voters and self.role is not Role.LEADER:
            self._start_election(now, transfer=True)

    def transfer_leadership(self, now: float) -> str | None:
        """Leader only: hand over to the most up-to-date other voter; returns its name."""
        if self.role is not Role.LEADER:
            return None
        others = [p for p in self.voters if p != self.me and now - self._acked_at.get(p, -1e18) <= self.timeout]
        if not others:
            return None
        best = max(others, key=lambda p: (self._match.get(p, 0), -self.voters.index(p)))
        if self._match.get(best, 0) < self.last_index:
            self._send_append(best)
        self._transferring = True
        self.out.append((best, m.RaftTimeoutNow(self.term)))
        return best

    # --- input -------------------------------------------------------------------------------
    def receive(self, now: float, peer: str, msg) -> None:
        """A Raft message from `peer` (a member we have a link with)."""
        self._now = now
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            raise ValueError(f"not a raft message: {msg!r}")
        handler(self, now, peer, msg)


_HANDLERS = {
    m.RaftVote: Raft._on_vote,
    m.RaftVoteReply: Raft._on_vote_reply,
    m.RaftAppend: Raft._on_append,
    m.RaftAppendReply: Raft._on_append_reply,
    m.RaftSnapshot: Raft._on_snapshot,
    m.RaftTimeoutNow: Raft._on_timeout_now,
}
