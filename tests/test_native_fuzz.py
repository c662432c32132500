"""Fuzzing a real node's native client port (warren's msgpack protocol) with hypothesis.

After a real handshake the client sends frames of every client kind (wire/messages.py), their
fields drawn from the kinds' own schemas (so most pass validation and reach the session) with
edge values: channels never opened or out of range, tags never given, 64-bit extremes, names
the broker reserves, odd queue arguments and message properties; and, among them, frames that
are not valid at all. Whatever comes, every frame the server sends is a known message, the
server closes the connection only after an `error` frame that says why (or after the client's
own connection.close), nothing is logged as a failure inside the node, and a bystander
connection on the same node carries on, its queue untouched.
"""

from __future__ import annotations

import socket
import time

import msgpack
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import broker.client as client
from broker.client import BlockingConnection
from broker.native import CLIENT_KINDS
from wire import messages as m
from wire import schema
from wire.frames import HEADER, FrameDecoder

from cluster_procs import running_cluster, wait_no_consumers

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        yield c


@pytest.fixture(scope="module")
def bystander(cluster):
    conn = BlockingConnection(client.ConnectionParameters(cluster.client_addr("n1")))
    ch = conn.channel()
    ch.queue_declare(OWN)
    ch.confirm_delivery()
    yield ch
    conn.close()


OWN = "bystander.own"  # the bystander's queue: a name the fuzzer makes only in the examples

# --- field values ------------------------------------------------------------------------------

INTS = st.one_of(st.integers(-3, 12), st.sampled_from(
    [65535, 65536, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1]))
NAMES = st.one_of(st.sampled_from(
    ["", "fuzz", "other", "amq.gen-fuzz", "amq.direct", "x" * 300, "\x00", "é☃"]),
    st.text(max_size=8))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=True), NAMES,
                    st.binary(max_size=12))
ANY = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(NAMES, inner, max_size=3)),
                   max_leaves=6)
ARG_KEYS = st.one_of(st.sampled_from(
    ["x-max-length", "x-max-length-bytes", "x-message-ttl", "x-expires", "x-overflow",
     "x-queue-mode", "x-queue-type", "x-cancel-on-ha-failover", "x-priority", "x-max-priority",
     "x-single-active-consumer", "x-dead-letter-exchange", "x-dead-letter-routing-key"]), NAMES)
PROP_KEYS = st.one_of(st.sampled_from(
    ["content_type", "delivery_mode", "priority", "expiration", "headers", "message_id",
     "timestamp", "correlation_id", "reply_to", "user_id", "app_id", "type"]), NAMES)


def _for(t) -> st.SearchStrategy:
    """A strategy for one field of the schema: its own type, with edge values."""
    if isinstance(t, mi.IntType):
        return INTS
    if isinstance(t, mi.StrType):
        return NAMES
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=64)
    if isinstance(t, mi.ListType):
        return st.lists(_for(t.item_type), max_size=4)
    if isinstance(t, mi.DictType):
        return st.dictionaries(ARG_KEYS, ANY, max_size=3)
    if isinstance(t, mi.UnionType):  # Publish.props: nil, or per body nil or a properties map
        return st.one_of(st.none(), st.lists(st.one_of(st.none(), st.dictionaries(PROP_KEYS, ANY, max_size=3),
                                                       ANY), max_size=4))
    return ANY


# mostly the channel the client opened and one queue, so that commands go deep, not only to
# "channel not open"
BY_NAME = {
    "ch": st.one_of(st.just(1), st.just(1), st.just(1), INTS),
    "rid": st.one_of(st.integers(1, 1000), INTS),
    "queue": st.one_of(st.just("fuzz"), st.just("fuzz"), NAMES),
}


def _kind(kind: str) -> st.SearchStrategy:
    fields = mi.type_info(schema.REGISTRY[kind]).fields
    return st.tuples(st.just(kind), *[BY_NAME[f.name] if f.name in BY_NAME else _for(f.type) for f in fields]).map(list)


def frame(value) -> bytes:
    body = msgpack.packb(value, use_bin_type=True)
    return HEADER.pack(len(body)) + body


