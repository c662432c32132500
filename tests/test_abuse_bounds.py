"""What one client, or a stranger, can make a node log, hold or keep open is bounded: client
strings clipped in log lines, refused logins answered late and logged at most once a second,
the handshake's time limit, the node's connection limit, channel_max, and the bytes a
transaction may hold. On the simulated network (MockClock), AMQP and warren's own protocol."""

from __future__ import annotations

import pytest
import trio
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame, header

from broker.amqp import codec
from broker.client import AMQPConnectionError, ChannelClosedByBroker, ConnectionClosedByBroker
from broker.client.aio import open_connection
from broker.log import Throttled, clip
from broker.simulation import CLIENT_PORT, PEER_PORT, sim_cluster, traced
from wire import messages as m
from wire.frames import encode_frame
from wire.schema import to_wire

from test_amqp_sim import AMQP_PORT, SimAmqp

pytestmark = pytest.mark.timeout(60)

ONE_NODE = {"names": ("n1",)}


# --- the pieces ---------------------------------------------------------------------------------

def test_clip_keeps_the_start_and_says_how_long():
    assert clip("guest") == "guest"
    long = "é" * 100_000
    assert clip(long) == "é" * 64 + "... (100000 chars)"
    assert clip(b"\x00" * 3) == repr(b"\x00" * 3)


class FakeLog:
    def __init__(self):
        self.lines = []

    def warning(self, event, **fields):
        self.lines.append((event, fields))


def test_throttled_writes_one_line_a_second_per_event_and_counts_the_rest():
    now = [0.0]
    log = FakeLog()
    t = Throttled(log, lambda: now[0])
    assert t.warning("login failed", peer="a")
    assert not t.warning("login failed", peer="b")
    assert not t.warning("login failed", peer="c")
    assert t.warning("handshake timed out", peer="d")  # another event has its own second
    now[0] = 1.0
    assert t.warning("login failed", peer="e")
    assert log.lines == [("login failed", {"peer": "a"}), ("handshake timed out", {"peer": "d"}),
                         ("login failed", {"peer": "e", "suppressed": 2})]


# --- logins ---------------------------------------------------------------------------------------

async def _amqp_login(c, user, password, results, name):
    start = trio.current_time()
    _, answer = await SimAmqp.connect(c, "n1", from_host="elsewhere", user=user, password=password)
    results[name] = (answer, trio.current_time() - start)


async def test_refused_logins_are_answered_late_logged_clipped_and_throttled(tmp_path, autojump_clock):
    trace: list = []
    long_user = "u" * 100_000  # near the frame limit: five of these once grew a log by 84 MB
    with traced(trace):
        async with sim_cluster(tmp_path, users={"app": "secret"}, **ONE_NODE) as c:
            results: dict = {}
            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(_amqp_login, c, long_user, "wrong", results, i)
                nursery.start_soon(_amqp_login, c, "app", "secret", results, "good")
            await trio.sleep(2)
            await _amqp_login(c, "app", "guess", results, "late")
    good, took = results["good"]
    assert isinstance(good, C.Connection.OpenOk) and took < 0.5  # not held by the refused ones
    for i in range(5):
        close, took = results[i]
        assert close.reply_code == 403 and took >= 1.0  # login_failure_delay, 1 s by default
        assert f"login refused for user '{'u' * 64}... (100000 chars)'" in close.reply_text
    failed = [fields for _, event, fields in trace if event == "AMQP login failed"]
    assert len(failed) == 2  # the five at once in one line, the late one in the next
    assert max(len(repr(f)) for f in failed) < 1000
    late = dict(failed[1])
    assert late["suppressed"] == "4" and late["user"] == "'app'" and "elsewhere" in late["peer"]
    assert not any("u" * 65 in repr(fields) for _, _, fields in trace)


async def test_a_native_refused_login_is_answered_late(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, login_failure_delay=2.5, **ONE_NODE) as c:
        start = trio.current_time()
        with pytest.raises(ConnectionClosedByBroker) as err:
            async with open_connection([f"n1:{CLIENT_PORT}"], network=c.net.host("n1"), user="x" * 5000,
                                       password="no", reconnect=False):
                pass
        assert trio.current_time() - start >= 2.5
        assert f"login refused for user '{'x' * 64}... (5000 chars)'" in str(err.value)


async def test_a_stranger_on_the_peer_port_is_logged_clipped_and_throttled(tmp_path, autojump_clock):
    trace: list = []
    with traced(trace):
        async with sim_cluster(tmp_path, **ONE_NODE) as c:
            for _ in range(3):
                stream = await c.net.host("elsewhere").connect("n1", PEER_PORT)
                await stream.send_all(encode_frame(to_wire(m.PeerAuth(m.PROTOCOL_VERSION, "n" * 5000, "peer",
                                                                      b"x" * 32, b"y" * 16))))
                await _closed_after(stream)
    refused = [dict(fields) for _, event, fields in trace if event == "peer connection refused"]
    assert len(refused) == 1  # the three at once: one line
    reason = refused[0]["reason"]
    assert len(reason) < 300 and reason.endswith('... (5057 chars)"') and "did not prove" not in reason
    assert not any("n" * 300 in repr(fields) for _, _, fields in trace)


# --- the handshake's time limit ----------------------------------------------------------------------

async def _closed_after(stream) -> float:
    """Seconds until the node closes `stream` (reading and discarding what it sends)."""
    start = trio.current_time()
    while await stream.receive_some(1 << 16):
        pass
    return trio.current_time() - start


