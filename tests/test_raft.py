"""mirroring/raft.py on a little seeded world of its own: elections, replication, failures,
partitions, membership changes, snapshots, leadership transfer; and, over many random seeds, the
safety properties (one leader per term, committed entries never differ between nodes)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mirroring.changes import MemberAdd, MemberRemove
from mirroring.raft import NOOP, ChangeInProgress, NotLeader, Persistent, Raft, Role
from wire import messages as m

TIMEOUT = 1.0
ADD_D = MemberAdd("d", ("d", 1), ("d", 2))


class World:
    """Nodes exchanging Raft messages with random latency, drops, crashes and partitions."""

    def __init__(self, names, seed: int = 0, drop: float = 0.0, dup: float = 0.0,
                 latency=(0.001, 0.01)):
        self.rng = random.Random(seed)
        self.seed = seed
        self.now = 0.0
        self.drop = drop
        self.dup = dup
        self.latency = latency
        self.names = list(names)
        self.disk = {n: Persistent(snap_config=tuple(names), snap_data={"applied": []}) for n in names}
        self.nodes: dict[str, Raft] = {}
        self.applied: dict[str, list] = {}
        self.crashed: set[str] = set()
        self.cut: set[frozenset] = set()
        self.inflight: list = []
        self.leaders_by_term: dict[int, str] = {}
        self.committed: dict[int, list] = {}  # index -> change, as first applied anywhere
        for n in names:
            self.start(n)

    def start(self, name: str) -> None:
        state = self.disk[name]
        # a copy, as a restart reads it back (the changes here are opaque lists: raft reads
        # only membership changes; the state file's round trip is tests/test_statefile.py's)
        self.nodes[name] = Raft(name, dataclasses.replace(state, entries=list(state.entries)),
                                rng=random.Random(self.rng.random()), now=self.now,
                                election_timeout=TIMEOUT)
        self.applied[name] = []
        self.crashed.discard(name)

    def crash(self, name: str) -> None:
        self.crashed.add(name)
        self.inflight = [x for x in self.inflight if name not in (x[2], x[3])]
        for other in self.names:
            if other != name and other not in self.crashed:
                self.nodes[other].peer_down(self.now, name)

    def partition(self, *groups) -> None:
        self.cut = {frozenset((a, b)) for g1 in groups for g2 in groups if g1 is not g2
                    for a in g1 for b in g2}

    def heal(self) -> None:
        self.cut = set()

    def linked(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self.cut and a not in self.crashed and b not in self.crashed

    def _flush(self, name: str) -> None:
        node = self.nodes[name]
        if node.dirty:
            self.disk[name] = node.persistent()
        out, node.out = node.out, []
        for peer, msg in out:
            if self.rng.random() < self.drop:
                continue
            copies = 2 if self.rng.random() < self.dup else 1
            for _ in range(copies):
                at = self.now + self.rng.uniform(*self.latency)
                self.inflight.append((at, self.rng.random(), name, peer, msg))
        for kind, index, item in node.take_committed():
            if kind == "snapshot":
                self.applied[name] = list(item["applied"])
            else:
                self.applied[name].append(item)
                first = self.committed.setdefault(index, item)
                assert first == item, f"seed {self.seed}: index {index} committed as {first} and {item}"

    def step(self, dt: float = 0.005) -> None:
        self.now += dt
        due = sorted(x for x in self.inflight if x[0] <= self.now)
        self.inflight = [x for x in self.inflight if x[0] > self.now]
        for _, _, src, dst, msg in due:
            if dst in self.nodes and self.linked(src, dst):
                self.nodes[dst].receive(self.now, src, msg)
                self._flush(dst)
        for name in self.names:
            if name in self.crashed:
                continue
            node = self.nodes[name]
            node.tick(self.now)
            self._flush(name)
            if node.role is Role.LEADER:
                seen = self.leaders_by_term.setdefault(node.term, name)
                assert seen == name, f"seed {self.seed}: two leaders in term {node.term}: {seen}, {name}"
        self.check_prefixes()

    def check_prefixes(self) -> None:
        logs = sorted((self.applied[n] for n in self.names), key=len)
        for shorter, longer in zip(logs, logs[1:]):
            assert longer[:len(shorter)] == shorter, f"seed {self.seed}: applied logs diverge"

    def run(self, seconds: float, dt: float = 0.005) -> None:
        for _ in range(int(seconds / dt)):
            self.step(dt)

    def leader(self) -> str | None:
        live = [n for n in self.names if n not in self.crashed and self.nodes[n].role is Role.LEADER]
        live.sort(key=lambda n: -self.nodes[n].term)
        return live[0] if live else None

    def wait_leader(self, seconds: float = 10.0, among=None) -> str:
        for _ in range(int(seconds / 0.005)):
            self.step()
            lead = self.leader()
            if lead is not None and (among is None or lead in among):
                node = self.nodes[lead]
                if node.has_quorum_contact(self.now):
                    return lead
        raise AssertionError(f"seed {self.seed}: no leader after {seconds} s")

    def propose(self, change, seconds: float = 5.0, among=None) -> str:
        lead = self.wait_leader(seconds, among)
        self.nodes[lead].propose(change)
        self._flush(lead)
        return lead

    def wait_applied(self, change, names=None, seconds: float = 5.0) -> None:
        names = names or [n for n in self.names if n not in self.crashed]
        for _ in range(int(seconds / 0.005)):
            if all(change in self.applied[n] for n in names):
                return
            self.step()
        raise AssertionError(f"seed {self.seed}: {change} not applied on {names}: {self.applied}")


def test_a_single_node_leads_itself_at_once():
    w = World(["a"])
    w.run(0.1)
    assert w.leader() == "a"
    w.propose(["x", 1])
    w.wait_applied(["x", 1])


def test_three_nodes_elect_one_leader_and_replicate():
    w = World(["a", "b", "c"], seed=1)
    lead = w.wait_leader(3.0)
    assert w.now < 1.0, "the first election should not wait for a full election timeout"
    w.nodes[lead].propose(["q", "declare"])
    w.wait_applied(["q", "declare"])
    terms = {w.nodes[n].term for n in w.names}
    assert len(terms) == 1


def test_a_round_of_proposals_goes_to_each_follower_as_one_append():
    w = World(["a", "b", "c"], seed=3)
    lead = w.wait_leader(3.0)
    w.run(0.5)
    node = w.nodes[lead]
    node.out.clear()
    for i in range(5):
        node.propose(["q", i], send=False)
    assert not node.out, "proposed with send=False: nothing goes before replicate"
    node.replicate()
    appends = [(peer, msg) for peer, msg in node.out if type(msg) is m.RaftAppend]
    assert sorted(peer for peer, _ in appends) == sorted(n for n in w.names if n != lead)
    assert all([c for _, c in msg.entries] == [["q", i] for i in range(5)] for _, msg in appends)
    node.replicate()  # nothing new: nothing sent again
    assert len([x for x in node.out if type(x[1]) is m.RaftAppend]) == 2
    w._flush(lead)
    for i in range(5):
        w.wait_applied(["q", i])


def test_proposals_at_a_follower_are_refused_with_the_leader_named():
    w = World(["a", "b", "c"], seed=2)
    lead = w.wait_leader()
    w.run(0.2)
    follower = next(n for n in w.names if n != lead)
    with pytest.raises(NotLeader) as exc:
        w.nodes[follower].propose(["x"])
    assert exc.value.leader == lead


def test_killing_the_leader_elects_another_fast_when_the_failure_is_seen():
    w = World(["a", "b", "c"], seed=3)
    old = w.wait_leader()
    w.propose(["before"])
    w.wait_applied(["before"])
    t0 = w.now
    w.crash(old)
    new = w.wait_leader(among=[n for n in w.names if n != old])
    assert new != old
    assert w.now - t0 < 0.15, f"failover took {w.now - t0:.3f} s"
    w.propose(["after"], among=[new])
    w.wait_applied(["after"])


@pytest.mark.parametrize("seed", range(20))
def test_after_a_broken_link_the_survivors_ask_in_turn_and_the_first_wins(seed):
    """No random 20-100 ms wait after a kill: the first survivor by name asks within 5-15 ms,
    the next only 30 ms later, so on a local network the first one leads (and hears a majority) within 40 ms
    in steps of 5 ms."""
    w = World(["a", "b", "c"], seed=seed, latency=(0.0005, 0.002))
    old = w.wait_leader()
    w.propose(["before"])
    w.wait_applied(["before"])
    survivors = sorted(n for n in w.names if n != old)
    t0 = w.now
    w.crash(old)
    waits = {n: w.nodes[n].next_deadline() - t0 for n in survivors}
    assert 0.005 <= waits[survivors[0]] <= 0.015 and 0.035 <= waits[survivors[1]] <= 0.045, waits
    new = w.wait_leader(among=survivors)
    assert new == survivors[0], f"seed {seed}: {new} won, not {survivors[0]}"
    assert w.now - t0 < 0.04, f"seed {seed}: failover took {(w.now - t0) * 1000:.1f} ms"


def test_a_silent_leader_is_replaced_after_the_election_timeout():
    w = World(["a", "b", "c"], seed=4)
    old = w.wait_leader()
    others = [n for n in w.names if n != old]
    w.partition([old], others)  # silence, no broken link reported
    new = w.wait_leader(among=others, seconds=10)
    assert new in others
    assert not w.nodes[old].has_quorum_contact(w.now) or w.nodes[old].role is not Role.LEADER


def test_a_minority_cannot_commit_and_its_leader_steps_down():
    w = World(["a", "b", "c"], seed=5)
    old = w.wait_leader()
    others = [n for n in w.names if n != old]
    w.partition([old], others)
    w.nodes[old].propose(["lost-write"])
    w._flush(old)
    w.run(3 * TIMEOUT)
    assert w.nodes[old].role is not Role.LEADER, "check-quorum: an isolated leader steps down"
    assert not w.nodes[old].has_quorum_contact(w.now)
    assert ["lost-write"] not in w.applied[old]
    new = w.wait_leader(among=others)
    w.propose(["majority-write"], among=[new])
    w.wait_applied(["majority-write"], names=others)
    w.heal()
    w.wait_applied(["majority-write"])
    assert all(["lost-write"] not in w.applied[n] for n in w.names)


def test_in_step_means_a_leaders_word_came_lately_and_everything_it_committed_is_applied():
    """The read index a queue leader delivers under (broker/router.py `may_deliver`)."""
    w = World(["a", "b", "c"], seed=8)
    lead = w.wait_leader()
    w.run(0.5)
    assert all(w.nodes[n].in_step(w.now) for n in w.names)
    loner = next(n for n in w.names if n != lead)
    rest = [n for n in w.names if n != loner]
    w.partition([loner], rest)  # or frozen: nothing comes in
    w.run(TIMEOUT * 1.1)
    assert not w.nodes[loner].in_step(w.now)
    assert w.nodes[lead].in_step(w.now) and all(w.nodes[n].in_step(w.now) for n in rest)
    w.propose(["moved-while-away"], among=[lead])
    w.wait_applied(["moved-while-away"], names=rest)
    # the leader's first word after the heal names a commit the loner does not hold yet:
    # still out of step (it would act on old metadata), until it has applied it
    node, leader = w.nodes[loner], w.nodes[lead]
    node.receive(w.now, lead, m.RaftAppend(leader.term, leader.last_index, leader.last_term, [],
                                           leader.commit, w.now, w.now))  # fresh: echoes now
    w._flush(loner)
    assert not node.in_step(w.now) and ["moved-while-away"] not in w.applied[loner]
    w.heal()
    w.wait_applied(["moved-while-away"], names=[loner])
    w.run(0.1)
    assert node.in_step(w.now)
    # a leader cut off from the majority is out of step too (before check-quorum unseats it)
    w.partition([lead], [n for n in w.names if n != lead])
    w.run(TIMEOUT * 1.1)
    assert not w.nodes[lead].in_step(w.now)


def test_a_leaders_kept_quorum_answer_ends_with_its_last_majority_word_or_a_lost_peer():
    """The leader keeps its answer to `in_step` (asked at every round of every queue leader):
    heard from a majority until the majority's latest word plus the timeout, and not a moment
    longer. A peer lost (`peer_down`) ends the kept answer at once."""
    w = World(["a", "b", "c"], seed=8)
    lead = w.wait_leader()
    w.run(0.5)
    leader = w.nodes[lead]
    others = [n for n in w.names if n != lead]
    now = w.now
    assert leader.in_step(now) and leader.in_step(now)  # the second answer is the kept one
    # the majority's word: the later of the two peers' last acknowledgements
    until = max(leader._acked_at[n] for n in others) + leader.timeout
    assert leader.in_step(until) and not leader.in_step(until + 1e-6)
    assert leader.in_step(now)
    for n in others:
        leader.peer_down(now, n)
    assert not leader.in_step(now)


def test_words_that_waited_in_a_socket_through_a_freeze_do_not_put_a_node_in_step():
    """A node frozen (SIGSTOP) reads on waking what its peers sent before: an append of the
    leader it knew, or replies to its own appends if it led. Received now, they were sent
    before the freeze, and the cluster may have moved on meanwhile (dst seed 68350: a woken
    node took a leader's buffered heartbeat for fresh word and showed its consumer deliveries
    already redelivered elsewhere). Freshness is measured on the receiver's own clock, by the
    reply of its own that the word echoes."""
    w = World(["a", "b", "c"], seed=8)
    lead = w.wait_leader()
    w.run(0.5)
    follower = next(n for n in w.names if n != lead)
    node, leader = w.nodes[follower], w.nodes[lead]
    assert node.in_step(w.now)
    # a heartbeat the leader sent just before the freeze, read 3 election timeouts later
    stale = m.RaftAppend(leader.term, leader.last_index, leader.last_term, [], leader.commit,
                         w.now, leader._echo_for[follower])
    node.receive(w.now + 3 * TIMEOUT, lead, stale)
    assert not node.in_step(w.now + 3 * TIMEOUT)
    # the leader's side: a majority's replies that waited through its freeze are no quorum
    others = [n for n in w.names if n != lead]
    sent_at = w.now
    for n in others:
        leader.receive(w.now + 3 * TIMEOUT, n, m.RaftAppendReply(leader.term, True, leader.last_index,
                                                                 w.nodes[n]._reply_to[1], sent_at))
    assert not leader.in_step(w.now + 3 * TIMEOUT)


def test_a_node_back_from_a_partition_does_not_disturb_the_leader():
    w = World(["a", "b", "c"], seed=6)
    lead = w.wait_leader()
    w.run(0.5)
    loner = next(n for n in w.names if n != lead)
    rest = [n for n in w.names if n != loner]
    term = w.nodes[lead].term
    w.partition([loner], rest)
    w.run(8 * TIMEOUT)  # the loner keeps asking (pre-votes), without raising its term
    assert w.nodes[loner].term == term
    w.heal()
    w.run(2.0)
    assert w.leader() == lead and w.nodes[lead].term == term


def test_crash_and_restart_keeps_the_committed_log():
    w = World(["a", "b", "c"], seed=7)
    w.propose(["one"])
    w.wait_applied(["one"])
    for n in w.names:
        w.crash(n)
    for n in w.names:
        w.start(n)
    w.propose(["two"])
    w.wait_applied(["two"])
    assert all(w.applied[n][-2:] == [NOOP, ["two"]] or ["one"] in w.applied[n] for n in w.names)
    assert all(["one"] in w.applied[n] for n in w.names)


def test_membership_add_and_remove_one_at_a_time():
    w = World(["a", "b", "c"], seed=8)
    w.disk["d"] = Persistent()  # a node that joins starts from the leader's log
    lead = w.wait_leader()
    w.run(0.3)
    w.nodes[lead].propose(ADD_D)
    w._flush(lead)
    with pytest.raises(ChangeInProgress):
        w.nodes[lead].propose(MemberRemove("c"))
    w.names.append("d")
    w.disk["d"] = w.nodes[lead].persistent()
    w.disk["d"].voted_for = None
    w.start("d")
    w.wait_applied(ADD_D)
    assert w.nodes[lead].voters == ("a", "b", "c", "d")
    lead = w.propose(MemberRemove("c"))
    w.wait_applied(MemberRemove("c"), names=["a", "b", "d"])
    w.crash("c")
    w.names.remove("c")
    w.propose(["after-remove"])
    w.wait_applied(["after-remove"])


def test_unapplied_holds_the_changes_proposed_or_committed_but_not_yet_taken():
    """What the node dials from (broker/cluster.py `addresses`): the log's changes its caller
    has not applied, in order; applied ones leave it (a removed member's old member.add among
    them)."""
    w = World(["a", "b", "c"], seed=4)
    lead = w.wait_leader()
    w.run(0.3)
    node = w.nodes[lead]
    node.take_committed()
    assert node.unapplied() == []
    node.propose(["x", 1], send=False)
    node.propose(["x", 2], send=False)
    assert node.unapplied() == [["x", 1], ["x", 2]]  # not even sent yet
    w._flush(lead)
    w.wait_applied(["x", 2])
    assert node.unapplied() == []


def test_a_lagging_follower_gets_the_snapshot():
    w = World(["a", "b", "c"], seed=9)
    lead = w.wait_leader()
    lagging = next(n for n in w.names if n != lead)
    w.crash(lagging)
    for i in range(40):
        w.propose([f"w{i}"], among=[n for n in w.names if n != lagging])
    w.wait_applied(["w39"], names=[n for n in w.names if n != lagging])
    for n in w.names:
        if n != lagging:
            node = w.nodes[n]
            node.compact(node._taken, {"applied": list(w.applied[n])})
            assert node.snap_index > 30
    w.start(lagging)
    w.wait_applied(["w39"])
    assert w.nodes[lagging].snap_index > 30


def test_leadership_transfer_is_quick_and_keeps_the_log():
    w = World(["a", "b", "c"], seed=10)
    lead = w.wait_leader()
    w.propose(["x"])
    w.wait_applied(["x"])
    target = w.nodes[lead].transfer_leadership(w.now)
    w._flush(lead)
    assert target is not None
    with pytest.raises(NotLeader):
        w.nodes[lead].propose(["refused during the transfer"])
    t0 = w.now
    new = w.wait_leader(among=[target])
    assert new == target and w.now - t0 < 0.1
    w.propose(["y"], among=[target])
    w.wait_applied(["y"])


def test_vote_messages_decode_as_wire_messages():
    from wire.schema import decode, to_wire
    for msg in (m.RaftVote(3, 10, 2, True, False), m.RaftAppend(3, 9, 2, [[3, ["noop"]]], 8, 1.5, 1.25),
                m.RaftAppendReply(3, True, 10, 2.5, 1.5), m.RaftSnapshot(3, 9, 2, ["a"], {"x": 1}),
                m.RaftVoteReply(3, False, False), m.RaftTimeoutNow(4)):
        assert decode(to_wire(msg)) == msg


@pytest.mark.parametrize("seed", range(60))
def test_random_faults_never_break_safety_and_a_healed_cluster_makes_progress(seed):
    w = World(["a", "b", "c", "d", "e"][: 3 + seed % 3], seed=seed, drop=0.05, dup=0.05,
              latency=(0.0005, 0.03))
    rng = random.Random(seed)
    n = 0
    for _ in range(25):
        action = rng.random()
        live = [x for x in w.names if x not in w.crashed]
        if action < 0.15 and len(live) > 1:
            w.crash(rng.choice(live))
        elif action < 0.3 and w.crashed:
            w.start(rng.choice(sorted(w.crashed)))
        elif action < 0.4:
            names = list(w.names)
            rng.shuffle(names)
            k = rng.randint(1, len(names) - 1)
            w.partition(names[:k], names[k:])
        elif action < 0.5:
            w.heal()
        lead = w.leader()
        if lead is not None:
            try:
                # a round of one to three proposals, sent as one append (as the cluster's driver
                # proposes what queued up meanwhile)
                for _ in range(1 + n % 3):
                    w.nodes[lead].propose(["w", n], send=False)
                    n += 1
                w.nodes[lead].replicate()
                w._flush(lead)
            except (NotLeader, ChangeInProgress):
                pass
        w.run(rng.uniform(0.05, 1.5))
    w.heal()
    for x in sorted(w.crashed):
        w.start(x)
    w.propose(["final"], seconds=20)
    w.wait_applied(["final"], seconds=20)
