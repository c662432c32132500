"""The managed HA policy and operator policies on a simulated cluster (SimNetwork under trio's
MockClock): the system policy from the first boot, back when cleared, forced into users'
policies; an operator policy capping a queue's length."""

from __future__ import annotations

import pytest
import trio

from broker.simulation import sim_cluster
from mirroring.changes import OperatorPolicySet, PolicyClear, PolicySet
from mirroring.policy import (SYSTEM_POLICY_NAME, make_operator_policy, make_policy,
                              system_policy)

pytestmark = pytest.mark.timeout(30)


def _everywhere(c, predicate):
    return lambda: all(predicate(n.md) for n in c.nodes.values())


async def test_the_system_policy_exists_from_the_first_boot_and_mirrors_queues(tmp_path,
                                                                               autojump_clock):
    async with sim_cluster(tmp_path, managed_ha=True) as c:
        await c.wait_for(_everywhere(c, lambda md: md.managed_ha
                                     and md.policies.get(SYSTEM_POLICY_NAME) == system_policy()),
                         timeout=5, what="the system policy on every node")
        assert c.nodes["n1"].md.policies[SYSTEM_POLICY_NAME].set_by == "managed-ha"
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("q", durable=True)
        await c.wait_for(_everywhere(c, lambda md: "q" in md.queues
                                     and set(md.queues["q"].mirrors) == {"n2", "n3"}),
                         timeout=10, what="q mirrored on every node")


async def test_a_first_node_alone_has_the_system_policy(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, names=("n1",), managed_ha=True) as c:
        await c.wait_for(_everywhere(c, lambda md: SYSTEM_POLICY_NAME in md.policies), timeout=5,
                         what="the system policy on the cluster's first node")


async def test_the_system_policy_comes_back_when_cleared(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, managed_ha=True) as c:
        await c.wait_for(_everywhere(c, lambda md: SYSTEM_POLICY_NAME in md.policies), timeout=5)
        before = c.nodes["n2"].md.version
        await c.nodes["n2"].cluster.propose(PolicyClear(SYSTEM_POLICY_NAME))
        await c.wait_for(_everywhere(c, lambda md: md.version >= before + 2
                                     and md.policies.get(SYSTEM_POLICY_NAME) == system_policy()),
                         timeout=5, what="the system policy back on every node")


async def test_a_users_policy_without_ha_keys_gets_them(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path, managed_ha=True) as c:
        await c.wait_for(_everywhere(c, lambda md: md.managed_ha), timeout=5)
        await c.nodes["n3"].cluster.propose(PolicySet(make_policy("ttl", "^t", {"message-ttl": 500})))
        await c.nodes["n3"].cluster.propose(PolicySet(make_policy(
            "two", "^two", {"ha-mode": "exactly", "ha-params": 2})))
        wanted = {"ttl": {"message-ttl": 500, "ha-mode": "all", "ha-sync-mode": "automatic"},
                  "two": {"ha-mode": "all", "ha-sync-mode": "automatic"}}

        def rewritten(md):
            return all(name in md.policies and md.policies[name].definition == d
                       and md.policies[name].set_by == "user+managed-ha"
                       for name, d in wanted.items())

        await c.wait_for(_everywhere(c, rewritten), timeout=5, what="the rewritten policies")
        assert len({(n.md.version, n.md.digest()) for n in c.nodes.values()}) == 1


async def test_without_managed_ha_there_is_no_system_policy(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        await trio.sleep(5)
        assert all(not n.md.managed_ha and not n.md.policies for n in c.nodes.values())


async def test_an_operator_policy_caps_a_policys_max_length(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        n1 = c.nodes["n1"]
        await n1.cluster.propose(PolicySet(make_policy("lim", "^q", {"max-length": 10})))
        await n1.cluster.propose(OperatorPolicySet(make_operator_policy("cap", ".*",
                                                                        {"max-length": 3})))
        async with c.connect("n1") as conn:
            ch = await conn.channel()
            await ch.queue_declare("q")
            await ch.confirm_delivery()
            for i in range(6):
                ch.publish_nowait("q", b"m%d" % i)
            assert await ch.wait_for_confirms(timeout=10)
            queue = n1.router.replicas["q"].replica.q
            await c.wait_for(lambda: queue.stats()["messages"] == 3, timeout=5)
