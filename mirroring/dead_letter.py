"""Dead-lettering's rules, as RabbitMQ 3.10 applies them to classic queues. Pure: no I/O, no
clock (the wall-clock time of a death comes in as `wall`).

* Where a queue dead-letters to (`target_from`): the `x-dead-letter-exchange` and
  `x-dead-letter-routing-key` arguments and the `dead-letter-exchange` / `dead-letter-routing-key`
  policy keys, each key resolved on its own, the queue's argument over the policy's.
* The checks RabbitMQ makes of those arguments at declare (`check_arguments`).
* What a dead-lettered message becomes (`dead_props`): its `x-death` header, a list of tables
  most recent first, one per (queue, reason) with a count; `x-first-death-queue/reason/exchange`
  set once; its `expiration` property removed (kept as the death's `original-expiration`).
* Cycle detection (`cycles`): a message is not dead-lettered into a queue it already died in
  when every death since then was automatic (expired or maxlen, no rejection), as RabbitMQ
  drops it.

Which messages go, and when, is the leader's decision: `DeadLetterSide` (a part of
`QueueState`, mirroring/queue.py) takes them from the queue and `ReplicaDeadLetters` (a part of
`Replica`, mirroring/replica.py) hands them out as a `DeadLetter` output; the leader's node
republishes them (broker/dead_letters.py). A message taken is not dropped: it is held as
unacknowledged by the node's dead-letter publisher (`holder`), replicated so (EDeadHead,
EDeadSettle), and acknowledged by it once the dead-letter exchange's queues have confirmed the
republished copy. If the leader dies first, the new leader requeues it (flagged) as any
unacknowledged message, so it is dead-lettered again: at least once, never lost.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

from wire import props as propsmod
from wire.errors import PRECONDITION_FAILED, ProtocolError
from wire.messages import EDeadHead, EDeadSettle

REJECTED, EXPIRED, MAXLEN = "rejected", "expired", "maxlen"


@dataclass(frozen=True, slots=True)
class Target:
    """Where a queue dead-letters to: an exchange ("" is the default exchange) and the routing
    key that replaces the message's own (None: its own keys are kept)."""
    exchange: str
    routing_key: str | None = None


def _text(v):
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def target_from(arguments: dict, policy: dict) -> Target | None:
    """The queue's dead-letter target (None: it has none); each key is the argument's if the
    queue sets it, else the policy's."""
    ex = arguments.get("x-dead-letter-exchange")
    if ex is None:
        ex = policy.get("dead-letter-exchange")
    if ex is None:
        return None
    key = arguments.get("x-dead-letter-routing-key")
    if key is None:
        key = policy.get("dead-letter-routing-key")
    return Target(_text(ex), _text(key))


