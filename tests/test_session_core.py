"""The session (broker/session/) without sockets. First the core alone, against a stand-in host
(`FakeHost`, the `SessionHost` protocol over plain dicts): commands and queue events in, output
and operations for the leaders out, no cluster, no task, no waiting. Then sessions made
directly on the nodes of a simulated cluster, fed the typed commands of wire/messages.py, their
output read as a list. What AMQP needs of it: routing through exchanges on the receiving node,
one confirm for a message routed to queues led from different nodes (nacked if any refuses),
returns, the order of replies per channel, recover, flow, and the queue limits."""

from __future__ import annotations

import pytest
import trio

from broker.session import (CLOSE, DeclareQueue, NodeHost, Propose, Session, SessionDriver,
                            SessionHost)
from wire import messages as m
from wire.errors import ProtocolError

from broker.simulation import sim_cluster

pytestmark = pytest.mark.timeout(60)


class Probe:
    """A session on `node` and everything it sent, as a client would see it."""

    def __init__(self, node):
        self.node = node
        self.out: list = []
        self.s = SessionDriver.open(node, f"{node.name}:40001", "guest", "probe", self.out.append)
        self.rid = 100

    async def do(self, cmd_type, *args, ch=1, wait=True):
        """Send a request (rid and channel filled in); wait for its Reply or Fail."""
        self.rid += 1
        rid = self.rid
        await self.s.handle(cmd_type(rid, ch, *args))
        if not wait:
            return rid
        return await self.answer(rid)

    async def answer(self, rid, timeout=20):
        with trio.fail_after(timeout):
            while True:
                for msg in self.out:
                    if type(msg) in (m.Reply, m.Fail) and msg.rid == rid:
                        return msg
                await trio.sleep(0.01)

    async def until(self, pred, timeout=20):
        with trio.fail_after(timeout):
            while not pred():
                await trio.sleep(0.01)

    def of(self, t):
        return [x for x in self.out if type(x) is t]

    async def setup(self, ch=1):
        await self.s.handle(m.ChannelOpen(1 + ch * 1000, ch))
        assert type(self.out[-1]) is m.Reply


def confirmed(p: Probe) -> tuple[set, set]:
    acks, nacks = set(), set()
    for c in p.of(m.Confirm):
        for a, b in c.acks:
            acks.update(range(a, b + 1))
        for a, b in c.nacks:
            nacks.update(range(a, b + 1))
    return acks, nacks


