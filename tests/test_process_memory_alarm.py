"""The memory alarm on a real warren-server process: a queue with no consumer is filled past a
small absolute high watermark; the node blocks the publisher instead of growing, and resumes it
once a consumer (on a connection of its own, which the alarm never holds) has drained the queue.
The client sees both events. The node's memory is read from /proc/PID/statm, as the node reads
its own."""

from __future__ import annotations

import time

import pytest
import trio

from broker.client.aio import open_connection
from broker.memory import READ_BUDGET
from broker.session import WINDOW_MSGS
from mirroring.alarm import TRIM_EVERY

from cluster_procs import running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(150)]

MiB = 1 << 20
HEADROOM = 40 * MiB  # the mark is set this far above the idle node's memory
TOTAL = 100_000  # 1 KiB messages published in all: about twice what fits under the mark
BODY = 1024
# How far past its mark a node may go: what publishers may send between two samples
# (READ_BUDGET bytes), and what was already read but not yet stored when the alarm went on (one
# publisher's credit window of WINDOW_MSGS messages, at the 1.5 KiB a queued 1 KiB message may
# cost). A node that did not hold would reach the whole TOTAL, some 115 MiB past its idle size.
OVERSHOOT = READ_BUDGET + WINDOW_MSGS * BODY * 3 // 2


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096


async def fill_hold_drain(c) -> dict:
    pid = c.procs["n1"].pid
    addr = c.client_addr("n1")
    idle = rss(pid)
    mark = idle + HEADROOM
    c.ctl_ok("n1", "set_vm_memory_high_watermark", "absolute", str(mark))
    status = c.ctl_json("n1", "status")
    assert status["memory_limit"] == mark and status["memory_alarm"] is False
    assert status["memory_python_blocks"] > 10_000  # the interpreter's live blocks, not the RSS
    collected = c.ctl_json("n1", "force_gc")  # through warrenctl, as an operator asks for it
    assert collected["python_blocks_after"] > 10_000 and 0 <= collected["seconds"] < 1, collected
    assert 0 < collected["rss_after"] <= collected["rss_before"], collected
    seen = {"confirmed": 0}
    out: dict = {"mark": mark}
    async with open_connection([addr], client_name="publisher") as pub:
        pch = await pub.channel()
        await pch.queue_declare("fill")
        await pch.confirm_delivery()

        def on_confirm(first, last, ok, reason):
            assert ok, reason
            seen["confirmed"] += last - first + 1

        pch.on_confirm = on_confirm

        async def publish():
            for i in range(TOTAL):
                await pch.basic_publish("", "fill", i.to_bytes(8, "big") + b"." * (BODY - 8))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            with trio.fail_after(60):
                while not pub.blocked:
                    await trio.sleep(0.05)
            out["blocked_after"] = seen["confirmed"]
            # held, not growing: no more confirms, and the node's memory stays put near the mark
            await trio.sleep(0.5)
            held_confirmed, held_rss = seen["confirmed"], rss(pid)
            samples = []
            for _ in range(20):
                await trio.sleep(0.1)
                samples.append(rss(pid))
            out.update(held_confirmed=held_confirmed, confirmed_later=seen["confirmed"],
                       held_rss=held_rss, max_rss=max(samples), min_rss=min(samples))
            out["status"] = c.ctl_json("n1", "status")
            out["connections"] = {r["client_name"]: r["state"] for r in
                                  c.ctl_json("n1", "list_connections", "client_name", "state")}
            # a consumer on a connection of its own drains the queue while the alarm is on
            got = []
            async with open_connection([addr], client_name="consumer") as con:
                cch = await con.channel()
                await cch.basic_qos(1000)
                consumer = await cch.basic_consume("fill")
                with trio.fail_after(90):
                    async for msg in consumer:
                        if not got:
                            out["first_delivery_while_blocked"] = pub.blocked
                        got.append(int.from_bytes(msg.body[:8], "big"))
                        cch.basic_ack(msg.delivery_tag)
                        if len(got) == TOTAL:
                            break
                out["consumer_events"] = [e[1] for e in con.events]
            with trio.fail_after(30):
                assert await pch.wait_for_confirms()
                await pub.wait_unblocked()  # the queue is empty: the alarm clears
        out.update(got=got, confirmed=seen["confirmed"], publisher_events=[e[1] for e in pub.events],
                   blocked_reason_seen=next(e[2] for e in pub.events if e[1] == "blocked"))
    return out


def test_a_node_past_its_mark_holds_publishers_and_resumes_them_once_a_consumer_drains(
        request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        t0 = time.monotonic()
        out = trio.run(fill_hold_drain, c)
        mark = out["mark"]
        # blocked before everything fit (the queue would take about twice the headroom)
        assert 0 < out["blocked_after"] < TOTAL * 0.8, out
        assert "low on memory: node n1 uses" in out["blocked_reason_seen"]
        # held: not one confirm while blocked, and the node's memory bounded near the mark
        # (by at most OVERSHOOT, however late a busy loop runs the 0.1 s timer)
        assert out["confirmed_later"] == out["held_confirmed"], out
        assert out["max_rss"] < mark + OVERSHOOT, (out["max_rss"] - mark) / MiB
        assert out["max_rss"] - out["min_rss"] < 4 * MiB, (out["max_rss"] - out["min_rss"]) / MiB
        status = out["status"]
        assert status["memory_alarm"] is True and status["alarms"] == ["n1"]
        assert status["publishers_blocked"] is True and status["memory_used"] > mark
        assert out["connections"] == {"publisher": "blocked"}
        # the consumer was served during the alarm, never blocked; the publisher was resumed
        # (it may have been blocked again on the way: the publisher is faster than the consumer)
        assert out["first_delivery_while_blocked"] is True
        assert "blocked" not in out["consumer_events"]
        events = out["publisher_events"]
        assert events[0] == "blocked" and events[-1] == "unblocked", events
        assert events.count("blocked") == events.count("unblocked")
        # nothing lost, nothing twice, in order
        assert out["confirmed"] == TOTAL
        assert out["got"] == list(range(TOTAL))
        # drained, the node clears its alarm at its next sample after it hands the freed memory
        # back (a trim at most every TRIM_EVERY s): the publisher's backlog, read once the alarm
        # first cleared, may have set it again just before the drain ended
        deadline = time.monotonic() + 10 * TRIM_EVERY
        while c.ctl_json("n1", "status")["memory_alarm"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.ctl_json("n1", "status")["memory_alarm"] is False
        log = c.log_path("n1").read_text()
        assert "memory resource limit alarm set on this node" in log
        assert "memory resource limit alarm cleared on this node" in log
        print(f"blocked after {out['blocked_after']} confirms; held at {out['max_rss'] / MiB:.1f} MiB "
              f"(mark {mark / MiB:.1f} MiB); whole run {time.monotonic() - t0:.1f} s")
