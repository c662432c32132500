"""Policies: validating definitions, matching queues, and where a queue's replicas belong.

Rules (everything that decides *which* policy a queue has and *where* its replicas live is in
this file; the broker only carries the answers out):

* A policy is a record (mirroring/records.py `Policy`: name, pattern, definition, priority,
  apply_to) built by `make_policy`. Its definition is checked key by key by `parse_definition`; the first problem
  found raises PolicyError (PRECONDITION_FAILED) whose text names the offending key. Problems are
  looked for in a fixed order: the definition as a whole, unrecognised keys, then `ha-mode`,
  `ha-params`, the keys that need `ha-mode`, `queue-master-locator`, then the queue limits
  (`max-length`, `max-length-bytes`, `message-ttl`, `expires`, `overflow`, `dead-letter-exchange`,
  `dead-letter-routing-key`: what the broker carries out is mirroring/queue.py `limits_from`'s),
  `queue-mode` (accepted, no effect) and the exchanges' `alternate-exchange` (a name;
  mirroring/exchanges.py routes by it).
* `queue-master-locator` "min-masters" (RabbitMQ's older name) is stored as "balanced".
* A queue's policy is the record whose pattern `re.search`es its name, whose apply_to is
  "queues" or "all", with the highest priority. Ties between equal priorities go to the policy
  whose name sorts first (plain string order), so every node picks the same one whatever order
  its dict happens to be in.
* Exclusive queues are never mirrored: `ha_settings(..., exclusive=True)` is the all-defaults
  record (mode None, locator None) whatever the policy says.
* Lists of nodes are ordered: `members` by seniority (join order), a queue's `mirrors` oldest
  first. Placement keeps existing mirrors that still fit the policy, in their order, and appends
  new ones at the end (they are the youngest). The leader is never one of its own mirrors. A new
  mirror only goes to a running member; an existing mirror on a node that is not running (or no
  longer a member) is dropped.
* `ha-sync-mode` "background" is warren's own (RabbitMQ has no such value): like "automatic",
  a new mirror is synchronised at once, but the queue keeps serving while it happens.
* Promotion: the oldest running mirror allowed by the two promote keys wins. Unsynchronised
  mirrors are allowed only if `ha-promote-on-failure` is "always" and, on a controlled
  shutdown, also `ha-promote-on-shutdown` is "always".
* Operator policies (`make_operator_policy`) are RabbitMQ 3.10's: only the keys OPERATOR_KEYS
  (queue limits; never an ha-* key), chosen for a queue by the same rule as policies, and merged
  with its policy's definition by `merge_operator_definition`: a key only one sets is taken
  from it, a key both set takes the lesser value (`effective_definition`).
* Managed HA (Amazon MQ's): the system policy SYSTEM_POLICY_NAME ({"ha-mode": "all",
  "ha-sync-mode": "automatic"} on every queue) and every user policy's HA keys forced to those
  two (`enforce_managed_ha`); the planner carries it out on the log's leader.

Pure: no trio, no I/O, no clock. Inputs are records, lists and sets; outputs are new values.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import msgspec

from wire.errors import PRECONDITION_FAILED, ProtocolError

from .records import DEFAULT_VHOST, Policy, qualify


class PolicyError(ProtocolError):
    """A policy or its definition was refused; the text names the key at fault."""

    def __init__(self, text: str):
        super().__init__(PRECONDITION_FAILED, f"Validation failed: {text}")


HA_MODES = ("all", "exactly", "nodes")
SYNC_MODES = ("manual", "automatic", "background")
PROMOTE_VALUES = ("always", "when-synced")
LOCATORS = ("client-local", "balanced")
LOCATOR_ALIASES = {"min-masters": "balanced"}
APPLY_TO = ("queues", "all", "exchanges")

# Keys that only mean something together with ha-mode.
NEEDS_HA_MODE = ("ha-params", "ha-sync-mode", "ha-sync-batch-size", "ha-promote-on-failure",
                 "ha-promote-on-shutdown")

# Queue limits a policy may set, as RabbitMQ's policies do (the queue arguments x-max-length
# and so on): {key: least allowed value}; `overflow` is a word. mirroring/queue.py
# `limits_from` combines them with a queue's own arguments.
LIMIT_KEYS = {"max-length": 0, "max-length-bytes": 0, "message-ttl": 0, "expires": 1}
OVERFLOW_VALUES = ("drop-head", "reject-publish", "reject-publish-dlx")
# Where a queue dead-letters to (the x-dead-letter-* arguments): names, mirroring/dead_letter.py
DEAD_LETTER_KEYS = ("dead-letter-exchange", "dead-letter-routing-key")
# Accepted and without effect: lazy queues page messages to disk, and warren keeps every message
# in memory (RabbitMQ itself ignores the key for classic queues from 3.12 on).
QUEUE_MODES = ("default", "lazy")

KEYS = frozenset({"ha-mode", *NEEDS_HA_MODE, "queue-master-locator", *LIMIT_KEYS, "overflow",
                  "queue-mode", *DEAD_LETTER_KEYS, "alternate-exchange"})


def _show(value) -> str:
    """A value as the user wrote it (JSON spelling), for error texts."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(key: str, value, allowed: tuple) -> None:
    if not isinstance(value, str) or value not in allowed:
        choices = ", ".join(f"'{a}'" for a in allowed)
        raise PolicyError(f"'{key}' must be one of {choices}, got {_show(value)}")


