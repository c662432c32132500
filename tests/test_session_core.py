"""The session core (broker/session/) alone: commands and queue events in, output and operations
for the queues' leaders out, against a stand-in host (`FakeHost`, the `SessionHost` protocol over
plain dicts). No cluster, no socket, no polling: every effect is there when the call returns.
The delivery tags' bookkeeping first, then the core's behaviour, then its driver's waits. The
session on a simulated cluster is tests/test_sim_session.py."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from broker.session import (CLOSE, DeclareQueue, NodeHost, Propose, Session, SessionDriver,
                            SessionHost)
from mirroring.changes import ExchangeDeclare
from mirroring.access import Access
from mirroring.records import Binding, Permission
from wire import messages as m

pytestmark = pytest.mark.timeout(60)


def test_an_ack_over_two_queues_settles_each_queue_its_own_ids():
    """One ack may name deliveries of several queues on a channel: each queue is told its own
    message ids. An unknown tag is a channel error."""
    from broker.session import Channel, ChannelError
    ch = Channel(1)
    ch.tags, ch.next_tag = {1: ("q1", 10), 2: ("q2", 20), 3: ("q1", 11)}, 4
    assert Session._settle(None, ch, [1, 2, 3], 0) == {"q1": [10, 11], "q2": [20]}
    assert ch.tags == {}
    ch.tags, ch.next_tag = {4: ("q1", 12), 5: ("q1", 13)}, 6
    assert Session._settle(None, ch, [5, 4], 0) == {"q1": [13, 12]}
    ch.tags, ch.next_tag = {6: ("q1", 14), 7: ("q2", 21), 8: ("q2", 22)}, 9
    assert Session._settle(None, ch, [8], 7) == {"q1": [14], "q2": [22, 21]}  # and all up to 7
    ch.tags, ch.next_tag = {9: ("q1", 15)}, 11
    with pytest.raises(ChannelError, match="unknown delivery tag 10"):
        Session._settle(None, ch, [9, 10], 0)


def _channel_with_runs(deliveries):
    """A channel that made `deliveries` [(queue, ids), ...] in order: as runs, and the same as
    a plain tag table."""
    from broker.session import Channel
    runs, plain = Channel(1), Channel(1)
    for qname, ids in deliveries:
        runs.record_delivery(runs.next_tag, qname, list(ids))
        for i in ids:
            plain.tags[plain.next_tag] = (qname, i)
            plain.next_tag += 1
        runs.next_tag = plain.next_tag
    return runs, plain


def test_acks_of_delivery_runs_in_order_settle_by_slicing():
    """A channel keeps each delivery as a run (first tag, queue, ids): acks of the oldest tags
    in order, over one run, part of one, or two of different queues, become id lists without
    the tag table; anything else falls back to the table, with the same answers."""
    from broker.session import ChannelError
    ch, _ = _channel_with_runs([("q1", [10, 11, 12]), ("q2", [20, 21]), ("q1", [13])])
    assert Session._settle(None, ch, [1, 2], 0) == {"q1": [10, 11]}
    assert Session._settle(None, ch, [3, 4], 0) == {"q1": [12], "q2": [20]}
    assert not ch._tags and [r[0] + r[3] for r in ch.tag_runs] == [5, 6]
    assert Session._settle(None, ch, [5, 6], 0) == {"q2": [21], "q1": [13]}
    assert not ch.tag_runs and not ch._tags
    ch, _ = _channel_with_runs([("q1", [10, 11, 12])])
    assert Session._settle(None, ch, [1, 3], 0) == {"q1": [10, 12]}  # a gap: the table
    assert ch.tags == {2: ("q1", 11)}
    ch, _ = _channel_with_runs([("q1", [10, 11])])
    with pytest.raises(ChannelError, match="unknown delivery tag 3"):
        Session._settle(None, ch, [1, 2, 3], 0)


@pytest.mark.parametrize("seed", range(30))
def test_delivery_runs_settle_as_the_tag_table_alone(seed):
    """Differential: random deliveries and acks (mostly in order, sometimes out of order, with
    multiple, or naming an unknown tag) give a channel with runs the same answers and the same
    table as one that keeps only the table."""
    import random

    from broker.session import ChannelError
    rng = random.Random(seed)
    deliveries = [(rng.choice(["q1", "q2"]), [rng.randint(1, 99) for _ in range(rng.randint(1, 4))])
                  for _ in range(12)]
    runs, plain = _channel_with_runs(deliveries)
    while plain.tags:
        live = sorted(plain.tags)
        r = rng.random()
        upto = 0
        if r < 0.6:
            tags = live[:rng.randint(1, len(live))]
        elif r < 0.8:
            tags = rng.sample(live, rng.randint(1, len(live)))
        elif r < 0.9:
            tags, upto = [], rng.choice(live)
        else:
            tags = live[:1] + [plain.next_tag + 5]
        outs = []
        for ch in (runs, plain):
            try:
                outs.append(Session._settle(None, ch, list(tags), upto))
            except ChannelError as exc:
                outs.append(str(exc))
        assert outs[0] == outs[1], (seed, tags, upto, outs)
        assert runs.tags == plain.tags, (seed, tags, upto)


def test_acks_one_at_a_time_move_a_tag_runs_mark():
    """One ack at a time from a delivery of a thousand costs in proportion to the ack: the
    run's ids are neither copied nor cut, its mark moves."""
    ch, _ = _channel_with_runs([("q1", list(range(100, 1100)))])
    run = ch.tag_runs[0]
    ids = run[2]
    for tag in range(1, 11):
        assert Session._settle(None, ch, [tag], 0) == {"q1": [99 + tag]}
    assert ch.tag_runs[0] is run and run[2] is ids and run[3] == 10
    assert ch.tags[11] == ("q1", 110) and 10 not in ch.tags and len(ch.tags) == 990


