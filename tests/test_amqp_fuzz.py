"""Fuzzing a real node's AMQP port with hypothesis: garbage, bad protocol headers, frames above
frame_max, unknown class and method ids, random arguments to real methods, content without its
header (and the other way round), frames on the wrong channel. Whatever comes, the server answers
with a connection.close or channel.close carrying an AMQP error code (never a dropped socket with
no reason, never a crash), and the node and a bystander connection carry on."""

from __future__ import annotations

import socket
import struct

import pika
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import frame, header

from amqp_raw import Closed, RawClient
from cluster_procs import running_cluster, wait_no_consumers

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]

CONNECTION_CODES = {320, 501, 502, 503, 504, 505, 506, 530, 540, 541}
CHANNEL_CODES = {311, 312, 313, 403, 404, 405, 406}
INDEXES = sorted(C.INDEX_MAPPING)


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        yield c


@pytest.fixture(scope="module")
def bystander(cluster):
    conn = pika.BlockingConnection(pika.ConnectionParameters("localhost", cluster.amqp_port("n1")))
    ch = conn.channel()
    ch.queue_declare("bystander")
    yield ch
    conn.close()


def raw_frame(kind, ch, payload, end=b"\xce", size=None):
    return struct.pack(">BHI", kind, ch, len(payload) if size is None else size) + payload + end


def frames_on(channels):
    """Frames of every sort on the channels `channels` draws."""
    return st.one_of(
        # anything at all in a frame's clothes
        st.builds(raw_frame, st.integers(0, 255), channels, st.binary(max_size=64),
                  st.sampled_from([b"\xce", b"\x00", b"\xff"])),
        # a frame announcing more than frame_max
        st.builds(lambda ch, n: raw_frame(1, ch, b"", size=n), channels, st.integers(131065, 2**32 - 1)),
        # a real class/method id (or an unknown one) with random arguments
        st.builds(lambda idx, args, ch: raw_frame(1, ch, struct.pack(">I", idx) + args),
                  st.one_of(st.sampled_from(INDEXES), st.integers(0, 2**32 - 1)),
                  st.binary(max_size=40), channels),
        # well-formed frames in a bad order or on the wrong channel
        st.builds(lambda ch: frame.marshal(C.Channel.Open(), ch), channels),
        st.builds(lambda ch: frame.marshal(C.Basic.Publish(0, "", "fuzz"), ch), channels),
        st.builds(lambda ch, n: frame.marshal(header.ContentHeader(0, n, C.Basic.Properties()), ch),
                  channels, st.integers(0, 10)),
        st.builds(lambda ch, b: frame.marshal(pbody.ContentBody(b), ch), channels,
                  st.binary(min_size=1, max_size=10)),
        st.builds(lambda ch, tag, multiple: frame.marshal(C.Basic.Ack(tag, multiple), ch), channels,
                  st.integers(0, 3), st.booleans()),
        st.builds(lambda ch: frame.marshal(C.Basic.Nack(1, False, True), ch), channels),
        st.builds(lambda ch: frame.marshal(C.Queue.Declare(0, "fuzz", False, False, True), ch), channels),
        st.builds(lambda ch: frame.marshal(C.Basic.Consume(0, "bystander", "", False, True), ch), channels),
        st.builds(lambda ch: frame.marshal(C.Channel.Close(200, "", 0, 0), ch), channels),
        st.just(frame.marshal(C.Connection.Close(200, "bye", 0, 0), 0)),
        st.just(raw_frame(8, 0, b"")),
    )


ANY_CHANNEL = st.sampled_from([0, 1, 2, 65535])
MOSTLY_ONE = st.sampled_from([1, 1, 1, 1, 0, 2])  # the channel the client opened, mostly
ATTACKS = st.one_of(
    st.tuples(st.just("garbage"), st.binary(min_size=1, max_size=200)),
    st.tuples(st.just("header"), st.binary(min_size=8, max_size=8).filter(lambda b: b != b"AMQP\x00\x00\x09\x01")),
    st.tuples(st.just("frames"), st.lists(frames_on(ANY_CHANNEL), min_size=1, max_size=6).map(b"".join)),
    st.tuples(st.just("channel"), st.lists(frames_on(MOSTLY_ONE), min_size=1, max_size=6).map(b"".join)),
)
PUBLISH = frame.marshal(C.Basic.Publish(0, "", "fuzz"), 1)
HEADER = frame.marshal(header.ContentHeader(0, 3, C.Basic.Properties()), 1)
BODY = frame.marshal(pbody.ContentBody(b"abc"), 1)


