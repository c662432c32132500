"""The memory alarm: the watermark's forms (mirroring/alarm.py), the hysteresis and when freed
memory is handed back, how the option reaches the config, and on the simulated cluster how one
node's alarm blocks publishers on every node while consumers keep draining (broker/memory.py).
The real-process test is tests/test_process_memory_alarm.py."""

from __future__ import annotations

import pytest
import trio

from broker import config
from broker.config import ConfigError
from broker.memory import READ_BUDGET, NodeMemory, SimMemory
from broker.simulation import sim_cluster
from mirroring.alarm import CLEAR_RATIO, Alarms, MemoryAlarm, Watermark, parse_watermark

MiB = 1 << 20


# --- the watermark's forms ------------------------------------------------------------------------

@pytest.mark.parametrize("value, fraction", [
    ("0.4", 0.4), (0.4, 0.4), (".5", 0.5), ("1", 1.0), (1, 1.0), ("0", 0.0), (" 0.25 ", 0.25),
])
def test_a_number_is_a_fraction_of_memory(value, fraction):
    wm = parse_watermark(value)
    assert wm == Watermark(fraction=fraction)
    assert wm.limit(1000 * MiB) == int(1000 * MiB * fraction)


@pytest.mark.parametrize("value, size", [
    ("512MiB", 512 * MiB), ("512M", 512 * MiB), ("512 MiB", 512 * MiB), ("2GB", 2 * 10 ** 9),
    ("2GiB", 2 << 30), ("1.5GiB", 3 << 29), ("100MB", 100 * 10 ** 6), ("64kB", 64_000),
    ("64KiB", 64 << 10), ("64k", 64 << 10), ("1073741824B", 1 << 30), ("1TB", 10 ** 12),
])
def test_a_size_with_a_unit_is_absolute(value, size):
    wm = parse_watermark(value)
    assert wm == Watermark(absolute=size)
    assert wm.limit(1 << 40) == size == wm.limit(1 << 20)  # the machine's memory does not matter
    assert str(wm) == value.replace(" ", "")  # shown as it was given


@pytest.mark.parametrize("value, message", [
    ("40", "more than all the memory"),  # 40 means 40x the memory, not 40%: refused
    ("1.5", "more than all the memory"),
    ("-0.4", "expected a fraction"),
    ("512", "more than all the memory"),  # bytes need a unit
    ("512XB", "expected a fraction"),
    ("lots", "expected a fraction"),
    ("0MiB", "must be positive"),
    ("", "expected a fraction"),
    (True, "is not a memory high watermark"),
    ([1], "is not a memory high watermark"),
])
def test_bad_watermarks_are_refused_saying_what_is_accepted(value, message):
    with pytest.raises(ValueError, match=message):
        parse_watermark(value)


# --- hysteresis and trimming ----------------------------------------------------------------------

def test_the_alarm_goes_on_above_the_mark_and_off_only_below_the_clear_mark():
    alarm = MemoryAlarm(100 * MiB)
    assert alarm.clear_below == int(100 * MiB * CLEAR_RATIO) == 90 * MiB
    assert not alarm.observe(50 * MiB) and not alarm.on
    assert not alarm.observe(100 * MiB) and not alarm.on  # at the mark is not past it
    assert alarm.observe(100 * MiB + 1) and alarm.on  # changed: on
    assert not alarm.observe(200 * MiB) and alarm.on
    assert not alarm.observe(95 * MiB) and alarm.on  # below the mark, above the clear mark
    assert not alarm.observe(90 * MiB) and alarm.on
    assert alarm.observe(90 * MiB - 1) and not alarm.on  # changed: off
    assert not alarm.observe(99 * MiB) and not alarm.on  # between the marks, off stays off
    assert alarm.observe(101 * MiB) and alarm.on


def test_a_new_limit_applies_at_the_next_observation():
    alarm = MemoryAlarm(100 * MiB)
    alarm.observe(150 * MiB)
    alarm.set_limit(200 * MiB)
    assert alarm.observe(150 * MiB) and not alarm.on  # 150 < 180: cleared
    alarm.set_limit(100 * MiB)
    assert alarm.observe(150 * MiB) and alarm.on


def test_a_mark_of_zero_blocks_for_good_and_never_trims():
    alarm = MemoryAlarm(parse_watermark("0").limit(8 << 30))
    assert alarm.observe(1) and alarm.on
    assert not alarm.observe(0) and alarm.on
    assert not alarm.wants_trim(10 * MiB, 100.0)


def test_freed_memory_is_asked_back_only_where_the_decision_is_at_stake_and_at_most_once_a_second():
    alarm = MemoryAlarm(100 * MiB, trim_every=1.0)
    assert not alarm.wants_trim(99 * MiB, 0.0)  # off and below the mark: nothing at stake
    assert alarm.wants_trim(101 * MiB, 0.0)  # about to go on: look again after trimming
    alarm.trimmed(0.0)
    assert not alarm.wants_trim(101 * MiB, 0.5)  # not again so soon: the alarm goes on
    alarm.observe(101 * MiB)
    assert alarm.wants_trim(95 * MiB, 1.0)  # on and above the clear mark: maybe it is free
    alarm.trimmed(1.0)
    assert not alarm.wants_trim(95 * MiB, 1.9)
    assert alarm.wants_trim(95 * MiB, 2.0)
    assert not alarm.wants_trim(80 * MiB, 5.0)  # below the clear mark: it clears anyway


