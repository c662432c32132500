"""Where every queue's replicas should be: the metadata log leader's decisions, as pure functions.

The leader of the metadata log (broker/cluster.py) turns every proposal into the concrete
change(s) to commit with `plan_change`, given the metadata and the set of running nodes; every
node then applies the same changes in the same order. Nothing here reads a clock or does I/O.

A queue definition carries its replicas (mirroring/records.py `QueueDef`: leader, mirrors
oldest first, synced, epoch); the planner's decisions are `Placement`s of them.

Each kind of proposal has its planner here (`_PLAN`, by the change's type); a kind without one
is committed as it was proposed.

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
* managed HA (Amazon MQ's, once `managed_ha.enable` is committed): a policy a user sets is
  committed with its HA keys forced to the system policy's (`enforce_managed_ha`); clearing the
  system policy commits the clear and then the policy again; `managed_ha.enable` itself commits
  the system policy and puts every user policy in line.
"""

from __future__ import annotations

from collections.abc import Callable

from wire.errors import PRECONDITION_FAILED

from . import changes as c
from .metadata import MetaError
from .policy import (HA, SYSTEM_POLICY_NAME, choose_promotion, effective_policy,
                     enforce_managed_ha, ha_settings, initial_leader, leader_handover,
                     managed_ha_out_of_line, place_mirrors, system_policy)
from .records import Placement, Policy, QueueDef, QueueUpdate, split_key


def ha_for(policies: dict[str, Policy], qdef: QueueDef) -> HA:
    return ha_settings(effective_policy(policies, qdef.name, qdef.vhost), qdef.exclusive)


def replica_load(queues: dict[str, QueueDef]) -> dict[str, int]:
    load: dict[str, int] = {}
    for q in queues.values():
        for n in (q.leader, *q.mirrors):
            load[n] = load.get(n, 0) + 1
    return load


def plan_declare(md, qdef: QueueDef, running: list[str], default_locator: str) -> QueueDef:
    """Complete a new queue's definition (proposed with `leader` the declaring node): leader,
    mirrors, synced, epoch."""
    if qdef.key in md.queues:
        return qdef  # a re-declare: equivalence is checked on apply
    declared_on = qdef.leader
    ha = ha_for(md.policies, qdef)
    running = [n for n in md.members if n in set(running)] or [declared_on]
    locator = qdef.arguments.get("x-queue-master-locator") or ha.locator or default_locator
    if qdef.exclusive:
        leader = declared_on
    else:
        if locator == "balanced":
            leaders = {n: 0 for n in running}
            for q in md.queues.values():
                if q.leader in leaders:
                    leaders[q.leader] += 1
            choice = min(running, key=lambda n: (leaders[n], running.index(n)))
        else:
            choice = declared_on
        leader = initial_leader(ha, choice, declared_on, running)
    # the load of every node (a pass over every queue) only where it places a mirror
    load = replica_load(md.queues) if ha.mode == "exactly" else None
    mirrors = place_mirrors(ha, leader, [], list(md.members), set(running), load)
    return qdef.placed(Placement(leader, tuple(mirrors), (), 1))


def plan(md, running: set[str], *, policies: dict[str, Policy] | None = None,
         down: str | None = None, shutdown: bool = False, up: str | None = None,
         synced: c.QueueSynced | None = None) -> tuple[QueueUpdate, ...]:
    """The updates that bring every queue in line.

    `down`: this node just went down (`shutdown`: a controlled stop). `up`: it just came back.
    `synced`: the synchronised mirrors of a queue, as its leader reported them.
    `policies`: the policy set to plan for (default: the current one).
    """
    policies = md.policies if policies is None else policies
    members = list(md.members)
    load = replica_load(md.queues)
    updates = []
    for name, q in md.queues.items():
        ha = ha_for(policies, q)
        leader, epoch = q.leader, q.epoch
        mirrors = list(q.mirrors)
        in_sync = list(q.synced)
        if synced is not None and synced.queue == name and synced.epoch == epoch:
            in_sync = [m for m in synced.synced if m in mirrors]
        if down is not None and leader == down:
            candidates = [m for m in mirrors if m in running]
            new = choose_promotion(ha, candidates, set(in_sync), running, shutdown)
            if new is not None:
                mirrors.remove(new)
                leader, epoch = new, epoch + 1
                in_sync = []
            elif not q.durable or q.exclusive:
                updates.append(QueueUpdate(name, None))
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
        placed_mirrors = tuple(mirrors)
        placed_synced = tuple(m for m in in_sync if m in mirrors)
        if (leader, placed_mirrors, placed_synced, epoch) != (q.leader, q.mirrors, q.synced, q.epoch):
            for n in set(mirrors) - set(q.mirrors):
                load[n] = load.get(n, 0) + 1
            updates.append(QueueUpdate(name, Placement(leader, placed_mirrors, placed_synced, epoch)))
    return tuple(updates)