async def test_fanout_to_queues_led_from_two_nodes_confirms_once_both_have_it(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p1, p2 = Probe(c.nodes["n1"]), Probe(c.nodes["n2"])
        await p1.setup()
        await p2.setup()
        assert type(await p1.do(m.QueueDeclare, "q1", False, True, False, False, {})) is m.Reply
        assert type(await p2.do(m.QueueDeclare, "q2", False, True, False, False, {})) is m.Reply
        assert c.nodes["n1"].md.queues["q2"]["leader"] == "n2"
        r = await p1.do(m.ExchangeDeclare, "fx", "fanout", False, False, False, False, {})
        assert type(r) is m.Reply
        for q in ("q1", "q2"):
            assert type(await p1.do(m.QueueBind, q, "fx", "", {})) is m.Reply
        await p1.do(m.ConfirmSelect)
        # q2's leader hears of it (and answers) late; a round trip shorter than the election
        # timeout, or n2 would be out of step with the log and hold its confirms (raft.py)
        c.net.delay("n1", "n2", 0.6)
        start = trio.current_time()
        await p1.s.handle(m.PublishTo(1, "fx", "ignored", False, [b"a", b"b", b"c"], None))
        await p1.until(lambda: p1.of(m.Confirm))
        assert trio.current_time() - start >= 1.2  # there and back over the slow link
        assert confirmed(p1) == ({1, 2, 3}, set())
        c.net.delay("n1", "n2", 0)
        for q in ("q1", "q2"):
            r = await p1.do(m.QueueDeclare, q, True, True, False, False, {})
            assert r.value == [q, 3, 0]


async def test_a_message_some_queue_refuses_is_nacked(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p = Probe(c.nodes["n1"])
        await p.setup()
        await p.do(m.QueueDeclare, "all", False, True, False, False, {})
        await p.do(m.QueueDeclare, "small", False, True, False, False,
                   {"x-max-length": 1, "x-overflow": "reject-publish"})
        await p.do(m.ExchangeDeclare, "fx", "fanout", False, False, False, False, {})
        await p.do(m.QueueBind, "all", "fx", "", {})
        await p.do(m.QueueBind, "small", "fx", "", {})
        await p.do(m.ConfirmSelect)
        await p.s.handle(m.PublishTo(1, "fx", "", False, [b"1", b"2", b"3"], None))
        await p.until(lambda: len(set().union(*confirmed(p))) == 3)
        assert confirmed(p) == ({1}, {2, 3})
        assert any("x-overflow reject-publish" in x.reason for x in p.of(m.Confirm) if x.nacks)
        assert (await p.do(m.QueueDeclare, "all", True, True, False, False, {})).value[1] == 3
        assert (await p.do(m.QueueDeclare, "small", True, True, False, False, {})).value[1] == 1


async def test_mandatory_unroutable_comes_back_before_its_confirm(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p = Probe(c.nodes["n2"])
        await p.setup()
        await p.do(m.ConfirmSelect)
        await p.s.handle(m.PublishTo(1, "amq.direct", "nobody", True, [b"x"], [["amq.direct", "nobody", b"\x00\x00"]]))
        await p.s.handle(m.PublishTo(1, "amq.direct", "nobody", False, [b"y"], None))
        kinds = [type(x) for x in p.out[-3:]]
        assert kinds == [m.Returned, m.Confirm, m.Confirm]
        ret = p.of(m.Returned)[0]
        assert (ret.code, ret.text, ret.exchange, ret.routing_key, ret.bodies) == \
            (312, "NO_ROUTE", "amq.direct", "nobody", [b"x"])
        assert confirmed(p) == ({1, 2}, set())
        r = await p.do(m.QueueBind, "nothere", "amq.direct", "k", {})
        assert type(r) is m.Fail and r.code == 404 and r.text == "no queue 'nothere' in vhost '/'"


async def test_missing_and_internal_exchanges_close_the_channel(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p = Probe(c.nodes["n1"])
        await p.setup()
        await p.s.handle(m.PublishTo(1, "nope", "k", False, [b"x"], None))
        fail = p.of(m.Fail)[-1]
        assert (fail.ch, fail.code, fail.text) == (1, 404, "no exchange 'nope' in vhost '/'")
        await p.setup(2)
        await p.do(m.ExchangeDeclare, "inner", "topic", False, False, False, True, {}, ch=2)
        await p.s.handle(m.PublishTo(2, "inner", "k", False, [b"x"], None))
        fail = p.of(m.Fail)[-1]
        assert (fail.ch, fail.code) == (2, 403)
        assert fail.text == "cannot publish to internal exchange 'inner' in vhost '/'"
        await p.setup(3)
        r = await p.do(m.ExchangeDeclare, "inner", "direct", False, False, False, True, {}, ch=3)
        assert type(r) is m.Fail and r.code == 406 and "inequivalent arg 'type'" in r.text
        await p.setup(4)
        r = await p.do(m.ExchangeDeclare, "ghost", "direct", True, False, False, False, {}, ch=4)
        assert type(r) is m.Fail and (r.code, r.text) == (404, "no exchange 'ghost' in vhost '/'")


async def test_replies_keep_the_order_of_requests_on_a_channel(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p2 = Probe(c.nodes["n2"])
        await p2.setup()
        await p2.do(m.QueueDeclare, "far", False, True, False, False, {})
        p = Probe(c.nodes["n1"])
        await p.setup()
        c.net.delay("n1", "n2", 2.0)
        first = await p.do(m.QueueDeclare, "far", True, False, False, False, {}, wait=False)
        second = await p.do(m.BasicQos, 10, False, wait=False)  # answered here, at once
        await p.answer(second)
        replies = [x.rid for x in p.of(m.Reply) if x.rid in (first, second)]
        assert replies == [first, second]


async def test_recover_and_flow(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p = Probe(c.nodes["n1"])
        await p.setup()
        await p.do(m.QueueDeclare, "rq", False, True, False, False, {})
        await p.s.handle(m.Publish(1, "rq", [b"1", b"2"], None))
        r = await p.do(m.BasicConsume, "rq", "t", False, False, {})
        assert r.value == "t"
        await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) == 2)
        r = await p.do(m.BasicRecover, True)
        assert type(r) is m.Reply
        await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) == 4)
        again = p.of(m.Deliver)[-1]
        assert again.redelivered and again.first_tag >= 3
        r = await p.do(m.ChannelFlow, False)
        assert r.value is False
        await p.s.handle(m.Ack(1, [], -1))  # everything: the queue delivers nothing more...
        await p.s.handle(m.Publish(1, "rq", [b"3"], None))
        await trio.sleep(1)
        assert sum(len(d.bodies) for d in p.of(m.Deliver)) == 4  # ...held while the flow is off
        r = await p.do(m.ChannelFlow, True)
        await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) == 5)
        with pytest.raises(ProtocolError) as e:  # a connection error, as in RabbitMQ
            await p.do(m.BasicRecover, False)
        assert e.value.code == 540


