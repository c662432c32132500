"""The AMQP port of a real 2-node cluster with real pika (and a bare pamqp client where exact
bytes matter): message properties and headers of every field type arrive as published through
another node, messages cross between AMQP and warren's own client, RabbitMQ's errors close the
channel or the connection and nothing else, mandatory returns, reject-publish nacks, TTL."""

from __future__ import annotations

import datetime
import decimal
import time

import pika
import pytest
import trio

from broker.client.aio import open_connection
from cluster_procs import running_cluster

from amqp_raw import RawClient, all_properties, publish_frames
from wire.props import decode_raw

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 2,
                         server_args=["--users", "guest:guest,bob:bobpw"]) as c:
        c.ctl_ok("n1", "set_policy", "ha-all", "^ha\\.", '{"ha-mode":"all","ha-sync-mode":"automatic"}')
        yield c


def connect(cluster, node, user="guest", password="guest", **kw):
    return pika.BlockingConnection(pika.ConnectionParameters(
        "localhost", cluster.amqp_port(node), credentials=pika.PlainCredentials(user, password), **kw))


def test_every_property_and_field_type_arrives_exactly_through_another_node(cluster):
    setup = connect(cluster, "n1")
    setup.channel().queue_declare("ha.props", durable=True)
    setup.close()
    raw = all_properties()
    pub = RawClient(cluster.amqp_port("n2"))  # the queue's leader is n1
    pub.open_channel()
    pub.publish(1, "", "ha.props", b"payload", raw)
    pub.publish(1, "", "ha.props", b"second", raw)
    got = None
    deadline = time.monotonic() + 10
    while got is None and time.monotonic() < deadline:
        got = pub.get(1, "ha.props")
    ok, props, body = got
    assert body == b"payload" and props == raw  # byte for byte
    assert (ok.exchange, ok.routing_key) == ("", "ha.props")
    decoded = decode_raw(props).headers  # a 32-bit float stays one (pamqp reads it back)
    assert decoded["float32"] == 1.5 and decoded["float64"] == 0.1
    pub.close()
    # and pika reads every value with its type
    conn = connect(cluster, "n1")
    method, p, body = conn.channel().basic_get("ha.props", auto_ack=True)
    assert body == b"second"
    h = p.headers
    assert (p.content_type, p.content_encoding, p.delivery_mode, p.priority, p.correlation_id,
            p.reply_to, p.expiration, p.message_id, p.timestamp, p.type, p.user_id, p.app_id,
            p.cluster_id) == ("application/json", "gzip", 2, 7, "corr-1", "reply-here", "600000",
                              "msg-1", 1700000001, "kind", "guest", "app", "cluster-x")
    assert (h["bool"], h["int8"], h["uint8"], h["int16"], h["uint16"], h["int32"], h["uint32"],
            h["int64"]) == (True, -5, 250, -300, 60000, -70000, 4000000000, -(2 ** 40))
    assert h["decimal"] == decimal.Decimal("123.45")  # (pika reads floats as integers: not checked)
    assert h["string"] == "héllo" and h["array"] == [1, "two"] and h["table"] == {"inner": False}
    assert h["timestamp"] == datetime.datetime(2023, 11, 14, 22, 13, 20, tzinfo=datetime.timezone.utc)
    assert h["void"] is None and h["bytes"] == b"\x00\xff\x10"
    conn.close()


def test_messages_cross_between_amqp_and_warrens_own_client(cluster):
    conn = connect(cluster, "n2")
    ch = conn.channel()
    ch.queue_declare("cross", durable=False)
    ch.confirm_delivery()  # so the message is in the queue before the other client asks for it
    ch.basic_publish("", "cross", b"from pika",
                     pika.BasicProperties(content_type="text/plain", headers={"n": 1, "s": "x"},
                                          message_id="m1", timestamp=1700000000, type="t"))

    async def native():
        async with open_connection([cluster.client_addr("n1")]) as c:
            nch = await c.channel()
            got = await nch.basic_get("cross", auto_ack=True)
            await nch.basic_publish("", "cross", b"from warren",
                                    {"content_type": "application/json", "headers": {"k": "v", "i": 3},
                                     "type": "native", "timestamp": 1700000002, "delivery_mode": 2})
            return got

    got = trio.run(native)
    assert got.body == b"from pika"
    assert got.properties == {"content_type": "text/plain", "headers": {"n": 1, "s": "x"},
                              "message_id": "m1", "timestamp": 1700000000, "type": "t"}
    method, p, body = get_eventually(ch, "cross")
    assert body == b"from warren" and (method.exchange, method.routing_key) == ("", "cross")
    assert (p.content_type, p.headers, p.type, p.timestamp, p.delivery_mode) == \
        ("application/json", {"k": "v", "i": 3}, "native", 1700000002, 2)
    conn.close()