def plan_drop_mirror(md, drop: c.DropMirror, running: set[str]) -> tuple[QueueUpdate, ...]:
    """A leader asks to drop its mirror on `drop.node`: the updates, or () if that is stale."""
    q = md.queues.get(drop.queue)
    if q is None or q.epoch != drop.epoch or drop.node not in q.mirrors:
        return ()
    ha = ha_for(md.policies, q)
    mirrors = [n for n in q.mirrors if n != drop.node]
    # not placed again in this change (see the module rules); `exactly` may replace it elsewhere
    mirrors = place_mirrors(ha, q.leader, mirrors, list(md.members), running - {drop.node},
                            replica_load(md.queues))
    synced = tuple(n for n in q.synced if n in mirrors)
    return (QueueUpdate(q.key, Placement(q.leader, tuple(mirrors), synced, q.epoch)),)


def plan_forget(md, node: str, running: set[str] = frozenset()) -> tuple[QueueUpdate, ...]:
    """A member is forgotten: each queue it led moves to its oldest mirror; a durable one with
    no mirror lives on, empty, on the most senior running member (its contents went with the
    node); a non-durable one is deleted."""
    updates = []
    others = [n for n in md.members if n != node and n in running]
    for name, q in md.queues.items():
        mirrors = tuple(n for n in q.mirrors if n != node)
        if q.leader == node:
            if mirrors:
                updates.append(QueueUpdate(name, Placement(mirrors[0], mirrors[1:], (), q.epoch + 1)))
            elif q.durable and not q.exclusive and others:
                updates.append(QueueUpdate(name, Placement(others[0], (), (), q.epoch + 1)))
            else:
                updates.append(QueueUpdate(name, None))
        elif node in q.mirrors:
            synced = tuple(n for n in q.synced if n != node)
            updates.append(QueueUpdate(name, Placement(q.leader, mirrors, synced, q.epoch)))
    return tuple(updates)


# --- proposals -> committed changes --------------------------------------------------------

Commit = Callable[[c.Change], None]


def plan_change(md, change: c.Change, running: set[str]) -> list[tuple[c.Change, object]]:
    """Turn a proposal into the concrete change(s) to commit, applying each to `md` as it goes
    (so pass a copy: the log's leader plans on a copy of its metadata, commits the changes, and
    every node then applies them to its own). Returns [(change, result of applying it), ...];
    [] when there is nothing to do. Raises MetaError (md untouched) when the change is refused.

    `running` is the set of members that are running as far as the leader can tell (it links
    to them, and the log records them up).
    """
    out: list[tuple[c.Change, object]] = []

    def commit(concrete: c.Change) -> None:
        out.append((concrete, md.apply(concrete)))

    planner = _PLAN.get(type(change))
    if planner is None:
        commit(change)
    else:
        planner(md, change, running, running - set(md.down), commit)
    return out


def _declare(md, change: c.QueueDeclare, running: set[str], live: set[str], commit: Commit):
    qdef = plan_declare(md, change.queue, sorted(running), change.locator or "client-local")
    commit(c.QueueDeclare(qdef))


def _node_down(md, change: c.NodeDown, running: set[str], live: set[str], commit: Commit):
    node = change.node
    if md.up.get(node) == change.incarnation:  # else: already down, or that incarnation is gone
        commit(c.NodeDown(node, change.incarnation, change.how,
                          plan(md, running - {node}, down=node, shutdown=change.how == "shutdown")))


