"""The native client's fast paths: one queued Ack per run of single acks of a channel, tags
from before a reconnect never sent (they would name other deliveries there), and publishes
joining the Publish batch at the tail only where they may (same channel and queue, no
properties on either, batch limits)."""

from __future__ import annotations

import types

from broker.client.aio import MAX_BATCH_MSGS, Channel, _Writer
from wire import messages as m


def channel_with_writer(ch: int = 1) -> tuple[Channel, _Writer]:
    writer = _Writer()
    conn = types.SimpleNamespace(_writer=writer, _put=writer.put)
    return Channel(conn, ch), writer


def test_single_acks_of_a_channel_queue_one_ack_message():
    chan, writer = channel_with_writer()
    assert not writer.wake.is_set()
    for tag in (1, 2, 3):
        chan.basic_ack(tag)
    assert writer.wake.is_set()  # the write loop is told there is something to send
    assert [(type(x), x.ch, x.tags, x.multiple_upto) for x in writer.items] == [(m.Ack, 1, [1, 2, 3], 0)]
    chan.basic_ack(5, multiple=True)  # a multiple ack joins the same message
    assert [(x.tags, x.multiple_upto) for x in writer.items] == [([1, 2, 3], 5)]
    other, _ = channel_with_writer(2)
    other.conn = chan.conn
    other.basic_ack(9)  # another channel's ack is a message of its own
    assert [(x.ch, x.tags) for x in writer.items] == [(1, [1, 2, 3]), (2, [9])]


def test_an_ack_after_a_publish_starts_a_new_message():
    chan, writer = channel_with_writer()
    writer.put(m.Publish(1, "q", [b"x"], None))
    chan.basic_ack(1)
    assert [type(x) for x in writer.items] == [m.Publish, m.Ack]


def test_tags_from_before_a_reconnect_are_not_sent():
    chan, writer = channel_with_writer()
    chan.tag_offset = 10  # the connection was re-established after tag 10
    chan.basic_ack(7)
    chan.basic_ack(10)
    assert list(writer.items) == []
    chan.basic_ack(12)  # the second delivery on the new connection: server tag 2
    assert [x.tags for x in writer.items] == [[2]]


def test_publishes_join_the_tail_batch_only_where_they_may():
    chan, writer = channel_with_writer()
    assert not writer.wake.is_set()
    chan.publish_nowait("q", b"a")
    assert writer.wake.is_set()
    chan.publish_nowait("q", bytearray(b"b"))  # copied: the caller may reuse its buffer
    chan.publish_nowait("r", b"c")  # another queue
    chan.publish_nowait("r", b"d", {"content_type": "x"})  # properties: a batch with props
    chan.publish_nowait("r", b"e")  # not into a batch that carries properties
    assert [(x.queue, x.bodies, x.props) for x in writer.items] == [
        ("q", [b"a", b"b"], None), ("r", [b"c"], None), ("r", [b"d"], [{"content_type": "x"}]),
        ("r", [b"e"], None)]
    assert type(writer.items[0].bodies[1]) is bytes
    assert writer.bytes_queued == 5


def test_a_full_batch_starts_another():
    chan, writer = channel_with_writer()
    for _ in range(MAX_BATCH_MSGS + 1):
        chan.publish_nowait("q", b"x")
    assert [len(x.bodies) for x in writer.items] == [MAX_BATCH_MSGS, 1]
