"""The states of a queue replica (mirroring/replica.py) and the moves allowed between them."""

from __future__ import annotations

import enum

class State(enum.Enum):
    WAITING = "waiting for its leader"
    MIRROR = "mirror"
    MIRROR_SYNCING = "mirror, receiving a sync"
    LEADER = "leader"
    LEADER_SYNCING = "leader, syncing (operations wait)"
    LEADER_SYNCING_LIVE = "leader, syncing in the background"
    STOPPED = "stopped"

    # members are singletons: hash them as objects, in C (Enum's own hash is Python code, and
    # the state is looked up in LEADING and its kin several times a round)
    __hash__ = object.__hash__


S = State
LEADING = frozenset({S.LEADER, S.LEADER_SYNCING, S.LEADER_SYNCING_LIVE})
FOLLOWING = frozenset({S.WAITING, S.MIRROR, S.MIRROR_SYNCING})
SERVING = frozenset({S.LEADER, S.LEADER_SYNCING_LIVE})

TRANSITIONS: dict[tuple[State, State], str] = {
    (S.WAITING, S.MIRROR): "RMirrorStart: the leader started us (empty, or resuming)",
    (S.MIRROR, S.MIRROR): "RMirrorStart of a new leader (resume or restart)",
    (S.MIRROR_SYNCING, S.MIRROR): "RSyncEnd, or a new leader's RMirrorStart",
    (S.MIRROR, S.MIRROR_SYNCING): "RSyncBatch: a batch sync started",
    (S.MIRROR_SYNCING, S.MIRROR_SYNCING): "RMirrorStart of a new leader during a sync",
    (S.MIRROR, S.WAITING): "a replication batch went missing: we asked the leader for a restart",
    (S.MIRROR_SYNCING, S.WAITING): "a replication batch went missing during a sync",
    (S.WAITING, S.LEADER): "Assign: we lead (a new queue, or promoted before any start)",
    (S.MIRROR, S.LEADER): "Assign: promoted (failover or hand-over)",
    (S.MIRROR_SYNCING, S.LEADER): "Assign: promoted during a sync (unsynchronised)",
    (S.LEADER, S.LEADER_SYNCING): "SyncRequest, blocking (the spec: the queue waits)",
    (S.LEADER, S.LEADER_SYNCING_LIVE): "SyncRequest, background (ha-sync-mode: background)",
    (S.LEADER_SYNCING, S.LEADER): "the sync completed, was cancelled or lost its mirrors",
    (S.LEADER_SYNCING_LIVE, S.LEADER): "the sync completed, was cancelled or lost its mirrors",
    (S.LEADER, S.WAITING): "Assign: another replica leads a newer epoch (demoted)",
    (S.LEADER_SYNCING, S.WAITING): "Assign: demoted during a sync",
    (S.LEADER_SYNCING_LIVE, S.WAITING): "Assign: demoted during a sync",
    **{(s, S.STOPPED): "Stop: deleted, or no replica here any more" for s in State if s is not S.STOPPED},
}


# a proposal to the metadata (or a word to a leader) not acted on is made again after this long
RETRY_PROPOSAL_AFTER = 1.0


class ReplicaError(Exception):
    """A transition the table does not allow: a bug, never a client's doing."""