def _node_up(md, change: c.NodeUp, running: set[str], live: set[str], commit: Commit):
    node = change.node
    if node in md.members and md.up.get(node) != change.incarnation:
        if node in md.up:
            # it restarted without the log noticing it go: its old incarnation goes first
            commit(c.NodeDown(node, md.up[node], "failure", plan(md, running - {node}, down=node)))
        commit(c.NodeUp(node, change.incarnation, plan(md, running | {node}, up=node)))


def _member_remove(md, change: c.MemberRemove, running: set[str], live: set[str], commit: Commit):
    node = change.name
    if node in running:
        # checked again here, where the change is ordered: a forget that waited for a leader
        # must not remove a node that came back meanwhile (dst seed 5531)
        raise MetaError(PRECONDITION_FAILED, f"node {node} is running: stop its app first")
    if node in md.members:
        commit(c.QueuesUpdate(plan_forget(md, node, running)))
        commit(change)


def _policy_set(md, change: c.PolicySet, running: set[str], live: set[str], commit: Commit):
    policies = {**md.policies, change.policy.key: change.policy}
    commit(c.PolicySet(change.policy, plan(md, live, policies=policies)))


def _policy_clear(md, change: c.PolicyClear, running: set[str], live: set[str], commit: Commit):
    policies = {k: v for k, v in md.policies.items() if k != change.name}
    commit(c.PolicyClear(change.name, plan(md, live, policies=policies)))


def _managed_policy_set(md, change: c.PolicySet, running: set[str], live: set[str],
                        commit: Commit):
    if md.managed_ha:
        change = c.PolicySet(enforce_managed_ha(change.policy)[0])
    _policy_set(md, change, running, live, commit)


def _managed_policy_clear(md, change: c.PolicyClear, running: set[str], live: set[str],
                          commit: Commit):
    _policy_clear(md, change, running, live, commit)
    vhost, name = split_key(change.name)
    if md.managed_ha and name == SYSTEM_POLICY_NAME:
        _policy_set(md, c.PolicySet(system_policy(vhost)), running, live, commit)


def _managed_ha_enable(md, change: c.ManagedHAEnable, running: set[str], live: set[str],
                       commit: Commit):
    if not md.managed_ha:
        commit(change)
    for record in managed_ha_out_of_line(md.policies, md.vhosts):
        _policy_set(md, c.PolicySet(record), running, live, commit)


def _vhost_add(md, change: c.VHostAdd, running: set[str], live: set[str], commit: Commit):
    """A new vhost; under the managed HA, with its system policy."""
    commit(change)
    wanted = system_policy(change.vhost.name)
    if md.managed_ha and md.policies.get(wanted.key) != wanted:
        _policy_set(md, c.PolicySet(wanted), running, live, commit)


def _replan(md, change: c.Replan, running: set[str], live: set[str], commit: Commit):
    updates = plan(md, live)
    if updates:
        commit(c.QueuesUpdate(updates))


def _queue_synced(md, change: c.QueueSynced, running: set[str], live: set[str], commit: Commit):
    q = md.queues.get(change.queue)
    if q is not None and q.epoch == change.epoch:
        updates = plan(md, live, synced=change)
        if updates:
            commit(c.QueuesUpdate(updates))


def _drop_mirror(md, change: c.DropMirror, running: set[str], live: set[str], commit: Commit):
    updates = plan_drop_mirror(md, change, live)
    if updates:
        commit(c.QueuesUpdate(updates))


# each kind of proposal the planner turns into what is committed, and its planner: called as
# (md, proposal, running members, live members, commit), it commits the concrete changes in
# order with `commit` (`plan_change`); a kind not listed is committed as it was proposed
_PLAN: dict[type[c.Change], Callable[..., None]] = {
    c.QueueDeclare: _declare,
    c.NodeDown: _node_down,
    c.NodeUp: _node_up,
    c.MemberRemove: _member_remove,
    c.PolicySet: _managed_policy_set,
    c.PolicyClear: _managed_policy_clear,
    c.ManagedHAEnable: _managed_ha_enable,
    c.VHostAdd: _vhost_add,
    c.Replan: _replan,
    c.QueueSynced: _queue_synced,
    c.DropMirror: _drop_mirror,
}
