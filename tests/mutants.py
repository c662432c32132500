"""Fault injection into the code itself: do the tests catch what they claim to?

Each mutant below breaks one promise of the broker on purpose (acks not replicated, no requeue on
promotion, resent publishes not de-duplicated, ...). For each, this script copies the working
tree, applies the mutant, runs the tests that should catch it, and reports whether they did. A
mutant that survives (its tests still pass) means a test that cannot fail: the script exits 1.

    python tests/mutants.py            # all mutants (a few minutes)
    python tests/mutants.py ack-not-replicated no-dedup   # some of them
    make mutants

A mutant is (name, file, the exact text to replace, its replacement, the tests to run). When the
code moves on, the script says which mutant no longer applies: mend its text here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SIM = ["tests/test_sim_mirroring.py"]
PROPERTY = ["tests/test_replica_property.py", "tests/test_replication_property.py"]


@dataclass
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: list
    what: str


MUTANTS = [
    Mutant("ack-not-replicated", "mirroring/queue.py",
           "        if self.effects is not None:\n            self.effects.append(ESettle(owner, how, ids))",
           "        if self.effects is not None and how != ACK:\n            self.effects.append(ESettle(owner, how, ids))",
           PROPERTY + ["tests/test_process_mirroring.py::test_kill9_of_leader_under_load_promotes_oldest_mirror_and_loses_no_confirmed_message"],
           "a consumer's acks are applied by the leader but never reach the mirrors"),
    Mutant("no-requeue-on-promotion", "mirroring/queue.py",
           "        for owner in sorted({o for (o, _, _) in self.unacked.values()}):\n"
           "            self._requeue(owner, [mid for mid, (o, _, _) in self.unacked.items() if o == owner])",
           "        pass",
           SIM + PROPERTY,
           "a promoted mirror does not requeue what was delivered but not acknowledged"),
    Mutant("no-redelivered-flag-on-promotion", "mirroring/queue.py",
           "        self.redeliver_below = max(self.redeliver_below, below)",
           "        pass",
           SIM,
           "a promoted mirror delivers what the old leader may have delivered without the flag"),
    Mutant("no-dedup", "mirroring/replica.py",
           "        if not q.seen(owner, msg.pseq):\n            limits = self.assign.limits",
           "        if True:\n            limits = self.assign.limits",
           ["tests/test_sim_mirroring.py::test_publishes_resent_to_a_new_leader_are_not_enqueued_twice",
            "tests/test_process_faults.py"],
           "a publish batch resent to a new leader is enqueued again"),
    Mutant("leader-delivers-out-of-step", "broker/router.py",
           "        if self._in_step(now):\n            return True\n        self._held.add(qp)",
           "        if True:\n            return True\n        self._held.add(qp)",
           ["tests/test_sim_partitions.py"],
           "a queue leader out of step with the metadata log (cut off, or woken from a freeze) "
           "delivers before it knows whether it was replaced"),
    Mutant("stale-link-read-handed-on", "broker/peers.py",
           "                            if now - self.last_heard > stale_after:",
           "                            if False:",
           ["tests/test_network.py"],
           "a peer link hands on what waited in its socket across a freeze"),
    Mutant("raft-retry-waits-for-liveness-tick", "broker/cluster.py",
           "        if raft.next_deadline() < self._sleeping_until:",
           "        if False:",
           ["tests/test_dst_regressions.py::test_regression_seeds"],
           "the metadata log's driver sleeps past a timer a message moved earlier (split votes)"),
    Mutant("deliveries-to-a-gone-session-kept", "broker/router.py",
           "                self.to_leader(ev.queue, m.QOwnerGone(ev.queue, (self.name, sid, ev.ch)))",
           "                pass",
           ["tests/test_dst_regressions.py::test_regression_seeds", "tests/test_sim_lent_bodies.py::test_deliveries_for_a_consumer_its_node_no_longer_has_go_back"],
           "a leader keeps feeding the consumers of a session that no longer exists"),
    Mutant("deliveries-to-a-closed-channel-kept", "broker/session/consumers.py",
           "        self.host.to_leader(ev.queue, m.QOwnerGone(ev.queue, (self.me, self.sid, ev.ch)))",
           "        pass",
           ["tests/test_dst_regressions.py::test_regression_seeds", "tests/test_sim_lent_bodies.py::test_deliveries_for_a_consumer_its_node_no_longer_has_go_back"],
           "a leader keeps feeding a consumer whose channel closed before a failover"),
    Mutant("leader-confirms-out-of-step", "mirroring/replica_leading.py",
           "        return not self.in_step or self.leaving and not self._outlives_its_node()\n",
           "        return self.leaving and not self._outlives_its_node()\n",
           ["tests/test_replica_property.py"],
           "a queue leader out of step with the metadata log (woken from a freeze) confirms"),
    Mutant("client-no-nack-on-loss", "broker/client/aio.py",
           "                ch.nacked.append((s, s, \"connection lost\"))\n"
           "                if ch.on_confirm is not None:\n"
           "                    ch.on_confirm(s, s, False, \"connection lost\")",
           "                pass",
           ["tests/test_sim_cluster.py::test_publishes_lost_with_their_connection_are_nacked_by_the_client",
            "tests/test_process_faults.py"],
           "publishes lost with a connection are neither confirmed nor nacked"),
    Mutant("sync-limit-ignored", "mirroring/sync.py",
           "        if not self.max_rate:\n            return self.started\n"
           "        return self.started + self.body_bytes_sent / self.max_rate",
           "        return self.started",
           ["tests/test_sync_plan.py", "tests/test_process_sync.py"],
           "mirroring_sync_max_throughput is not enforced"),
    Mutant("confirm-without-the-metadata", "mirroring/replica.py",
           "        self.q.node_gone(ev.node, False)\n        self._maybe_auto_delete()\n"
           "        if ev.node in self.rep.mirrors:",
           "        self.q.node_gone(ev.node, False)\n        self._maybe_auto_delete()\n"
           "        self._release(self.rep.remove(ev.node))\n        if ev.node in self.rep.mirrors:",
           ["tests/test_replica_property.py", "tests/test_sim_partitions.py"],
           "a leader that loses touch with a mirror confirms without it, before the metadata drops it"),
    Mutant("no-consumer-reregistration", "broker/session/core.py",
           "        ops += [c for ch in self.channels.values() for c in ch.consumers.values()\n"
           "                if c.queue == qname and c.arguments.get(\"x-cancel-on-ha-failover\") is not True]",
           "        pass",
           ["tests/test_sim_partitions.py", "tests/test_process_faults.py"],
           "consumers registered only with a leader that stepped down stop receiving"),
    Mutant("stale-deliveries-shown", "broker/session/core.py",
           "                    if ev.epoch < route[1]:\n                        self._stale_delivery(ch, ev)\n                        continue\n",
           "                    if False:\n                        self._stale_delivery(ch, ev)\n                        continue\n",
           ["tests/test_session_core.py", "tests/test_sim_session.py"],
           "deliveries a deposed leader sent late reach the client, unflagged, after the new leader's"),
    Mutant("replaced-link-forgotten", "broker/cluster_links.py",
           "                self.hooks.link_replaced(name)\n",
           "",
           ["tests/test_sim_session.py"],
           "what was in flight on a link another link replaced is never given back (a consumer's credit is lost)"),
    Mutant("raft-commit-without-majority", "mirroring/raft.py",
           "    def _majority(self) -> int:\n        return len(self.voters) // 2 + 1",
           "    def _majority(self) -> int:\n        return 1",
           ["tests/test_raft.py"],
           "the metadata log commits what only its leader holds"),
    Mutant("inline-round-keeps-old-timer", "broker/queue_process.py",
           "                self._sleep.deadline = deadline\n",
           "                pass\n",
           ["tests/test_sim_mirroring.py::test_a_last_ack_reaches_the_mirrors_within_the_settle_linger"],
           "a round run at the end of a peer batch leaves the queue task's timer where it was, "
           "so acks held for a batch wait a second instead of 4 ms"),
    Mutant("acks-held-until-a-publish", "mirroring/replica_leading.py",
           "        return now < self._settles_since + SETTLE_LINGER",
           "        return True",
           PROPERTY + ["tests/test_sim_mirroring.py::test_a_last_ack_reaches_the_mirrors_within_the_settle_linger"],
           "acks alone wait for the next publish batch however long that takes"),
    Mutant("cork-never-writes", "broker/framed.py",
           "        if direct.write(self._take_parts()):",
           "        if direct.rest.extend(self._take_parts()) or True:",
           ["tests/test_cork.py"],
           "corked output is always handed to the writer task (the direct write is dead code)"),
    Mutant("stopping-node-still-delivers", "broker/session/core.py",
           "                if leaving:\n                    continue",
           "                if False:\n                    continue",
           ["tests/test_sim_freeze.py", "tests/test_dst_regressions.py::test_regression_seeds"],
           "a node whose shutdown record is on its way still shows late deliveries, unflagged, "
           "after the leader redelivered them elsewhere (dst seed 30123)"),
    Mutant("link-back-pressure-dropped", "broker/session/publishing.py",
           "                self.full_links.append(qname)",
           "                pass",
           ["tests/test_inline_input.py"],
           "a publisher to a remote leader is never held by a full peer link"),
    Mutant("deliveries-to-an-unlinked-node-kept", "broker/router.py",
           "        else:\n            self._deliveries_lost(node, events)\n",
           "\n",
           ["tests/test_dst_regressions.py::test_regression_seeds"],
           "a leader with no link to a consumer's node drops its deliveries but counts them in "
           "flight (dst seed 67947)"),
    Mutant("lend-from-a-mirror-that-started-later", "mirroring/replica.py",
           "(t.synced or low >= t.start_id)",
           "True",
           ["tests/test_sim_lent_bodies.py"],
           "a leader counts on a mirror for bodies of messages older than its start"),
    Mutant("lacking-mirror-lends-again", "mirroring/replica.py",
           "            if t is not None:\n                t.lends = False",
           "            if t is not None:\n                pass",
           ["tests/test_sim_lent_bodies.py"],
           "a leader keeps sending deliveries without bodies to a node whose mirror lacked them"),
    Mutant("no-catch-up-before-lending", "broker/router.py",
           "        if None in bodies and qp.catch_up():",
           "        if False:",
           ["tests/test_sim_lent_bodies.py"],
           "a busy mirror lends nothing it has not applied yet: deliveries come back flagged"),
    Mutant("sessions-shown-out-of-step", "broker/router.py",
           "        if not self._in_step():\n            self._held_for_sessions = msgs",
           "        if False:\n            self._held_for_sessions = msgs",
           ["tests/test_sim_freeze.py", "tests/test_dst_regressions.py::test_regression_seeds"],
           "a node woken from a freeze shows its sessions what waited in its sockets before it "
           "knows whether the cluster counted it down"),
    Mutant("in-step-on-a-buffered-append", "mirroring/raft.py",
           "        self._in_step_until = min(msg.echo, now) + self.timeout",
           "        self._in_step_until = now + self.timeout",
           ["tests/test_raft.py", "tests/test_sim_freeze.py"],
           "a node woken from a freeze takes an append that waited in its socket for fresh word"),
    Mutant("quorum-answer-kept-past-a-lost-peer", "mirroring/raft.py",
           "            self._acked_at.pop(peer, None)\n            self._quorum_until = -1e18\n",
           "            self._acked_at.pop(peer, None)\n",
           ["tests/test_raft.py"],
           "a leader that lost its peers still answers in step from its kept quorum answer"),
    Mutant("quorum-on-buffered-replies", "mirroring/raft.py",
           "        heard = min(msg.echo, now)",
           "        heard = now",
           ["tests/test_raft.py"],
           "a leader woken from a freeze takes its followers' buffered replies for a quorum"),
    Mutant("links-to-a-counted-down-node-kept", "broker/cluster.py",
           "            if md.up.get(node) == run or (md.up.get(node) is None and md.down.get(node) == \"failure\"):\n",
           "            if False:\n",
           ["tests/test_sim_freeze.py"],
           "a node keeps its link to a node the log counted down: what it sent before the record "
           "reaches that node's consumer after the flagged redelivery elsewhere"),
    Mutant("down-and-up-in-a-snapshot-unseen", "broker/node.py",
           "                down_now = was_up and (self._counted_down or counted and went_down)\n",
           "                down_now = was_up and self._counted_down\n",
           ["tests/test_sim_freeze.py"],
           "a node that learns from a snapshot that its run went down and came back up shows its "
           "consumers deliveries the leaders already requeued, flagged, for others"),
    Mutant("alarm-read-handled", "broker/connection.py",
           "                    if memory.blocked:\n"
           "                        # the alarm went on while this read waited: what it brought is held,\n",
           "                    if False:\n"
           "                        # the alarm went on while this read waited: what it brought is held,\n",
           ["tests/test_memory_alarm.py::test_one_nodes_alarm_blocks_publishers_on_every_node_and_consumers_keep_draining"],
           "a publisher's read that waited while the memory alarm went on is handled at once: "
           "what the client sent after it was told it is blocked is confirmed"),
    Mutant("overtaken-assign-acted-on", "broker/queue_process.py",
           "        if t is rp.Assign and item is not self._newest_assign:\n",
           "        if False:\n",
           ["tests/test_queue_process.py"],
           "a replica acts on every Assign its inbox holds, in turn: a leader catching up confirms "
           "what only it holds on an older change, then steps down for a newer one (dst seed 53705)"),
    Mutant("non-member-link-refused-while-cut-off", "broker/cluster_links.py",
           "        return raft is not None and not raft.has_quorum_contact(trio.current_time())\n",
           "        return False\n",
           ["tests/test_sim_cluster.py::test_a_member_that_missed_a_rejoin_lets_the_rejoined_log_leader_link_to_it",
            "tests/test_sim_cluster.py::test_a_non_members_link_is_refused_unless_the_node_is_cut_off_from_a_majority"],
           "a node cut off while another was forgotten and joined again refuses that node's link "
           "when it leads the log: it stays paused and out of step (dst seed 105384)"),
    Mutant("non-member-link-always-accepted", "broker/cluster_links.py",
           "        return raft is not None and not raft.has_quorum_contact(trio.current_time())\n",
           "        return True\n",
           ["tests/test_sim_cluster.py::test_a_non_members_link_is_refused_unless_the_node_is_cut_off_from_a_majority"],
           "a node in touch with a majority takes a link from a node its view does not list, "
           "instead of telling it to join first"),
    Mutant("removed-member-still-dialed", "broker/cluster_links.py",
           "            for change in self.raft.unapplied():\n",
           "            for change in [c for _, c in self.raft.log if c[0] == \"member.add\"]:\n",
           ["tests/test_sim_cluster.py::test_a_refused_link_is_read_and_logged_once_on_each_side"],
           "members keep dialing a node that was removed but restarted without a reset, and count it running"),
    Mutant("refusal-after-broken-hello-unread", "broker/peers.py",
           "                await framed.receive(frozenset({\"link.hello\"}))  # an Error raises its reason\n",
           "                pass\n",
           ["tests/test_sim_cluster.py::test_a_refused_link_is_read_and_logged_once_on_each_side"],
           "a dialer whose LinkHello met a closed connection gives up without reading why it was refused"),
    Mutant("leaving-node-still-confirms", "mirroring/replica_leading.py",
           "        return not self.in_step or self.leaving and not self._outlives_its_node()\n",
           "        return not self.in_step\n",
           ["tests/test_sim_mirroring.py::test_a_node_stopping_its_app_confirms_nothing_its_queue_would_lose"],
           "a node stopping its app, its record of going on its way, still confirms publishes that "
           "no mirror it could hand the queue to holds (dst seed 111127)"),
    Mutant("leaving-node-holds-every-confirm", "mirroring/replica_leading.py",
           "        mirrors = list(self.rep.mirrors)\n        return choose_promotion(",
           "        mirrors = []\n        return choose_promotion(",
           ["tests/test_sim_mirroring.py::test_a_node_stopping_its_app_still_confirms_what_a_synchronised_mirror_holds"],
           "a node stopping its app holds even the confirms its synchronised mirrors make safe, and "
           "its publishers get nacks for messages that are kept"),
    Mutant("old-epoch-publish-applied", "mirroring/replica.py",
           "        if msg.epoch < self.epoch and msg.pseq != q.last_pseq.get((owner[0], owner[1]), 0) + 1:\n",
           "        if False:\n",
           ["tests/test_replica_property.py::test_a_batch_sent_to_an_earlier_epoch_waits_for_its_resend_when_one_before_it_is_missing",
            "tests/test_dst_regressions.py::test_regression_seeds"],
           "a leader applies a publish batch sent to an earlier epoch as it comes: a later batch "
           "makes the session's resend of earlier ones look applied, confirmed and never enqueued "
           "(dst seed 122307)"),
    Mutant("settles-follow-a-stale-route", "broker/session/core.py",
           "        if qname in self._ahead:\n",
           "        if False:\n",
           ["tests/test_sim_mirroring.py::test_acks_of_a_promoted_leaders_redeliveries_wait_for_the_route_to_it",
            "tests/test_dst_regressions.py::test_regression_seeds"],
           "a consumer's acks of a newer leader's deliveries go to the leader its node's metadata "
           "still names, and are lost (dst seed 116560)"),
    Mutant("stop-does-not-overtake-assigns", "broker/queue_process.py",
           "        elif t is rp.Stop:\n",
           "        elif False:\n",
           ["tests/test_queue_process.py"],
           "a replica acts on the Assign before a Stop in its inbox: a leader catching up confirms "
           "what only it holds, then its queue moves away and it is lost (dst seed 105284)"),
    Mutant("overtaken-assign-synced-forgotten", "mirroring/replica.py",
           "        self.listed_synced = self.me in a.synced\n\n    def node_gone",
           "        pass\n\n    def node_gone",
           ["tests/test_queue_process.py"],
           "a mirror listed synchronised by an overtaken Assign, promoted by the next, is logged as "
           "an unsynchronised promotion (the chaos checkers would allow a loss they should not)"),
    Mutant("start-app-while-joining", "broker/node.py",
           "        if self.joining_seed is not None:\n            # started now",
           "        if False:\n            # started now",
           ["tests/test_sim_cluster.py::test_start_app_on_a_node_still_joining_its_seed_is_refused"],
           "start_app on a node still joining its seed runs the app alone: the join never finishes"),
    Mutant("deposed-leader-takes-anothers-entry", "broker/cluster.py",
           "                if raft.term_at(index) == term:\n",
           "                if True:\n",
           ["tests/test_sim_cluster.py::test_a_deposed_log_leader_does_not_report_its_proposal_committed_by_another_leaders_entry"],
           "a deposed metadata leader reports its proposal committed when another leader's entry "
           "is committed at its index: a change answered done that never happened"),
    Mutant("deletes-not-resent", "broker/session/core.py",
           "        ops += [op for op in self._deletes.values() if op.queue == qname]\n",
           "",
           ["tests/test_sim_in_flight.py", "tests/test_amqp_in_flight.py"],
           "a queue.delete on its way to a leader that fails is not sent to the promoted one: the "
           "client waits for ever"),
    Mutant("request-to-a-down-queue-waits", "broker/session/core.py",
           "        if reason:\n            self.queue_lost(qname, reason)\n            return\n        self._send_to(qname, qdef, op)",
           "        self._send_to(qname, qdef, op)",
           ["tests/test_sim_cluster.py::test_a_redeclare_that_outlives_its_queues_node_is_refused_not_left_waiting"],
           "a request made after the log recorded its queue's node down waits for a change that "
           "will not come"),
    Mutant("queue-update-not-handed-on", "mirroring/metadata.py",
           "                self.queues[u.queue] = q.placed(u.placement)\n                self._touch(u.queue)\n",
           "                self.queues[u.queue] = q.placed(u.placement)\n",
           ["tests/test_sim_mirroring.py::test_nodes_policy_change_keeps_old_leader_until_a_new_mirror_is_synchronised"],
           "a queue's new mirrors or synchronised list reach the metadata but not its replicas (the "
           "node hands a change only to the queues it names)"),
    Mutant("state-file-keeps-a-cut-log", "broker/statefile.py",
           "                and (w[2] == 0 or entries[w[2] - 1] is w[3])):",
           "                ):",
           ["tests/test_statefile.py"],
           "a follower's log cut back by a new leader is saved as an append, so the entries it "
           "dropped come back after a restart"),
    Mutant("session-not-in-routing-index", "broker/session/core.py",
           "                self.host.track_route(qname, self)\n",
           "                pass\n",
           ["tests/test_sim_cluster.py::test_a_change_naming_its_queues_is_shown_only_to_the_sessions_routing_to_them"],
           "a session routing to a queue is not in the node's index, so the queue's deletion "
           "never reaches its consumer"),
    Mutant("link-loss-ignores-counted-down-queue", "broker/session/core.py",
           "                        down := host.queue_down_reason(qdef)):\n                    self.queue_lost(qname, down)\n            return\n",
           "                        down := host.queue_down_reason(qdef)):\n                    pass\n            return\n",
           ["tests/test_sim_partitions.py::test_a_publisher_whose_queue_node_is_counted_down_then_cut_off_is_nacked_not_left_waiting"],
           "a queue the log counts down stays routed when the link to its node breaks: its "
           "publisher waits until the node is back"),
    Mutant("proposal-round-not-replicated", "broker/cluster.py",
           "        raft.replicate()\n        if raft.out or raft.dirty:",
           "        if raft.out or raft.dirty:",
           ["tests/test_sim_cluster.py::test_a_declare_on_a_quiet_cluster_is_answered_in_a_few_network_trips"],
           "the log's leader proposes a round without sending it: every metadata change waits "
           "for the next heartbeat"),
    Mutant("failover-shipped-before-the-mirrors", "mirroring/replica.py",
           "        self._update_mirrors(now, resume)\n        if failover:\n"
           "            for c in self.q.failover():\n",
           "        if failover:\n            self.q.failover()\n"
           "        self._update_mirrors(now, resume)\n        if False:\n"
           "            for c in self.q.failover():\n",
           ["tests/test_replica_property.py::"
            "test_a_mirror_that_resumes_under_a_promoted_leader_gives_back_the_deliveries_it_does",
            "tests/test_replica_property.py::test_mirrors_equal_the_leader_through_syncs"],
           "a promoted leader requeues before it has mirrors: the batch goes to no one, and a "
           "mirror that resumes counts the redeliveries twice against the consumer's prefetch"),
    Mutant("acks-alone-confirm-out-of-step", "broker/queue_process.py",
           "                replica.in_step = host.may_deliver(self, now)  # (confirms wait while out of step)",
           "                pass",
           ["tests/test_queue_process.py::"
            "test_acknowledgements_alone_hold_their_confirms_while_the_node_is_out_of_step"],
           "a leader's round of mirrors' acknowledgements alone confirms without asking whether "
           "its node is in step with the metadata log"),
    Mutant("mirror-batches-alone-unacknowledged", "mirroring/replica_following.py",
           "            self.handle(msg, now)  # (a missing batch turns us WAITING: the rest are then ignored)\n"
           "        self.flush(now)",
           "            self.handle(msg, now)  # (a missing batch turns us WAITING: the rest are then ignored)",
           ["tests/test_queue_process.py::test_a_replication_batch_alone_is_acknowledged_without_a_round",
            "tests/test_process_mirroring.py"],
           "a mirror applies its leader's batches without acknowledging them: confirms wait for the "
           "next round of the mirror, or for ever"),
]


def run(m: Mutant) -> tuple[bool, str]:
    """Apply `m` to a copy of the tree and run its tests; True if they caught it."""
    with tempfile.TemporaryDirectory(prefix=f"warren-mutant-{m.name}-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".cache", ".venv", "var", "results", "__pycache__",
                                                                  ".hypothesis", "*.egg-info"))
        target = tree / m.file
        text = target.read_text()
        if text.count(m.old) != 1:
            return False, f"does not apply any more: the text to replace is not in {m.file} exactly once"
        target.write_text(text.replace(m.old, m.new))
        tests = [t for t in m.tests if (tree / t.split("::")[0]).exists()]
        if not tests:
            return False, "none of its tests exist"
        env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               "-m", "not docker and not spark", *tests],
                              cwd=tree, env=env, capture_output=True, text=True)
        tail = (proc.stdout.strip().splitlines() or [""])[-1]
        # Only pytest's "tests failed" (exit 1) counts: a collection error, such as a missing
        # dependency, is a broken harness, not a caught mutant.
        if proc.returncode not in (0, 1):
            return False, f"pytest could not run the tests (exit {proc.returncode}): {tail}"
        return proc.returncode == 1, tail


def main(argv=None) -> int:
    names = sys.argv[1:] if argv is None else argv
    chosen = [m for m in MUTANTS if not names or m.name in names]
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        print(f"unknown mutant(s): {', '.join(sorted(unknown))}; known: {', '.join(m.name for m in MUTANTS)}")
        return 2
    survivors = []
    for m in chosen:
        caught, tail = run(m)
        print(f"{'caught  ' if caught else 'SURVIVED'} {m.name}: {m.what}\n         {tail}", flush=True)
        if not caught:
            survivors.append(m.name)
    if survivors:
        print(f"{len(survivors)} of {len(chosen)} mutants survived: {', '.join(survivors)}")
        return 1
    print(f"all {len(chosen)} mutants caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