# --- the core alone, against a stand-in host ------------------------------------------------

class _Log:
    def bind(self, **_):
        return self

    def info(self, *_, **__):
        pass

    warning = debug = info


class FakeHost:
    """`SessionHost` over plain dicts: queues {name: {"leader", "epoch", ...}}, exchanges, and
    bindings {exchange: [Binding]}; what the core sends a leader lands in `sent`."""

    name = "n1"

    def __init__(self):
        self.log = _Log()
        self.leaving = False
        self.queues: dict[str, dict] = {}
        self.exchanges: dict[str, dict] = {"amq.direct": {"type": "direct", "internal": False}}
        self.bindings: dict[str, list] = {}
        self.links = {"n2"}
        self.full: set[str] = set()
        self.sent: list = []
        self.routing: dict[str, dict] = {}
        self.inputs = 0  # batches of input opened and closed
        self.proposed: list = []
        # the user's permissions in "/" (None: none), and their version (bump it to change them)
        self.permission = Permission("guest", "/", ".*", ".*", ".*")
        self.access_version = 0
        self.sessions: dict[tuple, Session] = {}  # (node, sid) -> a session direct replies reach
        self.replies: list = []  # direct replies sent to another node

    def add_queue(self, name, leader="n1", epoch=1, **more):
        self.queues[name] = {"leader": leader, "epoch": epoch, **more}

    def queue(self, name):
        return self.queues.get(name)

    def queue_route(self, qdef):
        return qdef["leader"], qdef["epoch"]

    def queue_epoch(self, qdef):
        return qdef["epoch"]

    def queue_locked(self, qdef, conn_id):
        return qdef.get("owner") not in (None, conn_id)

    def queue_down_reason(self, qdef):
        return qdef.get("down", "")

    def exchange(self, name):
        return self.exchanges.get(name)

    def exchange_kind(self, xdef):
        return xdef["type"], xdef["internal"]

    def bound(self, exchange, binding):
        return binding in self.bindings.get(exchange, ())

    def exchange_bound(self, source, binding):
        return binding in self.bindings.get(source, ())

    def routes_by_headers(self, exchange):
        return False

    def direct_reply(self, node, sid, ev):
        session = self.sessions.get((node, sid))
        if session is None:
            return node in self.links and bool(self.replies.append((node, sid, ev)) or True)
        return session.take_reply(ev)

    def to_session(self, node, sid, events):
        self.replies.append((node, sid, *events))

    def route(self, exchange, key, headers=None):
        if not exchange:
            return [key] if key in self.queues else []
        return [b.queue for b in self.bindings.get(exchange, ()) if b.key == key]

    def linked(self, node):
        return node == self.name or node in self.links

    def access(self, user, vhost):
        return Access(user, vhost, self.access_version, self.permission)

    def to_leader(self, qname, op):
        self.sent.append(op)

    def link_full(self, qname):
        return qname in self.full

    def mirror_bodies(self, ev):
        return [None] * len(ev.ids)

    def begin_input(self):
        self.inputs += 1

    def end_input(self):
        self.inputs += 1

    def track_route(self, qname, session):
        self.routing.setdefault(qname, {})[session.sid] = session

    def untrack_route(self, qname, sid):
        self.routing.get(qname, {}).pop(sid, None)

    # the driver's half
    async def propose(self, change):
        self.proposed.append(change)
        await trio.lowlevel.checkpoint()
        return None

    async def declare_queue(self, core, msg):
        await trio.lowlevel.checkpoint()
        if msg.queue in self.queues:
            return None
        self.add_queue(msg.queue)
        return [msg.queue, 0, 0]

    async def wait_link_room(self, qname):
        await trio.lowlevel.checkpoint()
        self.full.discard(qname)


