"""The sans-IO AMQP connection (broker/amqp/protocol.py), driven with frames pamqp encodes, no
socket: the handshake, connection and channel errors, content assembly, batching, the reply of
every request, confirms, heartbeats and closing."""

from __future__ import annotations

import pytest
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame, header

from broker.amqp import codec
from broker.amqp import protocol as P
from wire import messages as m
from wire.errors import ACCESS_REFUSED, ProtocolError


def login(mech, user, password):
    if (user, password) != ("guest", "guest"):
        raise ProtocolError(ACCESS_REFUSED, f"login refused for user '{user}'")


def parse(data: bytes) -> list:
    """The server's bytes as (channel, pamqp object) pairs."""
    out = []
    if data.startswith(b"AMQP"):
        out.append((0, data[:8]))
        data = data[8:]
    for kind, ch, payload in codec.FrameReader(1 << 20).feed(data):
        whole = codec.FRAME_HEAD.pack(kind, ch, len(payload)) + payload + codec.FRAME_END_CHAR
        out.append((ch, frame.unmarshal(whole)[2]))
    return out


def f(method, ch=0) -> bytes:
    return frame.marshal(method, ch)


def content(ch, body: bytes, props=None, frame_max=131072) -> bytes:
    out = f(header.ContentHeader(0, len(body), props or C.Basic.Properties()), ch)
    room = frame_max - 8
    for i in range(0, len(body), room):
        out += f(pbody.ContentBody(body[i:i + room]), ch)
    return out


def plain(user="guest", password="guest") -> str:
    return f"\0{user}\0{password}"


class Client:
    """A protocol under test and what it said."""

    def __init__(self, capabilities=None, heartbeat=0, frame_max=131072, **kw):
        self.p = P.AmqpProtocol(authenticate=login, node="n1", cluster="c", **kw)
        self.caps = {"authentication_failure_close": True, "consumer_cancel_notify": True,
                     "connection.blocked": True} if capabilities is None else capabilities
        self.heartbeat = heartbeat
        self.frame_max = frame_max
        self.now = 0.0

    def send(self, data: bytes) -> list:
        return self.p.receive_data(data, self.now)

    def said(self) -> list:
        return parse(self.p.data_to_send(self.now))

    def open(self, mechanism="PLAIN", response=None) -> list:
        self.send(codec.PROTOCOL_HEADER)
        start = self.said()
        assert isinstance(start[0][1], C.Connection.Start)
        self.send(f(C.Connection.StartOk({"capabilities": self.caps, "product": "test"},
                                         mechanism, response or plain())))
        tune = self.said()
        if not tune or not isinstance(tune[0][1], C.Connection.Tune):
            return tune
        self.send(f(C.Connection.TuneOk(0, self.frame_max, self.heartbeat)))
        events = self.send(f(C.Connection.Open("/")))
        assert isinstance(self.said()[0][1], C.Connection.OpenOk)
        return events

    def channel(self, ch=1) -> int:
        (cmd,) = self.send(f(C.Channel.Open(), ch))
        assert isinstance(cmd, m.ChannelOpen)
        self.p.send_output(m.Reply(cmd.rid, None))
        assert isinstance(self.said()[0][1], C.Channel.OpenOk)
        return ch


def test_wrong_protocol_header_gets_ours_back_and_the_connection_ends():
    c = Client()
    events = c.send(b"AMQP\x01\x01\x00\x09")
    assert c.p.data_to_send(0) == b"AMQP\x00\x00\x09\x01"
    assert [type(e) for e in events] == [P.Closed]
    c = Client()
    assert c.send(b"GET / HT") and c.p.state is P.State.CLOSED


def test_start_advertises_the_capabilities_and_mechanisms():
    c = Client()
    c.send(codec.PROTOCOL_HEADER)
    (_, start), = c.said()
    caps = start.server_properties["capabilities"]
    for cap in ("publisher_confirms", "consumer_cancel_notify", "basic.nack", "connection.blocked",
                "authentication_failure_close", "per_consumer_qos"):
        assert caps[cap] is True
    assert caps["exchange_exchange_bindings"] is False
    assert start.mechanisms == "PLAIN AMQPLAIN" and (start.version_major, start.version_minor) == (0, 9)