CLIENT_FRAMES = st.one_of(*[_kind(k) for k in sorted(CLIENT_KINDS - {"connection.close"})]).map(frame)
BAD_FRAMES = st.one_of(
    # a known kind with fields of any shape, or any value at all
    st.tuples(st.sampled_from(sorted(CLIENT_KINDS)), st.lists(ANY, max_size=8)).map(lambda t: frame([t[0], *t[1]])),
    ANY.map(frame),
    # a server-only or peer-only kind
    st.sampled_from([frame(["welcome", "n9", "c", 4096]), frame(["q.publish", "q", [], 1, [], None, True, 1]),
                     frame(["tick"]), frame(["error", 541, "boom"])]),
    # not msgpack in a frame's clothes, or bytes outside any frame
    st.binary(min_size=1, max_size=40).map(lambda b: HEADER.pack(len(b)) + b),
    st.binary(min_size=1, max_size=40),
)
OPEN = frame(["channel.open", 1, 1])
ATTACKS = st.lists(st.one_of(CLIENT_FRAMES, CLIENT_FRAMES, CLIENT_FRAMES, BAD_FRAMES), min_size=1, max_size=8)


# --- one connection ----------------------------------------------------------------------------

class RawNative:
    """A client of the native port that speaks frames as given."""

    def __init__(self, addr: str):
        host, port = addr.split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.dec = FrameDecoder(1 << 30)
        self.frames: list = []
        hello = self.next(10)
        assert hello.KIND == "hello", hello
        self.sock.sendall(frame(["client.auth", m.PROTOCOL_VERSION, "guest", "guest", "fuzz", "/"]))
        welcome = self.next(10)
        assert welcome.KIND == "welcome", welcome

    def next(self, timeout: float):
        """The next message from the server; TimeoutError when quiet, EOFError when closed."""
        deadline = time.monotonic() + timeout
        while not self.frames:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                raise TimeoutError from None
            except ConnectionResetError:
                raise EOFError from None
            if not data:
                raise EOFError
            self.frames += self.dec.feed(data)
        raw = self.frames.pop(0)
        try:
            return schema.decode(raw)
        except Exception as exc:  # noqa: BLE001 - an unreadable frame is a finding
            raise AssertionError(f"the server sent something that is not a message: {raw!r} ({exc})") from None

    def until_quiet(self, quiet: float = 0.15) -> tuple[list, bool]:
        got = []
        while True:
            try:
                got.append(self.next(quiet))
            except TimeoutError:
                return got, False
            except EOFError:
                return got, True

    def close(self) -> None:
        self.sock.close()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.sampled_from([True, True, True, False]), ATTACKS)
@example(True, [frame(["publish", 1, "fuzz", [b"x"], [{"headers": {"a": [1, {"b": None}]}}]])])
@example(True, [frame(["basic.consume", 5, 1, OWN, "", True, False, {"x-priority": "high"}])])
@example(True, [frame(["basic.consume", 5, 1, OWN, "", True, False, {}])])
@example(True, [frame(["queue.declare", 5, 1, "fuzz", False, False, False, True, {"x-max-length": -1}])])
@example(True, [frame(["ack", 1, [2**64 - 1], 0]), frame(["nack", 1, [], -1, True])])
@example(True, [frame(["basic.qos", 5, 1, 2**63 - 1, False])])
@example(False, [frame(["publish", 70000, "fuzz", [b"x"], None])])
@example(True, [frame(["publish", 1, "fuzz", [b"x", b"y"], [None]])])  # props not parallel to bodies
@example(True, [frame(["tx.select", 5, 1]), frame(["ack", 1, [1], 0]), frame(["tx.commit", 6, 1])])
def test_the_native_port_survives_anything(cluster, bystander, open_channel, attack):
    conn = RawNative(cluster.client_addr("n1"))
    try:
        data = (OPEN if open_channel else b"") + b"".join(attack)
        try:
            conn.sock.sendall(data)
        except OSError:
            pass
        got, closed = conn.until_quiet()
    finally:
        conn.close()
    errors = [x for x in got if x.KIND == "error"]
    for e in errors:
        assert isinstance(e.code, int) and 300 <= e.code < 600 and e.text, e
    if closed:
        # the server hangs up only after saying why, or after the client said goodbye
        asked = any(b"connection.close" in f for f in attack)
        assert (got and got[-1].KIND == "error") or asked, got
    # a no-ack consumer the attack may have put on the bystander's queue goes with its connection
    wait_no_consumers(bystander, OWN)
    bystander.basic_publish("", OWN, b"ping")
    assert bystander.basic_get(OWN, auto_ack=True)[2] == b"ping"


def test_nothing_went_wrong_inside_the_node(cluster, bystander):
    text = cluster.log_path("n1").read_text()
    assert "connection failed" not in text and "Traceback" not in text and "queue process failed" not in text
    assert cluster.alive("n1")
    with socket.create_connection(("127.0.0.1", cluster.client_port("n1")), timeout=5):
        pass