def core_session(host=None):
    host = host or FakeHost()
    out: list = []
    s = Session(host, 7, "127.0.0.1:40001", "guest", "probe", out.append)
    assert s.handle(m.ChannelOpen(1, 1)) is None
    assert out.pop() == m.Reply(1, None)
    return host, s, out


def sent(host, t):
    return [op for op in host.sent if type(op) is t]


def test_the_nodes_host_answers_everything_the_protocol_declares():
    from types import SimpleNamespace as NS
    router = NS(to_leader=print, link_full=print, mirror_bodies=print, begin_input=print,
                end_input=print, wait_link_room=print, to_session=print)
    node = NS(name="n1", log=_Log(), queue_down_reason=print, router=router, leaving=False,
              cluster=NS(md=NS(access_version=0), links={}), routing={})
    host = NodeHost(node)
    declared = {n for n in vars(SessionHost) if not n.startswith("_")} | set(SessionHost.__annotations__)
    assert {"queue", "to_leader", "track_route", "leaving"} <= declared
    assert [n for n in sorted(declared) if not hasattr(host, n)] == []
    assert [n for n in sorted(declared) if not hasattr(FakeHost(), n)] == []


def test_a_publish_goes_to_the_leader_and_is_confirmed_when_accepted():
    host, s, out = core_session()
    host.add_queue("q", leader="n2", epoch=3)
    s.handle(m.ConfirmSelect(2, 1))
    assert out.pop() == m.Reply(2, None)
    i = s.handle_run([m.Publish(1, "q", [b"a", b"bc"], None), m.ChannelOpen(9, 2)], 0)
    assert i == 1 and host.inputs == 2  # one batch of input, opened and closed
    (pub,) = sent(host, m.QPublish)
    assert (pub.queue, pub.owner, pub.pseq, pub.bodies, pub.resent, pub.epoch) == \
        ("q", ("n1", 7, 1), 1, [b"a", b"bc"], False, 3)
    assert s.routes == {"q": ("n2", 3)} and host.routing["q"] == {7: s}
    assert (s.inflight_msgs, s.inflight_bytes, s.channels[1].inflight) == (2, 3, 2)
    assert not out  # nothing confirmed before every mirror has it
    s.queue_events([m.EvAccepted("q", 1)])
    assert out == [m.Confirm(1, [[1, 2]], [], "")]
    assert (s.inflight_msgs, s.inflight_bytes) == (0, 0)


def test_mixed_mandatory_batches_in_one_run_return_only_the_mandatory_messages():
    """The AMQP front end's batches of one read, to an exchange with no binding for their key,
    plain and mandatory in turn: only the mandatory ones come back, each before its confirm."""
    host, s, out = core_session()
    s.handle(m.ConfirmSelect(2, 1))
    assert out.pop() == m.Reply(2, None)
    run = [m.PublishTo(1, "amq.direct", "nowhere", False, [b"a"], None, None, False),
           m.PublishTo(1, "amq.direct", "nowhere", True, [b"b", b"c"], None, None, False),
           m.PublishTo(1, "amq.direct", "nowhere", False, [b"d"], None, None, False)]
    assert s.handle_run(run, 0) == 3
    assert [o.bodies if type(o) is m.Returned else o.acks for o in out] == \
        [[[1, 1]], [b"b", b"c"], [[2, 3]], [[4, 4]]]


