"""Unit tests of mirroring/sync.py (batch sync planning) and mirroring/replication.py
(acceptance once every mirror acknowledged). Pure: time is an argument."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mirroring.replication import LeaderReplication, MirrorFollow
from mirroring.sync import BatchSync, message_size


def msgs(n, size=1024):
    return [(i, b"x" * size, None, False) for i in range(1, n + 1)]


def drain(job, now=0.0):
    batches = []
    while not job.done(now):
        b = job.next_batch(now)
        if b is None:
            assert job.exhausted, "nothing to send but not done"
            continue
        batches.append(b)
        job.acked()
    return batches


def test_batches_of_the_batch_size_in_id_order():
    """"Classic queue leaders perform synchronisation in batches" of ha-sync-batch-size."""
    batches = drain(BatchSync.of_list(msgs(1000), 100, 10 << 20, 0, 0.0))
    assert [len(b) for b in batches] == [100] * 10
    assert [m[0] for b in batches for m in b] == list(range(1, 1001))
    assert [len(b) for b in drain(BatchSync.of_list(msgs(5), 1, 10 << 20, 0, 0.0))] == [1] * 5


def test_a_batch_never_exceeds_the_frame_limit():
    """A batch of 50,000 x 1 KiB (the spec's ~49 MB example) is cut to fit the frame size."""
    limit = 1 << 20
    batches = drain(BatchSync.of_list(msgs(50_000), 50_000, limit, 0, 0.0))
    assert all(sum(message_size(m) for m in b) <= limit for b in batches)
    assert sum(map(len, batches)) == 50_000
    # one message larger than the limit still travels, alone
    big = [(1, b"x" * 2000, None, False), (2, b"y", None, False)]
    assert [len(b) for b in drain(BatchSync.of_list(big, 10, 1000, 0, 0.0))] == [1, 1]


def test_window_of_unacknowledged_batches():
    job = BatchSync.of_list(msgs(100), 10, 10 << 20, 0, 0.0, window=2)
    assert job.next_batch(0) and job.next_batch(0)
    assert job.next_batch(0) is None  # two unacknowledged: wait
    job.acked()
    assert job.next_batch(0) is not None


@settings(max_examples=50, deadline=None)
@given(st.sampled_from([100_000, 1_000_000, 5_000_000]), st.sampled_from([1, 100, 4096]),
       st.integers(200, 3000))
def test_throughput_limit_holds_the_rate_within_ten_percent(rate, batch_size, n):
    """"mirroring_sync_max_throughput ... the number of bytes per second": sending whenever
    allowed, the limit holds all along, and over the whole sync (start to done, as measured from
    the outside) the body rate is within 5% of the limit."""
    start = 100.0
    job = BatchSync.of_list(msgs(n), batch_size, 8 << 20, rate, start)
    now = start
    sends: list[tuple[float, int]] = []  # (time a batch was handed out, its body bytes)
    while not job.done(now):
        b = job.next_batch(now)
        if b is None:
            nxt = job.next_time()
            assert nxt is not None, "waiting for nothing"
            now = max(nxt, now + 1e-4)
            continue
        sends.append((now, sum(len(m[1]) for m in b)))
        job.acked()
    assert sum(x for _, x in sends) == job.body_bytes_sent == n * 1024
    # before each batch goes, what went before it fits in the time elapsed at the limit
    before = 0
    for t, x in sends:
        assert before <= rate * (t - start) + 1e-6, (t - start, before, rate)
        before += x
    # the sync ends only when the limit's time for its last bytes has come
    achieved = job.body_bytes_sent / (now - start)
    assert abs(achieved - rate) / rate < 0.05, (achieved, rate)


def test_unlimited_sync_sends_at_once_and_progress_counts():
    job = BatchSync.of_list(msgs(10), 4, 10 << 20, 0, 5.0)
    assert job.wait_time(5.0) == 0
    drain(job, 6.0)
    p = job.progress(7.0)
    assert p["messages"] == 10 and p["bytes"] == 10 * 1024 and p["batches"] == 3 and p["eta"] == 0


def test_publishes_are_accepted_only_when_every_mirror_acknowledged():
    """"a message will only be confirmed to the publisher when it has been accepted by all of
    the mirrors"."""
    rep = LeaderReplication()
    assert rep.record({("n1", 1): 5}) == (1, {("n1", 1): 5})  # no mirror: at once
    rep.add("n2", 10)
    rep.add("n3", 10)
    seq, now = rep.record({("n1", 1): 6})
    assert now == {}
    assert rep.acknowledged("n2", seq) == {}
    assert rep.acknowledged("n3", seq) == {("n1", 1): 6}
    seq2, _ = rep.record({("n1", 1): 7})
    assert rep.acknowledged("n2", seq2) == {}
    assert rep.remove("n3") == {("n1", 1): 7}  # a mirror that went away no longer holds it up


def test_a_new_mirror_does_not_hold_up_earlier_batches():
    rep = LeaderReplication()
    rep.add("n2", 1)
    s1, _ = rep.record({("a", 1): 1})
    rep.add("n3", 5)
    assert rep.acknowledged("n2", s1) == {("a", 1): 1}


def test_natural_sync_and_resume_rules():
    """"As messages are drained from the mirrored queue, the size of the head of the queue for
    which the new mirror is missing messages, will shrink until eventually the mirror's contents
    precisely match the leader's contents"."""
    rep = LeaderReplication()
    rep.add("n2", 100)
    rep.mirror_state("n2", 100)
    held = [50]  # the leader's message ids
    holds = lambda lo, hi: any(lo < i < hi for i in held)  # noqa: E731
    assert rep.newly_synced(holds) == []
    held = [100, 101]  # the head drained
    assert rep.newly_synced(holds) == ["n2"]
    assert rep.synced() == ["n2"]
    f = MirrorFollow(epoch=3, last_seq=17, start_id=40)
    assert f.can_resume(3, 17, 40, 0) and f.can_resume(3, 17, 1, 0)
    assert not f.can_resume(3, 16, 1, 0)  # it applied a batch the new leader never saw
    assert not f.can_resume(3, 17, 50, 0)  # it holds older messages the new leader lost
    assert f.can_resume(3, 17, 50, 60)  # unless the new leader holds them all (a full sync)
    assert f.accepts(3, 18) is True and f.accepts(3, 17) is False and f.accepts(3, 19) is None
    assert f.accepts(2, 18) is False


def test_a_mirror_that_just_finished_a_long_sync_is_not_stalled():
    """A blocking sync of a minute: the batches sent meanwhile are acknowledged after it, so the
    mirror's silence counts from the sync's end, not from its last acknowledgement before."""
    rep = LeaderReplication()
    rep.add("n2", 1, now=0.0)
    rep.mirror_state("n2", 0, 0, now=0.0)
    rep.record({("a", 1): 1})  # a batch it owes an acknowledgement for
    assert rep.stalled(now=61.0, after=4.0) == ["n2"]
    rep.mirror_state("n2", 0, 0, now=60.0)  # the sync completed at 60 s
    assert rep.stalled(now=61.0, after=4.0) == []
    assert rep.stalled(now=64.5, after=4.0) == ["n2"]  # and silence after it still counts