def _amqp_type(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "signedint" if -(1 << 31) <= v < (1 << 31) else "long"
    if isinstance(v, float):
        return "double"
    return type(v).__name__


def check_arguments(name: str, arguments: dict) -> None:
    """RabbitMQ's 406 for bad x-dead-letter-* arguments."""
    for key in ("x-dead-letter-exchange", "x-dead-letter-routing-key"):
        v = arguments.get(key)
        if v is not None and not isinstance(v, (str, bytes)):
            raise ProtocolError(PRECONDITION_FAILED, f"invalid type '{_amqp_type(v)}' for arg '{key}' "
                                                     f"in queue '{name}' in vhost '/'")
    if "x-dead-letter-routing-key" in arguments and "x-dead-letter-exchange" not in arguments:
        raise ProtocolError(PRECONDITION_FAILED,
                            f"invalid arg 'x-dead-letter-routing-key' for queue '{name}' in vhost "
                            f"'/': routing_key_but_no_dlx_defined")


def routing_keys(item, queue: str) -> tuple[str, list[str]]:
    """The exchange a message was published to and its routing keys (its key, then CC's)."""
    exchange, key = propsmod.routing_of(item, queue)
    keys = [key]
    headers = propsmod.headers_of(item)
    cc = headers.get("CC") if headers else None
    if isinstance(cc, list):
        keys.extend(_text(k) for k in cc if isinstance(k, (str, bytes)))
    return exchange, keys


def _deaths_of(headers: dict | None) -> list:
    deaths = headers.get("x-death") if headers else None
    return [d for d in deaths if isinstance(d, dict)] if isinstance(deaths, list) else []


def cycles(item, target_queue: str) -> bool:
    """Would dead-lettering this (already dead-lettered, `dead_props`) message into
    `target_queue` close an automatic cycle? True when the queue is in its x-death and no death
    from the latest back to that one was a rejection."""
    for d in _deaths_of(propsmod.headers_of(item)):
        if _text(d.get("reason")) == REJECTED:
            return False
        if _text(d.get("queue")) == target_queue:
            return True
    return False


def dead_props(item, queue: str, reason: str, wall: float) -> list:
    """A dead-lettered message's props item (exchange and key left for the caller to set): the
    AMQP properties it had, with its death recorded in `x-death` (an entry for the same queue
    and reason counts up and moves first), `x-first-death-*` kept or set, and no expiration."""
    exchange, keys = routing_keys(item, queue)
    raw = propsmod.to_raw(item)
    props = propsmod.decode_raw(raw)
    headers = dict(props.headers or {})
    deaths = _deaths_of(headers)
    for i, d in enumerate(deaths):
        if _text(d.get("queue")) == queue and _text(d.get("reason")) == reason:
            entry = dict(d)
            count = entry.get("count")
            entry["count"] = (count if isinstance(count, int) else 0) + 1
            deaths = [entry] + deaths[:i] + deaths[i + 1:]
            break
    else:
        entry = {"count": 1, "reason": reason, "queue": queue,
                 "time": datetime.datetime.fromtimestamp(int(wall), datetime.timezone.utc),
                 "exchange": exchange, "routing-keys": keys}
        if props.expiration is not None:
            entry["original-expiration"] = props.expiration
        deaths = [entry] + deaths
    headers["x-death"] = deaths
    headers.setdefault("x-first-death-queue", queue)
    headers.setdefault("x-first-death-reason", reason)
    headers.setdefault("x-first-death-exchange", exchange)
    props.headers = headers
    props.expiration = None
    return ["", "", props.marshal()]


@dataclass(slots=True)
class DeadLetter:
    """A replica's output: messages (id, body, props, redelivered) to republish to `target`.
    `held`: they are held by the node's dead-letter publisher (its owner `holder`), which
    acknowledges them to the queue's leader once its publishes are confirmed; else (refused by
    reject-publish-dlx, never enqueued) nothing is held. `again`, per message: the queue may
    have dead-lettered it before (it was requeued after a failover), so its copy is flagged
    redelivered."""
    reason: str
    target: Target
    msgs: list
    held: bool
    again: list


class DeadLetterSide:
    """The part of `QueueState` that takes messages to dead-letter them (see the module
    docstring); the leader records effects, a mirror applies the same methods."""

    def dead_head(self, upto: int, expired: bool, holder: tuple) -> list:
        """As `drop_upto`, but the messages taken are held by `holder` and returned."""
        oldest = self._oldest_ready()
        if oldest is None or oldest > upto:
            self.drop_upto(upto, expired)  # the TTL bookkeeping only
            return []
        if expired:
            self._expired_upto(upto)
        msgs = self._take_ready_upto(upto)
        self.ready_bytes -= sum(len(msg[1]) for msg in msgs)
        ids = [msg[0] for msg in msgs]
        if self.effects is not None:
            self.effects.append(EDeadHead(upto, expired, ids, holder))
        unacked = self.unacked
        for msg in msgs:
            unacked[msg[0]] = (holder, None, msg)
        return msgs

    def dead_over(self, limits, holder: tuple) -> list:
        """x-overflow drop-head with a dead-letter target: the messages over the length limits
        are taken from the head (as `drop_over` drops them) and held by `holder`."""
        if self.prioritised:
            return self.drop_ids(self.over_limits_ids(limits), holder)
        upto = self.over_limits(limits)
        return self.dead_head(upto, False, holder) if upto else []

    def apply_dead_head(self, eff: EDeadHead) -> None:
        """A mirror: the leader's `dead_head` (messages this replica lacks are held as stubs)."""
        holder = tuple(eff.holder)
        if eff.expired:
            self._expired_upto(eff.upto)
        have = {}
        for msg in self._take_ready_upto(eff.upto):
            have[msg[0]] = msg
            self.ready_bytes -= len(msg[1])
        unacked = self.unacked
        for mid in eff.ids:
            unacked[mid] = (holder, None, have.get(mid))

    def _take_ready_upto(self, upto: int) -> list:
        """Remove and return the ready messages with ids up to `upto`, in id order."""
        ready = self.ready
        if self.prioritised:
            return ready.take_upto(upto)
        msgs = []
        while ready and ready[0][0] <= upto:
            msgs.append(ready.popleft())
        return msgs

    def dead_settle(self, owner: tuple, ids, holder: tuple) -> list:
        """`owner` rejected `ids` without requeue: what it held passes to `holder`; returns the
        messages (those this replica holds)."""
        if self.effects is not None:
            self.effects.append(EDeadSettle(owner, list(ids), holder))
        unacked = self.unacked
        consumers = self.consumers
        out = []
        for mid in ids:
            e = unacked.get(mid)
            if e is None or e[0] != owner:
                continue  # already settled (requeued by a failover, say)
            if e[1] is not None:
                c = consumers.get(e[1])
                if c is not None:
                    c.in_flight -= 1
            unacked[mid] = (holder, None, e[2])
            if e[2] is not None:
                out.append(e[2])
        return out


class ReplicaDeadLetters:
    """The part of `Replica` that dead-letters (see the module docstring)."""

    @property
    def holder(self) -> tuple:
        """The owner that holds this leader's dead letters: its node's dead-letter publisher."""
        return (self.me, self.cfg.dead_letter_sid, 0)

    def _dead_letter(self, reason: str, target: Target, msgs: list, held: bool) -> None:
        below = self.q.redeliver_below
        self._out.append(DeadLetter(reason, target, msgs, held,
                                    [held and (bool(msg[3]) or msg[0] < below) for msg in msgs]))

    def _expire(self, now: float, inclusive: bool) -> None:
        """Drop, or dead-letter, the head's expired messages."""
        q = self.q
        target = self.assign.limits.dead_letter
        if target is None:
            q.expire(now, inclusive)
            return
        upto = q.expired_by(now, inclusive)
        if upto:
            msgs = q.dead_head(upto, True, self.holder)
            if msgs:
                self._dead_letter(EXPIRED, target, msgs, True)

    def _trim(self, limits) -> None:
        """x-overflow drop-head: the oldest ready messages over the length limits go (dead-lettered
        when the queue has a target)."""
        q = self.q
        if limits.dead_letter is None:
            q.drop_over(limits)
            return
        msgs = q.dead_over(limits, self.holder)
        if msgs:
            self._dead_letter(MAXLEN, limits.dead_letter, msgs, True)

    def _reject(self, owner: tuple, ids) -> None:
        """A reject or nack without requeue: dropped, or dead-lettered."""
        target = self.assign.limits.dead_letter
        if target is None:
            self.q.discard(owner, ids)
            return
        msgs = self.q.dead_settle(owner, ids, self.holder)
        if msgs:
            self._dead_letter(REJECTED, target, msgs, True)