def test_credit_is_state_and_the_driver_is_told_once_when_it_may_be_back(monkeypatch):
    import broker.session.publishing as publishing
    monkeypatch.setattr(publishing, "WINDOW_MSGS", 3)
    host, s, out = core_session()
    host.add_queue("q")
    told = []
    s.handle_now(m.Publish(1, "q", [b"1", b"2"], None))
    s.handle_now(m.Publish(1, "q", [b"3", b"4"], None))
    assert not s.has_credit and s.publisher
    s.when_room = lambda: told.append(True)
    s.queue_events([m.EvAccepted("q", 1)])
    assert s.has_credit and told == [True] and s.when_room is None
    s.queue_events([m.EvAccepted("q", 2)])
    assert told == [True]


def test_a_full_link_is_left_for_the_driver_and_the_run_goes_on():
    host, s, out = core_session()
    host.add_queue("q", leader="n2")
    host.full.add("q")
    msgs = [m.Publish(1, "q", [b"x"], None), m.Publish(1, "q", [b"y"], None)]
    assert s.handle_run(msgs, 0) == 2
    assert len(sent(host, m.QPublish)) == 2 and s.full_links == ["q", "q"]


def test_a_new_leader_epoch_gets_what_is_in_flight_and_the_consumers_again():
    host, s, out = core_session()
    host.add_queue("q", leader="n2", epoch=1)
    s.handle_now(m.Publish(1, "q", [b"x"], None))
    s.handle(m.BasicConsume(3, 1, "q", "c1", False, False, {}))
    s.handle(m.BasicConsume(4, 1, "q", "c2", False, False, {"x-cancel-on-ha-failover": True}))
    s.queue_events([m.EvConsumeOk(1, 3, "c1", "q", False), m.EvConsumeOk(1, 4, "c2", "q", False)])
    assert [(r.rid, r.value) for r in out] == [(3, "c1"), (4, "c2")]
    host.sent.clear()
    s.meta_changed({"other"})  # a change that does not name the queue: nothing
    assert not host.sent
    host.add_queue("q", leader="n3", epoch=2)
    s.meta_changed({"q"})
    (pub,) = sent(host, m.QPublish)
    assert pub.resent and pub.epoch == 2 and s.routes["q"] == ("n3", 2)
    assert [c.tag for c in sent(host, m.QConsume)] == ["c1"]  # c2 is cancelled, not re-registered


def test_a_queue_deleted_nacks_what_is_in_flight_and_cancels_its_consumers():
    host, s, out = core_session()
    host.add_queue("q")
    s.handle(m.ConfirmSelect(2, 1))
    s.handle(m.BasicConsume(3, 1, "q", "c1", False, False, {}))
    s.queue_events([m.EvConsumeOk(1, 3, "c1", "q", False)])
    s.handle_now(m.Publish(1, "q", [b"x"], None))
    out.clear()
    del host.queues["q"]
    s.meta_changed({"q"})
    assert out == [m.Cancelled(1, "c1", "queue 'q' in vhost '/' was deleted"),
                   m.Confirm(1, [], [[1, 1]], "queue 'q' in vhost '/' was deleted")]
    assert not s.routes and host.routing["q"] == {}


def test_deliveries_of_an_older_epoch_are_given_back_and_newer_ones_hold_the_acks():
    host, s, out = core_session()
    host.add_queue("q", leader="n2", epoch=2)
    s.handle(m.BasicConsume(3, 1, "q", "c", False, False, {}))
    s.queue_events([m.EvConsumeOk(1, 3, "c", "q", False)])
    out.clear()
    host.sent.clear()
    s.queue_events([m.EvDeliver(1, "c", "q", [5], [b"old"], [], None, 1)])
    assert not out and sent(host, m.QSettle)[0].ids == [5]  # requeued at the leader, unseen
    host.sent.clear()
    s.queue_events([m.EvDeliver(1, "c", "q", [6], [b"new"], [], None, 3)])  # beat the metadata here
    assert [d.bodies for d in out] == [[b"new"]]
    s.handle_now(m.Ack(1, [1], 0))
    assert not host.sent  # held: only the epoch-3 leader knows that delivery
    host.add_queue("q", leader="n3", epoch=3)
    s.meta_changed({"q"})
    (ack,) = sent(host, m.QSettle)
    assert (ack.ids, ack.how) == ([6], m.ACK)