async def test_limits_through_the_session(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p = Probe(c.nodes["n1"])
        await p.setup()
        r = await p.do(m.QueueDeclare, "capped", False, True, False, False, {"x-max-length": 2})
        assert type(r) is m.Reply
        await p.s.handle(m.Publish(1, "capped", [b"1", b"2", b"3", b"4", b"5"], None))
        await trio.sleep(0.5)
        r = await p.do(m.BasicGet, "capped", True)
        assert r.value[1] == b"4"  # drop-head: the oldest went
        await p.do(m.QueueDeclare, "ttl", False, True, False, False, {"x-message-ttl": 1000})
        await p.s.handle(m.Publish(1, "ttl", [b"old"], None))
        await trio.sleep(1.5)
        await p.s.handle(m.Publish(1, "ttl", [b"new"], None))
        r = await p.do(m.BasicGet, "ttl", True)
        assert r.value[1] == b"new" and r.value[4] == 0
        r = await p.do(m.QueueDeclare, "bad", False, True, False, False, {"x-expires": 0})
        assert type(r) is m.Fail and r.code == 406
        assert r.text == "invalid arg 'x-expires' for queue 'bad' in vhost '/': {value_zero,0}"
        await p.setup(2)
        r = await p.do(m.QueueDeclare, "short-lived", False, False, False, False, {"x-expires": 2000}, ch=2)
        assert type(r) is m.Reply, r
        assert "short-lived" in c.nodes["n1"].md.queues
        await trio.sleep(3)
        assert "short-lived" not in c.nodes["n1"].md.queues


async def test_headers_exchange_routes_each_message_by_its_headers(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        p = Probe(c.nodes["n3"])
        await p.setup()
        for q in ("red", "any"):
            await p.do(m.QueueDeclare, q, False, True, False, False, {})
        await p.do(m.QueueBind, "red", "amq.headers", "", {"x-match": "all", "colour": "red"})
        await p.do(m.QueueBind, "any", "amq.headers", "", {"x-match": "any", "colour": "red", "size": 1})
        await p.s.handle(m.PublishTo(1, "amq.headers", "", False, [b"a", b"b", b"c"],
                                     [{"headers": {"colour": "red"}}, {"headers": {"size": 1}}, None]))
        await trio.sleep(0.5)
        r = await p.do(m.QueueDeclare, "red", True, True, False, False, {})
        assert r.value[1] == 1
        r = await p.do(m.QueueDeclare, "any", True, True, False, False, {})
        assert r.value[1] == 2


async def test_deliveries_of_an_ended_leader_epoch_never_reach_the_client(tmp_path, autojump_clock):
    """A cut link that heals hands over what it held: deliveries the queue's leader sent before
    its epoch ended can arrive after the session moved on to the new epoch (a chaos partition of
    the leader's node showed them as repeats without `redelivered`). The session drops them and
    gives them back, so the leader delivers them again, flagged."""
    async with sim_cluster(tmp_path) as c:
        owner, p = Probe(c.nodes["n1"]), Probe(c.nodes["n2"])
        await owner.setup()
        await p.setup()
        await owner.do(m.QueueDeclare, "eq", False, True, False, False, {})
        await p.until(lambda: "eq" in c.nodes["n2"].md.queues)
        assert c.nodes["n2"].md.queues["eq"]["leader"] == "n1"  # deliveries cross a link
        await p.s.handle(m.Publish(1, "eq", [b"a", b"b"], None))
        assert (await p.do(m.BasicConsume, "eq", "t", False, False, {})).value == "t"
        await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) == 2)
        first = p.of(m.Deliver)[0]
        assert not first.redelivered
        epoch = p.s.core.routes["eq"][1]
        ids = sorted(i for q, i in p.s.core.channels[1].tags.values() if q == "eq")
        assert len(ids) == 2
        # the same two messages, as a leader of the epoch before would have sent them
        p.s.core.queue_events([m.EvDeliver(1, "t", "eq", ids, [b"a", b"b"], [], None, epoch - 1)])
        # never shown to the client as such; given back, and delivered again with the flag
        await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) == 4)
        again = p.of(m.Deliver)[1:]
        assert [b for d in again for b in d.bodies] == [b"a", b"b"]
        assert all(len(d.redelivered) == len(d.bodies) for d in again), again
        await trio.sleep(1)
        assert sum(len(d.bodies) for d in p.of(m.Deliver)) == 4
        # deliveries of the current epoch are shown as ever
        await p.s.handle(m.Publish(1, "eq", [b"c"], None))
        await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) == 5)
        assert p.of(m.Deliver)[-1].bodies == [b"c"] and not p.of(m.Deliver)[-1].redelivered


