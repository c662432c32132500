"""The fault explorer: chaos schedules carried out on the deterministic simulation.

The same seeded schedules as the real-process campaign (bench/chaos/schedule.py) and the same
checker (bench/chaos/checker.py), but the cluster is broker/simulation.py's: real `Node` code on
the simulated network under trio's MockClock, with one seed deciding everything (trio's
scheduling order, the clock, every node's choices). A schedule takes a fraction of a second
instead of twenty, and a failure replays exactly:

    warren-bench dst --seeds 500 --procs 2        # seeds 1..500 (make dst SEEDS=500)
    warren-bench dst --seed 1234 --replay         # one schedule again, with its event trace
    warren-bench dst --seeds 50 --priorities 4    # the workload on a priority queue (0..4)

How the fault kinds map onto the simulation: kill (the host dies, its tasks are cancelled; it
restarts from what it had saved), sigterm (stop_app, then the same), pause (its traffic is held
both ways, nothing breaks: the others see silence), stop_app / start_app, forget (kill or reset,
forget_cluster_node, then a fresh node joins), policy, sync, cancel_sync, rolling_restart,
full_restart, partition (the node cut off from the other nodes), and three the simulation adds:
drop (every connection between two nodes breaks at once), delay (a slow link) and client_drop
(a client's connection breaks).

Two runs of one seed produce the same trace of log events (`digest`), which the tests check.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio.testing

from broker.control import ctl_call
from broker.simulation import CLIENT_PORT, PEER_PORT, SIM_USER, SimCluster, deterministic, trace_digest, traced

from .checker import (EVENT_FIELDS, BrokerEvent, Fault, History, Phase, Verdict,
                      allow_unsynchronised_promotions, check, keeps_event, policy_timeline,
                      spec_allows_loss)
from .clients import Consumer, Publisher, rotate
from .faults import FaultRunner
from .schedule import PRIORITY_BACKLOG, expected_mirrors, KINDS, Action, Schedule, generate

SIM_KINDS = KINDS + ("drop", "delay", "client_drop")
SIM_RATE = 150  # msgs/s over all publishers: what a simulated second costs real time
SIM_TICKTIME = 3.0
# the longest confirm stall with every node up and linked and no fault in force: the real
# campaign's STALL_LIMIT, scaled to the simulation's shorter net_ticktime (a leader gives up on a
# silent mirror after net_ticktime, 3 s here: the stall must be caught below that)
SIM_STALL_LIMIT = 2.0
DEFAULT_SCALE = 0.4  # shorter faults and gaps than the real campaign's: a schedule in ~0.25 s
POLICY = "chaos-ha"

# bugs found by the explorer, kept as named regression seeds (run by tests/test_dst_regressions.py); each
# failed without its fix when found (a seed's schedule depends on schedule.py and on this driver:
# since the driver change of fef11dd, 9550 and 2281 no longer reach their bugs, which
# tests/test_sim_lent_bodies.py now stages directly)
REGRESSIONS: dict[str, int | tuple] = {
    # the publishing session's node learned of the queue leader's new epoch (its node had been
    # counted down while frozen) before the leader did, and resent its 104 in-flight batches;
    # the leader de-duplicated them, then started the epoch and dropped their acceptance: 500
    # publishes never confirmed (fixed: a new epoch carries what was accepted and unconfirmed)
    "resends-before-the-leaders-new-epoch": 31170,
    # sessions resent to the same leader (their link to it came back); accepting the recognised
    # resends took a replication batch number no batch carried, the mirror saw the gap and
    # restarted empty, the leader dropped it, then stopped with no synchronised mirror: 268
    # confirmed messages lost (fixed: a recognised resend waits for what was sent, no new number)
    "recognised-resend-took-a-batch-number": 36073,
    # a consumer's node was counted down by the log's leader (one link dropped) and up again,
    # the same run of it: the queue's leader had forgotten its sessions, nobody re-registered
    # the consumer, and 284 messages waited for it (fixed: sessions resend everything then)
    "consumer-of-a-node-counted-down-and-back": 144,
    # forget_cluster_node of the node leading a durable queue whose mirrors were not placed
    # again yet (right after a full restart) deleted the queue: every later publish was
    # unroutable, confirmed and dropped (fixed: the queue lives on, empty, on another member)
    "forget-keeps-a-durable-queue": 672,
    # after a full restart the last node to stop came back believing it still led the queue
    # (its shutdown could not be recorded without a majority) and confirmed publishes until the
    # log, recording its new run, promoted another replica: 16 confirmed messages lost; seed
    # 1554 stranded 342 the same way (fixed: a node acts on the metadata only once the log has
    # recorded this run of it up)
    "restarted-node-leads-on-an-old-word": 1109,
    "restarted-node-leads-on-an-old-word-2": 1554,
    # forget_cluster_node of the killed log leader waited for a leader; the node came back
    # first, then the forget went through and removed a running member: the cluster stalled
    # (fixed: the planner refuses to remove a running node; the campaign's drivers bring a node
    # whose forget was refused back as itself)
    "forget-of-a-node-that-came-back": 5531,
    # a queue leader woken from a pause, replaced meanwhile, handed its local consumer 174
    # messages unflagged that the new leader had already redelivered, flagged, elsewhere (fixed:
    # a leader delivers only while its node is in step with the metadata log, and peer links
    # drop what they read after a freeze's silence)
    "leader-woken-from-a-pause-delivers-again": 2967,
    # a publish parked for an old epoch was replayed unflagged by a later leader after another
    # had delivered its resend (fixed: QPublish carries the epoch its sender addressed)
    "publish-parked-for-an-old-epoch": 5581,
    # two members started at once after a full restart split their votes for ever: the driver
    # loop slept past Raft's quick retry until the liveness tick they shared (fixed: a message
    # that moves Raft's deadline earlier wakes the loop)
    "split-vote-retry-waited-for-the-liveness-tick": 7348,
    # a channel's close died with the leader that heard it; the promoted mirror kept feeding
    # that channel's consumer its prefetch, which the session dropped: 200 messages stranded
    # (fixed: a session tells the present leader again when a delivery names a closed channel)
    "delivery-to-a-channel-closed-before-a-failover": 2281,
    # a mirror promoted after a node restarted meanwhile kept the consumers of that node's old
    # sessions with 400 messages in flight to them, unacknowledged for ever: lost to everyone
    # (fixed: a node told of deliveries for a session it does not have says the owner is gone)
    "consumers-of-a-restarted-nodes-old-sessions": 9550,
    # a consumer's node under stop_app, its link to the queue's leader delayed: the leader applied
    # the shutdown record and redelivered, flagged, what it had sent that consumer, which then
    # received the late originals unflagged (fixed: once a node proposes its shutdown record, its
    # sessions show no more deliveries; since Raft's round-trip freshness the seed no longer
    # reaches the case: tests/test_sim_freeze.py stages it)
    "deliveries-after-the-shutdown-record": 30123,
    # a bug of the driver, not the broker: a rolling restart restarted a node that a forget held
    # (killed, out of the cluster); its old metadata, read first, said every mirror was
    # synchronised, so the restart went on before the restarted nodes had mirrors again and the
    # leader's node stopped with none synchronised: 2 confirmed messages lost, judged a bug
    # (fixed: the driver reads the most applied metadata and restarts only the nodes no other
    # fault holds, as the real driver does); seed 62919 lost 8 the same way
    "rolling-restart-read-a-forgotten-nodes-metadata": 64117,
    "rolling-restart-read-a-forgotten-nodes-metadata-2": 62919,
    # a consumer's node was paused through a rolling restart; the leader promoted on a restarted
    # node never had a link to it, dropped the deliveries it sent there and still counted them
    # in flight: 50 messages stranded with the sleeping node's consumer (fixed: deliveries for a
    # node with no link are given back as for a replaced link)
    "deliveries-to-a-node-never-linked": 67947,
    # a mirror's node paused for 1.7 s; the log's leader, whose silence from it began with a
    # partition of its own, counted it down 1.3 s into the pause; the queue's leader requeued
    # what that node's consumer held and redelivered it, flagged, elsewhere; the node woke and
    # showed its consumer the originals still in its socket, unflagged: 50 repeats (fixed: a
    # node's sessions are shown peers' traffic only while it is in step with the log, and a
    # node the log counted down drops what its links carried from before that record)
    "deliveries-read-after-being-counted-down": 68350,
    # (seed, faults per schedule): from `warren-bench dst --faults 3-6`
    # a node cut off (and restarted) while another was forgotten and joined again ignored that
    # node, the metadata log's new leader, as a non-member: its queue leader could not learn of
    # the promotion made meanwhile and the queue stayed unsynchronised for 30 s (fixed: a log
    # leader's appends are taken from any linked node)
    "log-leader-the-cut-off-node-thought-forgotten": (50115, (3, 6)),
    # a bug of the simulation: a full restart killed a node whose restart by another fault was
    # under way, and the restart raised instead of returning a dead node (fixed in
    # SimCluster._run_node)
    "killed-while-it-started": (50524, (3, 6)),
    # from `--faults 5-8`: a queue leader cut off by a partition caught up with the log at the
    # heal and acted on each change in turn: an older policy change dropped its only
    # synchronised mirror, so it confirmed 231 messages only it held, and a newer change in the
    # same batch had promoted an unsynchronised mirror elsewhere: they were lost (fixed: a
    # replica acts only on the newest Assign in its inbox)
    "acted-on-an-overtaken-assign": (53705, (5, 8)),
    # a forgotten node waiting to join again through its seed was stopped and started by
    # another fault (stop_app); its app started as a cluster of its own, and the join then
    # failed for good ("stop the app first"): the cluster never had three members again (fixed:
    # start_app is refused while the node joins; the driver leaves such a node to its join)
    "start-app-during-the-seed-join": (54014, (5, 8)),
    # (seed, faults, kinds): from `--faults 4-8 --kinds kill,pause,stop_app,forget,policy,
    # partition,drop,delay,client_drop`. n2, promoted while n3's consumer held 50 deliveries,
    # requeued them before n3 resumed as its mirror, so n3 never applied the requeue: it
    # counted them twice against the prefetch, and once promoted itself it delivered nothing:
    # 581 messages stranded (fixed: the failover is the new epoch's first replicated effect)
    "resumed-mirror-missed-the-failover": (92168, (4, 8), "kill,pause,stop_app,forget,policy,"
                                           "partition,drop,delay,client_drop"),
    # (seed, faults, kinds or None for all, publish rate): from `--faults 6-12 --rate 600`. The
    # queue's leader, cut off by a partition, caught up with six changes at once at the heal:
    # the last counted it down and moved the queue away, which reached the replica as a Stop,
    # not an Assign, so the policy change before it still counted as the newest word. Acting
    # on it dropped the only mirror that held what the leader had not confirmed: 730 messages
    # held only there were confirmed, then lost with the replica (fixed: a Stop supersedes
    # every Assign queued before it, broker/queue_process.py)
    "acted-on-an-assign-a-stop-overtook": (105284, (6, 12), None, 600),
    # the same campaign: n1 was forgotten and joined again while n3 was cut off, then led the
    # metadata log; n3's view still had n1 removed, so it refused n1's link as a non-member's,
    # stayed paused (pause_minority), and the queue waited 30 s for a mirror on it (fixed: a
    # node out of touch with a majority accepts links from nodes its view does not list)
    "rejoined-log-leader-refused-as-a-non-member": (105384, (6, 12), None, 600),
    # a real-process campaign's schedule: n1 began a stop_app as a partition healed; the log promoted its
    # mirror (the only replica left) in the middle of the stop, and it confirmed 500 publishes
    # its sessions resent to it, then lost them with its app (fixed: a node leaving confirms
    # and delivers nothing more, broker/router.py `may_deliver`)
    "confirmed-while-its-node-was-stopping": (
        111127, (6, 12), "forget,rolling_restart,partition,pause,stop_app,kill,full_restart,sigterm,policy", 600),
    # from the same campaign: a consumer's node woke from a freeze to a deposed leader's late batch and
    # the promoted leader's redelivery of it before the metadata change; the consumer's acks
    # went to the deposed leader, and the new one kept its credit used up: 4,164 stranded
    # (fixed: a session holds settles while a newer leader than its route's has delivered)
    "acks-of-a-newer-leaders-deliveries-sent-to-the-old": (116560, (6, 12), None, 600),
    # a later real-process campaign: a new leader's replica started with publish batches 115-130 that
    # had waited for it (sent to the epoch before), then took its session's resend of 72-130;
    # 72-114 looked applied, were confirmed and never enqueued: 645 lost (fixed: a batch sent
    # to an earlier epoch is applied only if it follows on from the publisher's last one; any
    # other waits for the session's resend, which brings them in order)
    "old-epoch-batch-applied-before-the-resend": (122307, (6, 12), None, 600),
}


def regression_run(value) -> SimResult:
    """Run one REGRESSIONS entry: a seed, or (seed, (least, most) faults per schedule), or
    that and the fault kinds drawn from (comma-separated; None: every kind), and then the
    publish rate."""
    if isinstance(value, tuple):
        seed, faults, *more = value
        kinds = more[0].split(",") if more and more[0] else None
        rate = more[1] if len(more) > 1 else SIM_RATE
        return run_seed(seed, kinds, faults=faults, rate=rate)
    return run_seed(value)


@dataclass
class SimResult:
    seed: int
    schedule: Schedule
    verdict: Verdict
    digest: str
    wall_s: float
    trace: list = field(default_factory=list, repr=False)

    def line(self) -> str:
        kinds = ",".join(self.schedule.fault_kinds())
        return f"seed {self.seed} [{kinds}] {self.verdict.line()} ({self.wall_s:.2f} s)"

    def replay(self) -> str:
        cmd = f"warren-bench dst --seed {self.seed}"
        if self.schedule.kinds:
            cmd += f" --kinds {','.join(self.schedule.kinds)}"
        if self.schedule.scale != DEFAULT_SCALE:
            cmd += f" --scale {self.schedule.scale:g}"
        if self.schedule.rate != SIM_RATE:
            cmd += f" --rate {self.schedule.rate}"
        if self.schedule.workload != "plain":
            cmd += f" --workload {self.schedule.workload}"
        if self.schedule.max_priority:
            cmd += f" --priorities {self.schedule.max_priority}"
        lo, hi = self.schedule.faults_range
        if (lo, hi) != (1, 3):
            cmd += f" --faults {lo}-{hi}"
        return cmd + " --replay"

    def real_replay(self) -> str | None:
        """The command that carries out this schedule on real processes (`warren-bench chaos`),
        when it drew no simulation-only fault; None otherwise."""
        s = self.schedule
        if any(k not in KINDS for k in s.fault_kinds()):
            return None
        base = [k for k in (s.kinds or SIM_KINDS) if k in KINDS]
        real = Schedule(**{**s.as_dict(), "actions": s.actions, "kinds": base if set(base) != set(KINDS) else []})
        return real.replay_command()


def sim_schedule(seed: int, kinds=None, faults=(1, 3), scale: float = DEFAULT_SCALE,
                 rate: int | None = SIM_RATE, workload: str = "plain", priorities: int = 0) -> Schedule:
    """The schedule of `seed` for the simulation: the real campaign's (`generate`) drawn from the
    real kinds in `kinds`, then some of its faults swapped for the simulation's own kinds. With
    no simulation-only kind drawn, it is exactly `warren-bench chaos`'s schedule of that seed
    with the same kinds, scale and rate (`rate` None: the campaign's own). `priorities` N: the
    workload on a priority queue (x-max-priority N), the same schedule otherwise."""
    wanted = set(kinds or SIM_KINDS)
    kinds = [k for k in SIM_KINDS if k in wanted]
    base = [k for k in kinds if k in KINDS] or ["kill"]
    s = generate(seed, base, min_faults=faults[0], max_faults=faults[1], scale=scale)
    extra = [k for k in kinds if k not in KINDS]
    rng = random.Random(seed * 31 + 7)
    if extra:
        # swap some of the drawn faults for the simulation's own kinds
        for i, a in enumerate(s.actions):
            if rng.random() < len(extra) / len(kinds):
                k = rng.choice(extra)
                names = [f"n{j}" for j in range(1, s.nodes + 1)]
                target = rng.choice(names)
                dur = round(rng.uniform(0.5, 3.0) * scale, 2) if k == "delay" else 0.0
                params = {"other": rng.choice([n for n in names if n != target]),
                          "seconds": round(rng.uniform(0.05, 0.5), 3)} if k in ("drop", "delay") else {}
                if k == "client_drop":
                    target = rng.choice(["publisher", "consumer"])
                s.actions[i] = Action(at=a.at, kind=k, target=target, duration=dur, params=params,
                                      seed=a.seed)
    s.rate = rate or s.rate
    s.max_priority = priorities
    s.kinds = kinds if set(kinds) != set(SIM_KINDS) else []
    s.workload = workload
    return s


class SimRun(FaultRunner):
    """One schedule on a SimCluster, recorded as a checker history (times: the mock clock)."""

    def __init__(self, s: Schedule, nursery: trio.Nursery, say=None):
        self.s = s
        self.names = [f"n{i}" for i in range(1, s.nodes + 1)]
        self.c = SimCluster(nursery, Path("/nonexistent"), names=self.names, seed=s.seed,
                            net_ticktime=SIM_TICKTIME)
        self.h = History()
        self.policy = dict(s.policy)
        self.policies = [(float("-inf"), self.policy)]  # (from when, policy): for the checker
        self.publishers: list[Publisher] = []
        self.consumers: list[Consumer] = []
        self.down: dict[str, str] = {}  # node -> how it went ("crash", "shutdown", "isolated")
        self.forgotten: set[str] = set()  # forgotten, not yet back as a member
        self.notes: list[str] = []
        self.say = say or (lambda text: None)
        self.clock = trio.current_time

    # --- helpers -------------------------------------------------------------------------------
    def anomaly(self, text: str) -> None:
        self.h.anomalies.append(text)
        self.say(f"ANOMALY: {text}")

    def live(self) -> list[str]:
        return [n for n in self.names if n not in self.c.killed and self.c.nodes[n].app_running]

    async def ctl(self, where: str, command: str, **args):
        return await ctl_call(self.c.net.host(where), where, PEER_PORT, "dst", b"s", command, args,
                              timeout=10)

    def queue(self) -> dict | None:
        """The queue's record in the freshest metadata a running node holds: the most applied
        log, since a node outside the cluster (forgotten, not yet joined) keeps an old one (dst
        seed 64117: a forgotten node's old view said every mirror was synchronised)."""
        live = self.live()
        if not live:
            return None
        freshest = max(live, key=lambda n: self.c.nodes[n].cluster.applied)
        return self.c.nodes[freshest].md.queues.get(self.s.queue)

    def allowance(self, targets: set[str], how: str) -> str | None:
        q = self.queue()
        if q is None:
            return None
        leader = q.leader
        down = set(self.down) | targets
        how_leader = how if leader in targets else self.down.get(leader, how)
        return spec_allows_loss(leader, list(q.mirrors), list(q.synced), down,
                                how_leader, self.policy.get("ha-promote-on-failure", "always"),
                                self.policy.get("ha-promote-on-shutdown", "when-synced"))

    async def wait_for(self, what: str, pred, timeout: float) -> bool:
        try:
            await self.c.wait_for(pred, timeout, what)
            return True
        except trio.TooSlowError:
            self.anomaly(f"timed out after {timeout:g} s waiting for {what}")
            return False

    def want_mirrors(self, leader: str | None) -> int:
        return expected_mirrors(self.policy, self.names, leader)

    def settled(self) -> bool:
        q = self.queue()
        want = self.want_mirrors(q.leader if q else None)
        return q is not None and len(q.mirrors) >= want and len(q.synced) >= want

    # --- the schedule --------------------------------------------------------------------------
    async def run(self) -> History:
        s = self.s
        await self.c.form()
        await self.ctl("n1", "set_policy", name=POLICY, pattern=s.pattern,
                       definition=json.dumps(self.policy), apply_to="queues")
        async with self.c.connect(s.leader) as conn:
            ch = await conn.channel()
            for name, arguments in s.queues():
                await ch.queue_declare(name, durable=True, arguments=arguments)
        await self.wait_for("the queue's mirrors to be synchronised after the declare", self.settled, 30)
        addrs = [f"{n}:{CLIENT_PORT}" for n in self.names]
        rate = s.rate / max(1, len(s.publishers))
        async with trio.open_nursery() as clients:
            async def start_consumers():
                for i, node in enumerate(s.consumers):
                    cons = Consumer(self.h, i, rotate(addrs, f"{node}:{CLIENT_PORT}"), s.queue,
                                    prefetch=s.prefetch, user=SIM_USER[0], password=SIM_USER[1],
                                    clock=self.clock, network=self.c.net.host(f"c{i}"), retries=s.retries)
                    self.consumers.append(cons)
                    await clients.start(cons.run)

            if not s.max_priority:
                await start_consumers()
            for i, node in enumerate(s.publishers):
                pub = Publisher(self.h, i, rotate(addrs, f"{node}:{CLIENT_PORT}"), s.queue, rate=rate,
                                window=s.confirm_window, size=s.message_size, careful=True,
                                user=SIM_USER[0], password=SIM_USER[1], clock=self.clock,
                                network=self.c.net.host(f"p{i}"), tick=0.025, priorities=s.max_priority)
                self.publishers.append(pub)
                await clients.start(pub.run)
            t0 = self.clock()
            self.h.phases.append(Phase(t0, "load"))
            if s.max_priority:  # a backlog first, for the priorities to order
                await trio.sleep(PRIORITY_BACKLOG)
                self.h.phases.append(Phase(self.clock(), "consume"))
                await start_consumers()
            async with trio.open_nursery() as undo:
                for a in s.actions:
                    await trio.sleep_until(t0 + a.at)
                    await self.act(a, undo)
                await trio.sleep_until(t0 + s.load_for)
                undo.cancel_scope.cancel()
            await self.heal()
            await self.finish(clients)
            clients.cancel_scope.cancel()
        self.h.phases.append(Phase(self.clock(), "end"))
        self.h.publishes = [p for pub in self.publishers for p in pub.pubs]
        for sub in self.h.subscriptions:
            if sub.t_end is None:
                sub.t_end = self.clock()
        return self.h

    def _resolve(self, a: Action) -> str:
        t = a.target
        q = self.queue()
        if t in self.names:
            return t
        if t == "leader":
            return q.leader if q else self.s.leader
        if t == "mirror":
            mirrors = sorted(q.mirrors) if q else []
            return random.Random(a.seed).choice(mirrors or [n for n in self.names if n != self.s.leader])
        clients = self.publishers if t == "publisher_node" else self.consumers
        for cl in clients:
            if cl.conn is not None and cl.conn.node:
                return cl.conn.node
        return (self.s.publishers if t == "publisher_node" else self.s.consumers)[0]

    async def act(self, a: Action, undo: trio.Nursery) -> None:
        rec = Fault(self.clock(), a.kind, None, dict(a.params))
        self.h.faults.append(rec)
        await self.carry_out(a, rec, undo)

    # --- faults (bench/chaos/faults.py: carry_out takes an action through these) ------------
    def handlers(self) -> dict:
        node_fault = self._fault_on_node
        return {"kill": node_fault, "sigterm": node_fault, "pause": node_fault,
                "stop_app": node_fault, "forget": node_fault, "partition": node_fault,
                "policy": self._fault_policy, "sync": self._fault_sync,
                "cancel_sync": self._fault_sync, "rolling_restart": self._fault_rolling_restart,
                "full_restart": self._fault_full_restart, "drop": self._fault_drop,
                "delay": self._fault_delay, "client_drop": self._fault_client_drop}

    async def fault_target(self, a: Action, undo: trio.Nursery) -> str:
        return self._resolve(a)

    def any_node_running(self) -> bool:
        return bool(self.live())

    def skip_if_down(self, a: Action, rec: Fault, node: str) -> bool:
        if node in self.down:
            rec.detail["skipped"] = f"{node} is already down"
            return True
        if a.kind == "forget" and (self.down or self.forgotten):
            # forgetting a member while another is down or gone would leave the metadata
            # log without a majority for good (as an operator who keeps a majority running
            # during maintenance knows not to do)
            rec.detail["skipped"] = "another member is down or forgotten"
            return True
        return False

    def skip_no_node_running(self, a: Action, rec: Fault) -> None:
        # every node is down (other faults hold them): there is no one to tell, as for an
        # operator whose rabbitmqctl finds no running node
        rec.detail["skipped"] = "no node is running"

    async def _fault_on_node(self, a: Action, rec: Fault, node: str, undo: trio.Nursery) -> None:
        k = a.kind
        how = {"kill": "crash", "forget": "crash", "pause": "isolated", "partition": "isolated"}.get(k, "shutdown")
        rec.loss_allowed = self.allowance({node}, how)
        self.down[node] = how
        await self._break(k, node, a)
        undo.start_soon(self._later, a, rec, node)

    async def _fault_policy(self, a: Action, rec: Fault,
                            node: str | None, undo: trio.Nursery) -> None:
        definition = dict(a.params["definition"])
        if await self._ctl_quietly(self.live()[0], "set_policy", name=POLICY,
                                   pattern=f"^{self.s.queue}$", apply_to="queues",
                                   definition=json.dumps(definition)):
            self.policy = definition
            self.policies.append((self.clock(), definition))

    async def _fault_sync(self, a: Action, rec: Fault,
                          node: str | None, undo: trio.Nursery) -> None:
        k = a.kind
        await self._ctl_quietly(self.live()[0], "sync_queue", queue=self.s.queue)
        if k == "cancel_sync":
            await trio.sleep(a.duration)
            if live := self.live():  # (the nodes may have gone down meanwhile)
                await self._ctl_quietly(live[0], "cancel_sync_queue", queue=self.s.queue)

    async def _fault_rolling_restart(self, a: Action, rec: Fault,
                                     node: str | None, undo: trio.Nursery) -> None:
        # a node another fault holds stays as that fault left it (as in the real driver)
        for node in [n for n in self.names if n not in self.down]:
            rec.loss_allowed = rec.loss_allowed or self.allowance({node}, "shutdown")
            await self._break("sigterm", node, a)
            await self._restore("sigterm", node)
            await self.wait_for(f"the queue to be synchronised again after {node} restarted",
                                self.settled, 30)
        rec.t_end = self.clock()

    async def _fault_full_restart(self, a: Action, rec: Fault,
                                  node: str | None, undo: trio.Nursery) -> None:
        rec.loss_allowed = self.allowance(set(self.names), "shutdown")
        for node in self.names:
            await self._break("sigterm", node, a)
        await trio.sleep(a.duration)
        for node in self.names:
            await self._restore("sigterm", node)
        rec.t_end = self.clock()

    async def _fault_drop(self, a: Action, rec: Fault,
                          node: str | None, undo: trio.Nursery) -> None:
        rec.target = self._resolve(a)
        self.c.net.drop(rec.target, a.params["other"])

    async def _fault_delay(self, a: Action, rec: Fault,
                           node: str | None, undo: trio.Nursery) -> None:
        rec.target = self._resolve(a)
        self.c.net.delay(rec.target, a.params["other"], a.params["seconds"])
        undo.start_soon(self._later, a, rec, rec.target)

    async def _fault_client_drop(self, a: Action, rec: Fault,
                                 node: str | None, undo: trio.Nursery) -> None:
        clients = self.publishers if a.target == "publisher" else self.consumers
        cl = clients[random.Random(a.seed).randrange(len(clients))]
        if cl.conn is not None and cl.conn.node:
            rec.target = cl.conn.node
            host = f"{'p' if a.target == 'publisher' else 'c'}{cl.index}"
            self.c.net.drop(host, cl.conn.node)

    async def _ctl_quietly(self, where: str, command: str, **args) -> bool:
        try:
            await self.ctl(where, command, **args)
            return True
        except Exception as exc:  # noqa: BLE001 - a refused command is part of the story
            self.notes.append(f"{command} on {where}: {exc}"[:200])
            return False

    async def _break(self, kind: str, node: str, a: Action) -> None:
        c = self.c
        if node in c.killed:
            return  # another fault has it down already
        if kind == "kill" or (kind == "forget" and a.params.get("how", "kill") == "kill"):
            c.kill(node)
        elif kind in ("sigterm", "forget"):
            await c.nodes[node].stop_app()
            c.kill(node)
        elif kind == "stop_app":
            await c.nodes[node].stop_app()
        elif kind == "pause":
            c.pause(node)
        elif kind == "partition":
            c.net.partition([node], [n for n in self.names if n != node])
        if kind == "forget":
            others = [n for n in self.live() if n != node]
            if others:
                await trio.sleep(0.5)
                if await self._ctl_quietly(others[0], "forget_cluster_node", node=node):
                    self.forgotten.add(node)

    async def _restore(self, kind: str, node: str) -> None:
        c = self.c
        if node in c.killed and kind not in ("kill", "sigterm", "forget"):
            return  # killed meanwhile by another fault: the heal restarts it
        if kind in ("kill", "sigterm"):
            if node in c.killed:
                await c.restart(node)
        elif kind == "forget":
            if node not in self.forgotten:
                # the forget was refused (no majority to record it, or the node came back
                # first): still a member, the node comes back as itself (seed 5531: started as
                # a new node, it waited for ever to join a cluster that needed the old one)
                if node in c.killed:
                    await c.restart(node)
                return
            # back as a new node: nothing saved, joining through a running member before its
            # app starts (it keeps trying while that member cannot be reached)
            if node not in c.killed:
                c.kill(node)  # another fault started the forgotten node meanwhile
            others = [n for n in self.live() if n != node] or [n for n in self.names if n != node]
            c.start_fresh(node, others[0])
            self.forgotten.discard(node)
        elif kind == "stop_app":
            if c.nodes[node].joining_seed is not None:
                return  # a forgotten node joining again: its app starts once it has joined
            try:
                await c.nodes[node].start_app()  # (does nothing if it runs)
            except* OSError:
                # a sigterm of another fault (a full restart) took the host down while the app
                # started (dst seed 159): that fault's own undo brings the node back
                if node not in c.killed:
                    raise
        elif kind == "pause":
            c.resume(node)
        elif kind == "partition":
            c.net.heal()
            for other in sorted(c.paused):
                c.net.pause(other)

    async def _later(self, a: Action, rec: Fault, node: str) -> None:
        try:
            await trio.sleep(a.duration)
        finally:
            with trio.CancelScope(shield=True):
                if a.kind == "delay":
                    self.c.net.delay(node, a.params["other"], 0)
                elif self.down.get(node) is not None:
                    await self._restore(a.kind, node)
                    self.down.pop(node, None)
                rec.t_end = self.clock()

    async def heal(self) -> None:
        c = self.c
        c.net.heal()
        for node in sorted(c.paused):
            c.resume(node)
        for node in self.names:
            if node in c.killed:
                await c.restart(node)
            elif not c.nodes[node].app_running and c.nodes[node].root is not None \
                    and not c.nodes[node].config.cluster_seed:
                await c.nodes[node].start_app()
        self.down.clear()
        await self.wait_for("every node running with every other after the heal",
                            lambda: all(c.nodes[n].running == set(self.names) for n in self.names), 60)
        await self.wait_for("the nodes to agree on the queue's replicas after the heal", self._agreed, 60)
        await self.wait_for("the queue's mirrors back after the heal", self.settled, 60)
        self.h.phases.append(Phase(self.clock(), "heal"))

    def _agreed(self) -> bool:
        views = {(q.leader, q.mirrors) if q else None
                 for q in (self.c.nodes[n].md.queues.get(self.s.queue) for n in self.names)}
        return len(views) == 1 and None not in views

    async def finish(self, clients: trio.Nursery) -> None:
        for p in self.publishers:
            p.stop.set()
        self.h.phases.append(Phase(self.clock(), "publish_end"))
        with trio.move_on_after(15):
            while any(p.unanswered for p in self.publishers):
                await trio.sleep(0.1)
        self.h.phases.append(Phase(self.clock(), "drain1"))
        confirmed = {p.id for pub in self.publishers for p in pub.pubs if p.outcome == "ack"}
        await self._drain(self.consumers, confirmed, 5.0)
        self.h.phases.append(Phase(self.clock(), "drain1_end"))
        for cl in self.consumers:
            cl.stop.set()
        await trio.sleep(0.5)
        self.h.phases.append(Phase(self.clock(), "drain2"))
        node = random.Random(self.s.seed * 7 + 1).choice(self.names)
        addrs = [f"{n}:{CLIENT_PORT}" for n in self.names]
        fresh = Consumer(self.h, len(self.consumers), rotate(addrs, f"{node}:{CLIENT_PORT}"), self.s.queue,
                         prefetch=self.s.prefetch, user=SIM_USER[0], password=SIM_USER[1],
                         clock=self.clock, network=self.c.net.host("c-drain2"))
        try:
            with trio.fail_after(20):
                await clients.start(fresh.run)
            await self._drain([fresh], set(), 3.0)
        except Exception as exc:  # noqa: BLE001
            self.anomaly(f"the second drain's consumer could not subscribe on {node}: {exc!r}")
        fresh.stop.set()
        await trio.sleep(0.3)
        for p in self.publishers:
            p.release.set()

    async def _drain(self, consumers, confirmed: set[int], quiet: float) -> None:
        start = last_change = self.clock()
        last_total = -1
        while self.clock() - start < 60:
            seen = set().union(*(c.ids for c in self.consumers + consumers))
            total = sum(c.count for c in consumers)
            if total != last_total:
                last_total, last_change = total, self.clock()
            if confirmed and confirmed <= seen and self.clock() - last_change > 0.5:
                return
            if self.clock() - last_change > quiet:
                return
            await trio.sleep(0.1)


async def _scenario(s: Schedule, say) -> History:
    async with trio.open_nursery() as nursery:
        run = SimRun(s, nursery, say)
        with trio.move_on_after(600) as limit:
            try:
                history = await run.run()
            except Exception as exc:  # noqa: BLE001 - any failure must end in a verdict
                run.anomaly(f"the simulation stopped: {exc!r}"[:400])
                history = run.h
        if limit.cancelled_caught:
            run.anomaly("the schedule did not finish within 600 simulated seconds")
            history = run.h
        history.meta.update(notes=run.notes, engine="simulation")
        history.meta["policies"] = run.policies  # for run_seed's judging of promotions; not saved
        nursery.cancel_scope.cancel()
    return history


def broker_events_in_trace(trace: list) -> list[BrokerEvent]:
    """The node log events the checker reads (links, app starts and stops, mirrors given up
    on, promotions), from a run's trace."""
    out = []
    for t, name, fields in trace:
        if t is None or not keeps_event(name):
            continue
        f = {k: v.strip("'") for k, v in fields if k == "node" or k in EVENT_FIELDS}
        node = f.pop("node", "")
        if node:
            out.append(BrokerEvent(t, node, name, f))
    return out


def promotions_in_trace(trace: list, queue: str) -> list[tuple[float, str, bool, str]]:
    """(time, node, synchronised, pid) of each promotion of `queue`'s mirrors in a run's trace."""
    needle = f"Mirrored queue '{queue}' in vhost '/': Promoting mirror"
    out = []
    for t, name, fields in trace:
        if needle in name:
            f = dict(fields)
            out.append((t, f.get("node", "'?'").strip("'"), f.get("synchronised") == "True",
                        name[len(needle):].split()[0]))
    return out


def run_seed(seed: int, kinds=None, faults=(1, 3), scale: float = DEFAULT_SCALE, rate: int = SIM_RATE,
             keep_trace: bool = False, say=None, workload: str = "plain", priorities: int = 0) -> SimResult:
    """One schedule on the simulation; deterministic for a given seed (and PYTHONHASHSEED)."""
    s = sim_schedule(seed, kinds, faults, scale, rate, workload, priorities)
    trace: list = []
    t0 = time.perf_counter()
    with traced(trace), deterministic(seed):
        history = trio.run(_scenario, s, say, clock=trio.testing.MockClock(autojump_threshold=0))
    policies = history.meta.pop("policies")
    history.broker_events = broker_events_in_trace(trace)
    for why in allow_unsynchronised_promotions(history.faults, promotions_in_trace(trace, s.queue),
                                               policy_timeline(policies), history.broker_events):
        history.meta["notes"].append(f"loss allowed from the promotion: {why}")
    verdict = check(history, stranded_after=5.0, recovery_grace=2 * SIM_TICKTIME + 3.0,
                    stall_limit=SIM_STALL_LIMIT, stall_grace=SIM_TICKTIME)
    return SimResult(seed, s, verdict, trace_digest(trace), time.perf_counter() - t0,
                     trace if keep_trace else [])


def _crash_reason(exc: BaseException) -> str:
    """The first leaf of an exception (group), with the place it was raised."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {'/'.join(Path(where.filename).parts[-2:])}:{where.lineno}" if where else ""
    return f"the simulated cluster crashed: {type(exc).__name__}: {exc}{at}"


def _one(args) -> dict:
    seed, kinds, faults, scale, rate, workload, priorities = args
    try:
        r = run_seed(seed, kinds, faults, scale, rate, workload=workload, priorities=priorities)
    except Exception as exc:  # a crash is a failed schedule like any other, reported with its seed
        s = sim_schedule(seed, kinds, faults, scale, rate, workload, priorities)
        crashed = SimResult(seed, s, None, "", 0.0)
        reason = _crash_reason(exc)
        return {"seed": seed, "ok": False, "line": f"seed {seed} [{','.join(s.fault_kinds())}] {reason}",
                "reasons": [reason], "replay": crashed.replay(), "lost_allowed": {}, "digest": "",
                "wall_s": 0.0, "kinds": s.fault_kinds(), "real": crashed.real_replay()}
    v = r.verdict
    return {"seed": seed, "ok": v.ok, "line": r.line(), "reasons": v.reasons[:5], "replay": r.replay(),
            "lost_allowed": dict(v.lost_allowed), "digest": r.digest, "wall_s": r.wall_s,
            "kinds": r.schedule.fault_kinds(), "real": r.real_replay(),
            "confirm_stall_s": v.confirm_stall_s, "confirm_stall_why": v.confirm_stall_why}


def explore(first: int, count: int, kinds=None, faults=(1, 3), scale: float = DEFAULT_SCALE,
            rate: int = SIM_RATE, procs: int = 1, out=None, workload: str = "plain",
            priorities: int = 0) -> list[dict]:
    """Seeds first .. first+count-1 (in `procs` processes); prints a line per failed schedule
    with its replay command, then a summary with every schedule whose loss the spec allowed."""
    out = out or sys.stdout  # looked up now: a test may have replaced it
    jobs = [(seed, kinds, faults, scale, rate, workload, priorities)
            for seed in range(first, first + count)]
    if procs > 1:
        import multiprocessing
        os.environ["PYTHONHASHSEED"] = "0"  # the workers' set orders agree with a replay's
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            results = pool.map(_one, jobs, chunksize=4)
    else:
        results = [_one(j) for j in jobs]
    for r in results:
        if not r["ok"]:
            print(f"FAIL {r['line']}\n     replay: {r['replay']}", file=out)
            if r["real"]:
                print(f"     on real processes: {r['real']}", file=out)
            for reason in r["reasons"]:
                print(f"       - {reason[:300]}", file=out)
    failed = [r for r in results if not r["ok"]]
    allowed = [r for r in results if sum(r["lost_allowed"].values())]
    print(f"{len(results)} schedules (seeds {first}..{first + count - 1}), {len(failed)} failed, "
          f"{len(allowed)} with loss the spec allows "
          f"({sum(sum(r['lost_allowed'].values()) for r in allowed):,} messages); "
          f"{sum(r['wall_s'] for r in results) / max(1, len(results)):.2f} s per schedule", file=out)
    for r in allowed:
        print(f"  allowed loss, seed {r['seed']} [{','.join(r['kinds'])}]: {r['lost_allowed']}", file=out)
    stalls = [r for r in results if r.get("confirm_stall_s") is not None]
    if stalls:
        worst = max(stalls, key=lambda r: r["confirm_stall_s"])
        print(f"  longest confirm stall with every node up and linked and no fault in force: "
              f"{worst['confirm_stall_s'] * 1000:.0f} ms (seed {worst['seed']}: "
              f"{worst['confirm_stall_why']})", file=out)
    out.flush()
    return results


def ensure_fixed_hashing(argv: list[str]) -> None:
    """Re-run this process with PYTHONHASHSEED=0 unless it is set: set iteration orders then
    agree between runs, so a seed replays on any process."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *argv])