def test_plain_and_amqplain_logins():
    events = Client().open()
    assert [type(e) for e in events] == [P.LoggedIn] and events[0].user == "guest"
    from pamqp import encode
    # AMQPLAIN's response is a field table without its length (ASCII here, so a str for pamqp)
    response = encode.field_table({"LOGIN": "guest", "PASSWORD": "guest"})[4:].decode("ascii")
    events = Client().open("AMQPLAIN", response)
    assert events[0].user == "guest"


def test_refused_login_closes_with_access_refused_or_just_closes_old_clients():
    c = Client()
    out = c.open(response=plain("guest", "nope"))
    (_, close), = out
    assert isinstance(close, C.Connection.Close) and close.reply_code == 403
    assert close.reply_text.startswith("ACCESS_REFUSED - Login was refused using authentication "
                                       "mechanism PLAIN")
    c = Client(capabilities={})
    assert c.open(response=plain("guest", "nope")) == []
    assert c.p.state is P.State.CLOSED
    c = Client()
    (_, close), = c.open(mechanism="EXTERNAL")
    assert close.reply_code == 503 and "unknown authentication mechanism 'EXTERNAL'" in close.reply_text


def test_an_unknown_vhost_is_not_allowed_and_named():
    c = Client(has_vhost=lambda name: name in ("/", "qa"))
    c.send(codec.PROTOCOL_HEADER)
    c.send(f(C.Connection.StartOk({}, "PLAIN", plain())))
    c.send(f(C.Connection.TuneOk(0, 131072, 0)))
    c.said()
    c.send(f(C.Connection.Open("prod")))
    (_, close), = c.said()
    assert (close.reply_code, close.reply_text) == (530, "NOT_ALLOWED - vhost prod not found")


def test_a_known_vhost_opens_and_the_session_is_in_it():
    c = Client(has_vhost=lambda name: name in ("/", "qa"))
    c.send(codec.PROTOCOL_HEADER)
    c.send(f(C.Connection.StartOk({}, "PLAIN", plain())))
    c.send(f(C.Connection.TuneOk(0, 131072, 0)))
    c.said()
    events = c.send(f(C.Connection.Open("qa")))
    assert isinstance(c.said()[0][1], C.Connection.OpenOk)
    assert [e.vhost for e in events if isinstance(e, P.LoggedIn)] == ["qa"]


def test_a_paused_node_refuses_to_open():
    c = Client(can_open=lambda: "node n1 cannot reach a majority of the cluster (pause_minority)")
    c.send(codec.PROTOCOL_HEADER)
    c.send(f(C.Connection.StartOk({}, "PLAIN", plain())))
    c.send(f(C.Connection.TuneOk(0, 131072, 0)))
    c.said()
    c.send(f(C.Connection.Open("/")))
    (_, close), = c.said()
    assert close.reply_code == 320 and "pause_minority" in close.reply_text


@pytest.mark.parametrize("frame_max, channel_max, text", [
    (1024, 0, "frame_max=1024 < 4096 min size"),
    (1 << 20, 0, "frame_max=1048576 > 131072 max size"),
    (4096, 5000, "channel_max=5000 > 2047 max channels"),
])
def test_tune_ok_out_of_bounds(frame_max, channel_max, text):
    c = Client()
    c.send(codec.PROTOCOL_HEADER)
    c.send(f(C.Connection.StartOk({}, "PLAIN", plain())))
    c.said()
    c.send(f(C.Connection.TuneOk(channel_max, frame_max, 0)))
    (_, close), = c.said()
    assert close.reply_code == 530 and text in close.reply_text