# --- definitions ---------------------------------------------------------------------------

def _definition_object(definition: str | dict) -> dict:
    """A definition as a non-empty dict (from JSON text, or given as one), or PolicyError."""
    if isinstance(definition, str):
        try:
            definition = json.loads(definition)
        except json.JSONDecodeError as e:
            raise PolicyError(
                f"'definition' is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
            ) from None
    if not isinstance(definition, dict):
        raise PolicyError(
            f"'definition' must be a JSON object, got {type(definition).__name__} "
            f"{_show(definition)}")
    if not definition:
        raise PolicyError("'definition' must not be empty")
    return definition


def parse_definition(definition: str | dict) -> dict:
    """Check a policy definition (JSON text of an object, or a dict) and return a new dict."""
    definition = _definition_object(definition)

    unknown = sorted((k for k in definition if k not in KEYS), key=str)
    if unknown:
        names = ", ".join(f"'{k}'" for k in unknown)
        raise PolicyError(f"{names} are not recognised policy settings")

    out: dict = {}
    mode = definition.get("ha-mode")
    if "ha-mode" in definition:
        _one_of("ha-mode", mode, HA_MODES)
        out["ha-mode"] = mode
        params = definition.get("ha-params")
        if mode == "all":
            if "ha-params" in definition:
                raise PolicyError(
                    f"'ha-params' must not be set for ha-mode 'all', got {_show(params)}")
        elif mode == "exactly":
            if not _is_int(params) or params < 1:
                raise PolicyError(
                    f"'ha-params' must be a positive integer for ha-mode 'exactly', "
                    f"got {_show(params)}")
            out["ha-params"] = params
        else:  # nodes
            if (not isinstance(params, list) or not params
                    or not all(isinstance(n, str) for n in params)):
                raise PolicyError(
                    f"'ha-params' must be a non-empty list of node names for ha-mode 'nodes', "
                    f"got {_show(params)}")
            out["ha-params"] = list(params)
    else:
        for key in NEEDS_HA_MODE:
            if key in definition:
                raise PolicyError(f"'{key}' cannot be used without 'ha-mode'")

    if "ha-sync-mode" in definition:
        _one_of("ha-sync-mode", definition["ha-sync-mode"], SYNC_MODES)
        out["ha-sync-mode"] = definition["ha-sync-mode"]
    if "ha-sync-batch-size" in definition:
        size = definition["ha-sync-batch-size"]
        if not _is_int(size) or size < 1:
            raise PolicyError(f"'ha-sync-batch-size' must be a positive integer, got {_show(size)}")
        out["ha-sync-batch-size"] = size
    for key in ("ha-promote-on-failure", "ha-promote-on-shutdown"):
        if key in definition:
            _one_of(key, definition[key], PROMOTE_VALUES)
            out[key] = definition[key]
    if "queue-master-locator" in definition:
        loc = definition["queue-master-locator"]
        loc = LOCATOR_ALIASES.get(loc, loc) if isinstance(loc, str) else loc
        _one_of("queue-master-locator", loc, LOCATORS)
        out["queue-master-locator"] = loc
    for key, least in LIMIT_KEYS.items():
        if key in definition:
            value = definition[key]
            if not _is_int(value) or value < least:
                kind = "a positive integer" if least else "a non-negative integer"
                raise PolicyError(f"'{key}' must be {kind}, got {_show(value)}")
            out[key] = value
    if "overflow" in definition:
        _one_of("overflow", definition["overflow"], OVERFLOW_VALUES)
        out["overflow"] = definition["overflow"]
    for key in DEAD_LETTER_KEYS:
        if key in definition:
            if not isinstance(definition[key], str):
                raise PolicyError(f"'{key}' must be a string, got {_show(definition[key])}")
            out[key] = definition[key]
    if "queue-mode" in definition:
        _one_of("queue-mode", definition["queue-mode"], QUEUE_MODES)
        out["queue-mode"] = definition["queue-mode"]
    if "alternate-exchange" in definition:  # an exchange's key (mirroring/exchanges.py)
        ae = definition["alternate-exchange"]
        if not isinstance(ae, str):
            raise PolicyError(f"'alternate-exchange' must be an exchange name, got {_show(ae)}")
        out["alternate-exchange"] = ae
    return out


