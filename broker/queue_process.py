"""The task that runs one queue replica on its node (here: the leader of a non-mirrored queue).

Like an Erlang process: one task, one bounded inbox, so FIFO order and back-pressure come from the
structure. Each wake-up drains a batch of operations from the inbox, applies them to the pure
`QueueState`, then dispatches deliveries and sends every resulting event, grouped per client
session, in one go.

Operations (lists, so they cross peer links unchanged); `owner` is [node, session id, channel]:
  ["publish", owner, first_seq, bodies, props]      first_seq 0 = no confirm wanted
  ["consume", owner, rid, tag, no_ack, prefetch, exclusive, arguments]
  ["cancel", owner, rid, tag]
  ["get", owner, rid, no_ack]
  ["ack" | "requeue" | "discard", owner, ids]
  ["owner_gone", owner]          a channel closed
  ["session_gone", node, sid]    a connection closed
  ["purge", owner, rid]
  ["declare_ok", owner, rid]     answer [name, messages, consumers]
  ["delete", owner, rid, if_unused, if_empty]
Events sent to sessions:
  ["deliver", ch, consumer_tag, queue, ids, bodies, redelivered_indexes, props]
  ["confirm", ch, first, last, ok, reason]
  ["reply", rid, value] / ["fail", rid, ch, code, text]
  ["consume_ok", ch, rid, tag, queue, no_ack]
  ["get_ok", ch, rid, queue, message-or-nil, remaining]
  ["cancelled", ch, tag, queue, reason]
"""

from __future__ import annotations

import itertools

import trio

from mirroring.queue import QueueState
from wire.errors import PRECONDITION_FAILED, ProtocolError

INBOX_SIZE = 512
BATCH = 512
_serial = itertools.count(1)


class QueueProcess:
    def __init__(self, node, qdef: dict):
        self.node = node
        self.qdef = qdef
        self.name = qdef["name"]
        self.state = QueueState(self.name)
        self.pid = f"<{node.name}.{next(_serial)}.0>"
        self.inbox, self._recv = trio.open_memory_channel(INBOX_SIZE)
        self.out: dict[tuple, list] = {}
        self.scope = trio.CancelScope()
        self.stopped = False

    # --- the task --------------------------------------------------------------------------
    async def run(self) -> None:
        recv = self._recv
        with self.scope:
            while True:
                try:
                    op = recv.receive_nowait()
                except trio.WouldBlock:
                    op = await recv.receive()
                self.handle(op)
                for _ in range(BATCH):
                    try:
                        op = recv.receive_nowait()
                    except trio.WouldBlock:
                        break
                    self.handle(op)
                more = self.flush()
                if more:
                    await trio.lowlevel.checkpoint()

    def stop(self, reason: str) -> None:
        """The queue was deleted (or moved away): cancel its consumers and end the task."""
        if self.stopped:
            return
        self.stopped = True
        for c in list(self.state.consumers.values()):
            self.emit(c.owner, ["cancelled", c.owner[2], c.tag, self.name, reason])
        self.state.consumers.clear()
        self.flush()
        self.scope.cancel()

    # --- operations ------------------------------------------------------------------------
    def handle(self, op: list) -> None:
        kind = op[0]
        if kind == "publish":
            _, owner, seq, bodies, props = op
            self.state.publish(bodies, props)
            if seq:
                self.emit(owner, ["confirm", owner[2], seq, seq + len(bodies) - 1, True, ""])
            return
        handler = getattr(self, "_op_" + kind, None)
        if handler is None:
            self.node.log.warning("unknown queue operation", queue=self.name, op=kind)
            return
        handler(*op[1:])

    def _op_ack(self, owner, ids):
        self.state.ack(tuple(owner), ids)

    def _op_requeue(self, owner, ids):
        self.state.requeue(tuple(owner), ids)

    def _op_discard(self, owner, ids):
        self.state.discard(tuple(owner), ids)

    def _op_consume(self, owner, rid, tag, no_ack, prefetch, exclusive, arguments):
        owner = tuple(owner)
        try:
            self.state.add_consumer(owner, tag, no_ack, prefetch, exclusive, arguments)
        except ProtocolError as exc:
            self.emit(owner, ["fail", rid, owner[2], exc.code, exc.text])
            return
        self.emit(owner, ["consume_ok", owner[2], rid, tag, self.name, no_ack])

    def _op_cancel(self, owner, rid, tag):
        owner = tuple(owner)
        self.state.remove_consumer(owner, tag)
        self.emit(owner, ["reply", rid, tag])
        self._maybe_auto_delete()

    def _op_get(self, owner, rid, no_ack):
        owner = tuple(owner)
        msg = self.state.get(owner, no_ack)
        self.emit(owner, ["get_ok", owner[2], rid, self.name,
                          list(msg) if msg is not None else None, self.state.message_count])

    def _op_owner_gone(self, owner):
        self.state.owner_gone(tuple(owner))
        self._maybe_auto_delete()

    def _op_session_gone(self, node, sid):
        self.state.owners_gone(lambda o: o[0] == node and o[1] == sid)
        self._maybe_auto_delete()

    def _op_purge(self, owner, rid):
        self.emit(owner, ["reply", rid, self.state.purge()])

    def _op_declare_ok(self, owner, rid):
        self.emit(owner, ["reply", rid, [self.name, self.state.message_count, len(self.state.consumers)]])

    def _op_delete(self, owner, rid, if_unused, if_empty):
        if if_unused and self.state.consumers:
            self.emit(owner, ["fail", rid, owner[2], PRECONDITION_FAILED,
                              f"queue '{self.name}' in vhost '/' in use"])
        elif if_empty and self.state.message_count:
            self.emit(owner, ["fail", rid, owner[2], PRECONDITION_FAILED,
                              f"queue '{self.name}' in vhost '/' is not empty"])
        else:
            count = self.state.message_count
            self.node.spawn(self.node.delete_queue_then_reply, self.name, owner, rid, count)

    def node_down(self, node: str) -> None:
        """Consumers and unacked deliveries of sessions on a node that went down."""
        self.state.owners_gone(lambda o: o[0] == node)
        self._maybe_auto_delete()
        self.flush()

    def _maybe_auto_delete(self):
        if self.qdef.get("auto_delete") and self.state.had_consumer and not self.state.consumers:
            self.state.had_consumer = False
            self.node.spawn(self.node.auto_delete_queue, self.name)

    # --- output ----------------------------------------------------------------------------
    def emit(self, owner, event: list) -> None:
        key = (owner[0], owner[1])
        lst = self.out.get(key)
        if lst is None:
            self.out[key] = [event]
        else:
            lst.append(event)

    def flush(self) -> bool:
        """Dispatch deliveries and send all pending events; True if more could be dispatched."""
        batches = self.state.dispatch()
        name = self.name
        for c, batch in batches:
            props = [m[2] for m in batch]
            self.emit(c.owner, [
                "deliver", c.owner[2], c.tag, name, [m[0] for m in batch], [m[1] for m in batch],
                [i for i, m in enumerate(batch) if m[3]],
                props if any(p is not None for p in props) else None,
            ])
        if self.out:
            out, self.out = self.out, {}
            to_session = self.node.to_session
            for (node, sid), events in out.items():
                to_session(node, sid, events)
        return bool(batches) and bool(self.state.ready)
