"""Whole-cluster tests on SimNetwork under trio's MockClock (autojump)."""

from __future__ import annotations

import pytest
import trio

from broker.client.errors import ChannelClosedByBroker

from simcluster import TICKTIME, sim_cluster

pytestmark = pytest.mark.timeout(20)


async def test_cluster_forms_and_members_agree(tmp_path, autojump_clock):
    async with sim_cluster(tmp_path) as c:
        for name, node in c.nodes.items():
            assert node.running == {"n1", "n2", "n3"}, name
            assert list(node.md.members) == ["n1", "n2", "n3"], name
        versions = {(n.md.version, n.md.digest()) for n in c.nodes.values()}
        assert len(versions) == 1
