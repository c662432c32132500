"""broker/native.py's NativeProtocol without a socket (bytes in, commands and events out;
session outputs in, frames out), and the connection driver (broker/connection.py) closing a
native connection from the server's side without polling."""

from __future__ import annotations

import pytest
import trio

from broker.client.errors import ConnectionClosedByBroker
from broker.framed import encode_many
from broker.frontend import ChannelFailed, Closed, ConnectionFailed, LoggedIn
from broker.native import NativeProtocol
from broker.simulation import sim_cluster
from wire import messages as m
from wire.errors import ProtocolError
from wire.frames import FrameDecoder
from wire.props import NO_PROPS, dict_to_raw
from wire.schema import decode_bytes

MAX = 1 << 20


def protocol(refusal="") -> NativeProtocol:
    def authenticate(user, password):
        if password != "secret":
            raise ProtocolError(403, f"login refused for user '{user}'")
    return NativeProtocol(authenticate=authenticate, can_open=lambda: refusal,
                          welcome=lambda: m.Welcome("n1", "warren", MAX),
                          hello=m.Hello(m.PROTOCOL_VERSION, "n1", b"nonce", MAX), max_frame=MAX)


def frames(*msgs) -> bytes:
    return encode_many(msgs, MAX)


def sent(p: NativeProtocol) -> list:
    parts = p.take_output(0.0)
    return FrameDecoder(MAX, decode_bytes).feed(b"".join(parts)) if parts else []


def auth(password="secret") -> m.ClientAuth:
    return m.ClientAuth(m.PROTOCOL_VERSION, "guest", password, "probe", "/")


def test_the_server_speaks_first_and_a_login_opens_the_session_with_what_came_with_it():
    p = protocol()
    assert p.handshaking and [type(x) for x in sent(p)] == [m.Hello]
    events = p.receive_data(frames(auth(), m.ChannelOpen(1, 1), m.Publish(1, "q", [b"x"], None)), 0.0)
    assert events[0] == LoggedIn("guest", {"connection_name": "probe"})
    assert events[1:] == [m.ChannelOpen(1, 1), m.Publish(1, "q", [b"x"], None)]
    assert p.opened and [type(x) for x in sent(p)] == [m.Welcome]


def test_a_login_names_its_vhost_and_an_unknown_one_is_not_allowed():
    def opened(vhost):
        p = NativeProtocol(authenticate=lambda user, password: None, can_open=lambda: "",
                           has_vhost=lambda name: name in ("/", "qa"),
                           welcome=lambda: m.Welcome("n1", "warren", MAX),
                           hello=m.Hello(m.PROTOCOL_VERSION, "n1", b"nonce", MAX), max_frame=MAX)
        sent(p)
        return p, p.receive_data(frames(m.ClientAuth(m.PROTOCOL_VERSION, "u", "p", "c", vhost)), 0.0)
    p, events = opened("qa")
    assert events == [LoggedIn("u", {"connection_name": "c"}, "qa")]
    p, events = opened("prod")
    assert [type(e) for e in events] == [ConnectionFailed, Closed]
    (error,) = sent(p)
    assert (error.code, error.text) == (530, "vhost prod not found")


@pytest.mark.parametrize("first, refusal, code", [
    (auth("wrong"), "", 403),
    (auth(), "the node is paused", 320),
    (m.ChannelOpen(1, 1), "", 505),
    (m.ClientAuth(m.PROTOCOL_VERSION + 1, "guest", "secret", "probe", "/"), "", None),
])
def test_a_refused_handshake_says_why_and_ends(first, refusal, code):
    p = protocol(refusal)
    sent(p)
    events = p.receive_data(frames(first, m.ChannelOpen(1, 1)), 0.0)
    assert [type(e) for e in events] == [ConnectionFailed, Closed]
    (error,) = sent(p)
    assert type(error) is m.Error and (code is None or error.code == code)
    assert p.closed and p.receive_data(frames(m.ChannelOpen(2, 2)), 0.0) == []


def test_a_frame_a_client_may_not_send_spoils_its_whole_read():
    p = protocol()
    p.receive_data(frames(auth()), 0.0)
    sent(p)
    events = p.receive_data(frames(m.ChannelOpen(1, 1), m.Welcome("x", "y", 1)), 0.0)
    assert [type(e) for e in events] == [ConnectionFailed, Closed]  # not the channel.open
    assert [(type(x), x.code) for x in sent(p)] == [(m.Error, 505)]


