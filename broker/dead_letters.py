"""This node's dead-letter publisher: it republishes what the queue leaders on this node
dead-letter (what and why is mirroring/dead_letter.py's), and acknowledges it to them once it is
safe.

It is a session of the node's own (the session core, broker/session/), opened when first needed and
never listed among the client connections, with one channel in confirm mode. Each message gets
its `x-death` (the wall clock's time), is routed through the dead-letter exchange with the
queue's dead-letter routing key or its own keys, minus the queues that would close an automatic
cycle, and is published as a client's publish is: to the target queues' leaders, resent to a new
leader after a failover, confirmed once every mirror has it. Only then is the source queue told
to let the message go (an ack from the holder, `ReplicaDeadLetters.holder`); until then the
source holds it, replicated, as an unacknowledged message, which a new source leader requeues.
A message that goes nowhere (no such exchange, no queue bound, a cycle, a target queue with no
live replica) is let go at once, as RabbitMQ drops it.
"""

from __future__ import annotations

import time

import trio

from mirroring import dead_letter as dl
from mirroring.records import DEFAULT_VHOST, qualify, split_key
from wire import messages as m
from wire import props as propsmod

from .session.core import Session
from .session.host import NodeHost

CH = 1
SIM_EPOCH = 1_700_000_000.0  # a simulated node's wall clock: this plus its (mock) clock


class DeadLetters:
    """One node's dead-letter publisher (see the module docstring)."""

    def __init__(self, node, simulated: bool):
        self.node = node
        self.sid = 0
        # confirm sequence number -> (source queue, message id), for held messages
        self._waiting: dict[int, tuple[str, int]] = {}
        self.wall = (lambda: SIM_EPOCH + trio.current_time()) if simulated else time.time

    def open(self) -> None:
        """With the app: the session id of this run's publisher (its session is opened when
        there is something to publish)."""
        self.sid = self.node.new_session_id()
        self._waiting.clear()

    def _session(self) -> Session:
        node = self.node
        core = node.sessions.get(self.sid)
        if core is None:
            core = Session(NodeHost(node), self.sid, "", "warren",
                                       "dead-letter publisher", self._out)
            core.listed = False
            node.sessions[self.sid] = core
            core.handle(m.ChannelOpen(0, CH))
            core.handle(m.ConfirmSelect(0, CH))
        return core

    def publish(self, qname: str, d: dl.DeadLetter) -> None:
        """Republish what queue `qname`'s leader here dead-lettered: runs of messages that go to
        the same queues with the same key and flag go as one batch (one publish, one confirm)."""
        if not self.node.app_running:
            return  # the app stops: the queue's next leader has the messages
        core = self._session()
        host = core.host
        target = d.target
        wall = self.wall()
        # names in x-death and the dead-letter exchange are the queue's vhost's (its key in
        # the tables: records.qualify)
        vhost, name = split_key(qname)
        xkey = qualify(vhost, target.exchange)
        exists = target.exchange == "" or host.exchange(xkey) is not None
        made: dict = {}  # the same props, dead the same way: made once (a batch's messages share them)
        let_go = []
        run: list = []  # [queues, key, again, bodies, props, ids]
        for msg, again in zip(d.msgs, d.again):
            item = msg[2]
            key_of = (item[0], item[1], item[2]) if type(item) is list else item if item is None else id(item)
            props = made.get(key_of)
            if props is None:
                props = made[key_of] = dl.dead_props(item, name, d.reason, wall)
            keys = [target.routing_key] if target.routing_key is not None else dl.routing_keys(item, name)[1]
            queues: list[str] = []
            if exists:
                for key in keys:
                    for q in self._route(host, vhost, xkey, key, props):
                        if q not in queues and not dl.cycles(props, split_key(q)[1]):
                            queues.append(q)
            if not queues:
                let_go.append(msg[0])
                continue
            if not run or run[0] != queues or run[1] != keys[0] or run[2] != again:
                self._send(core, qname, d.held, target.exchange, run)
                run = [queues, keys[0], again, [], [], []]
            run[3].append(msg[1])
            run[4].append([target.exchange, keys[0], props[2]])
            run[5].append(msg[0])
        self._send(core, qname, d.held, target.exchange, run)
        core.full_links.clear()  # nothing waits for room: a queue's dead letters are never held back
        if d.held and let_go:
            self._let_go({qname: let_go})

    @staticmethod
    def _route(host, vhost: str, xkey: str, key: str, props) -> list[str]:
        """The queues (keys) a dead letter reaches through exchange `xkey` of `vhost`."""
        if xkey or vhost == DEFAULT_VHOST:
            return host.route(xkey, key, lambda: propsmod.headers_of(props))
        qkey = qualify(vhost, key)  # another vhost's default exchange: the queue of that name
        return [qkey] if host.queue(qkey) is not None else []

    def _send(self, core: Session, qname: str, held: bool, exchange: str, run: list) -> None:
        if not run:
            return
        queues, key, again, bodies, props, ids = run
        if held:
            seq = core.channels[CH].next_seq
            for i, mid in enumerate(ids):
                self._waiting[seq + i] = (qname, mid)
        core.publish_routed(CH, queues, bodies, props, exchange, key, again)

    def _out(self, msg) -> None:
        """What the session says to its "client": confirms release the source queues' copies
        (a nack too: the target queue had no live replica, and RabbitMQ drops the message)."""
        if type(msg) is not m.Confirm:
            return
        done: dict[str, list[int]] = {}
        waiting = self._waiting
        for first, last in (*msg.acks, *msg.nacks):
            for seq in range(first, last + 1):
                held = waiting.pop(seq, None)
                if held is not None:
                    done.setdefault(held[0], []).append(held[1])
        if done:
            self._let_go(done)

    @property
    def holder(self) -> tuple:
        """The owner its messages are held by in their source queues (ReplicaDeadLetters.holder)."""
        return (self.node.name, self.sid, 0)

    def _let_go(self, done: dict[str, list[int]]) -> None:
        router = self.node.router
        owner = self.holder
        for qname, ids in done.items():
            router.to_leader(qname, m.QSettle(qname, owner, m.ACK, ids))