def read_until_quiet(client: RawClient, quiet: float = 0.15) -> tuple[list, bool]:
    """Frames from the server until it is quiet; answers a connection.close with close-ok.
    Returns (frames as (channel, object), closed by the server)."""
    got = []
    while True:
        try:
            ch, obj, _ = client.next(quiet)
        except TimeoutError:
            return got, False
        except Closed:
            return got, True
        except Exception as exc:  # noqa: BLE001 - a frame pamqp cannot read is a finding too
            raise AssertionError(f"the server sent something unreadable: {exc!r}") from None
        got.append((ch, obj))
        if isinstance(obj, C.Connection.Close):
            try:
                client.method(0, C.Connection.CloseOk())
            except OSError:
                pass


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ATTACKS)
# the known hard cases, always tried
@example(("header", b"AMQP\x00\x00\x08\x00"))  # another protocol version
@example(("garbage", b"GET / HTTP/1.1\r\n\r\n"))
@example(("frames", raw_frame(1, 0, b"", size=1 << 20)))  # above frame_max
@example(("channel", raw_frame(1, 1, b"\x00\x99\x00\x07")))  # unknown class and method
@example(("channel", PUBLISH + BODY))  # content without its header
@example(("channel", HEADER + BODY))  # content without its method
@example(("channel", PUBLISH + frame.marshal(C.Basic.Qos(0, 1, False), 1)))  # method inside content
@example(("channel", frame.marshal(C.Basic.Qos(0, 1, False), 2)))  # a channel never opened
@example(("frames", frame.marshal(pbody.ContentBody(b"x"), 0)))  # content on channel 0
@example(("channel", frame.marshal(C.Basic.Ack(3, False), 1)))  # an unknown delivery tag
@example(("channel", PUBLISH + HEADER + BODY + frame.marshal(C.Basic.Ack(0, True), 1)))
# a no-ack consumer on the bystander's queue, which must go with its connection
@example(("channel", frame.marshal(C.Basic.Consume(0, "bystander", "", False, True), 1)))
def test_the_amqp_port_survives_anything(cluster, bystander, attack):
    kind, data = attack
    port = cluster.amqp_port("n1")
    client = RawClient(port, handshake=kind in ("frames", "channel"))
    if kind == "channel":
        client.open_channel(1)
    if kind == "garbage" and data.startswith(b"AMQP\x00\x00\x09\x01"):
        data = b"X" + data
    try:
        client.send(data if kind in ("frames", "channel") else data)
    except OSError:
        pass
    frames, closed = read_until_quiet(client)
    client.close()
    if kind in ("garbage", "header"):
        # not AMQP: the server's protocol header (once it has 8 bytes), then the end
        if len(data) >= 8:
            assert frames[:1] == [(0, b"AMQP\x00\x00\x09\x01")] and closed, frames
        return
    closes = [o for _, o in frames if isinstance(o, C.Connection.Close)]
    for o in closes:
        assert o.reply_code in CONNECTION_CODES or o.reply_code == 200, o.reply_text
    for _, o in frames:
        if isinstance(o, C.Channel.Close):
            assert o.reply_code in CHANNEL_CODES, o.reply_text
    if closed:
        # the server may only hang up after saying why (or after the client said goodbye)
        assert closes or any(isinstance(o, C.Connection.CloseOk) for _, o in frames), frames
    # The attack may have consumed from the bystander's queue with no_ack (any client may): a
    # message published while the node has not yet seen that connection end is rightly the
    # attacker's. So first its consumer must go with its connection, then the bystander is untouched.
    wait_no_consumers(bystander, "bystander")
    bystander.basic_publish("", "bystander", b"ping")
    assert bystander.basic_get("bystander", auto_ack=True)[2] == b"ping"


def test_nothing_went_wrong_inside_the_node(cluster, bystander):
    text = cluster.log_path("n1").read_text()
    assert "AMQP connection failed" not in text and "Traceback" not in text
    assert cluster.alive("n1")
    with socket.create_connection(("127.0.0.1", cluster.amqp_port("n1")), timeout=5):
        pass
