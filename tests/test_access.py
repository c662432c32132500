"""Users, tags and permissions: the password hashes and permission patterns
(mirroring/access.py), the metadata's user and permission changes and their snapshot round trip,
and on a simulated cluster: replication across a leader change, and enforcement on the native
client port (channel-only 403 ACCESS_REFUSED, refusal at open)."""

from __future__ import annotations

import base64
import hashlib

import pytest
import trio
from msgspec import msgpack

from broker import access_control
from broker.client.aio import open_connection
from broker.client.errors import AMQPConnectionError, ChannelClosedByBroker, ConnectionClosedByBroker
from broker.simulation import CLIENT_PORT, sim_cluster
from mirroring import changes as c
from mirroring.access import Access, check_password, hash_password, implied_tags, parse_tags
from mirroring.metadata import Metadata, MetaError

pytestmark = pytest.mark.timeout(30)
from mirroring.records import Permission, User


# --- hashing and patterns ------------------------------------------------------------------------

def test_a_hash_is_rabbitmqs_salted_sha256_and_checks_only_its_password():
    salt = b"\x01\x02\x03\x04"
    stored = hash_password("s3cret", salt)
    assert base64.b64decode(stored) == salt + hashlib.sha256(salt + b"s3cret").digest()
    assert check_password(stored, "s3cret")
    assert not check_password(stored, "s3cret ")
    assert not check_password(stored, "")
    assert not check_password("not base64!", "s3cret")
    assert not check_password(base64.b64encode(b"short").decode(), "s3cret")


def test_two_hashes_of_one_password_differ_by_their_salt():
    a, b = access_control.new_hash("pw"), access_control.new_hash("pw")
    assert a != b and check_password(a, "pw") and check_password(b, "pw")


def test_tags_parse_and_imply_as_rabbitmqs():
    assert parse_tags("administrator, management management") == ("administrator", "management")
    assert parse_tags("") == ()
    assert implied_tags(("administrator",)) == {"administrator", "policymaker", "monitoring",
                                                 "management"}
    assert implied_tags(("monitoring",)) == {"monitoring", "management"}
    assert implied_tags(("impersonator",)) == set()


def test_patterns_match_anywhere_unless_anchored_and_the_default_exchange_is_amq_default():
    acc = Access("u", "/", 0, Permission("u", "/", "^perf\\.", "perf", ""))
    assert acc.allowed("configure", "queue", "perf.1")
    assert not acc.allowed("configure", "queue", "x.perf.1")
    assert acc.allowed("write", "queue", "x.perf.1")  # unanchored: anywhere in the name
    assert not acc.allowed("read", "queue", "perf.1")  # the empty pattern matches nothing
    assert not acc.allowed("write", "exchange", "")
    assert Access("u", "/", 0, Permission("u", "/", "", "^amq\\.default$", "")).allowed(
        "write", "exchange", "")
    with pytest.raises(Exception) as info:
        acc.check("read", "queue", "perf.1")
    assert info.value.text == "access to queue 'perf.1' in vhost '/' refused for user 'u'"
    assert not Access("u", "/", 0, None).allowed("configure", "queue", "q")  # no permissions


# --- the metadata ------------------------------------------------------------------------------------

def _md_with_user() -> Metadata:
    md = Metadata()
    md.apply(c.UserAdd(User("u", hash_password("pw", b"salt"), ("management",))))
    return md


def test_user_and_permission_changes_check_what_they_name_and_move_the_access_version():
    md = _md_with_user()
    with pytest.raises(MetaError, match="user 'u' already exists"):
        md.apply(c.UserAdd(User("u", "x")))
    with pytest.raises(MetaError, match="user 'nobody' does not exist"):
        md.apply(c.PermissionSet(Permission("nobody", "/", ".*", ".*", ".*")))
    with pytest.raises(MetaError, match="vhost 'x' does not exist"):
        md.apply(c.PermissionSet(Permission("u", "x", ".*", ".*", ".*")))
    before = md.access_version
    md.apply(c.PermissionSet(Permission("u", "/", ".*", "", "")))
    assert md.access_version > before and md.access("u", "/").configure == ".*"
    md.apply(c.UserDelete("u"))
    assert md.access("u", "/") is None and not md.permissions


def test_users_and_permissions_survive_a_snapshot_and_the_wire():
    md = _md_with_user()
    md.apply(c.PermissionSet(Permission("u", "/", "^a", "^b", "^c")))
    change = c.PermissionSet(Permission("u", "/", "^a", "^b", "^c"))
    assert c.decode_change(msgpack.decode(msgpack.encode(change))) == change
    again = Metadata.from_snapshot(msgpack.decode(msgpack.encode(md.snapshot())))
    assert again.users == md.users and again.permissions == md.permissions
    assert again.digest() == md.digest() and again.vhosts == md.vhosts
    assert again.access_version == md.version


# --- a simulated cluster -------------------------------------------------------------------------

async def _ctl(c, node: str, command: str, **args):
    return await access_control.COMMANDS[command](c.nodes[node], args)