def test_a_node_leaving_shows_no_more_deliveries():
    host, s, out = core_session()
    host.add_queue("q")
    s.handle(m.BasicConsume(3, 1, "q", "c", False, False, {}))
    s.queue_events([m.EvConsumeOk(1, 3, "c", "q", False)])
    out.clear()
    host.leaving = True
    s.queue_events([m.EvDeliver(1, "c", "q", [1], [b"x"], [], None, 1)])
    assert not out


def test_commands_that_wait_for_the_log_come_back_as_actions():
    host, s, out = core_session()
    host.add_queue("q")
    action = s.handle(m.ExchangeDeclare(2, 1, "ex", "direct", False, False, False, False, {}))
    assert type(action) is Propose and type(action.change) is ExchangeDeclare
    host.exchanges["ex"] = {"type": "direct", "internal": False}
    # a bind asked meanwhile is answered at once (already bound), but after the declare
    host.bindings["ex"] = [Binding("q", "k", {})]
    assert s.handle(m.QueueBind(3, 1, "q", "ex", "k", {})) is None
    assert not out  # its reply waits for the declare's
    assert action.then(None) is None
    assert out == [m.Reply(2, None), m.Reply(3, None)]
    declare = s.handle(m.QueueDeclare(4, 1, "new", False, True, False, False, {}))
    assert type(declare) is DeclareQueue and declare.msg.queue == "new"
    assert declare.then(["new", 0, 0]) is None and out[-1] == m.Reply(4, ["new", 0, 0])
    assert s.handle(m.ConnectionClose(5)) is CLOSE


def test_a_refused_action_closes_its_channel_with_its_request():
    from broker.session import ChannelError
    host, s, out = core_session()
    action = s.handle(m.ExchangeDeclare(2, 1, "ex", "topic", False, False, False, False, {}))
    s.action_failed(action, ChannelError(406, "inequivalent arg 'type'"))
    assert out == [m.Fail(2, 1, 406, "inequivalent arg 'type'")] and 1 not in s.channels


async def test_the_driver_carries_out_actions_and_waits_for_credit_without_polling(monkeypatch):
    import broker.session.publishing as publishing
    monkeypatch.setattr(publishing, "WINDOW_MSGS", 1)
    host, s, out = core_session()
    driver = SessionDriver(host, s)
    assert not await driver.handle(m.ExchangeDeclare(2, 1, "ex", "fanout", False, False, False, False, {}))
    assert type(host.proposed[0]) is ExchangeDeclare and out.pop() == m.Reply(2, None)
    assert not await driver.handle(m.QueueDeclare(3, 1, "q", False, True, False, False, {}))
    assert out.pop() == m.Reply(3, ["q", 0, 0])
    host.full.add("q")
    await driver.handle(m.Publish(1, "q", [b"1", b"2"], None))
    assert not s.full_links and not host.full  # waited for the link's room
    released = []

    async def reader():
        await driver.wait_credit()
        released.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert not released and s.when_room is not None
        s.queue_events([m.EvAccepted("q", 1)])
    assert released == [True]
    assert await driver.handle(m.ConnectionClose(9))


