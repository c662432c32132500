"""Virtual hosts on a simulated cluster: the same queue name in two vhosts is two mirrored
queues, each with its own vhost's policies; warrenctl's -p; deleting a vhost removes what it
holds on every node (across a change of the log's leader) and closes the connections into it."""

from __future__ import annotations

import pytest
import trio

from broker.client.errors import AMQPError, ConnectionClosedByBroker
from broker.control import ctl_call
from broker.session import SessionDriver
from broker.simulation import PEER_PORT, SIM_USER, sim_cluster
from mirroring.records import qualify
from wire import messages as m
from wire.errors import ProtocolError

pytestmark = pytest.mark.timeout(30)
VQ = qualify("v", "q")


def ctl_via(c):
    async def ctl(via, command, **args):
        return await ctl_call(c.net.host(via), via, PEER_PORT, "test", b"s", command, args)
    return ctl


async def add_vhost(c, ctl, via="n1", name="v"):
    """A vhost, in which guest and the simulation's user may do everything (as in RabbitMQ, a
    new vhost grants no one anything)."""
    await ctl(via, "add_vhost", name=name, description="tenant")
    for user in ("guest", SIM_USER[0]):
        await ctl(via, "set_permissions", vhost=name, user=user, configure=".*", write=".*",
                  read=".*")
    await c.wait_for(lambda: all(name in n.md.vhosts for n in c.nodes.values()
                                 if n.app_running), 10, "the vhost everywhere")


