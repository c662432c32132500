"""Where every queue's replicas should be: the metadata log leader's decisions, as pure functions.

The leader of the metadata log (broker/cluster.py) turns every proposal into the concrete
change(s) to commit with `plan_change`, given the metadata and the set of running nodes; every
node then applies the same changes in the same order. Nothing here reads a clock or does I/O.

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
* a leader asks to drop a mirror (it lost touch with it, or the mirror lost track): the mirror
  leaves the list, and is placed again (as a new, empty mirror) only by a later change, so its
  leader sees it go and releases what waited for it.
* a new epoch starts with no synchronised mirror: the new leader reports which of them resumed
  with everything, and only that report makes them synchronised again.
* a member is forgotten: queues it led move to their oldest mirror; a durable one without a
  mirror lives on, empty, on another member; a non-durable one is deleted.
"""

from __future__ import annotations

from wire.errors import PRECONDITION_FAILED

from .metadata import MetaError
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
    # the load of every node (a pass over every queue) only where it places a mirror
    load = replica_load(md.queues) if ha.mode == "exactly" else None
    qdef["mirrors"] = place_mirrors(ha, leader, [], list(md.members), set(running), load)
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
                in_sync = []
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
                in_sync = []
                mirrors = place_mirrors(ha, leader, mirrors, members, running, load)
        in_sync = [m for m in in_sync if m in mirrors]
        fields = {"leader": leader, "mirrors": mirrors, "synced": in_sync, "epoch": epoch}
        if any(q.get(k) != v for k, v in fields.items()):
            for n in set(mirrors) - set(q.get("mirrors", ())):
                load[n] = load.get(n, 0) + 1
            updates.append([name, fields])
    return updates


def plan_drop_mirror(md, name: str, epoch: int, node: str, running: set[str]) -> list:
    """A leader asks to drop its mirror on `node`: the updates, or [] if that is stale."""
    q = md.queues.get(name)
    if q is None or q.get("epoch", 1) != epoch or node not in q.get("mirrors", ()):
        return []
    ha = ha_for(md.policies, q)
    mirrors = [n for n in q["mirrors"] if n != node]
    # not placed again in this change (see the module rules); `exactly` may replace it elsewhere
    mirrors = place_mirrors(ha, q["leader"], mirrors, list(md.members), running - {node},
                            replica_load(md.queues))
    synced = [n for n in q.get("synced", ()) if n in mirrors]
    return [[name, {"mirrors": mirrors, "synced": synced}]]


def plan_forget(md, node: str, running: set[str] = frozenset()) -> list:
    """A member is forgotten: each queue it led moves to its oldest mirror; a durable one with
    no mirror lives on, empty, on the most senior running member (its contents went with the
    node); a non-durable one is deleted."""
    updates = []
    others = [n for n in md.members if n != node and n in running]
    for name, q in md.queues.items():
        mirrors = [n for n in q.get("mirrors", ()) if n != node]
        if q["leader"] == node:
            if mirrors:
                updates.append([name, {"leader": mirrors[0], "mirrors": mirrors[1:], "synced": [],
                                       "epoch": q.get("epoch", 1) + 1}])
            elif q["durable"] and not q.get("exclusive") and others:
                updates.append([name, {"leader": others[0], "mirrors": [], "synced": [],
                                       "epoch": q.get("epoch", 1) + 1}])
            else:
                updates.append([name, None])
        elif node in q.get("mirrors", ()):
            updates.append([name, {"mirrors": mirrors,
                                   "synced": [n for n in q.get("synced", ()) if n != node]}])
    return updates


def plan_change(md, change: list, running: set[str]) -> list[tuple[list, object]]:
    """Turn a proposal into the concrete change(s) to commit, applying each to `md` as it goes
    (so pass a copy: the log's leader plans on a copy of its metadata, commits the changes, and
    every node then applies them to its own). Returns [(change, result of applying it), ...];
    [] when there is nothing to do. Raises MetaError (md untouched) when the change is refused.

    `running` is the set of members that are running as far as the leader can tell (it links
    to them, and the log records them up).
    """
    out: list[tuple[list, object]] = []

    def commit(concrete: list) -> None:
        out.append((concrete, md.apply(concrete)))

    kind = change[0]
    live = running - set(md.down)
    if kind == "queue.declare":
        qdef = change[1]
        commit(["queue.declare", plan_declare(md, qdef, sorted(running),
                                              qdef.get("locator") or "client-local")])
    elif kind == "node.down":
        _, node, inc, how = change
        if md.up.get(node) == inc:  # else: already down, or that incarnation is gone
            commit(["node.down", node, inc, how,
                    plan(md, running - {node}, down=node, shutdown=how == "shutdown")])
    elif kind == "node.up":
        _, node, inc = change
        if node in md.members and md.up.get(node) != inc:
            if node in md.up:
                # it restarted without the log noticing it go: its old incarnation goes first
                commit(["node.down", node, md.up[node], "failure",
                        plan(md, running - {node}, down=node)])
            commit(["node.up", node, inc, plan(md, running | {node}, up=node)])
    elif kind == "member.remove":
        node = change[1]
        if node in running:
            # checked again here, where the change is ordered: a forget that waited for a leader
            # must not remove a node that came back meanwhile (dst seed 5531)
            raise MetaError(PRECONDITION_FAILED, f"node {node} is running: stop its app first")
        if node in md.members:
            commit(["queues.update", plan_forget(md, node, running)])
            commit(["member.remove", node])
    elif kind == "policy.set":
        policies = {**md.policies, change[1]["name"]: change[1]}
        commit(["policy.set", change[1], plan(md, live, policies=policies)])
    elif kind == "policy.clear":
        policies = {k: v for k, v in md.policies.items() if k != change[1]}
        commit(["policy.clear", change[1], plan(md, live, policies=policies)])
    elif kind == "replan":
        updates = plan(md, live)
        if updates:
            commit(["queues.update", updates])
    elif kind == "queue.synced":
        _, qname, epoch, synced = change
        q = md.queues.get(qname)
        if q is not None and q.get("epoch") == epoch:
            updates = plan(md, live, synced=(qname, epoch, synced))
            if updates:
                commit(["queues.update", updates])
    elif kind == "queue.drop_mirror":
        _, qname, epoch, node = change
        updates = plan_drop_mirror(md, qname, epoch, node, live)
        if updates:
            commit(["queues.update", updates])
    else:
        commit(change)
    return out