def get_eventually(ch, queue, timeout=10):
    """basic.get until a message comes (a publish through another connection may still be on
    its way)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ch.basic_get(queue, auto_ack=True)
        if got[0] is not None:
            return got
        time.sleep(0.02)
    raise AssertionError(f"no message in {queue} after {timeout} s")


def closed_channel(fn):
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
        fn()
    return e.value.reply_code, e.value.reply_text


def test_channel_errors_close_the_channel_only(cluster):
    conn = connect(cluster, "n1")
    other = connect(cluster, "n2")
    och = other.channel()
    och.queue_declare("mine", exclusive=True)
    och.queue_declare("durable.q", durable=True)
    och.exchange_declare("ex.direct", "direct")
    cases = [
        (lambda ch: ch.queue_declare("nope", passive=True), 404, "NOT_FOUND - no queue 'nope' in vhost '/'"),
        (lambda ch: ch.queue_declare("mine", passive=True), 405,
         "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'mine' in vhost '/'"),
        (lambda ch: ch.queue_declare("durable.q", durable=False), 406,
         "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'durable.q' in vhost '/': "
         "received 'false' but current is 'true'"),
        (lambda ch: ch.exchange_declare("ex.direct", "fanout"), 406,
         "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'ex.direct' in vhost '/': "
         "received 'fanout' but current is 'direct'"),
        (lambda ch: ch.queue_declare("amq.mine"), 403,
         "ACCESS_REFUSED - queue name 'amq.mine' contains reserved prefix 'amq.*'"),
        (lambda ch: ch.exchange_declare("nope", passive=True), 404, "NOT_FOUND - no exchange 'nope' in vhost '/'"),
        (lambda ch: ch.queue_bind("durable.q", "nope"), 404, "NOT_FOUND - no exchange 'nope' in vhost '/'"),
        # basic.ack has no reply: the channel's close reaches the next call
        (lambda ch: (ch.basic_ack(99), ch.queue_declare("durable.q", passive=True)), 406,
         "PRECONDITION_FAILED - unknown delivery tag 99"),
        (lambda ch: ch.exchange_delete("amq.direct"), 403, "ACCESS_REFUSED"),
        (lambda ch: ch.queue_declare("x", arguments={"x-max-length": -1}), 406,
         "PRECONDITION_FAILED - invalid arg 'x-max-length' for queue 'x' in vhost '/': {value_negative,-1}"),
    ]
    for fn, code, text in cases:
        ch = conn.channel()
        got = closed_channel(lambda: fn(ch))
        assert got[0] == code and got[1].startswith(text), (got, text)
    # the connection, the other connection and the node carry on
    ch = conn.channel()
    ch.queue_declare("durable.q", passive=True)
    och.basic_publish("", "durable.q", b"still here")
    assert get_eventually(ch, "durable.q")[2] == b"still here"
    assert conn.is_open and other.is_open
    conn.close()
    other.close()


def test_user_id_must_be_the_users_own(cluster):
    conn = connect(cluster, "n1", "bob", "bobpw")
    ch = conn.channel()
    ch.queue_declare("uid", durable=False)
    ch.basic_publish("", "uid", b"ok", pika.BasicProperties(user_id="bob"))
    code, text = closed_channel(lambda: (ch.basic_publish("", "uid", b"x", pika.BasicProperties(user_id="alice")),
                                         ch.queue_declare("uid", passive=True)))
    assert (code, text) == (406, "PRECONDITION_FAILED - user_id property set to 'alice' but "
                                 "authenticated user was 'bob'")
    ch = conn.channel()
    assert ch.queue_declare("uid", passive=True).method.message_count == 1
    conn.close()


def test_connection_errors_and_refusals(cluster):
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as e:
        connect(cluster, "n1", virtual_host="prod")
    assert "NOT_ALLOWED - vhost prod not found" in str(e.value)
    with pytest.raises(pika.exceptions.ProbableAuthenticationError) as e:
        connect(cluster, "n1", "guest", "wrong")
    assert "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN" in str(e.value)
    conn = connect(cluster, "n1")
    ch = conn.channel()
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
        ch.basic_qos(prefetch_size=10)
    assert e.value.reply_code == 540 and "prefetch_size!=0" in e.value.reply_text
    rows = cluster.ctl_json("n1", "list_connections")
    assert all(r["protocol"] in ("AMQP 0-9-1", "warren") for r in rows)


def test_a_vhost_of_its_own_through_pika(cluster):
    """amqp://host/v: the same queue and exchange names as in "/" are other queues and
    exchanges, errors name the vhost, and deleting the vhost closes the connection (320)."""
    cluster.ctl_ok("n1", "add_vhost", "v")
    cluster.ctl_ok("n1", "set_permissions", "-p", "v", "guest", ".*", ".*", ".*")
    try:
        root = connect(cluster, "n1").channel()
        tenant_conn = pika.BlockingConnection(pika.URLParameters(
            f"amqp://guest:guest@localhost:{cluster.amqp_port('n2')}/v"))
        tenant = tenant_conn.channel()
        for ch, body in ((root, b"root"), (tenant, b"tenant")):
            ch.queue_declare("vh.q")
            ch.exchange_declare("vh.x", "topic")
            ch.queue_bind("vh.q", "vh.x", "a.#")
            ch.basic_publish("vh.x", "a.b", body)
        time.sleep(0.3)
        assert root.basic_get("vh.q", auto_ack=True)[2] == b"root"
        assert tenant.basic_get("vh.q", auto_ack=True)[2] == b"tenant"
        assert root.basic_get("vh.q", auto_ack=True)[0] is None
        tenant.exchange_delete("vh.x")
        root.basic_publish("vh.x", "a.b", b"still routed in /")
        time.sleep(0.3)
        assert root.basic_get("vh.q", auto_ack=True)[2] == b"still routed in /"
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as e:
            tenant.basic_publish("vh.x", "a.b", b"x")
            tenant.queue_declare("vh.q", passive=True)
        assert e.value.reply_text == "NOT_FOUND - no exchange 'vh.x' in vhost 'v'"
        rows = cluster.ctl_json("n1", "list_bindings", "-p", "v")
        assert [(r["source_name"], r["destination_name"]) for r in rows] == [("", "vh.q")]
        assert [r["name"] for r in cluster.ctl_json("n2", "list_queues", "-p", "v")] == ["vh.q"]
        cluster.ctl_ok("n1", "delete_vhost", "v")
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as e:
            tenant_conn.process_data_events(time_limit=5)
            tenant_conn.channel()
        assert (e.value.reply_code, e.value.reply_text) == (320, "CONNECTION_FORCED - vhost 'v' is deleted")
        assert root.queue_declare("vh.q", passive=True).method.message_count == 0
        root.queue_delete("vh.q")
        root.exchange_delete("vh.x")
    finally:
        if "v" in [r["name"] for r in cluster.ctl_json("n1", "list_vhosts")]:
            cluster.ctl_ok("n1", "delete_vhost", "v")


def test_mandatory_returns_and_reject_publish_nacks_with_pika(cluster):
    conn = connect(cluster, "n2")
    ch = conn.channel()
    ch.confirm_delivery()
    returned = []
    ch.add_on_return_callback(lambda c, method, props, body: returned.append((method.reply_code, body)))
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("amq.direct", "no.such.binding", b"lost", mandatory=True)
    ch.queue_declare("full", arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    ch.basic_publish("", "full", b"1")
    ch.basic_publish("", "full", b"2")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "full", b"3")
    assert ch.queue_declare("full", passive=True).method.message_count == 2
    ch.basic_publish("amq.fanout", "", b"to nobody")  # not mandatory: confirmed and dropped
    conn.close()


def test_a_mandatory_publish_sent_in_one_write_with_plain_ones_comes_back(cluster):
    """Mandatory and plain publishes to one exchange and key with no binding, in one write (so
    one read): every mandatory message comes back as basic.return before the confirm that
    covers it; the plain ones are only confirmed."""
    from pamqp import commands as C
    from pamqp import header
    pub = RawClient(cluster.amqp_port("n1"))
    pub.open_channel()
    pub.method(1, C.Confirm.Select())
    pub.expect(C.Confirm.SelectOk)
    flags = [False, True, False, True, True, False]
    pub.send(b"".join(publish_frames(1, "amq.direct", "no.binding", b"m%d" % tag, mandatory=fl)
                      for tag, fl in enumerate(flags, 1)))
    returned, confirmed, returned_after_confirm = [], set(), []
    while len(confirmed) < len(flags):
        _, obj, _ = pub.next()
        if isinstance(obj, C.Basic.Return):
            assert obj.reply_code == 312 and obj.routing_key == "no.binding"
            pub.expect(header.ContentHeader)
            _, body, _ = pub.next()
            tag = int(body.value[1:])
            returned.append(tag)
            if tag in confirmed:
                returned_after_confirm.append(tag)
        else:
            assert isinstance(obj, C.Basic.Ack), obj
            upto = obj.delivery_tag
            confirmed |= set(range(1, upto + 1)) if obj.multiple else {upto}
    assert returned == [tag for tag, fl in enumerate(flags, 1) if fl]
    assert returned_after_confirm == []
    pub.close()


def test_message_ttl_expires_without_a_consumer(cluster):
    conn = connect(cluster, "n1")
    ch = conn.channel()
    ch.queue_declare("ha.ttl", arguments={"x-message-ttl": 300})
    for i in range(5):
        ch.basic_publish("", "ha.ttl", b"%d" % i)
    assert ch.queue_declare("ha.ttl", passive=True).method.message_count == 5
    time.sleep(0.8)
    assert ch.queue_declare("ha.ttl", passive=True).method.message_count == 0
    rows = {r["name"]: r for r in cluster.ctl_json("n2", "list_queues", "name", "messages", "mirror_pids")}
    assert rows["ha.ttl"]["messages"] == 0 and rows["ha.ttl"]["mirror_pids"]
    conn.close()


def test_large_messages_in_many_frames_through_a_mirrored_queue(cluster):
    conn = connect(cluster, "n1")
    conn.channel().queue_declare("ha.big")  # led by n1, mirrored on n2
    conn.close()
    conn = connect(cluster, "n2")
    ch = conn.channel()
    ch.confirm_delivery()
    bodies = [b"a" * 3_000_000, b"small", bytes(range(256)) * 12_000, b""]
    for body in bodies:
        ch.basic_publish("", "ha.big", body)  # confirmed: on the leader and its mirror
    got = [get_eventually(ch, "ha.big")[2] for _ in bodies]
    assert got == bodies
    conn.close()


def test_a_restricted_user_is_refused_per_channel_and_warrenctl_manages_users(cluster):
    """warrenctl's user commands (RabbitMQ's shapes and errors), then pika as a user whose
    permissions are `^perf\\.` regexes: every refusal closes its channel only."""
    assert "Adding user \"perf\"" in cluster.ctl("n1", "add_user", "perf", "pw").stderr
    cluster.ctl_ok("n2", "set_permissions", "perf", "^perf\\.", "^perf\\.", "^perf\\.")
    cluster.ctl_ok("n1", "add_user", "nobody", "pw")
    cluster.ctl_ok("n1", "set_user_tags", "nobody", "monitoring", "management")
    users = cluster.ctl_ok("n2", "list_users").splitlines()
    assert users[:2] == ["Listing users ...", "user\ttags"]
    assert "perf\t[]" in users and "nobody\t[monitoring, management]" in users
    assert "guest\t[administrator]" in users and not any("pw" in line for line in users)
    perms = cluster.ctl_ok("n1", "list_permissions", "-p", "/").splitlines()
    assert perms[0] == 'Listing permissions for vhost "/" ...'
    assert "perf\t^perf\\.\t^perf\\.\t^perf\\." in perms and "guest\t.*\t.*\t.*" in perms
    assert cluster.ctl_ok("n1", "list_user_permissions", "-q", "perf").splitlines()[-1] == \
        "/\t^perf\\.\t^perf\\.\t^perf\\."
    for args, error in ((("add_user", "perf", "x"), "Error: user 'perf' already exists"),
                        (("delete_user", "ghost"), "Error: user 'ghost' does not exist"),
                        (("set_permissions", "-p", "x", "perf", ".*", ".*", ".*"),
                         "Error: vhost 'x' does not exist"),
                        (("set_permissions", "perf", "(", ".*", ".*"),
                         "Error: invalid regular expression '('")):
        r = cluster.ctl("n1", *args)
        assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith(error), r.stderr
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as e:
        connect(cluster, "n1", "nobody", "pw")
    assert "NOT_ALLOWED - access to vhost '/' refused for user 'nobody'" in str(e.value)

    conn = connect(cluster, "n1", "perf", "pw")
    ok = conn.channel()
    ok.queue_declare("perf.q")
    refused = "ACCESS_REFUSED - access to {} in vhost '/' refused for user 'perf'"
    cases = [
        (lambda ch: ch.queue_declare("other"), "queue 'other'"),
        (lambda ch: ch.exchange_declare("other.x", "fanout"), "exchange 'other.x'"),
        (lambda ch: ch.queue_bind("perf.q", "amq.fanout"), "exchange 'amq.fanout'"),
        (lambda ch: (ch.basic_publish("amq.direct", "k", b"x"), ch.queue_declare("perf.q", passive=True)),
         "exchange 'amq.direct'"),
        (lambda ch: ch.queue_delete("other"), "queue 'other'"),
        (lambda ch: ch.basic_get("other"), "queue 'other'"),
    ]
    for fn, what in cases:
        ch = conn.channel()
        assert closed_channel(lambda: fn(ch)) == (403, refused.format(what))
    ok.exchange_declare("perf.x", "fanout")
    ok.queue_bind("perf.q", "perf.x")
    ok.basic_publish("perf.x", "", b"through perf.x")
    assert get_eventually(ok, "perf.q")[2] == b"through perf.x"
    assert conn.is_open
    conn.close()