def test_connection_errors_close_the_connection_and_only_close_ok_is_read():
    cases = [
        (f(C.Basic.Qos(0, 1, False), 1), 504, "expected 'channel.open' on channel 1"),
        (b"\x01\x00\x00\x00\x00\x00\x04\x00\x99\x00\x07\xce", 503, "unknown method (class 153 method 7)"),
        (b"\x09\x00\x00\x00\x00\x00\x00\xce", 501, "unknown frame type 9"),
        (b"\x08\x00\x01\x00\x00\x00\x00\xce", 501, "heartbeat frame on channel 1"),
        (content(1, b"x"), 504, "content frame on channel 1, which is not open"),
        (b"\x01\x00\x00\x00\x02\x00\x00\x00\xce", 501, "larger than frame_max"),
        (f(C.Basic.Deliver("t", 1, False, "", "q"), 0), 503, "'basic.deliver' is not allowed on channel 0"),
        (f(C.Channel.Open(), 3000), 504, "channel 3000 is above the negotiated channel_max 2047"),
    ]
    for data, code, text in cases:
        c = Client()
        c.open()
        events = c.send(data)
        assert [type(e) for e in events] == [P.ConnectionFailed], text
        (_, close), = c.said()
        assert close.reply_code == code and text in close.reply_text, (close.reply_text, text)
        assert c.p.state is P.State.CLOSING
        assert c.send(f(C.Channel.Open(), 1)) == []  # discarded while closing
        events = c.send(f(C.Connection.CloseOk()))
        assert [type(e) for e in events] == [P.Closed]


def test_oversized_frame_after_tune():
    c = Client(frame_max=4096)
    c.open()
    c.channel()
    c.send(f(C.Basic.Publish(0, "", "q"), 1) + f(header.ContentHeader(0, 5000, C.Basic.Properties()), 1)
           + f(pbody.ContentBody(b"x" * 5000), 1))
    (_, close), = c.said()
    assert close.reply_code == 501 and "larger than frame_max 4096" in close.reply_text


def test_content_out_of_order_is_unexpected():
    for data, text in (
        (content(1, b"x"), "with no basic.publish before it"),
        (f(C.Basic.Publish(0, "", "q"), 1) + f(pbody.ContentBody(b"x"), 1), "before its content header"),
        (f(C.Basic.Publish(0, "", "q"), 1) + f(C.Basic.Qos(0, 1, False), 1), "expected content header"),
        (f(C.Basic.Publish(0, "", "q"), 1) + content(1, b"x")[:-0 or None].replace(b"x\xce", b"xy\xce")
         .replace(b"\x00\x00\x00\x01x", b"\x00\x00\x00\x02x"), "longer than the 1 bytes"),
    ):
        c = Client()
        c.open()
        c.channel()
        c.send(data)
        (_, close), = c.said()
        assert close.reply_code in (505, 501) and text in close.reply_text, close.reply_text


def test_publishes_batch_per_channel_exchange_and_key():
    c = Client()
    c.open()
    c.channel(1)
    c.channel(2)
    props = C.Basic.Properties(content_type="text/plain", headers={"a": 1})
    data = b""
    for i in range(3):
        data += f(C.Basic.Publish(0, "", "q"), 1) + content(1, b"m%d" % i)
    data += f(C.Basic.Publish(0, "x", "k", True), 1) + content(1, b"big" * 50000, props)
    data += f(C.Basic.Publish(0, "x", "k", True), 2) + content(2, b"")
    events = c.send(data)
    a, b, d = events
    assert isinstance(a, m.PublishTo) and a.bodies == [b"m0", b"m1", b"m2"] and a.props is None
    assert (b.exchange, b.routing_key, b.mandatory, b.bodies[0]) == ("x", "k", True, b"big" * 50000)
    assert b.props[0][:2] == ["x", "k"] and b.props[0][2] == props.marshal()
    assert d.ch == 2 and d.bodies == [b""]


def test_a_mandatory_flag_is_kept_in_a_read_that_mixes_it_with_plain_publishes():
    """Publishes to one exchange and key in one read, some mandatory: each message keeps its own
    flag (a mixed run splits where the flag changes); a run with one flag stays one batch."""
    c = Client()
    c.open()
    c.channel(1)
    flags = [False, True, True, False, True]
    data = b""
    for i, mandatory in enumerate(flags):
        data += f(C.Basic.Publish(0, "amq.direct", "nowhere", mandatory), 1) + content(1, b"%d" % i)
    events = c.send(data)
    assert [(e[3], e[4]) for e in _flat(events)] == [(fl, b"%d" % i) for i, fl in enumerate(flags)]
    assert [(e.mandatory, len(e.bodies)) for e in events] == [(False, 1), (True, 2), (False, 1), (True, 1)]
    for same in (False, True):
        data = b"".join(f(C.Basic.Publish(0, "amq.direct", "nowhere", same), 1) + content(1, b"m")
                        for _ in range(4))
        (one,) = c.send(data)
        assert one.mandatory is same and one.bodies == [b"m"] * 4