def test_permissions_refuse_on_their_channel_only_and_a_change_is_seen_at_the_next_command():
    host, s, out = core_session()
    host.permission = Permission("guest", "/", "^perf\\.", "^perf\\.", "^amq\\.direct$")
    host.access_version += 1
    host.add_queue("perf.q")
    host.add_queue("other")
    assert s.handle(m.ChannelOpen(2, 2)) is None
    refusals = [
        (m.QueueBind(3, 1, "other", "amq.direct", "k", {}), "queue 'other'"),  # write on the queue
        (m.QueueBind(4, 1, "perf.q", "amq.topic", "k", {}), "exchange 'amq.topic'"),  # read on it
        (m.PublishTo(1, "amq.direct", "k", False, [b"x"], None, None, None), "exchange 'amq.direct'"),
        (m.Publish(1, "perf.q", [b"x"], None), "exchange 'amq.default'"),
        (m.BasicGet(5, 1, "perf.q", False), "queue 'perf.q'"),
        (m.ExchangeDelete(6, 1, "perf.x", False), None),  # allowed: configure ^perf\.
    ]
    for msg, what in refusals:
        if 1 not in s.channels:
            assert s.handle(m.ChannelOpen(9, 1)) is None
        out.clear()
        action = s.handle(msg)
        if what is None:
            assert 1 in s.channels and not any(type(o) is m.Fail for o in out)
            continue
        assert action is None and out[-1] == m.Fail(
            getattr(msg, "rid", 0), 1, 403, f"access to {what} in vhost '/' refused for user 'guest'")
        assert 1 not in s.channels and 2 in s.channels  # the other channel carries on
    host.permission = Permission("guest", "/", ".*", ".*", ".*")
    host.access_version += 1  # a change to the permissions: compiled again at the next check
    out.clear()
    s.handle(m.BasicGet(11, 1, "perf.q", False))
    assert not any(type(o) is m.Fail for o in out) and sent(host, m.QGet)


def test_a_closed_session_tells_every_queue_it_published_to():
    # a queue remembers each publishing session's last batch (to drop resends after a failover)
    # until it hears the session is gone: a connection that only published must say so too, or
    # every short-lived publisher leaves an entry behind in each queue it used
    host, s, out = core_session()
    host.add_queue("q", leader="n2", epoch=3)
    host.add_queue("other", leader="n1", epoch=1)
    s.handle(m.Publish(1, "q", [b"a"], None))
    s.handle(m.Publish(1, "other", [b"b"], None))
    s.close()
    assert sorted((op.queue, op.node, op.sid) for op in sent(host, m.QSessionGone)) == [
        ("other", "n1", 7), ("q", "n1", 7)]
    assert s.routes == {}
# --- direct reply-to and exchange bindings ---------------------------------------------------

def _amqp_item(exchange, key, **props):
    from pamqp import commands
    return [exchange, key, commands.Basic.Properties(**props).marshal()]


def test_direct_reply_to_round_trip_between_two_sessions():
    from broker.session.replyto import REPLY_TO
    from wire import props as propsmod
    host, client, cout = core_session()
    _, server, sout = core_session(host)
    server.sid = 8
    host.sessions[("n1", 7)] = client
    host.add_queue("rpc")
    client.handle(m.BasicConsume(3, 1, REPLY_TO, "", True, False, {}))
    (ok,) = cout
    tag = ok.value
    cout.clear()
    client.handle_now(m.PublishTo(1, "", "rpc", False, [b"req"],
                                  [_amqp_item("", "rpc", reply_to=REPLY_TO, correlation_id="c")], None, True))
    (pub,) = sent(host, m.QPublish)
    reply_to = propsmod.decode_raw(pub.props[0][2]).reply_to
    assert reply_to.startswith(REPLY_TO + ".") and propsmod.decode_raw(pub.props[0][2]).correlation_id == "c"
    server.handle(m.ConfirmSelect(2, 1))
    sout.clear()
    server.handle_now(m.PublishTo(1, "", reply_to, True, [b"resp"], None, None, False))
    assert sout == [m.Confirm(1, [[1, 1]], [], "")]  # delivered at once: nothing returned
    (deliver,) = cout
    assert (deliver.consumer_tag, deliver.first_tag, deliver.bodies) == (tag, 1, [b"resp"])
    assert deliver.props[0][:2] == ["", reply_to]  # delivered with the name it was sent to
    # the consumer cancelled: the next reply to that name is unroutable
    client.handle(m.BasicCancel(4, 1, tag))
    sout.clear()
    server.handle_now(m.PublishTo(1, "", reply_to, True, [b"late"], None, None, False))
    assert [type(o) for o in sout] == [m.Returned, m.Confirm]


