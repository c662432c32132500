"""The state of one queue replica: ready messages, consumers, unacknowledged deliveries.

Rules (everything that changes a queue's contents lives in this file and in queue_mirror.py, the
part of `QueueState` a mirror uses to start from a snapshot, take a sync and apply effects):

* Messages get increasing ids in publish order; `ready` is always sorted by id.
* A consumer belongs to an *owner* (node, session id, channel). Unacknowledged messages are
  tracked per owner, so cancelling a consumer keeps its deliveries ack-able on the channel,
  while closing the channel (`owner_gone`) requeues them.
* Delivery is round-robin over consumers that have credit (prefetch minus in-flight; prefetch
  0 means unlimited). `dispatch()` hands out as much as credit allows, in batches per consumer.
* A requeued message goes back to its original place (by id) with `redelivered` set.
* Limits (queue arguments, `Limits`): `x-message-ttl` (or a batch's own expiration, the lower)
  gives a publish batch a deadline, kept in `expiry` (the batch's last id, its deadline; messages
  with none behind ones with one get an entry that never comes); only the head expires, as in
  RabbitMQ's classic queues: an expired message is dropped from the head, never delivered
  (requeued ones too), or taken to be dead-lettered (mirroring/dead_letter.py, `DeadLetterSide`);
  `x-max-length` / `x-max-length-bytes` count ready messages and their body bytes: with
  `x-overflow` drop-head ready messages go from the head (after the round's deliveries: the
  oldest, or in a priority queue the highest priority's first, as RabbitMQ's), with
  reject-publish a message that would not fit is refused (`admit`). `x-expires` is the
  replica's business (mirroring/replica.py): an unused queue is deleted through the metadata.
  Expiries and drops are the leader's decisions: mirrors apply them as `EDrop` effects and
  never expire anything themselves, so they stay equal to their leader.

A message is the tuple (id, body, props, redelivered): tuples keep the per-message cost low.

Replication (the leader side): when `effects` is a list, every public method that changes the
state appends one *effect* describing what it did, so a mirror can apply the same change with
`apply_effects`. Effects are the typed records of wire/messages.py (EEnqueue, EDeliver, EGet,
ESettle, EConsume, ECancel, EOwnerGone, ESessionGone, ENodeGone, EPurge, EFailover, EDrop,
EDeadHead, EDropIds, EDeadSettle): one per call, never one per message.

Redelivery: a message is delivered with `redelivered` set when it was requeued, or when its id is
below `redeliver_below` (set on a failover: the old leader may have delivered any message the new
leader holds, and it cannot know which).

Unacknowledged deliveries are held in two forms. `_runs` keeps the newest ones as they were
handed out, one [owner, consumer key, ids, messages, settled] per consumer batch, oldest first
(the first `settled` of its ids are acknowledged already, their messages let go); the dict
`_unacked` (id -> (owner, consumer key or None, message)) holds the rest. A consumer acks in the
order it was served, so an ack nearly always continues the oldest run: `_ack_runs` settles it by
comparing ids and moving the run's mark, in C loops and in time proportional to the ack (never
to the run: one ack at a time from a run of thousands must stay cheap), with no per-message
entry ever made or removed.
Anything else (an ack out of order or from another owner, a requeue, a cancel, a failover, a
basic.get, a snapshot, a late mirror's sync) reads `unacked`, which first moves the runs into
the dict (`_spill`); every rule then works id by id on the dict. `_held` counts the runs' ids.

A mirror that started late (unsynchronised) lacks the queue's older messages: it keeps an
unacknowledged entry with no message (`None`) for deliveries it never had, so consumer credit
and acks stay exact, and it ignores the rest. Its ready messages are then always the leader's
ready messages from its start id on.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass
from heapq import merge
from itertools import accumulate, islice, repeat, starmap
from operator import attrgetter, itemgetter

from wire.errors import ACCESS_REFUSED, PRECONDITION_FAILED, ProtocolError
from wire.messages import (ACK, DISCARD, REQUEUE, ECancel, EConsume, EDeliver, EEnqueue,
                           EFailover, EGet, ENodeGone, EOwnerGone, EPurge, ESessionGone, ESettle)

from . import dead_letter
from .consumer import MAX_DISPATCH, Consumer
from .dead_letter import DeadLetterSide, Target
from .priority_store import MAX_PRIORITY, PriorityReady
from .queue_expiry import NEVER, ExpirySide
from .queue_mirror import MirrorSide
from .records import in_vhost

_msg_id = itemgetter(0)
_msg_body = itemgetter(1)
_consumer_priority = attrgetter("priority")
_entry_owner, _entry_key, _entry_msg = itemgetter(0), itemgetter(1), itemgetter(2)  # an unacked entry
SID_RUN_MASK = 0x7FFFFFFF  # a session id's high bits: its node's run (broker/node.py new_session_id)
MAX_DISPATCH_BYTES = 1 << 20  # and body bytes: a delivery frame stays far below the frame limit


@dataclass(frozen=True, slots=True)
class Limits:
    """What a queue's arguments ask of its contents (None: no limit)."""
    message_ttl: float | None = None  # seconds
    max_length: int | None = None
    max_bytes: int | None = None
    reject_publish: bool = False  # x-overflow reject-publish or reject-publish-dlx (else drop-head)
    expires: float | None = None  # seconds unused before the queue is deleted
    dead_letter: Target | None = None  # x-dead-letter-exchange / -routing-key
    reject_publish_dlx: bool = False  # x-overflow reject-publish-dlx: what is refused is dead-lettered
    # fixed by the queue's arguments alone (no policy sets them): the store and the consumers
    max_priority: int = 0  # x-max-priority (0: a plain queue)
    single_active: bool = False  # x-single-active-consumer

    @property
    def bounded(self) -> bool:
        return self.max_length is not None or self.max_bytes is not None