def test_publishes_asking_for_direct_reply_to_travel_in_batches_of_their_own():
    """A message whose reply_to is amq.rabbitmq.reply-to is flagged for the session (which
    rewrites it); it splits a run of plain publishes, its neighbours stay unflagged."""
    c = Client()
    c.open()
    c.channel(1)
    ask = C.Basic.Properties(reply_to="amq.rabbitmq.reply-to", correlation_id="1")
    other = C.Basic.Properties(reply_to="my-queue")
    data = b"".join(f(C.Basic.Publish(0, "", "rpc"), 1) + content(1, b"%d" % i, p)
                    for i, p in enumerate([other, ask, ask, None]))
    events = c.send(data)
    assert [(e.reply, len(e.bodies)) for e in events] == [(False, 1), (True, 2), (False, 1)]
    assert events[1].props[0][2] == ask.marshal()  # as published: the session rewrites it


def test_acks_batch_and_multiple_zero_means_everything():
    c = Client()
    c.open()
    c.channel()
    events = c.send(f(C.Basic.Ack(1), 1) + f(C.Basic.Ack(2), 1) + f(C.Basic.Ack(5, True), 1)
                    + f(C.Basic.Reject(7, True), 1) + f(C.Basic.Nack(0, True, False), 1))
    assert events == [m.Ack(1, [1, 2], 5), m.Nack(1, [7], 0, True), m.Nack(1, [], -1, False)]


def test_user_id_must_be_the_connections_user():
    c = Client()
    c.open()
    c.channel()
    events = c.send(f(C.Basic.Publish(0, "", "q"), 1) + content(1, b"x", C.Basic.Properties(user_id="bob"))
                    + f(C.Basic.Publish(0, "", "q"), 1) + content(1, b"y"))
    assert events == [P.ChannelFailed(1, 406, "user_id property set to 'bob' but authenticated "
                                              "user was 'guest'")]
    c.p.send_output(m.Fail(0, 1, 406, events[0].text))
    (_, close), = c.said()
    assert isinstance(close, C.Channel.Close) and close.reply_code == 406
    assert close.reply_text == "PRECONDITION_FAILED - user_id property set to 'bob' but authenticated user was 'guest'"
    ok = c.send(f(C.Basic.Publish(0, "", "q"), 1) + content(1, b"x", C.Basic.Properties(user_id="guest")))
    assert ok == []  # the channel is closed: discarded until close-ok
    c.send(f(C.Channel.CloseOk(), 1))
    c.channel(1)  # the channel number is free again
    (pub,) = c.send(f(C.Basic.Publish(0, "", "q"), 1) + content(1, b"x", C.Basic.Properties(user_id="guest")))
    assert pub.bodies == [b"x"]