async def test_a_second_link_that_replaces_the_first_gives_back_what_was_in_flight(tmp_path, autojump_clock):
    """Two nodes that dial each other at once end up with two links; the one dialed by the
    smaller name replaces the other, and whatever was in flight on the first may be lost (chaos
    seed 20032: a consumer's prefetch of deliveries vanished and 500 messages waited for it).
    The queue's leader gives back what that node's sessions had not acknowledged, flagged, and
    the sessions register their consumers again over the new link."""
    from broker.framed import FramedStream
    from broker.peers import dial_handshake
    from broker.simulation import PEER_PORT

    async with sim_cluster(tmp_path) as c:
        n1, n2 = c.nodes["n1"], c.nodes["n2"]
        owner, p = Probe(n1), Probe(n2)
        await owner.setup()
        await p.setup()
        await owner.do(m.QueueDeclare, "lq", False, True, False, False, {})
        await p.until(lambda: "lq" in n2.md.queues)
        await p.do(m.BasicQos, 5, False)
        assert (await p.do(m.BasicConsume, "lq", "t", False, False, {})).value == "t"
        await owner.s.handle(m.Publish(1, "lq", [b"%d" % i for i in range(20)], None))
        await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) == 5)
        first = [b for d in p.of(m.Deliver) for b in d.bodies]
        # the link n1-n2 was dialed by n2 (it joined through n1); one dialed by n1 replaces it
        assert n1.cluster.links["n2"].dialer == "n2"
        stream = await n1.network.connect("n2", PEER_PORT)
        framed = FramedStream(stream)
        assert await dial_handshake(framed, "n1", n1.config.secret, "peer") == "n2"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(n1.cluster.run_link, "n2", framed, "n1")
            # the five n2's consumer held come again, flagged, over the new link
            await p.until(lambda: sum(len(d.bodies) for d in p.of(m.Deliver)) >= 10)
            assert n1.cluster.links["n2"].dialer == "n1"
            again = [d for d in p.of(m.Deliver)][len(p.of(m.Deliver)) - 1:]
            redelivered = [b for d in p.of(m.Deliver)[1:] for i, b in enumerate(d.bodies) if i in d.redelivered]
            assert sorted(redelivered) == sorted(first), (first, redelivered, again)
            nursery.cancel_scope.cancel()


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
    bindings {exchange: [[queue, key, args]]}; what the core sends a leader lands in `sent`."""

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

    def route(self, exchange, key, headers=None):
        if not exchange:
            return [key] if key in self.queues else []
        return [q for q, k, _ in self.bindings.get(exchange, ()) if k == key]

    def linked(self, node):
        return node == self.name or node in self.links

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
                end_input=print, wait_link_room=print)
    node = NS(name="n1", log=_Log(), queue_down_reason=print, router=router, leaving=False,
              cluster=NS(md=None, links={}), routing={})
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
    assert type(action) is Propose and action.change[0] == "exchange.declare"
    host.exchanges["ex"] = {"type": "direct", "internal": False}
    # a bind asked meanwhile is answered at once (already bound), but after the declare
    host.bindings["ex"] = [["q", "k", {}]]
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
    assert host.proposed[0][0] == "exchange.declare" and out.pop() == m.Reply(2, None)
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