def make_policy(name: str, pattern: str, definition: str | dict, priority: int = 0,
                apply_to: str = "all", vhost: str = DEFAULT_VHOST) -> Policy:
    """A validated policy record of `vhost`, ready to store in the cluster metadata."""
    _check_fields(name, pattern, priority, apply_to)
    return Policy(name, pattern, parse_definition(definition), priority, apply_to, vhost=vhost)


def _check_fields(name, pattern, priority, apply_to) -> None:
    """The checks of a policy's fields other than its definition."""
    if not isinstance(name, str) or not name:
        raise PolicyError(f"'name' must be a non-empty string, got {_show(name)}")
    if not isinstance(pattern, str):
        raise PolicyError(f"'pattern' must be a string, got {_show(pattern)}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise PolicyError(f"'pattern' is not a valid regular expression: {e}") from None
    if not _is_int(priority):
        raise PolicyError(f"'priority' must be an integer, got {_show(priority)}")
    _one_of("apply-to", apply_to, APPLY_TO)


def effective_policy(policies: dict[str, Policy], queue_name: str,
                     vhost: str = DEFAULT_VHOST, kind: str = "queues") -> Policy | None:
    """The policy record that applies to queue `queue_name` of `vhost` (to an exchange, with
    `kind` "exchanges"), or None (see the module rules for ties). Only the policies of the
    resource's own vhost apply."""
    best = None
    for record in policies.values():
        if record.vhost != vhost or record.apply_to not in (kind, "all"):
            continue
        if re.search(record.pattern, queue_name) is None:
            continue
        if (best is None or record.priority > best.priority
                or (record.priority == best.priority and record.name < best.name)):
            best = record
    return best


# --- settings ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class HA:
    """A queue's mirroring settings, with RabbitMQ's defaults for keys the policy leaves out."""

    mode: str | None = None  # None (not mirrored), "all", "exactly", "nodes"
    params: object = None  # exactly: the replica count; nodes: a tuple of node names
    sync_mode: str = "manual"  # "manual", "automatic" or "background" (automatic, not blocking)
    sync_batch_size: int | None = None  # None: the node's mirroring_sync_batch_size
    promote_on_failure: str = "always"
    promote_on_shutdown: str = "when-synced"
    locator: str | None = None  # "client-local", "balanced" or None (the node's default)


def ha_settings(policy: Policy | None, exclusive: bool = False) -> HA:
    """The HA settings a queue gets from its effective policy record (None: no policy)."""
    if policy is None or exclusive:
        return HA()
    d = policy.definition
    params = d.get("ha-params")
    if isinstance(params, list):
        params = tuple(params)
    return HA(
        mode=d.get("ha-mode"),
        params=params,
        sync_mode=d.get("ha-sync-mode", "manual"),
        sync_batch_size=d.get("ha-sync-batch-size"),
        promote_on_failure=d.get("ha-promote-on-failure", "always"),
        promote_on_shutdown=d.get("ha-promote-on-shutdown", "when-synced"),
        locator=d.get("queue-master-locator"),
    )


# --- placement -----------------------------------------------------------------------------

def _unique(names) -> list[str]:
    return list(dict.fromkeys(names))


def place_mirrors(ha: HA, leader: str, mirrors: list[str], members: list[str],
                  running: set[str], load: dict[str, int] | None = None) -> list[str]:
    """The mirror list (oldest first) the queue should have now; see the module rules.

    all: every running member but the leader. exactly N: N-1 mirrors, or every running member
    but the leader if there are fewer; surplus existing mirrors are cut from the young end; a
    new one goes to the running member with the lowest `load`, ties to the most senior.
    nodes: the listed names that are running members, new ones added in the policy's order.
    """
    if ha.mode is None:
        return []
    usable = [n for n in _unique(members) if n in running and n != leader]
    usable_set = set(usable)
    if ha.mode == "nodes":
        wanted = [n for n in _unique(ha.params) if n in usable_set]
        wanted_set = set(wanted)
        kept = [m for m in _unique(mirrors) if m in wanted_set]
        return kept + [n for n in wanted if n not in kept]
    kept = [m for m in _unique(mirrors) if m in usable_set]
    if ha.mode == "all":
        return kept + [n for n in usable if n not in kept]
    if ha.mode == "exactly":
        target = max(ha.params - 1, 0)
        if len(kept) >= target:
            return kept[:target]
        load = load or {}
        seniority = {n: i for i, n in enumerate(usable)}
        spare = sorted((n for n in usable if n not in kept),
                       key=lambda n: (load.get(n, 0), seniority[n]))
        return kept + spare[:target - len(kept)]
    raise ValueError(f"unknown ha-mode {ha.mode!r}")


def initial_leader(ha: HA, locator_choice: str, declaring_node: str, running: list[str]) -> str:
    """The node that should lead a queue being declared.

    nodes mode: the locator's choice if it is a listed running node, else the first listed
    running node in the policy's order, else the declaring client's node. Other modes: the
    locator's choice.
    """
    if ha.mode != "nodes":
        return locator_choice
    up = set(running)
    listed_running = [n for n in ha.params if n in up]
    if locator_choice in listed_running:
        return locator_choice
    if listed_running:
        return listed_running[0]
    return declaring_node


def leader_handover(ha: HA, leader: str, mirrors: list[str], synced: set[str]) -> str | None:
    """Under a nodes policy that no longer lists the leader: the mirror that should take over.

    That is the oldest synchronised mirror that is listed. None means keep the current leader
    (it is listed, the mode is not nodes, or no listed mirror is synchronised yet).
    """
    if ha.mode != "nodes" or leader in ha.params:
        return None
    for m in mirrors:
        if m != leader and m in synced and m in ha.params:
            return m
    return None


def choose_promotion(ha: HA, mirrors: list[str], synced: set[str], running: set[str],
                     shutdown: bool) -> str | None:
    """The mirror to promote when the leader goes away (shutdown: a controlled stop).

    The oldest running mirror among those allowed; None when nobody may be promoted.
    """
    unsynced_ok = ha.promote_on_failure == "always" and (
        not shutdown or ha.promote_on_shutdown == "always")
    for m in mirrors:
        if m in running and (unsynced_ok or m in synced):
            return m
    return None


# --- operator policies ---------------------------------------------------------------------
# RabbitMQ 3.10's operator policies: set by the cluster's operator, they cap what users' policies
# may set. Only these keys are allowed (no ha-* key, no overflow): {key: least allowed value}.
# `max-in-memory-length`, `max-in-memory-bytes` and `delivery-limit` are quorum-queue limits in
# RabbitMQ; warren accepts and stores them, and its classic queues ignore them.
OPERATOR_KEYS = {"expires": 1, "message-ttl": 0, "max-length": 0, "max-length-bytes": 0,
                 "max-in-memory-length": 0, "max-in-memory-bytes": 0, "delivery-limit": 0}


def parse_operator_definition(definition: str | dict) -> dict:
    """Check an operator policy's definition (JSON text of an object, or a dict): every key one
    of OPERATOR_KEYS with an integer value no less than its least; a new dict, or PolicyError."""
    definition = _definition_object(definition)
    unknown = sorted((k for k in definition if k not in OPERATOR_KEYS), key=str)
    if unknown:
        names = ", ".join(f"'{k}'" for k in unknown)
        raise PolicyError(f"{names} are not recognised policy settings")
    for key, least in OPERATOR_KEYS.items():
        if key in definition:
            value = definition[key]
            if not _is_int(value) or value < least:
                kind = "a positive integer" if least else "a non-negative integer"
                raise PolicyError(f"'{key}' must be {kind}, got {_show(value)}")
    return dict(definition)


def make_operator_policy(name: str, pattern: str, definition: str | dict, priority: int = 0,
                         apply_to: str = "all", vhost: str = DEFAULT_VHOST) -> Policy:
    """A validated operator policy record (the checks of `make_policy`, the operator's keys)."""
    _check_fields(name, pattern, priority, apply_to)
    return Policy(name, pattern, parse_operator_definition(definition), priority, apply_to,
                  vhost=vhost)


def merge_operator_definition(user: dict | None, operator: dict | None) -> dict:
    """A queue's definition from its user policy's and its operator policy's (either may be
    None), as RabbitMQ merges them: a key only one of them sets is taken from it; a key both set
    (the operator's keys are all numeric limits) takes the lesser value."""
    merged = dict(user or {})
    for key, value in (operator or {}).items():
        mine = merged.get(key)
        merged[key] = value if mine is None else min(mine, value)
    return merged


def effective_definition(policies: dict[str, Policy], operator_policies: dict[str, Policy],
                         queue_name: str, vhost: str = DEFAULT_VHOST) -> dict:
    """The definition in effect for a queue: its policy's merged with its operator policy's,
    each chosen among its kind by `effective_policy`'s rule (pattern, apply-to, priority)."""
    user = effective_policy(policies, queue_name, vhost)
    operator = effective_policy(operator_policies, queue_name, vhost)
    return merge_operator_definition(user.definition if user else None,
                                     operator.definition if operator else None)


# --- managed HA (Amazon MQ's cluster deployments) -------------------------------------------
# Amazon MQ keeps every queue of a cluster mirrored on all nodes: a system policy that exists
# from the cluster's creation and is recreated if deleted, and the HA keys of every policy a
# user sets forced to its own (added when missing, replaced when different). RabbitMQ's
# operator policies cannot carry ha-* keys, so this is done the way Amazon MQ does it: by
# rewriting the policies themselves (mirroring/planner.py, on the log's leader).
SYSTEM_POLICY_NAME = "ha-all-AWS-OWNED-DO-NOT-DELETE"
MANAGED_HA_KEYS = {"ha-mode": "all", "ha-sync-mode": "automatic"}
HA_KEYS = ("ha-mode", *NEEDS_HA_MODE)


def system_policy(vhost: str = DEFAULT_VHOST) -> Policy:
    """The managed HA's system policy of a vhost (every vhost has one): every queue and
    exchange, priority 0."""
    return Policy(SYSTEM_POLICY_NAME, ".*", dict(MANAGED_HA_KEYS), 0, "all", "managed-ha", vhost)


def enforce_managed_ha(policy: Policy) -> tuple[Policy, str]:
    """A policy with its HA keys forced to the managed HA's, and what changed ("" if nothing).

    A policy that applies only to exchanges is left alone (HA keys mean nothing there); the
    system policy is rebuilt as it should be.
    """
    if policy.name == SYSTEM_POLICY_NAME:
        wanted = system_policy(policy.vhost)
        return wanted, "" if policy == wanted else "system policy restored"
    if policy.apply_to == "exchanges":
        return policy, ""
    old = policy.definition
    present = {k: old[k] for k in HA_KEYS if k in old}
    if present == MANAGED_HA_KEYS:
        return policy, ""
    definition = {k: v for k, v in old.items() if k not in HA_KEYS}
    definition.update(MANAGED_HA_KEYS)
    if present:
        was = ", ".join(f"{k}={_show(v)}" for k, v in present.items())
        note = f"HA keys replaced ({was})"
    else:
        note = "HA keys added"
    rewritten = msgspec.structs.replace(policy, definition=definition, set_by="user+managed-ha")
    return rewritten, note


def managed_ha_out_of_line(policies: dict[str, Policy],
                           vhosts=(DEFAULT_VHOST,)) -> list[Policy]:
    """The policies as the managed HA wants them, for those that are not (the system policy of
    each of `vhosts` first, if it is missing or changed)."""
    out = [system_policy(v) for v in vhosts
           if policies.get(qualify(v, SYSTEM_POLICY_NAME)) != system_policy(v)]
    for name in sorted(policies):
        if policies[name].name == SYSTEM_POLICY_NAME:
            continue
        rewritten, note = enforce_managed_ha(policies[name])
        if note:
            out.append(rewritten)
    return out