NO_LIMITS = Limits()
OVERFLOW = ("drop-head", "reject-publish", "reject-publish-dlx")
_INT_ARGS = {"x-message-ttl": 0, "x-expires": 1, "x-max-length": 0, "x-max-length-bytes": 0}


def _amqp_type(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "long"
    if isinstance(v, float):
        return "double"
    if isinstance(v, (str, bytes)):
        return "longstr"
    return type(v).__name__


def check_arguments(name: str, arguments: dict) -> None:
    """RabbitMQ's 406 for queue arguments it would refuse (the others are kept as given)."""
    where = f"for {in_vhost('queue', name)}"
    for key, least in _INT_ARGS.items():
        if key not in arguments:
            continue
        v = arguments[key]
        if isinstance(v, bool) or not isinstance(v, int):
            why = (f'"expected integer, got {_amqp_type(v)}"' if key == "x-message-ttl"
                   else f"{{unacceptable_type,{_amqp_type(v)}}}")
            raise ProtocolError(PRECONDITION_FAILED, f"invalid arg '{key}' {where}: {why}")
        if v < least:
            what = "value_zero" if v == 0 else "value_negative"
            raise ProtocolError(PRECONDITION_FAILED, f"invalid arg '{key}' {where}: {{{what},{v}}}")
    if "x-overflow" in arguments:
        v = arguments["x-overflow"]
        if isinstance(v, bytes):
            v = v.decode(errors="replace")
        if v not in OVERFLOW:
            raise ProtocolError(PRECONDITION_FAILED, f"invalid arg 'x-overflow' {where}: invalid_overflow")
    dead_letter.check_arguments(name, arguments)
    qtype = arguments.get("x-queue-type")
    if qtype is not None and qtype not in ("classic", b"classic"):
        why = "warren has classic queues only"
        if qtype in ("quorum", b"quorum"):
            why += (", as Amazon MQ's RabbitMQ clusters: they do not support quorum queues "
                    "(classic mirrored queues, set by policy, replicate instead)")
        raise ProtocolError(PRECONDITION_FAILED,
                            f"invalid arg 'x-queue-type' {where}: {{unacceptable_value,{qtype!r}}} "
                            f"({why})")
    if "x-cancel-on-ha-failover" in arguments and not isinstance(arguments["x-cancel-on-ha-failover"], bool):
        raise ProtocolError(PRECONDITION_FAILED, f"invalid arg 'x-cancel-on-ha-failover' {where}: "
                                                 f"{{unacceptable_type,{_amqp_type(arguments['x-cancel-on-ha-failover'])}}}")
    _check_priority_and_consumers(arguments, where)


def _check_priority_and_consumers(arguments: dict, where: str) -> None:
    """RabbitMQ's checks of x-max-priority (a non-negative integer up to 255) and
    x-single-active-consumer (a boolean)."""
    if "x-max-priority" in arguments:
        v = arguments["x-max-priority"]
        if isinstance(v, bool) or not isinstance(v, int):
            why = f'"expected integer, got {_amqp_type(v)}"'
        elif v < 0:
            why = f"{{value_negative,{v}}}"
        elif v > MAX_PRIORITY:
            why = f"{{max_value_exceeded,{v}}}"
        else:
            why = None
        if why:
            raise ProtocolError(PRECONDITION_FAILED, f"invalid arg 'x-max-priority' {where}: {why}")
    if "x-single-active-consumer" in arguments and not isinstance(arguments["x-single-active-consumer"], bool):
        raise ProtocolError(PRECONDITION_FAILED, f"invalid arg 'x-single-active-consumer' {where}: "
                                                 f"{{unacceptable_type,{_amqp_type(arguments['x-single-active-consumer'])}}}")


def check_consume_arguments(queue: str, arguments: dict | None) -> None:
    """RabbitMQ's 406 for a basic.consume's `x-priority` that is not an integer."""
    if arguments and "x-priority" in arguments:
        v = arguments["x-priority"]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ProtocolError(PRECONDITION_FAILED,
                                f"invalid arg 'x-priority' for queue '{queue}' in vhost '/': "
                                f'"expected integer, got {_amqp_type(v)}"')


def _lower(a, b):
    """The stricter of two limits (None: none set)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


def limits_from(arguments: dict | None, policy: dict | None = None) -> Limits:
    """The Limits of a queue's (already checked) arguments and the definition of the policy in
    effect for it (already checked: mirroring/policy.py). Where both set a limit, RabbitMQ's
    rule: the lower of the two lengths, sizes, TTLs and expiries; the queue's own `x-overflow`
    over the policy's `overflow`; each dead-letter key the argument's over the policy's."""
    arguments = arguments or {}
    policy = policy or {}
    if not arguments and not policy:
        return NO_LIMITS
    ttl = _lower(arguments.get("x-message-ttl"), policy.get("message-ttl"))
    exp = _lower(arguments.get("x-expires"), policy.get("expires"))
    over = arguments.get("x-overflow", policy.get("overflow"))
    if isinstance(over, bytes):
        over = over.decode(errors="replace")
    lim = Limits(message_ttl=ttl / 1000.0 if isinstance(ttl, int) else None,
                 max_length=_lower(arguments.get("x-max-length"), policy.get("max-length")),
                 max_bytes=_lower(arguments.get("x-max-length-bytes"), policy.get("max-length-bytes")),
                 reject_publish=over in ("reject-publish", "reject-publish-dlx"),
                 expires=exp / 1000.0 if isinstance(exp, int) else None,
                 dead_letter=dead_letter.target_from(arguments, policy),
                 reject_publish_dlx=over == "reject-publish-dlx",
                 max_priority=arguments.get("x-max-priority", 0),
                 single_active=arguments.get("x-single-active-consumer") is True)
    return NO_LIMITS if lim == NO_LIMITS else lim


class QueueState(MirrorSide, DeadLetterSide, ExpirySide):
    """One queue's contents and consumers. Pure: no I/O, no clock."""

    def __init__(self, name: str, max_priority: int = 0, single_active: bool = False):
        self.name = name
        # a queue with priorities keeps its ready messages in their own store, in delivery
        # order (mirroring/priority_store.py); a plain one in a deque, in id order
        self.prioritised = max_priority > 0
        self.ready: deque[tuple] | PriorityReady = PriorityReady(max_priority) if self.prioritised else deque()
        # x-single-active-consumer: only the first registered consumer receives, and the
        # consumers stay in registration order (no rotation)
        self.single_active = single_active
        # the active consumer was cancelled: as RabbitMQ's classic queue, the next one is active
        # but is handed nothing until the queue next runs (a publish, a settle, a consumer
        # added, a channel gone), so a client that cancels and then closes its channel has
        # its unacknowledged messages requeued before the next consumer is served
        self.sac_held = False
        self.next_id = 1
        self.consumers: dict[tuple, Consumer] = {}  # (owner, tag) -> Consumer, in rotation order
        self._unacked: dict[int, tuple] = {}  # msg id -> (owner, consumer key or None, message)
        self._runs: deque[list] = deque()  # [owner, key, ids, msgs, settled], oldest first
        self._held = 0  # ids in _runs
        self.ready_bytes = 0
        self.had_consumer = False
        self.last_pseq: dict[tuple, int] = {}  # (node, sid) -> last publish batch applied
        self.redeliver_below = 0  # ids below this are delivered as redelivered (see above)
        self.effects: list | None = None  # a list while mirrors need our effects
        # x-message-ttl: (last id of a publish batch, when it expires) in id order, and the
        # highest id known to have expired (a requeued message up to it is dropped too)
        self.expiry: deque[tuple[int, float]] = deque()
        self.expired_upto = 0
        # an entry's deadline is before the one ahead of it, or never (per-message TTLs, a
        # TTL set on a queue that had messages): expiry looks past what is already gone
        self.mixed_deadlines = False
        # running totals for the management API's rates, added once per batch (never per message)
        self.delivered_total = 0  # handed to consumers and to basic.get
        self.acked_total = 0  # acknowledged by clients

    def seen(self, origin, pseq: int) -> bool:
        """Was this publish batch already applied (a resend after a failover)?"""
        return self.last_pseq.get((origin[0], origin[1]), 0) >= pseq

    # --- unacknowledged deliveries (see the module docstring) -----------------------------------
    @property
    def unacked(self) -> dict[int, tuple]:
        """Every unacknowledged delivery by id: (owner, consumer key or None, message)."""
        if self._runs:
            self._spill()
        return self._unacked

    @unacked.setter
    def unacked(self, entries: dict[int, tuple]) -> None:
        self._runs.clear()
        self._held = 0
        self._unacked = entries

    @property
    def unacked_count(self) -> int:
        return len(self._unacked) + self._held

    def _spill(self) -> None:
        unacked = self._unacked
        for owner, key, ids, msgs, settled in self._runs:
            if settled:
                ids, msgs = ids[settled:], msgs[settled:]
            n = len(ids)
            unacked.update(zip(ids, zip(repeat(owner, n), repeat(key, n), msgs)))
        self._runs.clear()
        self._held = 0

    def _hold(self, owner: tuple, key: tuple, ids: list, msgs: list) -> None:
        """Record `msgs` (with ids `ids`) as delivered to consumer `key` of `owner`,
        unacknowledged. `msgs` becomes the queue's (an acknowledged message's place in it is
        set to None); `ids` is never changed."""
        self._runs.append([owner, key, ids, msgs, 0])
        self._held += len(ids)

    def _ack_runs(self, owner: tuple, ids: list) -> int:
        """Settle the longest prefix of `ids` that continues `owner`'s oldest runs, in order;
        returns its length (the rest, if any, is for the dict)."""
        runs = self._runs
        consumers = self.consumers
        n = len(ids)
        done = 0
        while runs and done < n:
            run = runs[0]
            if run[0] != owner:
                break
            rids, settled = run[2], run[4]
            left = len(rids) - settled
            k = left if left <= n - done else n - done
            if k == n and k == len(rids):  # the whole of one run: one comparison, no copies
                if rids != ids:
                    break
            elif rids[settled:settled + k] != ids[done:done + k]:
                break
            if k == left:
                runs.popleft()
            else:
                run[3][settled:settled + k] = repeat(None, k)  # let the messages go
                run[4] = settled + k
            c = consumers.get(run[1])
            if c is not None:
                c.in_flight -= k
            done += k
        self._held -= done
        return done

    def held_bodies(self, ids: list) -> list | None:
        """The bodies of `ids` if they are what is unacknowledged of one recent run of
        deliveries (what a leader just handed out), else None: see replica.local_bodies."""
        for _, _, rids, msgs, settled in islice(reversed(self._runs), 8):
            if settled:
                rids, msgs = rids[settled:], msgs[settled:]
            if rids == ids:
                return list(map(_msg_body, msgs)) if None not in msgs else None
        return None

    # --- queries ---------------------------------------------------------------------------
    @property
    def message_count(self) -> int:
        return len(self.ready)

    def stats(self) -> dict:
        unacked = self.unacked_count
        return {
            "messages_ready": len(self.ready),
            "messages_unacknowledged": unacked,
            "messages": len(self.ready) + unacked,
            "consumers": len(self.consumers),
            "ready_bytes": self.ready_bytes,
            "published": self.next_id - 1,
            "delivered": self.delivered_total,
            "acked": self.acked_total,
        }

    # --- publishing ------------------------------------------------------------------------
    def publish(self, bodies: list, props: list | None, origin: list | None = None,
                pseq: int = 0, redelivered: bool = False, now: float = 0.0,
                ttl: float | None = None, at: float | None = None) -> tuple[int, int]:
        """Enqueue a batch; returns the first and last id given. `origin`/`pseq` identify the
        publishing session's batch so a resend after a failover is recognised (`seen`).
        `redelivered`: a batch resent after a failover that this replica did not have; the old
        leader may have delivered it already, so it goes out flagged. `ttl` (seconds) makes the
        batch expire at `now` + ttl, or at `at` when given (a mirror: its leader's deadline)."""
        first = self.next_id
        if origin is not None:
            origin = (origin[0], origin[1])
            self.last_pseq[origin] = pseq
        if ttl is not None and at is None:
            at = now + ttl
        if self.effects is not None:
            self.effects.append(EEnqueue(first, bodies, props, origin, pseq, redelivered, ttl, at))
        n = len(bodies)
        exp = self.expiry
        if ttl is not None and n:
            if not exp and first - 1 > self.expired_upto:
                exp.append((first - 1, NEVER))  # the messages before it have no deadline
            if exp and at < exp[-1][1]:
                self.mixed_deadlines = True
            exp.append((first + n - 1, at))
        elif exp and n:  # messages with no deadline behind some with one
            self.mixed_deadlines = True
            if exp[-1][1] == NEVER:
                exp[-1] = (first + n - 1, NEVER)
            else:
                exp.append((first + n - 1, NEVER))
        flags = [redelivered] * n
        if props is None:
            self.ready.extend(zip(range(first, first + n), bodies, [None] * n, flags))
        else:
            self.ready.extend(zip(range(first, first + n), bodies, props, flags))
        self.next_id = first + n
        self.ready_bytes += sum(map(len, bodies))
        self.sac_held = False
        return first, first + n - 1

    def admit(self, bodies: list, limits: Limits) -> list[int]:
        """x-overflow reject-publish: the indexes of the messages of a batch that would not fit
        (RabbitMQ's rule: refused when the ready count or bytes would exceed the limit)."""
        max_len = limits.max_length
        max_bytes = limits.max_bytes
        n = len(self.ready)
        size = self.ready_bytes
        refused = []
        for i, body in enumerate(bodies):
            b = len(body)
            if (max_len is not None and n + 1 > max_len) or (max_bytes is not None and size + b > max_bytes):
                refused.append(i)
            else:
                n += 1
                size += b
        return refused

    def purge(self) -> int:
        if self.effects is not None:
            self.effects.append(EPurge())
        n = len(self.ready)
        self.ready.clear()
        self.ready_bytes = 0
        return n

    # --- consumers -------------------------------------------------------------------------
    def add_consumer(self, owner: tuple, tag: str, no_ack: bool, prefetch: int,
                     exclusive: bool = False, arguments: dict | None = None) -> Consumer:
        key = (owner, tag)
        if key in self.consumers:
            raise ProtocolError(PRECONDITION_FAILED, f"consumer tag {tag!r} is already in use on this channel")
        if any(c.exclusive for c in self.consumers.values()) or (exclusive and self.consumers):
            raise ProtocolError(ACCESS_REFUSED,
                                f"{in_vhost('queue', self.name)} in exclusive use")
        c = Consumer(owner, tag, no_ack, prefetch, exclusive, arguments or {})
        if self.effects is not None:
            self.effects.append(EConsume(owner, tag, no_ack, prefetch, exclusive, c.arguments))
        self.consumers[key] = c
        self.had_consumer = True
        self.sac_held = False
        return c

    def remove_consumer(self, owner: tuple, tag: str) -> Consumer | None:
        """Cancel: the consumer gets nothing more; its unacked messages stay with the owner."""
        if self.single_active and next(iter(self.consumers), None) == (owner, tag):
            self.sac_held = True
        c = self.consumers.pop((owner, tag), None)
        if c is not None:
            if self.effects is not None:
                self.effects.append(ECancel(owner, tag))
            for mid, (o, key, msg) in self.unacked.items():
                if key == (owner, tag):
                    self.unacked[mid] = (o, None, msg)
        return c

    def owner_gone(self, owner: tuple) -> int:
        """A channel closed: drop its consumers and requeue everything it had not acked."""
        if self.effects is not None:
            self.effects.append(EOwnerGone(owner))
        return self._owner_gone(owner)

    def _owner_gone(self, owner: tuple) -> int:
        self.sac_held = False
        for key in [k for k in self.consumers if k[0] == owner]:
            del self.consumers[key]
        ids = [mid for mid, (o, _, _) in self.unacked.items() if o == owner]
        self._requeue(owner, ids)
        return len(ids)

    def _owners_gone(self, predicate) -> int:
        owners = {k[0] for k in self.consumers if predicate(k[0])}
        owners |= {o for (o, _, _) in self.unacked.values() if predicate(o)}
        return sum(self._owner_gone(o) for o in sorted(owners))

    def session_gone(self, node: str, sid: int) -> int:
        """A client connection closed: all its channels are gone."""
        if self.effects is not None:
            self.effects.append(ESessionGone(node, sid))
        self.last_pseq.pop((node, sid), None)
        return self._owners_gone(lambda o: o[0] == node and o[1] == sid)

    def node_gone(self, node: str, forget_publishers: bool = True, run: int = 0) -> int:
        """Every session on `node` is gone (the node went down, or the leader lost its link to
        it). With `forget_publishers` (the node is down for good: its sessions never come back)
        their publish de-duplication marks go too; a link that may come back keeps them, so
        the sessions' resends are still recognised.

        `run` (the metadata's word for a node going down or coming back as a new run): only
        the sessions of that run of the node (its incarnation; a session id carries its run in
        the high bits, Node.new_session_id) are gone. A newer run's sessions may have registered
        here before this replica applied the record (dst seed 1554: a consumer of a restarted
        node, registered just before, was dropped and starved). 0: every run (a lost link)."""
        if self.effects is not None:
            self.effects.append(ENodeGone(node, forget_publishers, run))
        its = run & SID_RUN_MASK

        def gone(o) -> bool:
            return o[0] == node and (not its or (o[1] >> 32) == its)

        if forget_publishers:
            for key in [k for k in self.last_pseq if gone(k)]:
                del self.last_pseq[key]
        return self._owners_gone(gone)

    def failover(self, below: int | None = None) -> list[Consumer]:
        """This replica became leader (spec, "Mirrored Queue Implementation and Semantics"):
        every unacknowledged message is requeued with `redelivered` set, every message held now
        will be delivered as redelivered (the old leader may have delivered it), and consumers
        that asked for `x-cancel-on-ha-failover` are cancelled. Returns the cancelled consumers.
        Sessions on a node that went down are removed separately (`node_gone`)."""
        below = self.next_id if below is None else below
        if self.effects is not None:
            self.effects.append(EFailover(below))
        self.redeliver_below = max(self.redeliver_below, below)
        self.sac_held = False
        for owner in sorted({o for (o, _, _) in self.unacked.values()}):
            self._requeue(owner, [mid for mid, (o, _, _) in self.unacked.items() if o == owner])
        cancelled = [c for c in self.consumers.values()
                     if c.arguments.get("x-cancel-on-ha-failover") is True]
        for c in cancelled:
            del self.consumers[(c.owner, c.tag)]
        return cancelled

    # --- delivery --------------------------------------------------------------------------
    def dispatch(self) -> list[tuple[Consumer, list[tuple]]]:
        """Hand ready messages to consumers with credit, round-robin (the highest consumer
        priority first; with a single active consumer, to the first registered alone).

        Returns [(consumer, [message, ...]), ...]; messages of manual-ack consumers are
        recorded as unacknowledged."""
        if not self.ready or not self.consumers:
            return []
        if self.single_active:
            first = next(iter(self.consumers.values()))
            active = [first] if first.credit() > 0 and not self.sac_held else []
        else:
            active = [c for c in self.consumers.values() if c.credit() > 0]
        if not active:
            return []
        out: dict[tuple, list] = {}
        ready = self.ready
        budget = MAX_DISPATCH
        if len(active) == 1:
            # one consumer (the usual case): the run is taken from the head in one go, in C
            # loops, and what passes the byte cap goes back
            c = active[0]
            n = min(c.credit(), len(ready), budget)
            batch = list(starmap(ready.popleft, repeat((), n)))
            sizes = list(accumulate(map(len, map(_msg_body, batch))))
            if sizes[-1] >= MAX_DISPATCH_BYTES:
                keep = bisect_left(sizes, MAX_DISPATCH_BYTES) + 1  # up to the one that crosses it
                ready.extendleft(reversed(batch[keep:]))
                del batch[keep:]
            out[(c.owner, c.tag)] = batch
            size = sizes[len(batch) - 1]
        elif any(map(_consumer_priority, active)):
            size = self._share_by_priority(active, out)
        else:
            _, size = self._share_round_robin(active, out, budget, 0)
        result = []
        rounds = []
        for key, batch in out.items():
            c = self.consumers[key]
            ids = list(map(_msg_id, batch))
            if not c.no_ack:
                c.in_flight += len(batch)
                self._hold(c.owner, key, ids, batch.copy())  # (batch is the caller's)
            result.append((c, batch))
            rounds.append((c.owner, c.tag, ids))
            self.delivered_total += len(ids)
        if self.effects is not None:
            self.effects.append(EDeliver(rounds, size))
        self.ready_bytes -= size  # the bodies of everything either path took
        self._rotate()
        return result

    def _share_by_priority(self, active: list, out: dict) -> int:
        """Consumer priorities (x-priority on basic.consume): the consumers of the highest
        priority with credit are served round-robin, those of a lower priority only once every
        one above has no credit left. Fills `out` as dispatch does; returns the body bytes."""
        budget = MAX_DISPATCH
        size = 0
        for level in sorted({c.priority for c in active}, reverse=True):
            group = [c for c in active if c.priority == level]
            budget, size = self._share_round_robin(group, out, budget, size)
            if not self.ready or not budget or size >= MAX_DISPATCH_BYTES:
                break
        return size

    def _share_round_robin(self, group: list, out: dict, budget: int, size: int) -> tuple[int, int]:
        """Hand ready messages to `group` in turn, each up to its credit, while the dispatch's
        message `budget` and byte cap (`size` so far) allow. Fills `out`; returns what is left
        of the budget and the bytes taken so far."""
        ready = self.ready
        credits = [c.credit() for c in group]
        lists = [[] for _ in group]
        n = len(group)
        i = 0
        while ready and budget and size < MAX_DISPATCH_BYTES:
            for _ in range(n):
                if credits[i] > 0:
                    break
                i = (i + 1) % n
            else:
                break  # nobody in the group has credit left
            m = ready.popleft()
            lists[i].append(m)
            size += len(m[1])
            credits[i] -= 1
            budget -= 1
            i = (i + 1) % n
        for c, lst in zip(group, lists):
            if lst:
                out[(c.owner, c.tag)] = lst
        return budget, size

    def _rotate(self) -> None:
        """The consumer served first goes to the back, for fairness across dispatches (a mirror
        applying a delivery does the same, so its rotation order stays its leader's). A single
        active consumer queue keeps its registration order instead."""
        if len(self.consumers) > 1 and not self.single_active:
            first = next(iter(self.consumers))
            self.consumers[first] = self.consumers.pop(first)

    def get(self, owner: tuple, no_ack: bool) -> tuple | None:
        """basic.get: take the head message, tracking it as unacked unless no_ack."""
        if not self.ready:
            return None
        m = self.ready.popleft()
        self.ready_bytes -= len(m[1])
        self.delivered_total += 1
        if self.effects is not None:
            self.effects.append(EGet(owner, m[0], no_ack))
        if not no_ack:
            self.unacked[m[0]] = (owner, None, m)
        return m

    # --- settlement ------------------------------------------------------------------------
    def _take(self, owner: tuple, ids) -> list[tuple]:
        """Remove `owner`'s unacknowledged entries for `ids` and return them ((owner, key,
        message) each); an id that is not unacknowledged by `owner` (settled already, or
        requeued by a failover and delivered to another owner since) is ignored."""
        unacked = self.unacked
        n = len(ids)
        # the usual case, in C loops: every id is the owner's, all from one consumer
        entries = list(map(unacked.pop, ids, repeat(None, n)))
        # (list.count compares by identity first: entries of one delivery share their objects)
        if n and None not in entries and list(map(_entry_owner, entries)).count(owner) == n:
            keys = list(map(_entry_key, entries))
            if keys.count(keys[0]) == n:
                counts = ((keys[0], n),)
            else:
                counts = Counter(keys).items()
            for key, k in counts:
                if key is not None:
                    c = self.consumers.get(key)
                    if c is not None:
                        c.in_flight -= k
            return entries
        # otherwise put back what was popped and go id by id
        unacked.update((mid, e) for mid, e in zip(ids, entries) if e is not None)
        return self._take_each(owner, ids)

    def _take_each(self, owner: tuple, ids) -> list[tuple]:
        taken = []
        unacked = self.unacked
        consumers = self.consumers
        for mid in ids:
            entry = unacked.get(mid)
            if entry is None or entry[0] != owner:
                continue  # already settled (e.g. requeued by a failover): ignore
            del unacked[mid]
            key = entry[1]
            if key is not None:
                c = consumers.get(key)
                if c is not None:
                    c.in_flight -= 1
            taken.append(entry)
        return taken

    def settle(self, owner: tuple, how: int, ids) -> int:
        """ACK, REQUEUE or DISCARD (nack/reject without requeue: dropped, no dead-lettering)."""
        if self.effects is not None:
            self.effects.append(ESettle(owner, how, ids))
        self.sac_held = False
        if how == REQUEUE:
            return self._requeue(owner, ids)
        if self._runs:
            if type(ids) is not list:
                ids = list(ids)
            done = self._ack_runs(owner, ids)
            if done != len(ids):
                done += len(self._take(owner, ids[done:]))
        else:
            done = len(self._take(owner, ids))
        if how == ACK:
            self.acked_total += done
        return done

    def ack(self, owner: tuple, ids) -> int:
        return self.settle(owner, ACK, ids)

    def discard(self, owner: tuple, ids) -> int:
        return self.settle(owner, DISCARD, ids)

    def requeue(self, owner: tuple, ids) -> int:
        return self.settle(owner, REQUEUE, ids)

    def _requeue(self, owner: tuple, ids) -> int:
        # an entry's message is None where a mirror never had it: nothing to put back
        msgs = [m for m in map(_entry_msg, self._take(owner, ids)) if m is not None]
        if not msgs:
            return 0
        back = sorted((m[0], m[1], m[2], True) for m in msgs)
        self.ready_bytes += sum(len(m[1]) for m in back)
        ready = self.ready
        if self.prioritised:
            ready.merge_in(back)
        elif not ready or back[-1][0] < ready[0][0]:
            ready.extendleft(reversed(back))
        else:
            merged = list(merge(back, ready))
            ready.clear()
            ready.extend(merged)
        return len(back)
