"""An AMQP client's method on its way when the queue's leader's node fails is answered: the
AMQP port's side of tests/test_sim_in_flight.py, on the simulated network under MockClock.

A bare AMQP 0-9-1 client is connected to n2; queue 'q' leads from n1 (which also leads the
metadata log: the cluster's first node). Each method a RabbitMQ user sends and waits on for a
queue is started, and while it is on its way n1 fails: killed, cut off from n2 and n3, frozen,
or its app stopped. The client
must get the method's reply (a mirrored queue: from the promoted mirror; the metadata changes:
from the log's new leader) or, for a queue without mirrors, the channel.close a method sent
after the failure gets (404 "home node ... is down or inaccessible"; a publish is nacked); never
silence, and never a closed connection.
"""

from __future__ import annotations

import pytest
import trio
from pamqp import body as pbody
from pamqp import commands as C
from pamqp import header

from test_amqp_sim import SimAmqp
from test_sim_in_flight import fail
from test_sim_mirroring import declare_on_all_nodes, set_policy
from broker.simulation import sim_cluster

pytestmark = pytest.mark.timeout(60)

DOWN = (404, "NOT_FOUND - home node 'n1' of durable queue 'q' in vhost '/' is down or inaccessible")


def publish_frames(body: bytes) -> list:
    return [C.Basic.Publish(0, "", "q"), header.ContentHeader(0, len(body), C.Basic.Properties()),
            pbody.ContentBody(body)]


# method -> (what it needs on the channel first, what it sends, the reply a served one gets)
METHODS = {
    "delete": ([], [C.Queue.Delete(0, "q")], C.Queue.DeleteOk),
    "purge": ([], [C.Queue.Purge(0, "q")], C.Queue.PurgeOk),
    "get": ([], [C.Basic.Get(0, "q")], C.Basic.GetOk),
    "consume": ([], [C.Basic.Consume(0, "q", "c1")], C.Basic.ConsumeOk),
    "cancel": ([(C.Basic.Consume(0, "q", "c1"), C.Basic.ConsumeOk)], [C.Basic.Cancel("c1")], C.Basic.CancelOk),
    "declare": ([], [C.Queue.Declare(0, "q", durable=True)], C.Queue.DeclareOk),
    "passive": ([], [C.Queue.Declare(0, "q", passive=True)], C.Queue.DeclareOk),
    "publish": ([(C.Confirm.Select(), C.Confirm.SelectOk)], publish_frames(b"p"), C.Basic.Ack),
    "commit": ([(C.Tx.Select(), C.Tx.SelectOk)], publish_frames(b"t") + [C.Tx.Commit()], C.Tx.CommitOk),
    "bind": ([], [C.Queue.Bind(0, "q", "amq.direct", "k")], C.Queue.BindOk),
    "unbind": ([(C.Queue.Bind(0, "q", "amq.direct", "k"), C.Queue.BindOk)],
               [C.Queue.Unbind(0, "q", "amq.direct", "k")], C.Queue.UnbindOk),
}
# what a queue whose only replica is down answers instead (the rest: channel.close DOWN)
REFUSED = {"cancel": C.Basic.CancelOk, "publish": C.Basic.Nack, "bind": C.Queue.BindOk,
           "unbind": C.Queue.UnbindOk}
ANSWERS = tuple({reply for _, _, reply in METHODS.values()} | set(REFUSED.values())
                | {C.Channel.Close, C.Connection.Close})


async def answer_to(client: SimAmqp, timeout: float = 45):
    """The first reply to the method in flight (deliveries and their content skipped), or a
    channel.close or connection.close."""
    with trio.fail_after(timeout):
        while True:
            obj = await client.next(timeout)
            if obj is None or isinstance(obj, ANSWERS):
                return obj


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("fault", ["kill", "partition", "pause", "stop_app"])
@pytest.mark.parametrize("mirrored", [True, False], ids=["all", "unmirrored"])
async def test_an_amqp_method_in_flight_when_the_leaders_node_fails_is_answered(
        tmp_path, autojump_clock, method, fault, mirrored):
    before, sent, served = METHODS[method]
    async with sim_cluster(tmp_path) as c:
        async with c.connect("n1") as c1:
            ch1 = await c1.channel()
            if mirrored:
                await set_policy(c, "ha-all", r"^q$", {"ha-mode": "all"})
                await declare_on_all_nodes(c, ch1, "q")
            else:
                await ch1.queue_declare("q", durable=True)
                await c.wait_for(lambda: all("q" in n.md.queues for n in c.nodes.values()))
                await ch1.confirm_delivery()
            for i in range(3):
                ch1.publish_nowait("q", b"m%d" % i)
            assert await ch1.wait_for_confirms(timeout=10)
        client, ok = await SimAmqp.connect(c, "n2")
        assert isinstance(ok, C.Connection.OpenOk)
        await client.method(1, C.Channel.Open())
        await client.expect(C.Channel.OpenOk)
        for ask, reply in before:
            await client.method(1, ask)
            await client.expect(reply)
        for part in sent:
            await client.method(1, part)
        await trio.sleep(0)  # on its way
        await fail(c, fault)
        answer = await answer_to(client)
    if fault == "stop_app" and not mirrored and isinstance(answer, served):
        return  # a stop is not instant: the method may be served before the app stops
    if mirrored or method in REFUSED:
        expected = served if mirrored else REFUSED[method]
        assert isinstance(answer, expected), (answer, getattr(answer, "reply_text", ""))
        if isinstance(answer, (C.Queue.DeleteOk, C.Queue.PurgeOk)):
            assert answer.message_count == 3
        elif isinstance(answer, C.Queue.DeclareOk):
            assert answer.message_count == 3
    else:
        assert isinstance(answer, C.Channel.Close), answer
        code, text = DOWN
        if method == "commit":
            text = text.replace("NOT_FOUND - ", "NOT_FOUND - tx.commit failed: ")
        assert (answer.reply_code, answer.reply_text) == (code, text)
