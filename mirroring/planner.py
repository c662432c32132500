"""Where every queue's replicas should be: the coordinator's decisions, as pure functions.

The coordinator (the most senior running node, see broker/node.py) calls these with the
cluster metadata and the set of running nodes, and turns the result into one metadata change
that every node then applies in the same order. Nothing here reads a clock or does I/O.

A queue definition carries its replicas:
  leader   the node of the leader replica
  mirrors  mirror nodes, oldest first (the order in which they were added: "the oldest mirror")
  synced   the mirrors known to be synchronised
  epoch    increases whenever the leader replica changes (promotion, hand-over, restart), so
           replication messages of an old leader are recognised and ignored

Rules (the spec's, section by section, in mirroring/policy.py's terms):
* declare: leader from the locator (x-queue-master-locator argument, then the policy's
  queue-master-locator, then the node's setting), adjusted by a `nodes` policy; mirrors placed.
* a node goes down: it leaves every mirror list; a queue it led promotes its oldest allowed
  mirror (`choose_promotion`, ha-promote-on-failure / -on-shutdown); with none, a durable queue
  waits for its leader and a non-durable one is deleted. Mirrors are then re-placed (`exactly`
  replaces the lost one).
* a node comes up: mirrors are re-placed (`all` and `nodes` add it); a queue it leads restarts
  (new epoch: its mirrors start again from the new, empty leader replica).
* a policy changes, or a mirror becomes synchronised: mirrors re-placed, and a `nodes` policy
  that no longer lists the leader hands over to a synchronised listed mirror.
"""

from __future__ import annotations

from .policy import (HA, choose_promotion, effective_policy, ha_settings, initial_leader,
                     leader_handover, place_mirrors)


def ha_for(policies: dict, qdef: dict) -> HA:
    return ha_settings(effective_policy(policies, qdef["name"]), qdef.get("exclusive", False))


def replica_load(queues: dict) -> dict[str, int]:
    load: dict[str, int] = {}
    for q in queues.values():
        for n in (q["leader"], *q.get("mirrors", ())):
            load[n] = load.get(n, 0) + 1
    return load


def plan_declare(md, qdef: dict, running: list[str], default_locator: str) -> dict:
    """Complete a new queue's definition: leader, mirrors, synced, epoch."""
    qdef = dict(qdef)
    declared_on = qdef.get("declared_on") or qdef.get("leader")
    if qdef["name"] in md.queues:
        return qdef  # a re-declare: equivalence is checked on apply
    ha = ha_for(md.policies, qdef)
    running = [n for n in md.members if n in set(running)] or [declared_on]
    locator = ((qdef.get("arguments") or {}).get("x-queue-master-locator") or ha.locator
               or qdef.get("locator") or default_locator)
    if qdef.get("exclusive"):
        leader = declared_on
    else:
        if locator == "balanced":
            leaders = {n: 0 for n in running}
            for q in md.queues.values():
                if q["leader"] in leaders:
                    leaders[q["leader"]] += 1
            choice = min(running, key=lambda n: (leaders[n], running.index(n)))
        else:
            choice = declared_on
        leader = initial_leader(ha, choice, declared_on, running)
    qdef["leader"] = leader
    qdef["mirrors"] = place_mirrors(ha, leader, [], list(md.members), set(running),
                                    replica_load(md.queues))
    qdef["synced"] = []
    qdef["epoch"] = 1
    qdef.pop("locator", None)
    return qdef


def plan(md, running: set[str], *, policies: dict | None = None, down: str | None = None,
         shutdown: bool = False, up: str | None = None,
         synced: tuple[str, int, list] | None = None) -> list:
    """The updates [[queue, fields or None (delete)], ...] that bring every queue in line.

    `down`: this node just went down (`shutdown`: a controlled stop). `up`: it just came back.
    `synced`: (queue, epoch, synchronised mirrors) as reported by the queue's leader.
    `policies`: the policy set to plan for (default: the current one).
    """
    policies = md.policies if policies is None else policies
    members = list(md.members)
    load = replica_load(md.queues)
    updates = []
    for name, q in md.queues.items():
        ha = ha_for(policies, q)
        leader, epoch = q["leader"], q.get("epoch", 1)
        mirrors = list(q.get("mirrors", ()))
        in_sync = list(q.get("synced", ()))
        if synced is not None and synced[0] == name and synced[1] == epoch:
            in_sync = [m for m in synced[2] if m in mirrors]
        if down is not None and leader == down:
            candidates = [m for m in mirrors if m in running]
            new = choose_promotion(ha, candidates, set(in_sync), running, shutdown)
            if new is not None:
                mirrors.remove(new)
                leader, epoch = new, epoch + 1
                in_sync = [m for m in in_sync if m != new]
            elif not q["durable"] or q.get("exclusive"):
                updates.append([name, None])
                continue
        if up is not None and leader == up:
            epoch += 1  # its replica restarts empty; mirrors follow the new incarnation
            in_sync = []
        if leader in running:
            mirrors = [m for m in mirrors if m in running]
            mirrors = place_mirrors(ha, leader, mirrors, members, running, load)
            new = leader_handover(ha, leader, mirrors, set(in_sync))
            if new is not None:
                mirrors.remove(new)
                leader, epoch = new, epoch + 1
                in_sync = [m for m in in_sync if m != new]
                mirrors = place_mirrors(ha, leader, mirrors, members, running, load)
        in_sync = [m for m in in_sync if m in mirrors]
        fields = {"leader": leader, "mirrors": mirrors, "synced": in_sync, "epoch": epoch}
        if any(q.get(k) != v for k, v in fields.items()):
            for n in set(mirrors) - set(q.get("mirrors", ())):
                load[n] = load.get(n, 0) + 1
            updates.append([name, fields])
    return updates