def test_outputs_as_warren_clients_read_them_and_holds_told_only_for_memory():
    p = protocol()
    p.receive_data(frames(auth()), 0.0)
    sent(p)
    amqp_item = ["logs", "error", dict_to_raw({"content_type": "text/plain"})]
    p.send_output(m.Returned(1, 312, "NO_ROUTE", "ex", "k", [b"x"], [amqp_item]))
    p.send_blocked(True, "credit")  # credit flow holds the client untold
    p.send_blocked(True, "memory alarm", source="memory")
    p.send_output(m.Reply(5, None))
    p.send_output(m.Deliver(1, "ctag", 1, [b"a", b"b"], [], [None, amqp_item], None))
    p.send_output(m.Deliver(1, "ctag", 3, [b"c"], [], [{"type": "t"}], None))  # warren's client's own
    p.send_output(m.Reply(6, [7, b"d", False, amqp_item, 0]))  # a basic.get answer
    plain = {"content_type": "text/plain"}
    assert sent(p) == [m.Returned(1, 312, "NO_ROUTE", "ex", "k", [b"x"], [plain]),
                       m.Blocked("memory alarm"), m.Reply(5, None),
                       m.Deliver(1, "ctag", 1, [b"a", b"b"], [], [None, plain], [None, ["logs", "error"]]),
                       m.Deliver(1, "ctag", 3, [b"c"], [], [{"type": "t"}], None),
                       m.Reply(6, [7, b"d", False, plain, 0, ["logs", "error"]])]
    p.client_closed(0.0)
    p.send_output(m.Reply(6, None))
    assert p.closed and sent(p) == []


def test_a_publish_to_an_exchange_goes_to_the_session_as_an_amqp_publish_would():
    """Each message's properties in AMQP's form with its exchange and routing key, its TTL and
    direct reply-to request read here from the properties (not taken from the client), runs of
    equal ones as one batch; a bad expiration, or a user_id not the user's (on any publish), fails
    the channel with RabbitMQ's text; properties that are not a map close the connection."""
    p = protocol()
    p.receive_data(frames(auth()), 0.0)
    sent(p)
    props = [None, {"expiration": "500"}, {"expiration": 500, "type": "t"},
             {"reply_to": "amq.rabbitmq.reply-to"}]
    sneaky = m.PublishTo(1, "logs", "k", True, [b"a", b"b", b"c", b"d"], props, 7, True)
    out = p.receive_data(frames(sneaky), 0.0)
    raw = dict_to_raw
    assert out == [
        m.PublishTo(1, "logs", "k", True, [b"a"], [["logs", "k", NO_PROPS]], None, False),
        m.PublishTo(1, "logs", "k", True, [b"b", b"c"],  # an int expiration is AMQP's text
                    [["logs", "k", raw(props[1])],
                     ["logs", "k", raw({"expiration": "500", "type": "t"})]], 500, False),
        m.PublishTo(1, "logs", "k", True, [b"d"], [["logs", "k", raw(props[3])]], None, True)]
    assert p.receive_data(frames(m.PublishTo(2, "", "q", False, [b"x"], [{"expiration": "soon"}], None, False)),
                          0.0) == [ChannelFailed(2, 406, "invalid expiration 'soon': no_integer")]
    assert p.opened
    for spoof in (m.PublishTo(3, "logs", "k", False, [b"x"], [{"user_id": "admin"}], None, False),
                  m.Publish(3, "q", [b"x", b"y"], [None, {"user_id": "admin"}])):
        assert p.receive_data(frames(spoof), 0.0) == [ChannelFailed(
            3, 406, "user_id property set to 'admin' but authenticated user was 'guest'")]
    mine = m.Publish(4, "q", [b"x"], [{"user_id": "guest"}])
    assert p.receive_data(frames(mine), 0.0) == [mine]
    bad = m.PublishTo(1, "logs", "k", False, [b"x"], [["logs", "k", b"\xff"]], None, False)
    assert [type(e) for e in p.receive_data(frames(bad), 0.0)] == [ConnectionFailed, Closed]
    (error,) = sent(p)
    assert (error.code, error.text) == (502, "publish.to: the properties of a message must be a map "
                                             "or nil on channel 1")


def test_a_client_gone_in_the_middle_of_a_frame_is_told():
    p = protocol()
    p.receive_data(frames(auth()), 0.0)
    sent(p)
    assert p.receive_data(frames(m.ChannelOpen(1, 1))[:-2], 0.0) == []
    assert [type(e) for e in p.receive_eof(0.0)] == [ConnectionFailed, Closed]
    assert [type(x) for x in sent(p)] == [m.Error]
    q = protocol()
    q.receive_data(frames(auth()), 0.0)
    assert q.receive_eof(0.0) == [] and q.closed


async def test_a_native_connection_closed_by_the_server_ends_at_once(tmp_path, autojump_clock):
    """force_close (stop_app, a pause, close_connection) tells the client why and ends the
    connection when its writer has sent that: nothing polls for it, so no time passes; the
    client then ends with the server's reason."""
    async with sim_cluster(tmp_path) as c:
        node = c.nodes["n1"]
        with pytest.raises(ConnectionClosedByBroker, match="closed by the operator"):
            async with c.connect("n1") as conn:
                await conn.channel()
                (front,) = node.connections.values()
                start = trio.current_time()
                front.force_close(320, "closed by the operator")
                for _ in range(1000):
                    if not node.connections:
                        break
                    await trio.sleep(0)
                assert not node.connections and not node.sessions
                assert trio.current_time() == start
                await trio.sleep(1)  # the client hears the close and leaves this block
