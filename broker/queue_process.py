"""The task that runs one queue replica on its node: a pump around mirroring/replica.py.

Like an Erlang process: one task, one inbox, so operations are handled in arrival order. The
inbox never blocks a sender (a peer link's reader, a session): publishers are held upstream by
their sessions' credit window, so memory stays bounded without one busy queue stalling a link.

Each wake-up takes a batch from the inbox (up to BATCH items, or ROUND_BYTES of publishes),
hands each to the replica, tells a leader whether it may hand out deliveries and confirms
(only while its node is in step with the metadata log: the Router's `may_deliver`), ends the
round (`flush`: deliveries, one replication batch per mirror, the sync's next step), and
carries out what the replica asked for: messages to other replicas, events to sessions,
metadata proposals, log lines. The round runs corked (broker/framed.py `Cork`): what it sends
is written at its end, straight from this task, one write per connection. Timers come from the
replica's `next_deadline`. A leader's input of nothing but its mirrors' acknowledgements (the
round its publishers' confirms wait for, one per mirror per replication batch), and a mirror's
of nothing but its leader's batches, skip the rest of a round, which could have nothing to do
(`Replica.acks_alone`, `batches_alone`).

An Assign (what the metadata says of the queue) that a newer Assign follows in the inbox is
not acted on (`Replica.assign_superseded`): a node that applies several metadata changes at
once, catching up, queues one per change, and the replica must act on where the metadata is
now, not on the states it passed through. A Stop (the queue deleted, or moved off this node)
supersedes every Assign before it in the same way: the metadata's newest word is then that
this node holds no replica at all.

Where a round runs. There is one round (`_round`: a batch of inputs, the timers, the round's
end, its outputs), and three places that run it, because the round must run in whichever task
already holds the input when waking this task would cost a pass of trio's scheduler per hop (on
every node a mirrored publish crosses, the largest cost per message at moderate rates):
* the replica's own task (`run`): after a wake-up, a timer, or a round that stopped at its
  budget; the only place that waits;
* the task that fed a batch of input while this task was idle (`after_batch`, at the end of
  `Router.begin_input`/`end_input`: a peer link's reader, or a client connection's reader with
  a run of publishes and acks); it runs the round through `_round_inline`, which then moves
  the parked task's timer to the replica's new deadline, or wakes the task if more is due. A
  batch of nothing but replication takes a shorter path (`_replication_alone`);
* a session that needs the bodies a batch still waiting here would give this mirror
  (`catch_up`, also through `_round_inline`).
All three hold `_in_round` while a round runs, so none starts one inside another.

What a replica's task asks of the node is `ReplicaHost` (the Router, broker/router.py).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Protocol

import trio

from mirroring import replica as rp
from mirroring.dead_letter import DeadLetter
from mirroring.records import named
from wire.messages import RRep, RRepOk

from .framed import CORK

BATCH = 512
CATCH_UP_ROUNDS = 8  # rounds catch_up runs at most (each takes up to BATCH inputs)


class ReplicaHost(Protocol):
    """What a replica's task asks of its node (broker/router.py `Router` answers it)."""

    log: Any
    # the open batch of input (Router.begin_input), or None: an idle replica that gets input
    # during it appends itself, and the batch's end runs its round (`after_batch`)
    batch: list | None
    batch_now: float  # the clock when the open batch began: its rounds' time

    @property
    def leaving(self) -> bool: ...  # the node's shutdown record is on its way (Node.leaving)

    def may_deliver(self, qp: "QueueProcess", now: float) -> bool: ...  # in step with the log
    def replica_ended(self, qp: "QueueProcess") -> None: ...
    # --- the replica's outputs ---
    def to_node(self, node: str, msg, encoded=None) -> None: ...  # to the replica on `node`
    def encode_once(self, msg) -> Any: ...  # one encoding for a batch several mirrors get
    def to_session(self, node: str, sid: int, events: list) -> None: ...
    def propose(self, change) -> None: ...  # a metadata change, through the log, soon
    def delete_for_client(self, qname: str, owner: tuple, rid: int, count: int) -> None: ...
    def auto_delete(self, qname: str) -> None: ...
    def dead_letter(self, qname: str, d: DeadLetter) -> None: ...  # republish (broker/dead_letters.py)


