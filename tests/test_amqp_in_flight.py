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
from test_sim_in_flight import RoundFault, fail, queue_of_three, round_seeds, run_rounds
from broker.simulation import sim_cluster

pytestmark = pytest.mark.timeout(60)

DOWN = (404, "NOT_FOUND - home node 'n1' of durable queue 'q' in vhost '/' is down or inaccessible")


def publish_frames(queue: str, body: bytes) -> list:
    return [C.Basic.Publish(0, "", queue), header.ContentHeader(0, len(body), C.Basic.Properties()),
            pbody.ContentBody(body)]


def methods(queue: str) -> dict:
    """method -> (what it needs on the channel first, what it sends, the reply a served one gets)."""
    return {
        "delete": ([], [C.Queue.Delete(0, queue)], C.Queue.DeleteOk),
        "purge": ([], [C.Queue.Purge(0, queue)], C.Queue.PurgeOk),
        "get": ([], [C.Basic.Get(0, queue)], (C.Basic.GetOk, C.Basic.GetEmpty)),
        "consume": ([], [C.Basic.Consume(0, queue, "c1")], C.Basic.ConsumeOk),
        "cancel": ([(C.Basic.Consume(0, queue, "c1"), C.Basic.ConsumeOk)], [C.Basic.Cancel("c1")],
                   C.Basic.CancelOk),
        "declare": ([], [C.Queue.Declare(0, queue, durable=True)], C.Queue.DeclareOk),
        "passive": ([], [C.Queue.Declare(0, queue, passive=True)], C.Queue.DeclareOk),
        "publish": ([(C.Confirm.Select(), C.Confirm.SelectOk)], publish_frames(queue, b"p"), C.Basic.Ack),
        "commit": ([(C.Tx.Select(), C.Tx.SelectOk)], publish_frames(queue, b"t") + [C.Tx.Commit()],
                   C.Tx.CommitOk),
        "bind": ([], [C.Queue.Bind(0, queue, "amq.direct", "k")], C.Queue.BindOk),
        "unbind": ([(C.Queue.Bind(0, queue, "amq.direct", "k"), C.Queue.BindOk)],
                   [C.Queue.Unbind(0, queue, "amq.direct", "k")], C.Queue.UnbindOk),
    }


METHODS = methods("q")
# what a queue whose only replica is down answers instead (the rest: channel.close DOWN)
REFUSED = {"cancel": C.Basic.CancelOk, "publish": C.Basic.Nack, "bind": C.Queue.BindOk,
           "unbind": C.Queue.UnbindOk}
ANSWERS = (C.Queue.DeleteOk, C.Queue.PurgeOk, C.Basic.GetOk, C.Basic.GetEmpty, C.Basic.ConsumeOk,
           C.Basic.CancelOk, C.Queue.DeclareOk, C.Basic.Ack, C.Basic.Nack, C.Tx.CommitOk,
           C.Queue.BindOk, C.Queue.UnbindOk, C.Channel.Close, C.Connection.Close)


async def send_method(c, via: str, before: list, sent: list) -> SimAmqp:
    """An AMQP client connected to `via` with channel 1 open, which has done `before` (each
    method and its reply) and sent `sent` (the method in flight)."""
    client, ok = await SimAmqp.connect(c, via)
    assert isinstance(ok, C.Connection.OpenOk), ok
    await client.method(1, C.Channel.Open())
    await client.expect(C.Channel.OpenOk)
    for ask, reply in before:
        await client.method(1, ask)
        await client.expect(reply)
    for part in sent:
        await client.method(1, part)
    return client


async def answer_to(client: SimAmqp, timeout: float = 45):
    """The first reply to the method in flight (deliveries and their content skipped), a
    channel.close or connection.close, or None if the connection ended."""
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
    if method == "get":
        served = C.Basic.GetOk  # the queue holds 3 messages here
    async with sim_cluster(tmp_path) as c:
        await queue_of_three(c, mirrored)
        client = await send_method(c, "n2", before, sent)
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


async def _amqp_round(c, rng, round_no: int) -> str:
    """tests/test_sim_in_flight.py's random round through the AMQP port: one random method of
    METHODS on a random queue through a random node, one random fault on a random node while it
    is on its way (RoundFault); returns how the method was answered."""
    via, anyone = rng.choice(c.names), rng.choice(c.names)
    queue, method = rng.choice(["m.q", "u.q"]), rng.choice(sorted(METHODS))
    fault = RoundFault(c, rng, queue, anyone)
    before, sent, _ = methods(queue)[method]
    out: list = []

    async def answer(client):
        try:
            got = await answer_to(client)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            got = None
        out.append(type(got).__name__ if got is not None else "connection ended")

    with trio.fail_after(30):
        client = None
        try:
            async with c.connect(anyone) as setup:  # (a delete may have taken it)
                await (await setup.channel()).queue_declare(queue, durable=True)
            client = await send_method(c, via, before, sent)
            async with trio.open_nursery() as ops:
                ops.start_soon(answer, client)
                await fault.run()
        finally:
            await fault.mend_if_broken()
            if client is not None:
                await client.stream.aclose()
    await c.wait_running(c.names, timeout=60)
    return f"{method} {queue} via {via}, {fault}: {out[0]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", round_seeds())
def test_random_amqp_methods_through_random_faults_are_all_answered(tmp_path, seed):
    """Seeded rounds of one AMQP method and one fault each (on any node: the leader's, a
    mirror's, the client's own), on a mirrored and an unmirrored queue; every method is answered
    (or its connection closed) within 30 simulated seconds. `WARREN_ROUND_SEEDS=0-299 pytest
    tests/test_amqp_in_flight.py -k random -n 2` hunts longer."""
    run_rounds(tmp_path, seed, _amqp_round)