def test_any_alarm_in_the_cluster_blocks_and_a_gone_node_no_longer_counts():
    a = Alarms("n1")
    assert not a.blocked and a.reason == "" and a.nodes == []
    assert a.set_remote("n3", "node n3 uses 2GiB")  # changed: blocked
    assert a.blocked and a.nodes == ["n3"] and "node n3 uses 2GiB" in a.reason
    assert not a.set_local("node n1 uses 1GiB")  # still blocked: no change
    assert a.nodes == ["n1", "n3"] and a.reason.startswith("low on memory: node n1")
    assert not a.set_local(None)
    assert a.forget("n3") and not a.blocked  # its link went: unblocked
    assert not a.forget("n3")
    a.set_remote("n2", "x")
    assert a.forget_peers() and not a.blocked


class _Log:
    def __getattr__(self, name):
        return lambda *args, **kw: None


async def test_publishing_reads_bring_the_next_sample_forward_so_a_busy_loop_cannot_overshoot():
    """The timer samples every CHECK_EVERY seconds, but a loop busy with publishes runs it late:
    READ_BUDGET bytes read from publishers take a sample at once, so the node passes its mark by
    at most about that much (the real-process test holds the node near its mark this way)."""
    probe = SimMemory(used=50 * MiB)
    memory = NodeMemory("n1", parse_watermark("100MiB"), probe, _Log(), dict)
    memory.check(trio.current_time())
    assert not memory.blocked
    probe.used_bytes = 120 * MiB  # publishes came in; the timer has not run
    memory.took(READ_BUDGET - 1)
    assert not memory.blocked  # under the budget: no sample yet
    memory.took(1)
    assert memory.blocked and memory.alarm.used == 120 * MiB
    probe.used_bytes = 10 * MiB
    memory.took(READ_BUDGET // 2)  # a sample resets the count: half a budget takes none
    assert memory.blocked
    memory.took(READ_BUDGET // 2)
    assert not memory.blocked


# --- the option ----------------------------------------------------------------------------------

def test_the_option_from_flag_environment_and_toml(tmp_path, monkeypatch):
    monkeypatch.setenv("WARREN_HOME", str(tmp_path / "home"))
    base = {"WARREN_SECRET": "s"}
    assert config.load({}, env=base).memory_watermark == Watermark(fraction=0.4)  # RabbitMQ's default
    env = {**base, "WARREN_MEMORY_HIGH_WATERMARK": "512MiB"}
    assert config.load({}, env=env).memory_watermark == Watermark(absolute=512 * MiB)
    assert config.load({"memory_high_watermark": "0.6"}, env=env).memory_watermark == Watermark(fraction=0.6)
    for text, want in (("memory_high_watermark = 0.3\n", Watermark(fraction=0.3)),
                       ("memory_high_watermark = '2GB'\n", Watermark(absolute=2 * 10 ** 9))):
        path = tmp_path / "node.toml"
        path.write_text(text)
        assert config.load({"config": str(path)}, env=base).memory_watermark == want
        # the environment beats the file
        assert config.load({"config": str(path)}, env=env).memory_watermark == Watermark(absolute=512 * MiB)


@pytest.mark.parametrize("source, message", [
    ({"flags": {"memory_high_watermark": "40"}}, "memory_high_watermark: memory high watermark '40' is more than all"),
    ({"env": {"WARREN_MEMORY_HIGH_WATERMARK": "big"}}, "memory_high_watermark: memory high watermark 'big'"),
    ({"toml": "memory_high_watermark = true\n"}, "memory_high_watermark must be a number or a string, not a boolean"),
    ({"toml": "memory_high_watermark = '3 apples'\n"}, "memory high watermark '3 apples'"),
])
def test_bad_option_values_are_clear_errors(tmp_path, monkeypatch, source, message):
    monkeypatch.setenv("WARREN_HOME", str(tmp_path / "home"))
    flags = dict(source.get("flags", {}))
    if "toml" in source:
        path = tmp_path / "bad.toml"
        path.write_text(source["toml"])
        flags["config"] = str(path)
    with pytest.raises(ConfigError) as info:
        config.load(flags, env={"WARREN_SECRET": "s", **source.get("env", {})})
    assert message in str(info.value)


# --- the simulated cluster: one node's alarm blocks publishers everywhere --------------------------

pytestmark_sim = pytest.mark.timeout(30)


@pytestmark_sim
async def test_one_nodes_alarm_blocks_publishers_on_every_node_and_consumers_keep_draining(
        tmp_path, autojump_clock):
    """n3 passes its mark: a publisher on n1 is told and held (its publishes wait in the
    client), a consumer on n2 keeps consuming and acking; when n3 falls below 90% of its mark
    the publisher is released and everything it published arrives."""
    async with sim_cluster(tmp_path, memory_high_watermark="100MiB") as c:
        blocked_at = []
        async with c.connect("n1", on_blocked=lambda reason: blocked_at.append(trio.current_time())) as pub, \
                c.connect("n2") as con:
            pch, cch = await pub.channel(), await con.channel()
            await pch.queue_declare("q")
            await pch.confirm_delivery()
            for i in range(100):
                pch.publish_nowait("q", b"before %d" % i)
            assert await pch.wait_for_confirms(timeout=10)

            c.memory["n3"].used_bytes = 101 * MiB
            with trio.fail_after(5):
                await c.wait_for(lambda: pub.blocked, what="the publisher on n1 to be blocked")
            assert "node n3 uses 101MiB of memory, above its high watermark of 100MiB" in pub.blocked_reason
            assert all(n.memory.blocked for n in c.nodes.values())
            assert c.nodes["n3"].memory.alarm.on and not c.nodes["n1"].memory.alarm.on

            # the publisher is held: what it publishes now is not confirmed
            for i in range(100):
                pch.publish_nowait("q", b"during %d" % i)
            with pytest.raises(trio.TooSlowError):
                await pch.wait_for_confirms(timeout=2)
            session = next(iter(c.nodes["n1"].sessions.values()))
            assert session.publisher

            # the consumer is not a publisher: it is read, its acks drain the queue
            consumer = await cch.basic_consume("q")
            got = []
            with trio.fail_after(10):
                async for msg in consumer:
                    got.append(msg.body)
                    cch.basic_ack(msg.delivery_tag)
                    if len(got) == 100:
                        break
            assert got == [b"before %d" % i for i in range(100)]
            assert not con.blocked and not any(e[1] == "blocked" for e in con.events)
            await c.wait_for(lambda: c.nodes["n1"].router.replicas["q"].replica.q.stats()["messages"] == 0,
                             timeout=5, what="the acks to reach the queue")
            assert pub.blocked

            c.memory["n3"].used_bytes = 91 * MiB  # below the mark, not below 90% of it
            await trio.sleep(1)
            assert pub.blocked
            c.memory["n3"].used_bytes = 89 * MiB
            with trio.fail_after(5):
                await pub.wait_unblocked()
            assert await pch.wait_for_confirms(timeout=10)
            with trio.fail_after(10):
                async for msg in consumer:
                    got.append(msg.body)
                    cch.basic_ack(msg.delivery_tag)
                    if len(got) == 200:
                        break
            assert got[100:] == [b"during %d" % i for i in range(100)]
            assert [e[1] for e in pub.events] == ["blocked", "unblocked"]
            assert len(blocked_at) == 1


@pytestmark_sim
async def test_a_node_that_goes_away_with_its_alarm_no_longer_blocks_and_tells_again_when_back(
        tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, memory_high_watermark="100MiB") as c:
        c.memory["n3"].used_bytes = 200 * MiB
        await c.wait_for(lambda: c.nodes["n1"].memory.blocked, timeout=5, what="n1 to hear of n3's alarm")
        assert c.nodes["n1"].memory.alarms.nodes == ["n3"]
        c.kill("n3")
        await c.wait_for(lambda: not c.nodes["n1"].memory.blocked, timeout=30,
                         what="n1 to forget the alarm of a node that is gone")
        # n3 comes back still above its mark: the new link carries its alarm
        await c.restart("n3")
        await c.wait_for(lambda: c.nodes["n1"].memory.alarms.nodes == ["n3"]
                         and c.nodes["n2"].memory.alarms.nodes == ["n3"], timeout=30,
                         what="n3's alarm to reach n1 and n2 over the new links")
        c.memory["n3"].used_bytes = 0
        await c.wait_for(lambda: not any(n.memory.blocked for n in c.nodes.values()), timeout=5,
                         what="the alarm to clear everywhere")


@pytestmark_sim
async def test_a_connection_that_starts_publishing_during_an_alarm_is_held_after_that_read(
        tmp_path, autojump_clock):
    """RabbitMQ's "blocking" state: a connection that has not published is read (it may only
    consume); once it publishes it is told and held."""
    async with sim_cluster(tmp_path, memory_high_watermark="100MiB") as c:
        c.memory["n1"].used_bytes = 200 * MiB
        await c.wait_for(lambda: c.nodes["n1"].memory.blocked, timeout=5, what="the alarm")
        async with c.connect("n1") as conn:
            ch = await conn.channel()  # requests of a connection that has not published: read
            await ch.queue_declare("q")
            await ch.confirm_delivery()
            assert not conn.blocked
            ch.publish_nowait("q", b"first")
            await c.wait_for(lambda: conn.blocked, timeout=5, what="the client to be told")
            with pytest.raises(trio.TooSlowError), trio.fail_after(2):
                await ch.queue_declare("other")  # held: not read any more
            c.memory["n1"].used_bytes = 0
            with trio.fail_after(5):
                await conn.wait_unblocked()
                assert await ch.wait_for_confirms()
