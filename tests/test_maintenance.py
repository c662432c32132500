"""Unit tests of mirroring.maintenance: the node-is-mirror-sync-critical rule and when a rolling
restart may go on to its next node."""

from __future__ import annotations

from mirroring.changes import MemberAdd, PolicySet, QueueDeclare, QueuesUpdate
from mirroring.maintenance import mirror_counts, sync_critical_queues, unsynchronised_queues
from mirroring.metadata import Metadata
from mirroring.policy import make_policy
from mirroring.records import Placement, QueueDef, QueueUpdate

RUNNING = {"n1", "n2", "n3"}


def cluster(*queues, mirrored: str = "^m") -> Metadata:
    """n1..n3; a policy mirroring the queues whose names start with `mirrored`; each queue
    (name, leader, mirrors, synced) declared and placed so."""
    md = Metadata()
    for n in ("n1", "n2", "n3"):
        md.apply(MemberAdd(n, (n, 25672), (n, 5672)))
    md.apply(PolicySet(make_policy("ha", mirrored, {"ha-mode": "all", "ha-sync-mode": "automatic"})))
    for name, leader, mirrors, synced in queues:
        md.apply(QueueDeclare(QueueDef(name, True, False, False, {}, leader)))
        place(md, name, mirrors, synced)
    return md


def place(md, name, mirrors, synced) -> None:
    q = md.queues[name]
    md.apply(QueuesUpdate((QueueUpdate(name, Placement(q.leader, tuple(mirrors), tuple(synced),
                                                       q.epoch)),)))


def test_a_leader_without_a_synchronised_mirror_is_critical():
    md = cluster(("m.ok", "n1", ["n2", "n3"], ["n2"]), ("m.bad", "n1", ["n2", "n3"], []),
                 ("m.other", "n2", ["n1", "n3"], []))
    assert sync_critical_queues(md, "n1", RUNNING) == ["m.bad"]
    assert sync_critical_queues(md, "n2", RUNNING) == ["m.other"]
    assert sync_critical_queues(md, "n3", RUNNING) == []  # it leads nothing


def test_a_synchronised_mirror_on_a_stopped_node_does_not_count():
    md = cluster(("m.q", "n1", ["n2", "n3"], ["n2"]))
    assert sync_critical_queues(md, "n1", {"n1", "n3"}) == ["m.q"]


def test_mirrored_by_policy_counts_even_without_mirrors_and_unmirrored_queues_never():
    md = cluster(("m.alone", "n1", [], []), ("plain", "n1", [], []))
    assert sync_critical_queues(md, "n1", RUNNING) == ["m.alone"]


def test_rolling_restart_waits_for_mirrors_placed_again_and_synchronised():
    md = cluster(("m.q", "n1", ["n2"], ["n2"]), ("plain", "n1", [], []))
    before = {"m.q": 2}
    assert mirror_counts(md) == {"m.q": 1}
    assert unsynchronised_queues(md, RUNNING, before) == {"m.q": "1 mirror(s) of 2 placed"}
    place(md, "m.q", ["n2", "n3"], ["n2"])
    assert unsynchronised_queues(md, RUNNING, before) == {"m.q": "unsynchronised on n3"}
    place(md, "m.q", ["n2", "n3"], ["n2", "n3"])
    assert unsynchronised_queues(md, RUNNING, before) == {}
    assert unsynchronised_queues(md, {"n2", "n3"}) == {"m.q": "its leader n1 is not running"}


def test_blocked_time_counts_every_blocking_sync_seen_and_the_last_one_whole():
    from broker.rolling import blocking_syncs, note_blocking_syncs

    seen: dict = {}
    for elapsed in (0.5, 2.0, 0.3):  # a sync seen at 0.5 s and 2 s, then a new one
        note_blocking_syncs({"queues": [{"name": "q", "vhost": "/", "sync_mode": "automatic",
                                         "sync": {"elapsed": elapsed}},
                                        {"name": "q", "vhost": "v", "sync_mode": "automatic",
                                         "sync": {"elapsed": 1.0}},
                                        {"name": "b", "vhost": "/", "sync_mode": "background",
                                         "sync": {"elapsed": 9.0}}]}, seen)
    assert seen == {"q": [2.0, 0.3], "q (vhost v)": [1.0]}
    assert blocking_syncs(seen["q"], {"elapsed": 0.8}) == [2.0, 0.8]
    assert blocking_syncs(seen["q"], None) == [2.0, 0.3]
    assert blocking_syncs([], {"elapsed": 0.4}) == [0.4]
    assert blocking_syncs([], None) == []


def test_a_rolling_restart_names_a_queue_with_its_vhost_and_sends_its_key_back(monkeypatch):
    """The report and the lines say "q (vhost v)"; the mirror counts the node reads back are by
    the queue's key (records.qualify)."""
    from broker import rolling

    monkeypatch.setattr(rolling, "POLL_SECONDS", 0)
    sent = []
    sync = {"elapsed": 1.5, "total_messages": 10, "messages": 4, "rate_msgs": 6.0}

    def call(where, command, payload, timeout):
        if command == "node_is_mirror_sync_critical":
            return {"queues": []}
        if command != "maintenance_status":
            return None  # stop_app, start_app
        sent.append(payload.get("least_mirrors"))
        waiting = len(sent) == 3  # the first look after start_app: still syncing
        row = {"name": "q", "vhost": "v", "leader": "n1", "mirrors": ["n2", "n3"],
               "synced": ["n2"] if waiting else ["n2", "n3"], "mirrored": True,
               "sync_mode": "automatic", "messages": 10, "sync": sync if waiting else None,
               "last_sync": None}
        return {"members": {n: [n, 25672] for n in ("n1", "n2", "n3")},
                "running_nodes": ["n1", "n2", "n3"], "queues": [row],
                "waiting": [{"name": "q", "vhost": "v", "why": "unsynchronised on n3"}] if waiting else []}

    said: list[str] = []
    [report] = rolling.RollingRestart(call, "n1", say=said.append).run(["n3"])
    assert sent[2:] == [{"v\x00q": 2}, {"v\x00q": 2}]
    assert "  waiting for 1 queue(s): q (vhost v) (syncing for 1.5 s: 6 of 10 messages left to " \
           "send, 6 msgs/s)" in said
    assert (report.queues_blocked, report.blocking_syncs) == (["q (vhost v)"], {"q (vhost v)": [1.5]})
