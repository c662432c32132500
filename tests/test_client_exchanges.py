"""warren's own client with exchanges, on the simulated cluster: declaring them, binding queues
and exchanges, publishing through them from one node to queues on another, the exchange and
routing key a consumer reads back, mandatory messages returned, the bindings of an exclusive
queue made again after the client's node is killed and it reconnects elsewhere, and direct
reply-to between two of its clients."""

from __future__ import annotations

import pytest
import trio

from broker.client.errors import ChannelClosedByBroker
from broker.simulation import sim_cluster

pytestmark = pytest.mark.timeout(30)


async def _take(consumer, n: int, seconds: float = 5.0) -> list:
    got = []
    with trio.fail_after(seconds):
        async for msg in consumer:
            consumer.channel.basic_ack(msg.delivery_tag)
            got.append(msg)
            if len(got) == n:
                return got
    return got


async def test_topic_and_fanout_exchanges_route_across_nodes_and_say_where_a_message_came_from(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        async with c.client("reader", ["n1"]) as reader, c.client("writer", ["n2"]) as writer:
            rch = await reader.channel()
            await rch.exchange_declare("logs", "topic", durable=True)
            await rch.exchange_declare("everything", "fanout")
            await rch.exchange_bind("logs", "everything")  # all of `everything` goes on to `logs`
            ok = await rch.queue_declare("", exclusive=True)
            await rch.queue_bind(ok.queue, "logs", "*.error")
            consumer = await rch.basic_consume(ok.queue)

            wch = await writer.channel()
            await wch.confirm_delivery()
            await wch.basic_publish("logs", "kern.error", b"disk", {"content_type": "text/plain"})
            await wch.basic_publish("logs", "kern.info", b"routine")  # bound to nothing
            await wch.basic_publish("everything", "app.error", b"via fanout")
            await wch.basic_publish("", ok.queue, b"direct")
            assert await wch.wait_for_confirms(5)

            got = await _take(consumer, 3)
            assert [(g.body, g.exchange, g.routing_key) for g in got] == [
                (b"disk", "logs", "kern.error"), (b"via fanout", "everything", "app.error"),
                (b"direct", "", ok.queue)]
            assert got[0].properties == {"content_type": "text/plain"}

            await rch.basic_cancel(consumer.tag)
            await wch.basic_publish("logs", "db.error", b"got")
            assert await wch.wait_for_confirms(5)
            one = await rch.basic_get(ok.queue, auto_ack=True)
            assert (one.exchange, one.routing_key) == ("logs", "db.error")

            await rch.queue_unbind(ok.queue, "logs", "*.error")
            assert rch.bindings == [("exchange", "logs", "everything", "", {})]
            await wch.basic_publish("logs", "kern.error", b"unbound now", mandatory=True)
            assert await wch.wait_for_confirms(5)  # RabbitMQ confirms a returned message too
            (back,) = wch.returned
            assert (back.reply_code, back.reply_text, back.exchange, back.routing_key, back.body) == (
                312, "NO_ROUTE", "logs", "kern.error", b"unbound now")

            await rch.exchange_delete("everything")
            assert rch.bindings == [] and "everything" not in rch.exchanges
            with pytest.raises(ChannelClosedByBroker) as ei:
                await wch.basic_publish("everything", "x", b"nowhere")
                await wch.wait_for_confirms(5)
                await wch.queue_declare("", exclusive=True)  # the channel's close arrives first
            assert ei.value.reply_code == 404
            assert "no exchange 'everything' in vhost '/'" in ei.value.reply_text


async def test_an_exclusive_queues_bindings_are_made_again_when_the_client_reconnects(
        tmp_path, autojump_clock):
    """The reader's node is killed: its exclusive queue goes with it (as its connection did), and
    the client, reconnecting to n2, declares the exchange and a server-named queue again (under
    a new name), binds it again and consumes from it again, so messages published afterwards
    reach the same consumer."""
    async with sim_cluster(tmp_path) as c:
        recovered = trio.Event()
        async with c.client("reader", ["n1", "n2"], on_reconnect=lambda node: recovered.set()) as reader, \
                c.client("writer", ["n3"]) as writer:
            rch = await reader.channel()
            await rch.exchange_declare("alerts", "direct")
            ok = await rch.queue_declare("", exclusive=True)
            await rch.queue_bind(ok.queue, "alerts", "page")
            consumer = await rch.basic_consume(ok.queue)
            wch = await writer.channel()
            await wch.confirm_delivery()
            await wch.basic_publish("alerts", "page", b"before")
            assert await wch.wait_for_confirms(5)
            assert [g.body for g in await _take(consumer, 1)] == [b"before"]

            c.kill("n1")
            with trio.fail_after(30):
                await recovered.wait()  # re-declared and bound again
            # a server-named queue is named anew (an amq.gen- name may not be asked for), and
            # its binding and consumer follow it
            renamed = [e[2] for e in reader.events if e[1] == "queue-renamed"]
            assert len(renamed) == 1 and renamed[0].startswith(f"{ok.queue} -> amq.gen-")
            new_name = renamed[0].split(" -> ")[1]
            assert consumer.queue == new_name
            assert rch.bindings == [("queue", new_name, "alerts", "page", {})]
            assert reader.node.startswith("n2")
            await wch.basic_publish("alerts", "page", b"after", mandatory=True)
            assert await wch.wait_for_confirms(5)
            assert wch.returned == []
            got = await _take(consumer, 1)
            assert [(g.body, g.exchange, g.routing_key) for g in got] == [(b"after", "alerts", "page")]


async def test_direct_reply_to_between_warren_clients_on_two_nodes(tmp_path, autojump_clock):
    """RabbitMQ's direct reply-to with warren's client on both sides: the caller consumes
    `amq.rabbitmq.reply-to` (no ack) and publishes with that reply_to; the server, on another
    node, reads the per-channel address the node put in its place and answers to it; the answer
    goes straight to the caller's channel, through no queue."""
    async with sim_cluster(tmp_path) as c:
        async with c.client("caller", ["n1"]) as caller, c.client("server", ["n2"]) as server:
            sch = await server.channel()
            await sch.queue_declare("rpc")
            requests = await sch.basic_consume("rpc")
            cch = await caller.channel()
            answers = await cch.basic_consume("amq.rabbitmq.reply-to", auto_ack=True)
            await cch.basic_publish("", "rpc", b"6", {"reply_to": "amq.rabbitmq.reply-to",
                                                      "correlation_id": "c1"})
            (request,) = await _take(requests, 1)
            address = request.properties["reply_to"]
            assert address.startswith("amq.rabbitmq.reply-to.")
            await sch.basic_publish("", address, b"720", {"correlation_id": "c1"})
            with trio.fail_after(5):
                async for answer in answers:
                    break
            assert (answer.body, answer.properties["correlation_id"]) == (b"720", "c1")
            assert (await sch.queue_declare("rpc", passive=True)).message_count == 0
