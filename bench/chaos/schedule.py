"""Seeded fault schedules: from one integer, what a chaos run does and when.

This module owns the *plan* of a chaos run as plain data (JSON-serialisable, printable, equal
for equal seeds): the queue's mirroring policy, which node leads it at first, where each
publisher and consumer connects first, the load, and 1-3 fault actions with their times. It does
no I/O and knows nothing of processes; bench/chaos/real.py carries a schedule out (and a
simulation driver could too). After the actions every schedule ends the same way: heal
(every node back, every partition healed), stop publishing, drain with the consumers that ran
through the faults, then drain again with a fresh consumer.

Fault kinds (`KINDS`):
  kill            kill -9 of the target, restarted `duration` s later
  sigterm         SIGTERM (a controlled stop) and start again `duration` s later
  pause           SIGSTOP, SIGCONT `duration` s later
  stop_app        `warrenctl stop_app`, `start_app` `duration` s later
  forget          kill -9 (or stop_app + reset) of the target, `forget_cluster_node` of it on a
                  running node, and `duration` s later it joins again as a fresh node
  policy          `set_policy` of another mirroring definition (ha-mode all / exactly 2 / nodes,
                  sync mode manual / automatic)
  sync            `sync_queue`
  cancel_sync     `sync_queue`, then `cancel_sync_queue` shortly after
  rolling_restart every node in turn: SIGTERM, start, wait until the queue's mirrors are
                  synchronised again, then the next (Amazon MQ's maintenance, spec 004)
  full_restart    SIGTERM of every node, then all start again `duration` s later
  partition       the target's network namespace cut off from the other nodes for `duration` s

The workload (`WORKLOADS`, `Schedule.workload`) is a choice, not drawn from the seed: "plain"
(the default) or "retry", a retry loop (the queue dead-letters what its consumers reject once to a
retry queue whose TTL sends it back; the same policy mirrors both). The checker judges the
deliveries the consumers acknowledge.

Targets: "leader" (the queue's leader when the action runs), "mirror" (one of its mirrors,
picked with the action's own seed), "publisher_node" / "consumer_node" (the node the first
publisher / consumer is connected to then), a node "nI" (a random target resolved here, so the
seed alone decides it), or "cluster" / "queue" for actions that are not about one node.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict, dataclass, field

KINDS = ("kill", "sigterm", "pause", "stop_app", "forget", "policy", "sync", "cancel_sync",
         "rolling_restart", "full_restart", "partition")
NODE_KINDS = ("kill", "sigterm", "pause", "stop_app", "forget", "partition")
ROLE_TARGETS = ("leader", "mirror", "publisher_node", "consumer_node", "random")
QUEUE = "chaos.q"
DEFAULT_RATE = 2000  # msgs/s over all publishers
# what the clients do (Schedule.workload): "plain" publishes to one queue and acknowledges every
# delivery; "retry" is a retry loop, the queue with a dead-letter exchange and a retry queue with
# a TTL that sends back what the consumers reject once
WORKLOADS = ("plain", "retry")
RETRY_TTL_MS = 200

# mirroring definitions a schedule starts from or switches to (weights: the common shapes first)
POLICIES: list[tuple[int, dict]] = [
    (5, {"ha-mode": "all", "ha-sync-mode": "automatic"}),  # Amazon MQ's default
    (2, {"ha-mode": "all"}),
    (2, {"ha-mode": "exactly", "ha-params": 2, "ha-sync-mode": "automatic"}),
    (1, {"ha-mode": "exactly", "ha-params": 2}),
    (1, {"ha-mode": "nodes", "ha-params": "PAIR", "ha-sync-mode": "automatic"}),
    (1, {"ha-mode": "nodes", "ha-params": "PAIR"}),
]


@dataclass
class Action:
    at: float  # seconds after the load starts
    kind: str
    target: str  # leader | mirror | publisher_node | consumer_node | nI | cluster | queue
    duration: float = 0.0  # seconds until it is undone (0: an instant action)
    params: dict = field(default_factory=dict)
    seed: int = 0  # for choices made when it runs (which mirror)

    def describe(self) -> str:
        extra = "".join(f" {k}={json.dumps(v)}" for k, v in sorted(self.params.items()))
        dur = f" for {self.duration:g} s" if self.duration else ""
        return f"t={self.at:5.2f}s {self.kind} {self.target}{dur}{extra}"


@dataclass
class Schedule:
    seed: int
    kinds: list[str]  # the kinds it was drawn from (part of what replays it)
    nodes: int
    policy: dict
    leader: str  # the node that declares the queue, so it leads it (client-local)
    publishers: list[str]  # the node each publisher connects to first
    consumers: list[str]
    rate: int  # msgs/s over all publishers
    message_size: int
    prefetch: int
    confirm_window: int
    actions: list[Action]
    load_for: float  # seconds of load; faults are undone (healed) at the end of it
    queue: str = QUEUE
    faults_range: list[int] = field(default_factory=lambda: [1, 3])  # how it was drawn (replay)
    scale: float = 1.0
    workload: str = "plain"  # or "retry" (WORKLOADS)
    # 0 a plain queue; N a priority queue (x-max-priority N) whose messages carry priorities
    # 0..N, judged for their order too (checker.py `priority_order`)
    max_priority: int = 0

    # --- the workload: which queues, with which arguments, and how consumers treat messages ---
    def queues(self) -> list[tuple[str, dict]]:
        """The queues to declare, in order, with their arguments. "retry": the queue dead-letters
        what its consumers reject to `queue.retry`, whose TTL sends it back (a retry loop); a
        priority workload's queue has its x-max-priority."""
        main = {"x-max-priority": self.max_priority} if self.max_priority else {}
        if self.workload != "retry":
            return [(self.queue, main)]
        retry = self.queue + ".retry"
        return [(retry, {"x-message-ttl": RETRY_TTL_MS, "x-dead-letter-exchange": "",
                         "x-dead-letter-routing-key": self.queue}),
                (self.queue, {**main, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": retry})]

    @property
    def pattern(self) -> str:
        """The chaos policy's pattern: every queue of the workload."""
        return "^" + re.escape(self.queue) + ("(\\.retry)?$" if self.workload == "retry" else "$")

    @property
    def retries(self) -> int:
        """How many times a consumer rejects a message before it acknowledges it."""
        return 1 if self.workload == "retry" else 0

    def replay_command(self) -> str:
        """The one command that runs this schedule again."""
        cmd = f"warren-bench chaos --seed {self.seed}"
        if self.kinds:
            cmd += f" --kinds {','.join(self.kinds)}"
        if self.faults_range != [1, 3]:
            lo, hi = self.faults_range
            cmd += f" --faults {lo}" + (f"-{hi}" if hi != lo else "")
        if self.scale != 1.0:
            cmd += f" --scale {self.scale:g}"
        if self.rate != DEFAULT_RATE:
            cmd += f" --rate {self.rate}"
        if self.workload != "plain":
            cmd += f" --workload {self.workload}"
        if self.max_priority:
            cmd += f" --priorities {self.max_priority}"
        return cmd + " --replay"

    def simulation_command(self) -> str:
        """The one command that carries out this schedule on the deterministic simulation."""
        return self.replay_command().replace("warren-bench chaos --seed", "warren-bench dst --from-chaos --seed", 1)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        d = dict(d)
        d["actions"] = [Action(**a) for a in d["actions"]]
        return cls(**d)

    def fault_kinds(self) -> list[str]:
        return [a.kind for a in self.actions]

    def describe(self) -> str:
        kind = f"priority queue (x-max-priority {self.max_priority}) " if self.max_priority else ""
        lines = [f"seed {self.seed}: {self.nodes} nodes, {kind}queue {self.queue} led by {self.leader}, "
                 f"policy {json.dumps(self.policy)}",
                 f"  load {self.rate} msgs/s x {self.message_size} B for {self.load_for:g} s; "
                 f"publishers on {', '.join(self.publishers)} (confirms, window {self.confirm_window}); "
                 f"consumers on {', '.join(self.consumers)} (manual acks, prefetch {self.prefetch})"]
        lines += ["  " + a.describe() for a in self.actions]
        lines.append(f"  t={self.load_for:5.2f}s heal, stop publishing, drain, drain again with a fresh consumer")
        return "\n".join(lines)


# a priority queue's workload: how long the publishers run before the consumers subscribe, so
# that a backlog is there for the priorities to order (the checker's "consume" phase)
PRIORITY_BACKLOG = 0.5


def expected_mirrors(policy: dict, names: list[str], leader: str | None) -> int:
    """How many mirrors `policy` gives a queue led by `leader` on a cluster of `names`."""
    mode = policy.get("ha-mode")
    if mode == "all":
        return len(names) - 1
    if mode == "exactly":
        return min(int(policy.get("ha-params", 1)), len(names)) - 1
    listed = [n for n in policy.get("ha-params") or [] if n in names]
    if not listed:
        return 0
    return len(listed) - 1 if leader in listed else len(listed)


def _pick_policy(rng: random.Random, names: list[str], leader: str) -> dict:
    weights = [w for w, _ in POLICIES]
    pol = dict(rng.choices([p for _, p in POLICIES], weights)[0])
    if pol.get("ha-params") == "PAIR":
        other = rng.choice([n for n in names if n != leader])
        pol["ha-params"] = sorted([leader, other])
    r = rng.random()
    if r < 0.15:
        pol["ha-promote-on-failure"] = "when-synced"
    elif r < 0.35:
        pol["ha-promote-on-shutdown"] = "always"
    return pol


def _duration(rng: random.Random, kind: str, scale: float) -> float:
    lo, hi = {"kill": (1.5, 6.0), "sigterm": (1.0, 4.0), "pause": (1.0, 9.0), "stop_app": (1.5, 6.0),
              "forget": (2.0, 5.0), "full_restart": (0.5, 2.0), "partition": (2.0, 9.0),
              "cancel_sync": (0.05, 0.5)}.get(kind, (0.0, 0.0))
    return round(rng.uniform(lo, hi) * (scale if kind != "cancel_sync" else 1.0), 2)


def generate(seed: int, kinds: list[str] | tuple[str, ...] | None = None, *, nodes: int = 3,
             min_faults: int = 1, max_faults: int = 3, scale: float = 1.0) -> Schedule:
    """The schedule of `seed`, drawn from `kinds` (all when None). `scale` shortens (or
    lengthens) every duration and gap, for quick smoke runs."""
    kinds = list(kinds or KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"unknown fault kind(s) {bad}; known: {', '.join(KINDS)}")
    kinds = [k for k in KINDS if k in kinds]  # the draw depends on the set, not on how it was written
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(1, nodes + 1)]
    leader = rng.choice(names)
    policy = _pick_policy(rng, names, leader)
    count = rng.randint(min_faults, max_faults)
    chosen = [rng.choice(kinds) for _ in range(count)]
    # at most one whole-cluster action per schedule: they take the longest
    heavy = [i for i, k in enumerate(chosen) if k in ("rolling_restart", "full_restart")]
    for i in heavy[1:]:
        light = [k for k in kinds if k not in ("rolling_restart", "full_restart")]
        chosen[i] = rng.choice(light) if light else chosen[i]
    actions: list[Action] = []
    t = round(rng.uniform(2.0, 4.0) * scale, 2)
    for k in chosen:
        if k in NODE_KINDS:
            target = rng.choice(ROLE_TARGETS)
            if target == "random":
                target = rng.choice(names)
        elif k in ("policy", "sync", "cancel_sync"):
            target = "queue"
        else:
            target = "cluster"
        params: dict = {}
        if k == "policy":
            params["definition"] = _pick_policy(rng, names, leader)
        if k == "forget":
            params["how"] = rng.choice(["kill", "reset"])
        dur = _duration(rng, k, scale)
        actions.append(Action(at=t, kind=k, target=target, duration=dur, params=params,
                              seed=rng.randrange(1 << 30)))
        # the next one may start while this one is still in effect (overlapping faults)
        t = round(t + dur * rng.uniform(0.3, 1.2) + rng.uniform(0.5, 3.0) * scale, 2)
    # clients: 1-2 of each, on random nodes; half the time one sits on the first fault's node
    publishers = [rng.choice(names) for _ in range(rng.randint(1, 2))]
    consumers = [rng.choice(names) for _ in range(rng.randint(1, 2))]
    first = actions[0].target if actions else None
    doomed = leader if first == "leader" else first if first in names else None
    if doomed and rng.random() < 0.5:
        (publishers if rng.random() < 0.5 else consumers)[0] = doomed
    last_end = max((a.at + a.duration for a in actions), default=0.0)
    load_for = round(max(last_end, t) + 2.0 * scale, 2)
    return Schedule(seed=seed, kinds=kinds if set(kinds) != set(KINDS) else [],
                    nodes=nodes, policy=policy, leader=leader, publishers=publishers,
                    consumers=consumers, rate=DEFAULT_RATE, message_size=256,
                    prefetch=rng.choice([50, 200, 500]), confirm_window=rng.choice([500, 1000, 2000]),
                    actions=actions, load_for=load_for, faults_range=[min_faults, max_faults],
                    scale=scale)


def one_of_each(seed: int, scale: float = 0.4) -> list[Schedule]:
    """One single-fault schedule per kind (the smoke run)."""
    return [generate(seed + i, [k], min_faults=1, max_faults=1, scale=scale) for i, k in enumerate(KINDS)]


def main(argv=None) -> None:
    """`python -m bench.chaos.schedule SEED [KIND,...]`: print a schedule."""
    import sys
    args = sys.argv[1:] if argv is None else argv
    seed = int(args[0]) if args else 1
    kinds = args[1].split(",") if len(args) > 1 else None
    s = generate(seed, kinds)
    print(s.describe())
    print(json.dumps(s.as_dict()))


if __name__ == "__main__":
    main()