def test_replies_become_their_ok_methods_and_nowait_suppresses_them():
    c = Client()
    c.open()
    c.channel()
    (d,) = c.send(f(C.Queue.Declare(0, "", False, False, True, True, False, {"x-expires": 1000}), 1))
    assert isinstance(d, m.QueueDeclare) and d.exclusive and d.arguments == {"x-expires": 1000}
    c.p.send_output(m.Reply(d.rid, ["amq.gen-1", 0, 0]))
    (_, ok), = c.said()
    assert isinstance(ok, C.Queue.DeclareOk) and ok.queue == "amq.gen-1"
    (b,) = c.send(f(C.Queue.Bind(0, "", "amq.fanout", "", True), 1))
    c.p.send_output(m.Reply(b.rid, None))
    assert c.said() == []  # nowait
    (cons,) = c.send(f(C.Basic.Consume(0, "", "", False, False, False, False, {"x-cancel-on-ha-failover": True}), 1))
    assert cons.queue == "" and cons.arguments == {"x-cancel-on-ha-failover": True}
    c.p.send_output(m.Reply(cons.rid, "ctag"))
    (_, cok), = c.said()
    assert cok.consumer_tag == "ctag"
    # deliveries name the queue for messages published without exchange (warren's own client)
    c.p.send_output(m.Deliver(1, "ctag", 1, [b"a", b"b"], [1], [None, ["x", "k", b"\x00\x00"]], None))
    frames = [o for _, o in c.said()]
    assert [type(o) for o in frames] == [C.Basic.Deliver, header.ContentHeader, pbody.ContentBody] * 2
    assert (frames[0].routing_key, frames[0].exchange, frames[0].redelivered) == ("amq.gen-1", "", False)
    assert (frames[3].routing_key, frames[3].exchange, frames[3].redelivered) == ("k", "x", True)
    (g,) = c.send(f(C.Basic.Get(0, "", True), 1))
    c.p.send_output(m.Reply(g.rid, None))
    assert isinstance(c.said()[0][1], C.Basic.GetEmpty)
    (g,) = c.send(f(C.Basic.Get(0, "", True), 1))
    c.p.send_output(m.Reply(g.rid, [3, b"body", True, {"content_type": "a/b"}, 4]))
    getok, hdr, body = [o for _, o in c.said()]
    assert (getok.delivery_tag, getok.redelivered, getok.message_count, getok.routing_key) == (3, True, 4, "amq.gen-1")
    assert hdr.properties.content_type == "a/b" and body.value == b"body"
    # a server-sent cancel, to a client that understands it
    c.p.send_output(m.Cancelled(1, "ctag", "queue deleted"))
    (_, cancel), = c.said()
    assert isinstance(cancel, C.Basic.Cancel) and cancel.consumer_tag == "ctag"


def test_a_failed_request_closes_its_channel_with_its_class_and_method():
    c = Client()
    c.open()
    c.channel()
    (d,) = c.send(f(C.Queue.Declare(0, "q", True), 1))
    c.p.send_output(m.Fail(d.rid, 1, 404, "no queue 'q' in vhost '/'"))
    (_, close), = c.said()
    assert (close.reply_code, close.class_id, close.method_id) == (404, 50, 10)
    assert close.reply_text == "NOT_FOUND - no queue 'q' in vhost '/'"


def test_confirms_use_multiple_only_when_nothing_below_is_unconfirmed():
    c = Client()
    c.open()
    c.channel()
    c.send(f(C.Confirm.Select(), 1))
    c.p.send_output(m.Confirm(1, [[3, 4]], [], ""))  # 1 and 2 still out: one by one
    c.p.send_output(m.Confirm(1, [[1, 2]], [[5, 5]], "full"))
    c.p.send_output(m.Confirm(1, [[6, 9]], [], ""))
    got = [(type(o).__name__, o.delivery_tag, o.multiple) for _, o in c.said()]
    assert got == [("Ack", 3, False), ("Ack", 4, False), ("Ack", 2, True), ("Nack", 5, False),
                   ("Ack", 9, True)]


def test_heartbeats_are_sent_and_checked():
    c = Client(heartbeat=10)
    c.open()
    assert c.p.next_deadline() == 5.0
    c.now = 5.0
    assert c.p.tick(5.0) == []
    assert c.p.data_to_send(5.0) == codec.HEARTBEAT_FRAME
    c.now = 15.0
    c.send(codec.HEARTBEAT_FRAME)  # the client's heartbeat keeps it alive
    assert c.p.tick(30.0) == []
    events = c.p.tick(35.5)
    assert [type(e) for e in events] == [P.ConnectionFailed, P.Closed]
    assert "missed heartbeats from client, timeout: 10s" in events[0].text