async def test_users_and_permissions_replicate_and_outlive_a_log_leader(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await _ctl(c, "n2", "add_user", name="alice", password="pw1")
        await _ctl(c, "n3", "set_permissions", vhost="/", user="alice", configure="^a",
                   write=".*", read=".*")
        await _ctl(c, "n1", "set_user_tags", name="alice", tags=["monitoring"])
        await c.wait_for(lambda: len({(n.md.version, n.md.digest()) for n in c.nodes.values()}) == 1
                         and all(n.md.users.get("alice", User("", "")).tags == ("monitoring",)
                                 and ("/", "alice") in n.md.permissions for n in c.nodes.values()))
        rows = await _ctl(c, "n1", "list_users")
        assert {"user": "alice", "tags": ["monitoring"]} in rows
        assert all(set(r) == {"user", "tags"} for r in rows)  # never a password or its hash
        leader = c.nodes["n1"].cluster.leader
        c.kill(leader)
        rest = [n for n in c.names if n != leader]
        await c.wait_for(lambda: c.nodes[rest[0]].cluster.leader in rest, what="a new leader")
        await _ctl(c, rest[0], "change_password", name="alice", password="pw2")
        await c.wait_for(lambda: all(check_password(c.nodes[n].md.users["alice"].password_hash, "pw2")
                                     for n in rest))
        assert (await _ctl(c, rest[1], "list_user_permissions", user="alice")) == [
            {"user": "alice", "vhost": "/", "configure": "^a", "write": ".*", "read": ".*"}]
        await c.restart(leader)
        await c.wait_running(c.names)
        md = c.nodes[leader].md
        assert check_password(md.users["alice"].password_hash, "pw2") and md.access("alice", "/")


async def test_seeded_users_are_administrators_with_every_permission_on_the_default_vhost(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, names=("n1",)) as c:
        md = c.nodes["n1"].md
        assert md.users["guest"].tags == ("administrator",)
        assert md.permissions[("/", "guest")] == Permission("guest", "/", ".*", ".*", ".*")
        assert check_password(md.users["guest"].password_hash, "guest")
        assert "guest" not in md.users["guest"].password_hash


def _connect(c, user: str, password: str):
    return open_connection([f"n1:{CLIENT_PORT}"], network=c.net.host("n1"), reconnect=False,
                           user=user, password=password)


async def test_a_restricted_user_is_refused_with_rabbitmqs_text_on_that_channel_only(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, names=("n1",)) as c:
        await _ctl(c, "n1", "add_user", name="perf", password="pw")
        await _ctl(c, "n1", "set_permissions", vhost="/", user="perf", configure="^perf\\.",
                   write="^perf\\.", read="^perf\\.")
        async with _connect(c, "perf", "pw") as conn:
            ok = await conn.channel()
            await ok.queue_declare("perf.q")
            cases = [
                (lambda ch: ch.queue_declare("other"),
                 "access to queue 'other' in vhost '/' refused for user 'perf'"),
                (lambda ch: ch.basic_publish("", "perf.q", b"x"),
                 "access to exchange 'amq.default' in vhost '/' refused for user 'perf'"),
                (lambda ch: ch.basic_consume("other"),
                 "access to queue 'other' in vhost '/' refused for user 'perf'"),
                (lambda ch: ch.queue_purge("other"),
                 "access to queue 'other' in vhost '/' refused for user 'perf'"),
                (lambda ch: ch.queue_delete("other"),
                 "access to queue 'other' in vhost '/' refused for user 'perf'"),
            ]
            for op, text in cases:
                bad = await conn.channel()
                try:
                    await op(bad)
                    await trio.sleep(1)  # a publish is refused asynchronously
                except ChannelClosedByBroker:
                    pass
                assert not bad.is_open
                err = bad.close_reason
                assert (err.reply_code, err.reply_text) == (403, text)
            # the connection and the other channel carry on
            await ok.queue_declare("perf.q2")
            assert await ok.basic_get("perf.q2") is None
        # the permissions change: a session sees it at its next operation
        async with _connect(c, "perf", "pw") as conn:
            ch = await conn.channel()
            await _ctl(c, "n1", "set_permissions", vhost="/", user="perf", configure=".*",
                       write=".*", read=".*")
            await ch.queue_declare("other")


async def test_a_user_without_permissions_in_the_vhost_is_refused_at_open(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, names=("n1",)) as c:
        await _ctl(c, "n1", "add_user", name="nobody", password="pw")
        with pytest.raises(AMQPConnectionError) as info:
            async with _connect(c, "nobody", "pw"):
                pass
        assert "(530) access to vhost '/' refused for user 'nobody'" in str(info.value)
        with pytest.raises(AMQPConnectionError) as info:
            async with _connect(c, "nobody", "wrong"):
                pass
        assert "login refused for user 'nobody'" in str(info.value)


async def test_the_users_option_seeds_the_first_boot_only(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, names=("n1",)) as c:
        await _ctl(c, "n1", "delete_user", name="sim")
        c.kill("n1")
        node = await c.restart("n1", users={"guest": "guest", "newcomer": "pw"})
        await c.wait_running(["n1"])
        assert set(node.md.users) == {"guest"}  # what the cluster holds, not the option


async def test_deleting_a_user_closes_its_connections(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, names=("n1",)) as c:
        await _ctl(c, "n1", "add_user", name="gone", password="pw")
        await _ctl(c, "n1", "set_permissions", vhost="/", user="gone", configure=".*",
                   write=".*", read=".*")
        async with _connect(c, "guest", "guest") as stays:
            with pytest.raises(ConnectionClosedByBroker) as info:
                async with _connect(c, "gone", "pw") as conn:
                    await conn.channel()
                    await _ctl(c, "n1", "delete_user", name="gone")
                    await trio.sleep(5)
            assert (info.value.reply_code, info.value.reply_text) == (320, "user 'gone' was deleted")
            await stays.channel()