def test_direct_reply_to_refusals():
    from broker.session.replyto import REPLY_TO
    host, s, out = core_session()
    s.handle(m.BasicConsume(3, 1, REPLY_TO, "", False, False, {}))
    assert out[-1].code == 406 and out[-1].text == "reply consumer cannot acknowledge"
    s.handle(m.ChannelOpen(4, 2))
    host.add_queue("rpc")
    s.handle_now(m.PublishTo(2, "", "rpc", False, [b"req"], [_amqp_item("", "rpc", reply_to=REPLY_TO)], None, True))
    assert out[-1].code == 406 and out[-1].text == "fast reply consumer does not exist"
    assert not sent(host, m.QPublish)


def test_a_reply_for_another_node_goes_there_and_a_bad_name_is_unroutable():
    from broker.session.replyto import encode_token
    host, s, out = core_session()
    name = encode_token("n2", 5, 3, "k")
    s.handle_now(m.PublishTo(1, "", name, True, [b"r"], None, None, False))
    ((node, sid, ev),) = host.replies
    assert (node, sid, ev.ch, ev.key, ev.bodies) == ("n2", 5, 3, "k", [b"r"]) and not out
    s.handle_now(m.PublishTo(1, "", "amq.rabbitmq.reply-to.@@", True, [b"r"], None, None, False))
    assert [type(o) for o in out] == [m.Returned]


def test_exchange_bind_proposes_once_and_checks_both_exchanges():
    from mirroring.changes import ExchangeBindingAdd, ExchangeBindingRemove
    from mirroring.records import ExchangeBinding
    host, s, out = core_session()
    host.exchanges["up"] = {"type": "topic", "internal": False}
    action = s.handle(m.ExchangeBind(3, 1, "amq.direct", "up", "a.*", {}))
    assert action.change == ExchangeBindingAdd("up", ExchangeBinding("amq.direct", "a.*", {}))
    host.bindings["up"] = [ExchangeBinding("amq.direct", "a.*", {})]
    assert s.handle(m.ExchangeBind(4, 1, "amq.direct", "up", "a.*", {})) is None  # there already
    action = s.handle(m.ExchangeUnbind(5, 1, "amq.direct", "up", "a.*", {}))
    assert type(action.change) is ExchangeBindingRemove
    s.handle(m.ExchangeBind(6, 1, "nope", "up", "", {}))
    assert out[-1].code == 404 and out[-1].text == "no exchange 'nope' in vhost '/'"


def test_a_confirmed_reply_to_another_node_waits_for_its_outcome():
    """Replies to a channel on another node, published in confirm mode or mandatory, are
    confirmed (or returned) when that node says whether its consumer took them; nacked when
    the link breaks first."""
    from broker.session.replyto import encode_token
    host, s, out = core_session()
    s.handle(m.ConfirmSelect(2, 1))
    out.clear()
    name = encode_token("n2", 5, 3, "k")
    s.handle_now(m.PublishTo(1, "", name, True, [b"a"], None, None, False))
    s.handle_now(m.PublishTo(1, "", name, True, [b"b"], None, None, False))
    s.handle_now(m.PublishTo(1, "", name, False, [b"c"], None, None, False))
    (_, _, first), (_, _, second), (_, _, third) = host.replies
    assert first.sender == ("n1", 7) and first.rid and second.rid and not out
    s.queue_events([m.EvReplyTaken(first.rid, True)])
    assert out == [m.Confirm(1, [[1, 1]], [], "")]
    out.clear()
    s.queue_events([m.EvReplyTaken(second.rid, False)])
    assert [type(o) for o in out] == [m.Returned, m.Confirm] and out[1].acks == [[2, 2]]
    out.clear()
    host.links.discard("n2")
    s.route_changed("n2")
    assert len(out) == 1 and out[0].nacks == [[3, 3]] and "link to node n2 broke" in out[0].reason
    # a taker on the other node answers its publisher
    _, taker, _ = core_session(host)
    taker.queue_events([m.EvDirectReply(1, "nope", name, [b"x"], None, 9, ("n1", 7))])
    assert host.replies[-1] == ("n1", 7, m.EvReplyTaken(9, False))
