"""A Jepsen-style checker for a total queue: what happened to every message of one chaos run.

This module owns the *history* (what a driver records while clients run and faults happen) and
the *verdict* (what the checker concludes from it). It is pure: no I/O, no clock, no trio, so the
real-process driver (bench/chaos/real.py) and a deterministic simulation driver can both record
the same plain dataclasses and reuse `check` unchanged. Times are floats in any one clock.

The history
-----------
- `Publish`: one per message a publisher handed to the client: id, publisher index, the node its
  connection was on, `t_pub`, the outcome ("ack", "nack" or None when no answer came), `t_conf`
  and the nack reason (the client reports publishes lost with a connection as nacks with reason
  "connection lost"); in a priority queue's workload, the message's priority.
- `Delivery`: one per delivery received by a consumer (a redelivery is another one): id,
  consumer index, node, time, the `redelivered` flag.
- `Subscription`: when a consumer was subscribed to a queue (`t_end` None: until the end).
- `Fault`: one per fault action: time, kind, target, detail, `t_end` (when it was undone: the
  node back, the partition healed) and `loss_allowed`: None, or why the spec allows losing the
  messages confirmed before `t_end` (see `spec_allows_loss`, judged from the replicas seen
  when the fault began, and `allow_unsynchronised_promotions`, from what the broker logged when
  it promoted: a mirror that came back during the fault may be promoted unsynchronised).
- `Phase`: markers "load" (clients start; in a priority queue's workload the publishers alone,
  and "consume" when the consumers subscribe, after a backlog has built), "heal" (every fault undone), "publish_end" (the
  publishers stopped), "drain1" (the consumers that ran through the faults drain what is left),
  "drain1_end" (they stop), "drain2" (a second, fresh consumer looks for anything the first
  drain did not get), "end".
- `Disconnect`: a client connection broke (publishes in flight on it may be unanswered for good).
- `anomalies`: what the driver saw the cluster do wrong that the messages cannot show (a wait
  for recovery that ran out, a queue left without a leader); each one fails the verdict.

The rules
---------
- delivered = a consumer received the id from any queue: a message dead-lettered (rejected,
  expired) counts as delivered once it is delivered from its dead-letter queue (in a retry loop,
  when it comes back to its own queue), and not as lost meanwhile.
- lost = confirmed (ack) and never delivered. Lost is allowed only where a fault says the spec
  allows it and the message was confirmed before that fault ended, or, for an unsynchronised
  promotion the fault led to after it ended, the promoted replica lacked it by the spec's rules
  (`Fault.loss_window`) (`lost_allowed`, by reason); every other lost message is a bug. Unconfirmed and nacked publishes may be lost: counted apart.
- duplicates = ids delivered more than once; fine when every delivery after the first carried
  `redelivered`, a bug otherwise. The times are the clients' receive times, and two consumers
  on two connections through two nodes can receive out of the broker's order: the broker's
  first (unflagged) delivery to one consumer may reach it a moment after the flagged
  redelivery to another (its node was stopping and the queue requeued what it had in flight).
  So one unflagged delivery that trails flagged ones is the broker's first if it is the only
  unflagged one, went to another consumer than every earlier delivery, and trails them by at
  most CROSS_PATH_SLACK seconds.
- stranded messages = first delivered during the second drain although the first drain had a
  consumer subscribed to their queue the whole time: a bug even though nothing is lost.
- stranded consumers = a subscribed consumer received nothing for longer than `stranded_after`
  while confirmed messages of its queue waited (published and not yet delivered to anyone),
  not counting the time from each fault until `recovery_grace` after it ended.
- stuck publishes = no ack and no nack by the end although the publisher's connection never
  broke after the publish: a bug.
- phantom deliveries = ids nobody published: a bug.
- priority order (a priority queue's workload: publishes that carry a priority) = a consumer
  received message b before message a, both without `redelivered`, though a's priority is at
  least b's and a was confirmed before b was published: the queue held a when b came, so a is
  handed out first (FIFO within a priority, and no overtaking of a higher priority). And the
  backlog (messages confirmed before the "consume" phase, when no consumer existed yet, so all
  of them were queued at once) reaches each consumer highest priority first. Judged only where
  a confirm proves the order (`priority_order`); a bug.
- confirm stalls = the longest time a publisher had publishes outstanding and no confirm (nor
  nack) came, counting only the time when every node was up and linked and no fault was in
  force (`BrokerEvent`s from the node logs tell when the links were up, and when a queue ran a
  blocking sync, which the spec lets hold every operation; a history without them excuses each
  fault until `recovery_grace` after it ended; with them, each fault that was undone and each
  link down until `stall_grace`, the cluster's net_ticktime, after it ended). One longer than
  `stall_limit`
  (STALL_LIMIT) is a bug: a healthy cluster confirms within a round trip to every mirror.
- measures (not judged): the longest time without a delivery while published messages waited
  (published, not yet delivered), and for every fault the time from it to the first delivery
  after it. The longest pause in deliveries and the confirm stall each say what they waited
  for, as far as the history can tell: the faults in force, links down, and what the node logs
  said meanwhile (a mirror the leader gave up on, a promotion).
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

CROSS_PATH_SLACK = 0.25  # seconds by which receive order across consumers may invert (see the rules)
# The longest confirm stall allowed with every node up and linked and no fault in force. A
# confirm then waits for one round trip to each mirror (milliseconds). What may hold confirms
# for longer in a healthy cluster is bounded by the cluster's own timers: a node out of step
# with the metadata log holds them until it hears from the log's leader (the election timeout,
# at most 2 s), and a mirror's start that went unanswered is sent again after 1 s. 3 s is above
# those, and below what a mirror nobody hears from costs: its leader waits net_ticktime (10 s by
# default) before it gives up on it, which is the stall this rule is there to catch.
STALL_LIMIT = 3.0

# --- the history -------------------------------------------------------------------------------


@dataclass(slots=True)
class Publish:
    id: int
    publisher: int
    node: str | None
    t_pub: float
    outcome: str | None = None  # "ack" | "nack" | None (no answer)
    t_conf: float | None = None
    reason: str = ""  # the nack's reason
    queue: str = ""
    priority: int | None = None  # a priority queue's workload: the message's priority


@dataclass(slots=True)
class Delivery:
    id: int
    consumer: int
    node: str | None
    t: float
    redelivered: bool
    queue: str = ""


@dataclass(slots=True)
class Subscription:
    consumer: int
    queue: str
    t_start: float
    t_end: float | None = None  # None: subscribed until the end of the history


@dataclass
class Fault:
    t: float
    kind: str
    target: str | None = None
    detail: dict = field(default_factory=dict)
    t_end: float | None = None  # when the fault was undone (None: an instant action)
    loss_allowed: str | None = None  # why the spec allows losing what was confirmed before t_end
    # an unsynchronised promotion after t_end (`allow_unsynchronised_promotions`): (published
    # no later than, confirmed no later than) of what else that promotion may lose
    loss_window: tuple[float, float] | None = None


@dataclass(slots=True)
class Phase:
    t: float
    name: str  # load | heal | publish_end | drain1 | drain2 | end


@dataclass(slots=True)
class Disconnect:
    t: float
    role: str  # "publisher" | "consumer"
    index: int
    node: str | None = None
    reason: str = ""


@dataclass(slots=True)
class BrokerEvent:
    """A line of a node's log that the checker reads: a link up or down, the app starting or
    stopping, a mirror given up on, a promotion (`BROKER_EVENTS`)."""
    t: float
    node: str
    event: str
    fields: dict = field(default_factory=dict)


# the log events a driver keeps for the checker (substrings of the event text)
BROKER_EVENTS = ("node listening", "app started", "stopping app", "app stopped", "node up",
                 "node down", "asking to drop the mirror", "Promoting mirror",
                 "not following", "replication batch missing", "steps down", "mirror following leader",
                 "pausing clients", ": Synchronising ", ": Synchronisation ")
EVENT_FIELDS = ("peer", "reason", "leader", "how", "queue", "mode", "pid")  # the fields kept of each


def keeps_event(event: str) -> bool:
    return any(k in event for k in BROKER_EVENTS)


@dataclass
class History:
    publishes: list[Publish] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    subscriptions: list[Subscription] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    disconnects: list[Disconnect] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    broker_events: list[BrokerEvent] = field(default_factory=list)

    def phase(self, name: str) -> float | None:
        """The time of the first marker called `name`, or None."""
        for p in self.phases:
            if p.name == name:
                return p.t
        return None

    @property
    def end(self) -> float:
        t = self.phase("end")
        if t is not None:
            return t
        times = [p.t for p in self.phases] + [d.t for d in self.deliveries] + \
                [p.t_pub for p in self.publishes]
        return max(times, default=0.0)


# --- the spec's loss rule ----------------------------------------------------------------------

def spec_allows_loss(leader: str | None, mirrors: list[str], synced: list[str] | set[str],
                     down: set[str], how: str, promote_on_failure: str = "always",
                     promote_on_shutdown: str = "when-synced") -> str | None:
    """Whether the spec allows a queue to lose confirmed messages when the nodes in `down` go
    away, and why; None when it does not.

    `leader`, `mirrors` (oldest first) and `synced` are the queue's replicas just before the
    fault; `how` is how the leader's node goes away: "crash" (kill -9: its replica is gone),
    "shutdown" (stop_app, SIGTERM: a controlled stop, its replica is gone too, the broker is
    in-memory) or "isolated" (SIGSTOP, a partition: it comes back with its contents).

    The spec promotes the oldest surviving mirror allowed by the promote keys (an unsynchronised
    one only with ha-promote-on-failure "always" and, on a controlled stop, also
    ha-promote-on-shutdown "always"). Loss is allowed when that mirror is unsynchronised, or when
    no mirror may be promoted and the leader's replica does not come back with its contents.
    """
    if leader is None or leader not in down:
        return None  # the leader survives: nothing may be lost
    synced = set(synced)
    survivors = [m for m in mirrors if m not in down and m != leader]
    unsynced_ok = promote_on_failure == "always" and (how != "shutdown" or promote_on_shutdown == "always")
    chosen = next((m for m in survivors if unsynced_ok or m in synced), None)
    if chosen is not None:
        if chosen in synced:
            return None
        return (f"unsynchronised mirror on {chosen} promoted (ha-promote-on-failure "
                f"{promote_on_failure}, ha-promote-on-shutdown {promote_on_shutdown})")
    if how == "isolated":
        return None  # nobody promoted: the leader comes back with its messages
    if not survivors:
        return "every replica of the queue was killed or stopped (in-memory: their contents are gone)"
    return (f"no synchronised mirror survived and none may be promoted; the leader's node restarts "
            f"empty (in-memory) after {'a controlled stop' if how == 'shutdown' else 'a crash'}")


SHUTDOWN_KINDS = frozenset({"sigterm", "stop_app", "rolling_restart", "full_restart"})
PROMOTION_GRACE = 30.0  # seconds after a fault ends in which a promotion is still its doing


def held_from(events: list[BrokerEvent], node: str, pid: str, t: float) -> float:
    """When the replica `pid` on `node`, promoted at `t`, last started following a leader empty
    ("mirror following leader", how "started empty", in this run of its node: a node's replica
    ids start again with its process), from the node logs; `t` if it never did (it held
    nothing of its own)."""
    began = max((e.t for e in events if e.node == node and e.t <= t
                 and e.event.startswith("app started")), default=float("-inf"))
    return max((e.t for e in events if began <= e.t <= t and e.fields.get("pid") == pid
                and e.event.startswith("mirror following leader")
                and e.fields.get("how") == "started empty"), default=t)


def allow_unsynchronised_promotions(faults: list[Fault], promotions: list[tuple],
                                    policy_at, events: list[BrokerEvent] = ()) -> list[str]:
    """Judge loss at the promotion, not only from the replicas seen when a fault began.

    `promotions`: (time, node, synchronised, pid) of each promotion of the queue's mirrors, as
    the broker logged it (synchronised: the metadata listed that mirror as synchronised until
    then; pid: the promoted replica's); `policy_at(t)`: the queue's policy at time t; `events`:
    the node logs' events (`held_from`). A mirror that joined after a fault began
    (it came back from an earlier one) can be promoted unsynchronised during it; the spec allows
    the loss that follows wherever the promote keys allowed the promotion:
    ha-promote-on-failure "always", and for a controlled stop ha-promote-on-shutdown "always"
    as well. The fault in force at the promotion (the latest begun, not ended more than
    PROMOTION_GRACE seconds before) gets that allowance unless it has one. A promotion the keys
    forbade gives none: the checker then counts the loss as a bug. Returns what it allowed.

    A promotion after the fault ended (a node woken from a pause catches up with the log, and
    its stale links get it counted down again) may also lose what the leader confirmed after
    that end, but only what the promoted replica lacked by the spec's rules: the spec says "If
    there is no mirror that is synchronised with the leader, messages that only existed on
    leader will be lost", and "A newly added mirror provides no additional form of redundancy
    or availability of the queue's contents that existed before the mirror was added". So the
    fault's `loss_window` covers messages published no later than the promoted replica last
    started empty (the promotion itself if it never started: it held nothing) and confirmed no
    later than the promotion; a message published after that start reached the mirror before
    its confirm, and its loss stays a bug (dst seed 1008 at the prio branch's tip: 30 messages
    published to a leader that woke from a pause, confirmed with no mirror listed, lost when a
    mirror added just after was promoted unsynchronised)."""
    said = []
    for t, node, synchronised, *pid in promotions:
        if synchronised:
            continue
        open_ = [f for f in faults if f.t <= t <= (f.t_end if f.t_end is not None else f.t) + PROMOTION_GRACE]
        if not open_:
            continue
        f = max(open_, key=lambda f: f.t)
        policy = policy_at(t)
        on_failure = policy.get("ha-promote-on-failure", "always")
        on_shutdown = policy.get("ha-promote-on-shutdown", "when-synced")
        if on_failure != "always" or (f.kind in SHUTDOWN_KINDS and on_shutdown != "always"):
            continue
        if f.loss_allowed is None:
            f.loss_allowed = (f"unsynchronised mirror on {node} promoted (ha-promote-on-failure "
                              f"{on_failure}, ha-promote-on-shutdown {on_shutdown}; the broker's log)")
            said.append(f.loss_allowed)
        if pid and (f.t_end is None or t > f.t_end):
            if f.loss_window is None or t > f.loss_window[1]:
                f.loss_window = (held_from(events, node, pid[0], t), t)
    return said


def policy_timeline(changes: list[tuple[float, dict]]):
    """`policy_at(t)` from [(time from which it holds, policy), ...] in time order."""
    def policy_at(t: float) -> dict:
        now = changes[0][1]
        for t0, policy in changes:
            if t0 <= t:
                now = policy
        return now
    return policy_at


# --- the verdict -------------------------------------------------------------------------------

@dataclass
class Verdict:
    ok: bool
    reasons: list[str]
    published: int
    confirmed: int
    nacked: int
    unconfirmed: int
    deliveries: int
    delivered: int
    lost: int
    lost_ids: list[int]
    lost_allowed: dict[str, int]
    lost_unconfirmed: int  # nacked or unanswered publishes never delivered (allowed)
    duplicates: int
    duplicates_redelivered: int
    duplicates_unflagged: int
    duplicate_ids_unflagged: list[int]
    redelivered: int
    stranded: int
    stranded_ids: list[int]
    stranded_consumers: list[dict]
    stuck: int
    stuck_by_publisher: dict[int, int]
    phantom: int
    longest_gap_s: float | None
    longest_gap_at: float | None
    recovery: list[dict]
    anomalies: list[str]
    longest_gap_why: str = ""  # what the longest pause in deliveries waited for
    # the longest confirm stall with every node up and linked and no fault in force
    confirm_stall_s: float | None = None
    confirm_stall_at: float | None = None
    confirm_stall_publisher: int | None = None
    confirm_stall_why: str = ""
    # a priority queue's workload: deliveries judged for their order, and pairs out of order
    # (consumer, the id delivered first, the id that should have come before it)
    order_judged: int = 0
    order_violations: int = 0
    order_examples: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stuck_by_publisher"] = {str(k): v for k, v in self.stuck_by_publisher.items()}
        return d

    def line(self) -> str:
        """One line: OK/FAIL and the numbers that matter."""
        allowed = sum(self.lost_allowed.values())
        gap = "-" if self.longest_gap_s is None else f"{self.longest_gap_s * 1000:.0f} ms"
        stall = "-" if self.confirm_stall_s is None else f"{self.confirm_stall_s * 1000:.0f} ms"
        rec = [r["first_delivery_after_s"] for r in self.recovery if r["first_delivery_after_s"] is not None]
        return (f"{'OK  ' if self.ok else 'FAIL'} published {self.published:,} confirmed {self.confirmed:,} "
                f"nacked {self.nacked:,} unconfirmed {self.unconfirmed:,} delivered {self.delivered:,} | "
                f"lost {self.lost:,} (allowed {allowed:,}) dup {self.duplicates:,} "
                f"(unflagged {self.duplicates_unflagged:,}) stranded {self.stranded:,}"
                f"{'+' + str(len(self.stranded_consumers)) + ' consumer(s)' if self.stranded_consumers else ''} "
                f"stuck {self.stuck:,}"
                f"{f' order {self.order_violations:,} of {self.order_judged:,}' if self.order_judged else ''}"
                f" | longest gap {gap}{_why(self.longest_gap_why)}, "
                f"confirm stall {stall}{_why(self.confirm_stall_why)}, recovery "
                f"{'-' if not rec else f'{max(rec):.2f} s'}")


def _why(text: str) -> str:
    return f" ({text})" if text else ""


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _clip(merged: list[tuple[float, float]], starts: list[float], a: float, b: float) -> list[tuple[float, float]]:
    """The parts of the merged intervals inside (a, b)."""
    out = []
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(merged) and merged[i][0] < b:
        x, y = merged[i]
        lo, hi = max(a, x), min(b, y)
        if hi > lo:
            out.append((lo, hi))
        i += 1
    return out


def _subtract(parts: list[tuple[float, float]], holes: list[tuple[float, float]],
              hole_starts: list[float]) -> list[tuple[float, float]]:
    out = []
    for a, b in parts:
        cur = a
        for x, y in _clip(holes, hole_starts, a, b):
            if x > cur:
                out.append((cur, x))
            cur = max(cur, y)
        if b > cur:
            out.append((cur, b))
    return out


def _flagged_repeats(first: Delivery, reps: list[Delivery]) -> bool:
    """Whether the repeats of one id are in order: every delivery but the broker's first
    carried `redelivered` (see the rules above for the one that may trail by a moment)."""
    unflagged = [d for d in reps if not d.redelivered]
    if not unflagged:
        return True
    if len(unflagged) > 1 or not first.redelivered:
        return False
    d = unflagged[0]
    earlier = [first] + reps[:reps.index(d)]
    return all(e.consumer != d.consumer and d.t - e.t <= CROSS_PATH_SLACK for e in earlier)


def unlinked_spans(events: list[BrokerEvent], end: float) -> list[tuple[float, float]] | None:
    """When not every node was up and linked to every other, from the node logs' events: a
    node counts from its "app started" until it stops ("stopping app", "app stopped", or a new
    process's "node listening"), and each node's link to each peer from its "node up" to its
    "node down" as that node logged it (a killed node logs nothing, but its peers log the
    link down). None without events (a history recorded before the drivers kept them)."""
    if not events:
        return None
    nodes = sorted({e.node for e in events})
    running: set[str] = set()
    links: set[tuple[str, str]] = set()
    want = {(a, b) for a in nodes for b in nodes if a != b}
    spans: list[tuple[float, float]] = []
    since: float | None = None
    for e in sorted(events, key=lambda e: e.t):
        ev = e.event
        if ev.startswith("app started"):
            running.add(e.node)
        elif ev.startswith(("stopping app", "app stopped", "node listening")):
            running.discard(e.node)
            links = {l for l in links if l[0] != e.node}
        elif ev.startswith("node up") and e.fields.get("peer"):
            links.add((e.node, e.fields["peer"]))
        elif ev.startswith("node down") and e.fields.get("peer"):
            links.discard((e.node, e.fields["peer"]))
        else:
            continue
        whole = len(running) == len(nodes) and links >= want
        if not whole and since is None:
            since = e.t
        elif whole and since is not None:
            spans.append((since, e.t))
            since = None
    if since is not None:
        spans.append((since, end))
    return spans


def blocking_syncs(events: list[BrokerEvent], end: float) -> list[tuple[float, float]]:
    """When a queue leader ran a blocking sync (the spec: the queue serves nothing else
    meanwhile, so its confirms wait), from its log lines "Synchronising N messages ..." and
    "Synchronisation complete/stopped/cancelled"."""
    spans, open_ = [], {}
    for e in sorted(events, key=lambda e: e.t):
        key = (e.node, e.fields.get("queue"))
        if ": Synchronising " in e.event and e.fields.get("mode") == "blocking":
            open_.setdefault(key, e.t)
        elif ": Synchronisation " in e.event and key in open_:
            spans.append((open_.pop(key), e.t))
    return spans + [(t, end) for t in open_.values()]


def confirm_stalls(pubs: list[Publish], breaks: dict[int, list[float]], end: float,
                   shortest: float = 0.0) -> list[tuple[float, float, int]]:
    """(from, to, publisher) for each span in which a publisher had publishes outstanding and
    no answer came (longer than `shortest`). A publish is outstanding from `t_pub` until its
    confirm or nack, or until its publisher's connection broke (the client gave up on it), or
    the end."""
    by_publisher: dict[int, list[tuple[float, int]]] = {}
    for p in pubs:
        ev = by_publisher.setdefault(p.publisher, [])
        ev.append((p.t_pub, 1))
        if p.outcome is not None and p.t_conf is not None:
            ev.append((p.t_conf, -1))
        else:
            b = breaks.get(p.publisher, [])
            k = bisect.bisect_left(b, p.t_pub)
            ev.append((b[k] if k < len(b) else end, -1))
    out = []
    for publisher, ev in by_publisher.items():
        ev.sort(key=lambda x: (x[0], -x[1]))  # a publish and its confirm at one instant: in order
        outstanding, since = 0, None
        for t, delta in ev:
            if delta < 0 and since is not None and t - since > shortest:
                out.append((since, t, publisher))
            if delta < 0:
                since = t
            outstanding += delta
            if outstanding == 0:
                since = None
            elif since is None:
                since = t
    return out


def _in_force(f: Fault, a: float, b: float) -> bool:
    """Was fault `f` in force during (a, b)? (One that ended as `a` began was not.)"""
    end = f.t_end if f.t_end is not None else f.t
    return f.t < b and a < end or a <= f.t <= b and end == f.t


def explain(h: History, a: float, b: float, unlinked: list[tuple[float, float]] | None) -> str:
    """What a pause from `a` to `b` waited for, as far as the history tells: the faults in
    force, links down, and what the node logs said meanwhile (a mirror given up on, a
    promotion, a mirror started again)."""
    faults = []
    for f in h.faults:
        name = f"{f.kind}{' of ' + f.target if f.target else ''}"
        if _in_force(f, a, b) and name not in faults:
            faults.append(name)
    if faults:
        said = [f"during {', '.join(faults)}"]
    else:
        ended = [f for f in h.faults if (f.t_end if f.t_end is not None else f.t) <= a]
        last = max(ended, key=lambda f: f.t_end if f.t_end is not None else f.t, default=None)
        said = ["no fault in force" + (
            f" ({last.kind}{' of ' + last.target if last.target else ''} ended "
            f"{a - (last.t_end if last.t_end is not None else last.t):.1f} s before)" if last else "")]
    if not faults and unlinked:
        down = sum(min(b, y) - max(a, x) for x, y in unlinked if x < b and y > a)
        if down > 0:
            said.append(f"not every node up and linked for {down:.1f} s of it")
    syncing = sum(min(b, y) - max(a, x) for x, y in blocking_syncs(h.broker_events, b) if x < b and y > a)
    if syncing > 0:
        said.append(f"a blocking sync for {syncing:.1f} s of it")
    seen: list[str] = []
    for e in h.broker_events:
        if not a <= e.t <= b + 0.5 or e.event.startswith(("node up", "node listening", "app started")) \
                or "Synchronis" in e.event:
            continue
        f = e.fields
        text = e.event.split(": ", 1)[-1]
        if text.startswith("node down"):
            text = f"link to {f.get('peer')} down"
        elif text.startswith("mirror following leader"):
            text = f"mirror {f.get('how', '')} following {f.get('leader', '')}"
        elif f.get("reason"):
            text += f" ({f['reason']})"
        line = f"{e.node}: {text[:90]}"
        if line not in seen:
            seen.append(line)
            said.append(f"{line} at +{e.t - a:.1f} s")
            if len(seen) == 3:
                break
    return "; ".join(said)


def check(h: History, *, stranded_after: float = 5.0, recovery_grace: float = 5.0,
          stall_limit: float = STALL_LIMIT, stall_grace: float = 0.0, sample: int = 20) -> Verdict:
    """Judge one history (see the module's docstring for the rules)."""
    reasons: list[str] = []
    end = h.end
    pubs: dict[int, Publish] = {}
    for p in h.publishes:
        pubs[p.id] = p
    published = len(pubs)
    confirmed_ids = [i for i, p in pubs.items() if p.outcome == "ack"]
    nacked = sum(1 for p in pubs.values() if p.outcome == "nack")
    unanswered = [p for p in pubs.values() if p.outcome is None]

    # first delivery time of each id, repeats, phantoms
    deliveries = sorted(h.deliveries, key=lambda d: d.t)
    first: dict[int, Delivery] = {}
    repeats: dict[int, list[Delivery]] = {}
    phantom = 0
    for d in deliveries:
        if d.id not in pubs:
            phantom += 1
        if d.id in first:
            repeats.setdefault(d.id, []).append(d)
        else:
            first[d.id] = d
    redelivered = sum(1 for d in deliveries if d.redelivered)

    # lost, and which losses the spec allows
    allowing = [f for f in h.faults if f.loss_allowed]
    lost_allowed: dict[str, int] = {}
    lost_bug: list[int] = []
    for i in confirmed_ids:
        if i in first:
            continue
        t_conf = pubs[i].t_conf
        why = None
        t_pub = pubs[i].t_pub
        for f in allowing:
            limit = f.t_end if f.t_end is not None else f.t
            window = f.loss_window
            if t_conf is None or t_conf <= limit or \
                    (window is not None and t_pub <= window[0] and t_conf <= window[1]):
                why = f"{f.kind}{' of ' + f.target if f.target else ''}: {f.loss_allowed}"
                break
        if why is None:
            lost_bug.append(i)
        else:
            lost_allowed[why] = lost_allowed.get(why, 0) + 1
    lost_bug.sort()
    lost_unconfirmed = sum(1 for i, p in pubs.items() if p.outcome != "ack" and i not in first)
    if lost_bug:
        reasons.append(f"{len(lost_bug)} confirmed message(s) never delivered, e.g. ids {lost_bug[:5]}")

    # duplicates
    unflagged = sorted(i for i, reps in repeats.items() if not _flagged_repeats(first[i], reps))
    if unflagged:
        reasons.append(f"{len(unflagged)} id(s) delivered again without the redelivered flag, "
                       f"e.g. {unflagged[:5]}")
    if phantom:
        reasons.append(f"{phantom} deliveries of ids nobody published")

    # stranded messages: first seen in the second drain though a consumer ran through the first
    t_d1, t_d2 = h.phase("drain1"), h.phase("drain2")
    stranded_ids: list[int] = []
    if t_d2 is not None:
        stranded_ids = sorted(i for i, d in first.items() if d.t >= t_d2 and i in pubs)
        if stranded_ids:
            start = t_d1 if t_d1 is not None else t_d2
            stop = h.phase("drain1_end") or t_d2
            queues = {pubs[i].queue for i in stranded_ids}
            through = [s for s in h.subscriptions if s.queue in queues and s.t_start <= start
                       and (s.t_end is None or s.t_end >= stop)]
            who = (f"consumer(s) {sorted({s.consumer for s in through})} were subscribed through the "
                   f"first drain" if through else "no consumer stayed subscribed through the first drain")
            reasons.append(f"{len(stranded_ids)} message(s) stranded: first delivered in the second "
                           f"drain, though {who}; e.g. ids {stranded_ids[:5]}")

    # stranded consumers: quiet while confirmed messages of their queue waited
    waiting_by_queue: dict[str, list[tuple[float, float]]] = {}
    for i, d in first.items():
        p = pubs.get(i)
        if p is None or p.outcome != "ack" or p.t_conf is None:
            continue
        waiting_by_queue.setdefault(p.queue, []).append((p.t_conf, d.t))
    waiting = {q: _merge(v) for q, v in waiting_by_queue.items()}
    excused = _merge([(f.t, (f.t_end if f.t_end is not None else f.t) + recovery_grace) for f in h.faults])
    excused_starts = [a for a, _ in excused]
    by_consumer: dict[int, list[float]] = {}
    for d in deliveries:
        by_consumer.setdefault(d.consumer, []).append(d.t)
    stranded_consumers = []
    for s in h.subscriptions:
        w = waiting.get(s.queue)
        if not w:
            continue
        w_starts = [a for a, _ in w]
        s_end = s.t_end if s.t_end is not None else end
        times = by_consumer.get(s.consumer, [])
        lo = bisect.bisect_left(times, s.t_start)
        hi = bisect.bisect_right(times, s_end)
        marks = [s.t_start, *times[lo:hi], s_end]
        worst = None
        for a, b in zip(marks, marks[1:]):
            if b - a <= stranded_after:
                continue
            for x, y in _subtract(_clip(w, w_starts, a, b), excused, excused_starts):
                if y - x > stranded_after and (worst is None or y - x > worst[1] - worst[0]):
                    worst = (x, y)
        if worst is not None:
            stranded_consumers.append({"consumer": s.consumer, "queue": s.queue, "from": worst[0],
                                       "to": worst[1], "seconds": round(worst[1] - worst[0], 3)})
    for sc in stranded_consumers:
        reasons.append(f"consumer {sc['consumer']} received nothing for {sc['seconds']:.1f} s while "
                       f"confirmed messages of {sc['queue'] or 'its queue'} waited")

    # stuck publishes: unanswered though the connection never broke after the publish
    breaks: dict[int, list[float]] = {}
    for d in h.disconnects:
        if d.role == "publisher":
            breaks.setdefault(d.index, []).append(d.t)
    for v in breaks.values():
        v.sort()
    stuck_by: dict[int, int] = {}
    for p in unanswered:
        b = breaks.get(p.publisher, [])
        k = bisect.bisect_left(b, p.t_pub)
        if k < len(b) and b[k] <= end:
            continue  # its connection broke afterwards: the client gave up on it
        stuck_by[p.publisher] = stuck_by.get(p.publisher, 0) + 1
    stuck = sum(stuck_by.values())
    if stuck:
        reasons.append(f"{stuck} publish(es) never confirmed nor nacked while the connection stayed "
                       f"up (by publisher: {dict(sorted(stuck_by.items()))})")

    # measures: longest pause while messages waited (here from their publish: during a
    # failover the confirms are late too), and recovery after each fault
    all_waiting = _merge([(pubs[i].t_pub, d.t) for i, d in first.items() if i in pubs])
    aw_starts = [a for a, _ in all_waiting]
    t_load = h.phase("load")
    times = [d.t for d in deliveries if t_load is None or d.t >= t_load]
    gap, gap_at = None, None
    for a, b in zip(times, times[1:]):
        if gap is not None and b - a <= gap:
            continue
        for x, y in _clip(all_waiting, aw_starts, a, b):
            if gap is None or y - x > gap:
                gap, gap_at = y - x, x
    unlinked = unlinked_spans(h.broker_events, end)
    gap_why = explain(h, gap_at, gap_at + gap, unlinked) if gap else ""

    # confirm stalls while every node was up and linked and no fault was in force
    if unlinked is None:
        holes = excused  # no node logs: each fault until recovery_grace after it ended
    else:
        # A fault that was undone, or a link that was down, can hold confirms a while longer:
        # a mirror that missed batches meanwhile acknowledges nothing, and its leader gives up
        # on it only when the mirror has been silent `stall_grace` (net_ticktime) seconds, which
        # may be counted from an acknowledgement that came just after the fault ended. So the
        # first `stall_grace` seconds after each are excused too, whether the stall began during
        # the fault or just after it (a publisher that had nothing outstanding meanwhile); any
        # longer stall, and any stall further from a fault, is still judged against the limit.
        holes = _merge([(f.t, f.t_end + stall_grace if f.t_end is not None else f.t) for f in h.faults]
                       + [(x, y + stall_grace if y > x else y) for x, y in unlinked]
                       + blocking_syncs(h.broker_events, end))
    hole_starts = [a for a, _ in holes]
    stall, stall_at, stall_by = None, None, None
    for a, b, publisher in confirm_stalls(h.publishes, breaks, end, shortest=0.0):
        if stall is not None and b - a <= stall:
            continue
        for x, y in _subtract([(a, b)], holes, hole_starts):
            if stall is None or y - x > stall:
                stall, stall_at, stall_by = y - x, x, publisher
    stall_why = explain(h, stall_at, stall_at + stall, unlinked) if stall else ""
    if stall is not None and stall > stall_limit:
        reasons.append(f"publisher {stall_by} waited {stall:.1f} s for a confirm with every node up "
                       f"and linked and no fault in force ({stall_why})")

    all_times = [d.t for d in deliveries]
    recovery = []
    for k, f in enumerate(h.faults):
        j = bisect.bisect_right(all_times, f.t)
        after = all_times[j] - f.t if j < len(all_times) else None
        recovery.append({"fault": k, "kind": f.kind, "target": f.target, "t": f.t,
                         "first_delivery_after_s": None if after is None else round(after, 4)})

    order_judged, out_of_order = priority_order(pubs, deliveries, h.phase("consume"))
    if out_of_order:
        c, b, a = out_of_order[0]
        reasons.append(f"{len(out_of_order)} deliveries out of priority order, e.g. consumer {c} got "
                       f"id {b} before id {a}, which the queue held first with a priority at least "
                       f"as high")

    for a in h.anomalies:
        reasons.append(f"anomaly: {a}")

    ok = not reasons
    return Verdict(
        ok=ok, reasons=reasons, published=published, confirmed=len(confirmed_ids), nacked=nacked,
        unconfirmed=len(unanswered), deliveries=len(deliveries), delivered=len(first),
        lost=len(lost_bug), lost_ids=lost_bug[:sample], lost_allowed=lost_allowed,
        lost_unconfirmed=lost_unconfirmed, duplicates=len(repeats),
        duplicates_redelivered=len(repeats) - len(unflagged), duplicates_unflagged=len(unflagged),
        duplicate_ids_unflagged=unflagged[:sample], redelivered=redelivered,
        stranded=len(stranded_ids), stranded_ids=stranded_ids[:sample],
        stranded_consumers=stranded_consumers, stuck=stuck, stuck_by_publisher=stuck_by,
        phantom=phantom, longest_gap_s=None if gap is None else round(gap, 4),
        longest_gap_at=gap_at, recovery=recovery, anomalies=list(h.anomalies),
        longest_gap_why=gap_why, confirm_stall_s=None if stall is None else round(stall, 4),
        confirm_stall_at=stall_at, confirm_stall_publisher=stall_by, confirm_stall_why=stall_why,
        order_judged=order_judged, order_violations=len(out_of_order),
        order_examples=[list(x) for x in out_of_order[:sample]])


def priority_order(pubs: dict[int, Publish], deliveries: list[Delivery],
                   t_consume: float | None = None) -> tuple[int, list[tuple]]:
    """The priority order rules (see the module docstring) over `deliveries` (in time order):
    how many deliveries it judged, and each one out of order as (consumer, its id, the id of a
    later delivery that should have come before it). Each consumer's unflagged deliveries are
    walked from the last, keeping per priority the earliest confirm among those seen; then its
    backlog (confirmed before `t_consume`) from the first, keeping the lowest priority seen."""
    seqs: dict[int, list[tuple[Delivery, Publish]]] = {}
    for d in deliveries:
        p = pubs.get(d.id)
        if not d.redelivered and p is not None and p.priority is not None:
            seqs.setdefault(d.consumer, []).append((d, p))
    judged = 0
    bad: list[tuple] = []
    for consumer, seq in seqs.items():
        top = max(p.priority for _, p in seq)
        earliest: list[tuple[float, int] | None] = [None] * (top + 1)  # (t_conf, id) per priority
        for d, p in reversed(seq):
            judged += 1
            for level in range(p.priority, top + 1):
                e = earliest[level]
                if e is not None and e[0] < p.t_pub:
                    bad.append((consumer, d.id, e[1]))
                    break
            if p.outcome == "ack" and p.t_conf is not None:
                e = earliest[p.priority]
                if e is None or p.t_conf < e[0]:
                    earliest[p.priority] = (p.t_conf, d.id)
        if t_consume is None:
            continue
        lowest: tuple[int, int] | None = None  # (priority, id) of the lowest backlog message so far
        for d, p in seq:
            if p.outcome != "ack" or p.t_conf is None or p.t_conf >= t_consume:
                continue
            if lowest is not None and p.priority > lowest[0]:
                bad.append((consumer, lowest[1], d.id))
            elif lowest is None or p.priority < lowest[0]:
                lowest = (p.priority, d.id)
    return judged, bad


# --- plain data round trip (JSON lines, the simulation driver) ----------------------------------

def history_to_dict(h: History) -> dict:
    return {"publishes": [asdict(p) for p in h.publishes],
            "deliveries": [asdict(d) for d in h.deliveries],
            "subscriptions": [asdict(s) for s in h.subscriptions],
            "faults": [asdict(f) for f in h.faults], "phases": [asdict(p) for p in h.phases],
            "disconnects": [asdict(d) for d in h.disconnects], "anomalies": list(h.anomalies),
            "meta": dict(h.meta), "broker_events": [asdict(e) for e in h.broker_events]}


def history_from_dict(d: dict) -> History:
    return History(publishes=[Publish(**x) for x in d.get("publishes", ())],
                   deliveries=[Delivery(**x) for x in d.get("deliveries", ())],
                   subscriptions=[Subscription(**x) for x in d.get("subscriptions", ())],
                   faults=[Fault(**x) for x in d.get("faults", ())],
                   phases=[Phase(**x) for x in d.get("phases", ())],
                   disconnects=[Disconnect(**x) for x in d.get("disconnects", ())],
                   anomalies=list(d.get("anomalies", ())), meta=dict(d.get("meta", {})),
                   broker_events=[BrokerEvent(**x) for x in d.get("broker_events", ())])