async def test_the_same_queue_name_in_two_vhosts_is_two_queues_with_their_own_policies(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        ctl = ctl_via(c)
        await add_vhost(c, ctl)
        await ctl("n1", "set_policy", vhost="v", name="ha", pattern=".*",
                  definition='{"ha-mode":"all","ha-sync-mode":"automatic"}')
        async with c.connect("n1") as root, c.connect("n1", vhost="v") as tenant:
            ch_root, ch_v = await root.channel(), await tenant.channel()
            await ch_root.queue_declare("q", durable=True)
            await ch_v.queue_declare("q", durable=True)
            await ch_root.confirm_delivery()
            await ch_v.confirm_delivery()
            await ch_root.basic_publish("", "q", b"root")
            for body in (b"v1", b"v2"):
                await ch_v.basic_publish("", "q", body)
            await c.wait_for(lambda: all(set(n.md.queues[VQ].synced) == {"n2", "n3"}
                                         for n in c.nodes.values()), 10, "v's q mirrored")
            assert all(n.md.queues["q"].mirrors == () for n in c.nodes.values())
            assert VQ in c.nodes["n3"].router.replicas and "q" not in c.nodes["n3"].router.replicas
            assert (await ch_root.basic_get("q", auto_ack=True)).body == b"root"
            assert await ch_root.basic_get("q", auto_ack=True) is None
            again = await ch_v.queue_declare("q", durable=True)
            assert (again.queue, again.message_count) == ("q", 2)
            assert [(await ch_v.basic_get("q", auto_ack=True)).body for _ in range(2)] == \
                [b"v1", b"v2"]
            with pytest.raises(AMQPError, match="no queue 'r' in vhost 'v'"):
                await ch_v.queue_declare("r", passive=True)
        rows = await ctl("n2", "list_queues", vhost="v", columns=["name", "policy", "mirror_pids"])
        assert [(r["name"], r["policy"], len(r["mirror_pids"])) for r in rows] == [("q", "ha", 2)]
        rows = await ctl("n2", "list_queues", columns=["name", "policy"])
        assert rows == [{"name": "q", "policy": ""}]
        assert [p["vhost"] for p in await ctl("n3", "list_policies", vhost="v")] == ["v"]
        assert await ctl("n3", "list_policies") == []
        bindings = await ctl("n1", "list_bindings", vhost="v")
        assert [(b["source_name"], b["destination_name"]) for b in bindings] == [("", "q")]
        assert {x["name"] for x in await ctl("n1", "list_exchanges", vhost="v")} == {
            "", "amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"}
        assert [v["name"] for v in await ctl("n1", "list_vhosts")] == ["/", "v"]
        with pytest.raises(ProtocolError, match="vhost 'nope' does not exist"):
            await ctl("n1", "list_queues", vhost="nope")
        with pytest.raises(ProtocolError, match="no queue 'r' in vhost 'v'"):
            await ctl("n1", "purge_queue", vhost="v", queue="r")
        await ctl("n1", "clear_policy", vhost="v", name="ha")
        await c.wait_for(lambda: all(n.md.queues[VQ].mirrors == () for n in c.nodes.values()),
                         10, "the vhost's policy cleared")


async def test_an_unknown_vhost_is_refused_at_login(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        with pytest.raises(ConnectionClosedByBroker) as ei:
            async with c.connect("n1", vhost="nope"):
                pass
        assert (ei.value.reply_code, ei.value.reply_text) == (530, "vhost nope not found")


async def test_deleting_a_vhost_removes_it_everywhere_across_a_leader_change(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        ctl = ctl_via(c)
        await add_vhost(c, ctl)
        await ctl("n1", "set_policy", vhost="v", name="ha", pattern=".*",
                  definition='{"ha-mode":"all"}')
        old = c.nodes["n1"].cluster.leader
        home, via = [n for n in c.nodes if n != old]
        with pytest.raises(ConnectionClosedByBroker) as closed:
            async with c.connect(home, vhost="v") as tenant:
                ch = await tenant.channel()
                await ch.queue_declare("q", durable=True)
                await ch.confirm_delivery()
                await ch.basic_publish("", "q", b"x")
                await c.wait_for(lambda: all(VQ in n.router.replicas for n in c.nodes.values()),
                                 10, "a replica on every node")
                # the log's leader goes: a new one commits the deletion, and the node that
                # was away hears of it when it comes back
                c.kill(old)
                await c.wait_for(lambda: c.nodes[via].cluster.leader not in (None, old), 20,
                                 "a new log leader")
                await ctl(via, "delete_vhost", name="v")
                await c.wait_for(lambda: not c.nodes[home].sessions, 10, "the connection closed")
                await ch.queue_declare("again")
        assert (closed.value.reply_code, closed.value.reply_text) == (320, "vhost 'v' is deleted")
        await c.restart(old)
        await c.wait_running(["n1", "n2", "n3"])
        await c.wait_for(lambda: all(not any(k.startswith("v\x00") for k in n.router.replicas)
                                     for n in c.nodes.values()), 10, "no replica of v left")
        for n in c.nodes.values():
            md = n.md
            assert "v" not in md.vhosts and VQ not in md.queues
            assert all(x.vhost == "/" for x in md.exchanges.values())
            assert all(p.vhost == "/" for p in md.policies.values())
        with pytest.raises(ProtocolError, match="vhost 'v' does not exist"):
            await ctl("n1", "delete_vhost", name="v")
        with pytest.raises(ProtocolError, match="vhost '/' cannot be deleted"):
            await ctl("n1", "delete_vhost", name="/")


def test_warrenctl_sends_the_p_vhost_and_names_it_in_headers(capsys):
    from broker.ctl import _request, build_parser

    def request(*argv):
        return _request(build_parser().parse_args(list(argv)))

    payload, columns, header = request("list_queues", "-p", "v", "name")
    assert payload == {"columns": ["name"], "vhost": "v"} and header == "Listing queues for vhost v ..."
    assert request("list_policies", "--vhost", "v")[2] == 'Listing policies for vhost "v" ...'
    assert request("list_vhosts")[0] == {}
    assert request("delete_queue", "-p", "v", "q")[0] == {"queue": "q", "vhost": "v"}
    assert request("sync_queue", "q")[0] == {"queue": "q", "vhost": "/"}
    assert request("add_vhost", "v", "--description", "tenant")[0] == {
        "name": "v", "description": "tenant", "tracing": False}
    assert request("set_policy", "-p", "v", "ha", ".*", "{}")[0]["vhost"] == "v"
    assert 'for vhost "v"' in capsys.readouterr().err


async def bound_exchange(node, vhost, exchange, queue, key):
    """A direct `exchange` in `vhost` with `queue` bound to it by `key` (a session on `node`:
    the native client declares no exchanges)."""
    out: list = []
    s = SessionDriver.open(node, f"{node.name}:40009", "guest", "setup", out.append, vhost)
    steps = [m.ChannelOpen(1, 1), m.ExchangeDeclare(2, 1, exchange, "direct", False, True, False,
                                                    False, {}),
             m.QueueBind(3, 1, queue, exchange, key, {})]
    for step in steps:
        await s.handle(step)
        with trio.fail_after(5):
            while not any(type(x) in (m.Reply, m.Fail) and x.rid == step.rid for x in out):
                await trio.sleep(0.01)
    assert not [x for x in out if type(x) is m.Fail], out


async def test_a_queue_of_another_vhost_dead_letters_within_its_vhost(tmp_path, autojump_clock):
    """`x-dead-letter-exchange: ""` names v's default exchange (a rejected message lands in v's
    dlq, not in /'s), and a named dead-letter exchange is v's; x-death names the queue without
    its vhost."""
    async with sim_cluster(tmp_path) as c:
        ctl = ctl_via(c)
        await add_vhost(c, ctl)
        async with c.connect("n1") as root, c.connect("n2", vhost="v") as tenant:
            ch_root, ch = await root.channel(), await tenant.channel()
            await ch_root.queue_declare("dlq", durable=True)  # /'s: must stay empty
            await ch_root.queue_declare("via-x", durable=True)
            for name in ("dlq", "via-x"):
                await ch.queue_declare(name, durable=True)
            for vhost in ("v", "/"):  # a dlx in each: v's queue must use v's
                await bound_exchange(c.nodes["n1"], vhost, "dlx", "via-x", "dead")
            await ch.queue_declare("work", durable=True, arguments={
                "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dlq"})
            await ch.queue_declare("work-x", durable=True, arguments={
                "x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "dead"})
            await ch.confirm_delivery()
            for queue in ("work", "work-x"):
                await ch.basic_publish("", queue, b"job " + queue.encode())
                got = await ch.basic_get(queue)
                ch.basic_reject(got.delivery_tag, requeue=False)
            for queue, source in (("dlq", "work"), ("via-x", "work-x")):
                await c.wait_for(lambda q=queue: c.nodes["n2"].md.queues.get(qualify("v", q))
                                 is not None, 5, "declared")
                dead = None
                with trio.move_on_after(5):
                    while dead is None:
                        dead = await ch.basic_get(queue, auto_ack=True)
                        await trio.sleep(0.05)
                assert dead is not None and dead.body == b"job " + source.encode()
                [death] = dead.properties["headers"]["x-death"]
                assert (death["queue"], death["reason"], death["exchange"]) == (source, "rejected", "")
            for queue in ("dlq", "via-x"):
                assert await ch_root.basic_get(queue, auto_ack=True) is None


async def test_maintenance_status_names_a_queue_by_name_and_vhost_and_reads_keys_back(
        tmp_path, autojump_clock):
    """What a rolling restart reads shows a queue of v as RabbitMQ names it (name and vhost
    columns, "q (vhost v)" in its lines), and the mirror counts it sends back are by key."""
    from broker.rolling import waiting_line
    async with sim_cluster(tmp_path) as c:
        ctl = ctl_via(c)
        await add_vhost(c, ctl)
        await ctl("n1", "set_policy", vhost="v", name="ha", pattern=".*",
                  definition='{"ha-mode":"all"}')
        async with c.connect("n1", vhost="v") as tenant:
            await (await tenant.channel()).queue_declare("q", durable=True)
        await c.wait_for(lambda: all(len(n.md.queues[VQ].synced) == 2 for n in c.nodes.values()),
                         10, "v's q mirrored")
        st = await ctl("n2", "maintenance_status", least_mirrors={VQ: 3})
        [row] = st["queues"]
        assert (row["name"], row["vhost"], row["mirrored"]) == ("q", "v", True)
        assert st["waiting"] == [{"name": "q", "vhost": "v", "why": "2 mirror(s) of 3 placed"}]
        assert waiting_line(st, st["waiting"]) == \
            "1 queue(s): q (vhost v) (2 mirror(s) of 3 placed; 0 messages)"
        assert (await ctl("n2", "maintenance_status", least_mirrors={VQ: 2}))["waiting"] == []