def test_close_both_ways():
    c = Client()
    c.open()
    events = c.send(f(C.Connection.Close(200, "bye", 0, 0)))
    assert [type(e) for e in events] == [P.Closed]
    assert isinstance(c.said()[0][1], C.Connection.CloseOk)
    c = Client()
    c.open()
    c.p.close(320, "node n1 is stopping", 0.0)
    (_, close), = c.said()
    assert close.reply_code == 320 and close.reply_text == "CONNECTION_FORCED - node n1 is stopping"
    assert [type(e) for e in c.p.tick(10.0)] == [P.Closed]  # no close-ok in time


def test_blocked_and_unblocked_only_for_clients_that_said_so():
    c = Client()
    c.open()
    c.p.send_blocked(True, "credit")
    c.p.send_blocked(True, "credit")
    c.p.send_blocked(False)
    assert [type(o) for _, o in c.said()] == [C.Connection.Blocked, C.Connection.Unblocked]
    c = Client(capabilities={})
    c.open()
    c.p.send_blocked(True, "credit")
    assert c.said() == []


def test_unsupported_methods():
    for method, code, text in (
        (C.Basic.Publish(0, "", "q", False, True), 540, "immediate=true"),
        (C.Basic.Qos(10, 0, False), 540, "prefetch_size!=0 (10)"),
    ):
        c = Client()
        c.open()
        c.channel()
        c.send(f(method, 1))
        (_, close), = c.said()
        assert close.reply_code == code and text in close.reply_text


def test_exchange_bind_and_unbind_become_session_commands():
    c = Client()
    c.open()
    c.channel()
    (bind,) = c.send(f(C.Exchange.Bind(0, "down", "up", "k", False, {"x": 1}), 1))
    assert (type(bind), bind.destination, bind.source, bind.routing_key, bind.arguments) == \
        (m.ExchangeBind, "down", "up", "k", {"x": 1})
    (unbind,) = c.send(f(C.Exchange.Unbind(0, "down", "up", "k"), 1))
    assert type(unbind) is m.ExchangeUnbind and unbind.source == "up"


def _flat(events) -> list:
    """The messages of PublishTo events, one by one: how reads are cut changes the batches only."""
    return [(e.ch, e.exchange, e.routing_key, e.mandatory, body, None if e.props is None else e.props[i])
            for e in events if isinstance(e, m.PublishTo) for i, body in enumerate(e.bodies)]


@pytest.mark.parametrize("seed", range(12))
def test_reads_cut_anywhere_give_the_same_messages(seed):
    """The same stream of publishes (small, empty, with properties, one larger than a frame, on
    two channels) read whole and read in random pieces, down to single bytes: the same messages
    in the same order."""
    import random
    rng = random.Random(seed)
    props = C.Basic.Properties(content_type="text/plain", headers={"a": 1})
    stream = b""
    for i in range(40):
        ch = rng.choice([1, 1, 2])
        size = rng.choice([0, 1, 10, 1024, 5000])
        stream += f(C.Basic.Publish(0, rng.choice(["", "x"]), "q%d" % (i % 3)), ch)
        stream += content(ch, bytes([i]) * size, props if i % 5 == 0 else None, frame_max=4096)
    whole, cut = Client(frame_max=4096), Client(frame_max=4096)
    for c in (whole, cut):
        c.open()
        c.channel(1)
        c.channel(2)
    want = _flat(whole.send(stream))
    assert len(want) == 40
    got, pos = [], 0
    while pos < len(stream):
        n = rng.choice([1, 2, 3, 6, 7, 8, 100, 1500, 4096, 9000])
        got += _flat(cut.send(stream[pos:pos + n]))
        pos += n
    assert got == want
    assert not cut.said()  # no error


def test_a_frame_above_frame_max_is_refused_when_its_head_is_in_even_across_reads():
    c = Client(frame_max=4096)
    c.open()
    c.channel()
    c.send(f(C.Basic.Publish(0, "", "q"), 1) + f(header.ContentHeader(0, 5000, C.Basic.Properties()), 1))
    body = f(pbody.ContentBody(b"x" * 5000), 1)
    assert c.send(body[:3]) == [] and not c.said()  # not even the frame's head yet
    c.send(body[3:100])
    (_, close), = c.said()
    assert close.reply_code == 501 and "larger than frame_max 4096" in close.reply_text