class QueueProcess:
    """One replica's task and inbox (see the module docstring)."""

    def __init__(self, host: ReplicaHost, replica: rp.Replica):
        self.host = host  # the Router: sends, session events, proposals, logs
        self.replica = replica
        self.name = replica.name
        self.inbox: deque = deque()
        self._wake = trio.Event()
        self._idle = False  # the task waits for input (an inline round may run: after_batch)
        self._sleep: trio.CancelScope | None = None  # its timer while it waits
        self._noted = False  # due a round at the end of the current batch
        self._in_round = False  # a round runs (catch_up must not start another inside it)
        self._round_watch: trio.Event | None = None  # set at the end of the next round
        self.scope = trio.CancelScope()
        self.log = host.log.bind(**named(self.name))
        # the newest Assign delivered: an older one still in the inbox is superseded (the
        # replica acts on what the metadata says now, not on a state it has already left);
        # None once a Stop is delivered, which supersedes them all
        self._newest_assign: rp.Assign | None = replica.assign

    def deliver(self, item) -> None:
        """Queue an input for the replica: a wire message, a replica.* record, or a callable
        `fn(replica, now)` (control-plane queries and commands)."""
        t = type(item)
        if t is rp.Assign:
            self._newest_assign = item
        elif t is rp.Stop:
            # the metadata now holds no replica here (dst seed 105284: a leader cut off by a
            # partition caught up on six changes at once; the last moved its queue away, and
            # came as this `rp.Stop` message, so the Assign before it still counted as the newest: acting
            # on it dropped the only mirror that held what the leader had not confirmed, and
            # 730 messages held only here were confirmed, then lost with the replica)
            self._newest_assign = None
        self.inbox.append(item)
        batch = self.host.batch
        if batch is not None and self._idle:
            if not self._noted:  # the batch's end runs the round (`after_batch`)
                self._noted = True
                batch.append(self)
        else:
            self._wake.set()

    def reassign(self, assign: rp.Assign) -> None:
        """Hand the replica what the metadata now says of its queue, unless it says what the
        replica was last handed: a change to another queue wakes no one here (every change
        used to cost a round of every replica on the node, so declaring N queues cost N²)."""
        if assign != self._newest_assign:
            self.deliver(assign)

    def after_batch(self) -> None:
        """The end of a batch of peer traffic that gave this replica input while its task
        waited: run the round here, in the reader's task, rather than wake the task for it (a
        pass of trio's scheduler per hop, on every node a mirrored publish crosses). The task
        stays parked; its timer follows the replica's new deadline."""
        self._noted = False
        if not self._idle or self.replica.state is rp.State.STOPPED:
            self._wake.set()
            return
        inbox = self.inbox
        kind = type(inbox[0]) if inbox else None
        if kind is RRepOk or kind is RRep:
            if all(type(item) is kind for item in inbox) and self._replication_alone(kind, inbox):
                return
        self._round_inline(self.host.batch_now)

    def _replication_alone(self, kind: type, inbox: deque) -> bool:
        """A round of nothing but replication traffic, without the rest of a round's work: a
        leader's of its mirrors' acknowledgements (`Replica.acks_alone`: the confirms they
        release leave at once), or a mirror's of its leader's batches (`Replica.batches_alone`:
        its acknowledgement leaves at once). False if the replica wants an ordinary round."""
        replica = self.replica
        host = self.host
        now = host.batch_now
        self._in_round = True
        try:
            if kind is RRepOk:
                replica.in_step = host.may_deliver(self, now)  # (confirms wait while out of step)
                replica.leaving = host.leaving
                if not replica.acks_alone(inbox, now):
                    return False
            elif not replica.batches_alone(inbox, now):
                return False
            inbox.clear()
            self._carry_out()
        except Exception:  # a bug costs this queue, as in a round
            self.log.exception("queue process failed")
            self.scope.cancel()
        finally:
            self._in_round = False
        return True

    def catch_up(self) -> bool:
        """Apply the inbox now, from the caller's task (a session about to hand out deliveries
        whose bodies this mirror holds: the replication batch that came before them on the link
        may still wait here). False if there was nothing to run."""
        if not self.inbox or self._in_round or self.replica.state is rp.State.STOPPED:
            return False
        for _ in range(CATCH_UP_ROUNDS):
            if not self.inbox or self.replica.state is rp.State.STOPPED:
                break
            self._round_inline()
        return True

    def _round_inline(self, now: float | None = None) -> None:
        if now is None:
            now = trio.current_time()
        try:
            more = self._round(now)
        except Exception:  # a bug costs this queue, as it would in its own task
            self.log.exception("queue process failed")
            self.scope.cancel()
            return
        if more or self.inbox or self.replica.state is rp.State.STOPPED:
            self._wake.set()
        elif self._sleep is not None:
            deadline = self.replica.next_deadline(now)
            if deadline is None:
                deadline = math.inf
            if deadline != self._sleep.deadline:  # (moving a trio deadline is not cheap)
                self._sleep.deadline = deadline

    def watch_round(self, event: trio.Event) -> None:
        """Set `event` at the end of the replica's next round (whichever way it runs)."""
        self._round_watch = event

    def kick(self) -> None:
        """Run a round even with nothing new in the inbox (the node came in step)."""
        self._wake.set()

    @property
    def role(self) -> str:
        return self.replica.role

    async def run(self) -> None:
        replica = self.replica
        inbox = self.inbox
        clock = trio.current_time
        more = False
        with self.scope:
            while replica.state is not rp.State.STOPPED:
                if not inbox and not more:
                    deadline = replica.next_deadline(clock())
                    with trio.move_on_at(deadline if deadline is not None else math.inf) as sleep:
                        self._sleep = sleep
                        self._idle = True
                        try:
                            await self._wake.wait()
                        finally:
                            self._idle = False
                            self._sleep = None
                    self._wake = trio.Event()
                more = self._round(clock())
                if more or inbox:
                    await trio.lowlevel.checkpoint()
        self.host.replica_ended(self)

    def _round(self, now: float) -> bool:
        """One round: a batch of inputs, the timers, the round's end, its outputs. True if more
        could be dispatched at once."""
        replica = self.replica
        inbox = self.inbox
        self._in_round = True
        try:
            with CORK:  # what the round sends leaves at its end, from this task
                # once per round, before any input: a replica promoted in this round reads it too
                replica.in_step = self.host.may_deliver(self, now)
                replica.leaving = self.host.leaving
                for _ in range(BATCH):
                    if not inbox or replica.round_bytes >= rp.ROUND_BYTES:
                        break
                    self._handle(inbox.popleft(), now)
                replica.tick(now)
                more = replica.flush(now)
                self._carry_out()
        finally:
            self._in_round = False
        return more

    def _handle(self, item, now: float) -> None:
        replica = self.replica
        t = type(item)
        handler = _INPUTS.get(t)
        if t is rp.Assign and item is not self._newest_assign:
            replica.assign_superseded(item, now)
        elif handler is not None:
            handler(replica, item, now)
        elif callable(item) and not hasattr(item, "KIND"):
            item(replica, now)
        else:
            replica.handle(item, now)

    def _carry_out(self) -> None:
        out, events = self.replica.take_output()
        host = self.host
        shared = encoded = None
        for o in out:
            t = type(o)
            if t is rp.Send:
                msg = o.msg
                if type(msg) is RRep:  # one batch for every mirror: encode it once
                    if msg is not shared:
                        shared, encoded = msg, host.encode_once(msg)
                    host.to_node(o.node, msg, encoded)
                else:
                    host.to_node(o.node, msg)
            elif t is rp.Log:
                getattr(self.log, o.level)(o.event, **o.fields)
            elif t is rp.Propose:
                host.propose(o.change)
            elif t is rp.DeleteQueue:
                host.delete_for_client(self.name, o.owner, o.rid, o.count)
            elif t is rp.AutoDelete:
                host.auto_delete(self.name)
            elif t is DeadLetter:
                host.dead_letter(self.name, o)
        for (node, sid), evs in events.items():
            host.to_session(node, sid, evs)
        watch = self._round_watch
        if watch is not None:
            self._round_watch = None
            watch.set()


_INPUTS = {
    rp.Assign: rp.Replica.assign_now,
    rp.NodeGone: rp.Replica.node_gone,
    rp.LinkDown: rp.Replica.link_down,
    rp.LinkUp: rp.Replica.link_up,
    rp.LinkReplaced: rp.Replica.link_replaced,
    rp.Stop: rp.Replica.stop,
    rp.SyncRequest: lambda r, ev, now: r.request_sync(ev.why, now),
    rp.SyncCancel: lambda r, ev, now: r.cancel_sync(now),
}