async def test_a_handshake_never_finished_is_closed_after_handshake_timeout(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, handshake_timeout=3.0, **ONE_NODE) as c:
        host = c.net.host("n1")
        silent = await host.connect("n1", AMQP_PORT)  # not even the protocol header
        assert 3.0 <= await _closed_after(silent) < 3.5
        no_tune_ok = await host.connect("n1", AMQP_PORT)  # logged in, never tunes
        await no_tune_ok.send_all(codec.PROTOCOL_HEADER + frame.marshal(
            C.Connection.StartOk({}, "PLAIN", "\0guest\0guest"), 0))
        assert 3.0 <= await _closed_after(no_tune_ok) < 3.5
        native = await host.connect("n1", CLIENT_PORT)  # reads the hello, never logs in
        assert 3.0 <= await _closed_after(native) < 3.5
        client, ok = await SimAmqp.connect(c, "n1")  # an open connection has no such limit
        assert isinstance(ok, C.Connection.OpenOk)
        await trio.sleep(10)
        await client.method(1, C.Channel.Open())
        await client.expect(C.Channel.OpenOk)


def leaves(exc: BaseException):
    """The exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaves(inner)
    else:
        yield exc


# --- limits ---------------------------------------------------------------------------------------

async def test_connections_past_max_connections_are_refused(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, max_connections=2, **ONE_NODE) as c:
        first, ok = await SimAmqp.connect(c, "n1")
        assert isinstance(ok, C.Connection.OpenOk)
        async with c.connect("n1"):  # a native connection counts too
            _, close = await SimAmqp.connect(c, "n1")
            assert close.reply_code == 530
            assert close.reply_text == "NOT_ALLOWED - connection refused: node connection limit (2) is reached"
            with pytest.raises(AMQPConnectionError, match=r"\(530\) connection refused: node connection limit"):
                async with c.connect("n1"):
                    pass
        await trio.sleep(5)  # the refused ones gone too (their close-ok never came)
        _, ok = await SimAmqp.connect(c, "n1")  # room again
        assert isinstance(ok, C.Connection.OpenOk)


async def test_channel_max_is_negotiated_and_enforced(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, channel_max=3, **ONE_NODE) as c:
        stream = await c.net.host("n1").connect("n1", AMQP_PORT)
        client = SimAmqp(stream)
        await client.send(codec.PROTOCOL_HEADER)
        await client.expect(C.Connection.Start)
        await client.method(0, C.Connection.StartOk({}, "PLAIN", "\0guest\0guest"))
        tune = await client.expect(C.Connection.Tune)
        assert tune.channel_max == 3
        await client.method(0, C.Connection.TuneOk(0, 131072, 0))
        await client.method(0, C.Connection.Open("/"))
        await client.expect(C.Connection.OpenOk)
        await client.method(3, C.Channel.Open())
        await client.expect(C.Channel.OpenOk)
        await client.method(4, C.Channel.Open())
        close = await client.next()
        assert close.reply_code == 504 and "channel 4 is above the negotiated channel_max 3" in close.reply_text

        with pytest.raises(BaseException) as err:
            async with c.connect("n1") as conn:  # warren's protocol: three channels open at once
                for _ in range(3):
                    await conn.channel()
                await conn.channel()
        assert {(e.reply_code, e.reply_text) for e in leaves(err.value)} == {
            (530, "number of channels opened (3) has reached the negotiated channel_max (3)")}


def _publish(ch: int, body: bytes) -> bytes:
    return (frame.marshal(C.Basic.Publish(0, "", "q"), ch)
            + frame.marshal(header.ContentHeader(0, len(body), C.Basic.Properties()), ch)
            + frame.marshal(pbody.ContentBody(body), ch))


TX_TEXT = ("transaction on channel 1 would hold 1200 bytes of uncommitted publishes, more than "
           "max_tx_bytes (1000): commit or roll back sooner")


async def test_a_transaction_past_max_tx_bytes_closes_its_channel(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, max_tx_bytes=1000, **ONE_NODE) as c:
        client, _ = await SimAmqp.connect(c, "n1")
        await client.method(1, C.Channel.Open())
        await client.expect(C.Channel.OpenOk)
        await client.method(1, C.Queue.Declare(0, "q"))
        await client.expect(C.Queue.DeclareOk)
        await client.method(1, C.Tx.Select())
        await client.expect(C.Tx.SelectOk)
        await client.send(_publish(1, b"a" * 600))
        await client.method(1, C.Tx.Commit())  # a commit starts the count again
        await client.expect(C.Tx.CommitOk)
        await client.send(_publish(1, b"b" * 600) + _publish(1, b"c" * 600))
        close = await client.next()
        assert isinstance(close, C.Channel.Close) and close.reply_code == 406
        assert close.reply_text == f"PRECONDITION_FAILED - {TX_TEXT}"
        await client.method(1, C.Channel.CloseOk())
        await client.method(2, C.Channel.Open())  # the connection carries on
        await client.expect(C.Channel.OpenOk)
        await client.method(2, C.Queue.Declare(0, "q", passive=True))
        assert (await client.expect(C.Queue.DeclareOk)).message_count == 1  # the committed one only

        async with c.connect("n1") as conn:  # warren's protocol likewise
            ch = await conn.channel()
            await ch.tx_select()
            await ch.basic_publish("", "q", b"d" * 600)
            await ch.tx_rollback()  # so does a rollback
            await ch.basic_publish("", "q", b"e" * 600)
            await ch.basic_publish("", "q", b"f" * 600)
            with pytest.raises(ChannelClosedByBroker) as err:
                await ch.tx_commit()
            assert err.value.reply_code == 406 and err.value.reply_text == TX_TEXT

