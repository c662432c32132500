"""warren's own client with exchanges, on the simulated cluster: declaring them, binding queues
and exchanges, publishing through them from one node to queues on another, the exchange and
routing key a consumer reads back, mandatory messages returned, the bindings of an exclusive
queue made again after the client's node is killed and it reconnects elsewhere, a publisher
whose node dies under it while it publishes through an exchange, and direct reply-to between
two of its clients."""

from __future__ import annotations

import pytest
import trio

from broker.client.errors import ChannelClosedByBroker
from broker.simulation import sim_cluster
from mirroring.changes import PolicySet
from mirroring.records import Policy

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


async def test_publishing_through_an_exchange_on_the_node_that_dies(tmp_path, autojump_clock):
    """The fault where it hurts: the publisher is connected to n1, which routes its messages
    through a topic exchange to a queue mirrored on every node and led by n1; n1 is killed in
    the middle. The publisher reconnects to n2 and goes on; what was unconfirmed when the link
    broke is nacked ("connection lost") and published again; every confirmed id is delivered
    (from the promoted mirror) to a consumer on n3, none lost, and nobody is left waiting."""
    async with sim_cluster(tmp_path) as c:
        await c.nodes["n1"].cluster.propose(PolicySet(Policy("ha", "^orders", {"ha-mode": "all"}, 0,
                                                             "queues")))
        async with c.client("pub", ["n1", "n2"]) as pub, c.client("sub", ["n3"]) as sub:
            pch = await pub.channel()
            await pch.exchange_declare("events", "topic", durable=True)
            await pch.queue_declare("orders", durable=True)
            await pch.queue_bind("orders", "events", "order.#")
            await pch.confirm_delivery()
            confirmed, nacked = set(), set()
            sent = {}

            def on_confirm(first, last, ok, reason):
                for seq in range(first, last + 1):
                    (confirmed if ok else nacked).add(sent[seq])
            pch.on_confirm = on_confirm

            async def publish(i: int) -> None:
                sent[pch.next_seq] = i
                await pch.basic_publish("events", "order.created", str(i).encode())

            for i in range(2000):
                await publish(i)
                if i == 1000:
                    c.kill("n1")
                if i % 50 == 0:
                    await trio.sleep(0.01)
            with trio.fail_after(30):
                while len(confirmed) + len(nacked) < len(sent):
                    await trio.sleep(0.1)
            again = sorted(nacked - confirmed)
            assert again, "the kill should have caught some publishes unconfirmed"
            for i in again:
                await publish(i)
            with trio.fail_after(30):
                await pch.wait_for_confirms()
            assert confirmed == set(range(2000))

            sch = await sub.channel()
            consumer = await sch.basic_consume("orders")
            seen = set()
            with trio.fail_after(30):
                async for msg in consumer:
                    sch.basic_ack(msg.delivery_tag)
                    assert (msg.exchange, msg.routing_key) == ("events", "order.created")
                    seen.add(int(msg.body))
                    if seen >= confirmed:
                        break
            assert seen == confirmed
