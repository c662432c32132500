"""broker/amqp/codec.py: the hot path's shortcuts produce exactly what pamqp produces, and the
frame reader splits a stream the way pamqp's frame.unmarshal reads it."""

from __future__ import annotations

import datetime
import decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands, frame, header
from pamqp import commands as C

from broker.amqp import codec
from wire import props as propsmod

SHORT = st.text(max_size=40).filter(lambda s: len(s.encode()) <= 255)
NAME = st.from_regex(r"[a-zA-Z0-9_.:-]{0,40}", fullmatch=True)  # what pamqp accepts as an exchange


ITEMS = st.one_of(st.none(), st.builds(lambda ex, key, ct: [ex, key, C.Basic.Properties(content_type=ct).marshal()],
                                         NAME, SHORT, st.sampled_from([None, "text/plain"])),
                  st.just({"content_type": "a/b", "headers": {"k": 1}}))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 65535), SHORT, st.integers(1, 2**62), st.lists(st.tuples(st.binary(max_size=300), ITEMS),
       min_size=1, max_size=4), st.sets(st.integers(0, 3)), SHORT, st.sampled_from([4096, 4104, 131072]))
def test_deliveries_are_pamqps(ch, ctag, first, messages, redelivered, queue, frame_max):
    bodies = [b for b, _ in messages]
    props = [p for _, p in messages]
    out: list = []
    codec.deliver_batch(ch, ctag, first, bodies, redelivered, props, queue, propsmod.to_raw,
                        frame_max, out)
    want = []
    room = frame_max - 8
    for i, (body, item) in enumerate(messages):
        ex, key = propsmod.routing_of(item, queue)
        raw = propsmod.to_raw(item)
        want += [frame.marshal(C.Basic.Deliver(ctag, first + i, i in redelivered, ex, key), ch),
                 frame.marshal(header.ContentHeader(0, len(body), propsmod.decode_raw(raw)), ch)]
        want += [frame.marshal(pbody.ContentBody(body[j:j + room]), ch) for j in range(0, len(body), room)]
    assert b"".join(out) == b"".join(want)


@settings(max_examples=200, deadline=None)
@given(NAME, SHORT, st.booleans(), st.booleans())
def test_publish_decoding_is_pamqps(exchange, key, mandatory, immediate):
    method = commands.Basic.Publish(0, exchange, key, mandatory, immediate)
    payload = frame.marshal(method, 1)[7:-1]
    cache = codec.PublishCache()
    for _ in range(2):  # a miss, then a hit
        assert cache.decode(payload) == (exchange, key, mandatory, immediate)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**63 - 1), st.booleans(), st.booleans())
def test_ack_decoding_is_pamqps(tag, multiple, requeue):
    for method, want in ((commands.Basic.Ack(tag, multiple), (tag, multiple, False)),
                         (commands.Basic.Nack(tag, multiple, requeue), (tag, multiple, requeue)),
                         (commands.Basic.Reject(tag, requeue), (tag, False, requeue))):
        payload = frame.marshal(method, 1)[7:-1]
        assert codec.decode_ack(payload) == want


def test_frame_reader_splits_like_pamqp_and_keeps_partial_frames():
    frames = [frame.marshal(commands.Basic.Publish(0, "", "q"), 1),
              frame.marshal(header.ContentHeader(0, 5, commands.Basic.Properties()), 1),
              frame.marshal(pbody.ContentBody(b"hello"), 1), codec.HEARTBEAT_FRAME]
    stream = b"".join(frames)
    for cut in range(1, len(stream)):
        r = codec.FrameReader(4096)
        got = r.feed(stream[:cut]) + r.feed(stream[cut:])
        assert len(got) == 4
        for (kind, ch, payload), raw in zip(got, frames):
            used, channel, value = frame.unmarshal(raw)
            assert used == len(raw) and channel == ch
            assert raw[7:-1] == payload


def test_frame_reader_refuses_oversized_and_broken_frames():
    r = codec.FrameReader(4096)
    with pytest.raises(codec.CodecError) as e:
        r.feed(b"\x01\x00\x01\x00\x01\x00\x00")  # 65536 bytes announced
    assert e.value.code == 501 and "larger than frame_max 4096" in e.value.text
    r = codec.FrameReader(4096)
    with pytest.raises(codec.CodecError) as e:
        r.feed(b"\x01\x00\x01\x00\x00\x00\x01\x00\x00")
    assert e.value.code == 501 and "does not end with 0xCE" in e.value.text


def test_decode_method_errors():
    with pytest.raises(codec.CodecError) as e:
        codec.decode_method(b"\x00\x99\x00\x07")
    assert e.value.code == 503 and "class 153 method 7" in e.value.text
    with pytest.raises(codec.CodecError) as e:
        codec.decode_method(b"\x00\x32\x00\x0a\x00")  # queue.declare cut short
    assert e.value.code == 502
    with pytest.raises(codec.CodecError):
        codec.decode_method(b"\x00")


def test_properties_round_trip_between_the_two_forms():
    ts = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.timezone.utc)
    props = commands.Basic.Properties(
        content_type="application/json", content_encoding="utf-8",
        headers={"i": 7, "s": "x", "f": 1.5, "l": [1, "a"], "t": {"n": True},
                 "d": decimal.Decimal("1.25"), "ts": ts, "b": bytearray(b"\x00\x01"), "v": None},
        delivery_mode=2, priority=5, correlation_id="c", reply_to="r", expiration="60000",
        message_id="m", timestamp=ts, message_type="t", user_id="guest", app_id="a")
    raw = props.marshal()
    d = propsmod.raw_to_dict(raw)
    assert d["type"] == "t" and d["timestamp"] == int(ts.timestamp())
    assert d["headers"]["d"] == "1.25" and d["headers"]["b"] == b"\x00\x01"
    back = propsmod.decode_raw(propsmod.dict_to_raw(d))
    assert back.content_type == "application/json" and back.message_type == "t"
    assert back.headers["i"] == 7 and back.headers["l"] == [1, "a"]
    assert back.timestamp == ts
    assert propsmod.headers_of(["x", "k", raw])["s"] == "x"
    assert propsmod.headers_of(["x", "k", propsmod.NO_PROPS]) is None
    assert propsmod.routing_of(None, "q") == ("", "q")
    # a value with no AMQP form is left out, the rest kept
    assert propsmod.decode_raw(propsmod.dict_to_raw({"headers": {"o": object()}, "app_id": "a"})).app_id == "a"
