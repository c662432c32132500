"""The process-cluster launcher (broker.localcluster): `stop` signals only warren-servers of the
home (also one started there by hand), `start` prints a hint that works when pasted anywhere and
starts only the nodes that are not running (one node alone when named, with its ports and
settings), `reset` wipes a stopped home and refuses while a node runs, `warrenctl stop` returns
once the node has exited, and a LocalCluster's signal helpers do what the process tests rely on."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.localcluster import PID_FILE, executable, free_port, is_node_process, pick_free_ports
from cluster_procs import ProcessCluster, running_cluster

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]


def _stop_cli(home) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.localcluster", "stop", "--home", str(home)],
                          capture_output=True, text=True, timeout=30)


def _spawned(argv: list[str]) -> subprocess.Popen:
    """Popen, returning once the child has exec'ed (its /proc cmdline is argv, not ours or empty)."""
    proc = subprocess.Popen(argv)
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 5
    while cmdline.read_bytes().split(b"\0")[0] != argv[0].encode() and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def test_free_ports_stay_free_while_outgoing_connections_come_and_go():
    """A picked port must still be free when a node binds it later: picks lie below the kernel's
    ephemeral range, so no outgoing connection made in between can take one as its local port
    (CI once lost the README's n4 that way: its peer port, picked at the session's start, was the
    local end of a connection by the time n4 started)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = pick_free_ports(20)
    runs = pick_free_ports(3, span=4)
    ports = set(picked) | {base + i for base in runs for i in range(4)}
    assert len(ports) == 20 + 12, "a port was given out twice"
    assert all(port < low for port in ports), (sorted(ports), low)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(512)
        outgoing = [socket.create_connection(listener.getsockname()) for _ in range(300)]
        try:
            assert not {s.getsockname()[1] for s in outgoing} & ports
        finally:
            for s in outgoing:
                s.close()
    for port in sorted(ports):  # and each is bindable, now and by the node that gets it
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_come_from_warren_free_ports_when_set(monkeypatch):
    """WARREN_FREE_PORTS=LOW-HIGH bounds the picks (the suite's parallel workers get one share
    each, tests/conftest.py); a malformed value is an error that says what is expected."""
    monkeypatch.setenv("WARREN_FREE_PORTS", "21000-21199")
    picked = pick_free_ports(10)
    assert all(21000 <= p <= 21199 for p in picked), picked
    for bad in ("21000", "high-low", "21199-21000", "80-90"):
        monkeypatch.setenv("WARREN_FREE_PORTS", bad)
        with pytest.raises(RuntimeError, match=r"WARREN_FREE_PORTS=.*expected LOW-HIGH"):
            pick_free_ports(1)


def test_is_node_process_checks_program_and_name(tmp_path):
    sleeper = _spawned(["sleep", "30"])
    try:
        ok, why = is_node_process(sleeper.pid, "n1")
        assert not ok and "is not warren-server n1" in why and "sleep 30" in why
    finally:
        sleeper.kill()
        sleeper.wait()
    ok, why = is_node_process(sleeper.pid, "n1")
    assert not ok and "is gone" in why
    with ProcessCluster(1, tmpdir=str(tmp_path)) as c:
        assert is_node_process(c.procs["n1"].pid, "n1") == (True, "")
        ok, why = is_node_process(c.procs["n1"].pid, "n2")
        assert not ok and "--name n1" in why


def test_stop_skips_pids_that_are_no_longer_the_node(tmp_path):
    """A pid file outlives its processes; after pid reuse, stop must leave strangers alone."""
    with ProcessCluster(1, tmpdir=str(tmp_path)) as c:
        node = c.procs["n1"]
        stranger = _spawned(["sleep", "60"])
        gone = subprocess.Popen(["true"])
        gone.wait()
        try:
            pids = {"n2": node.pid,        # a warren-server, but node n1, not n2
                    "n3": stranger.pid,    # some other program got the pid
                    "n4": gone.pid,        # nothing runs under that pid
                    "n1": node.pid}
            (c.home / PID_FILE).write_text(json.dumps(pids))
            r = _stop_cli(c.home)
            assert r.returncode == 0, r.stderr
            lines = r.stdout.splitlines()
            assert any(line.startswith("n2: skipped") and "not warren-server n2" in line for line in lines), lines
            assert any(line.startswith("n3: skipped") and "sleep 60" in line for line in lines), lines
            assert any(line.startswith("n4: skipped") and "is gone" in line for line in lines), lines
            assert f"n1: stopped (pid {node.pid})" in lines
            assert node.wait(10) == 0  # SIGTERM: a graceful exit
            assert stranger.poll() is None, "stop signalled a process that was not the node"
            assert not (c.home / PID_FILE).exists()
        finally:
            stranger.kill()
            stranger.wait()


def _plain_env(**extra) -> dict:
    """The caller's environment without any WARREN_* setting (as in a new shell)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARREN_")}
    env.update(extra)
    return env


def _wait_gone(pid: int, name: str, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_node_process(pid, name)[0]:
            return True
        time.sleep(0.05)
    return False


def test_cli_start_again_starts_nothing_and_stop_stops_the_nodes(tmp_path):
    """Also: the printed hint works when pasted into a new shell in another directory (absolute
    WARREN_HOME, the secret exported) and leaves no cookie file behind; and `stop` stops a node
    started by hand with the same WARREN_HOME (found in the home's run registry)."""
    c = ProcessCluster(2, tmpdir=str(tmp_path))
    base_client, base_peer = c.client_port("n1") - 1, c.peer_port("n1") - 1
    http_port = free_port()
    cwd = tmp_path / "clone"
    cwd.mkdir()
    args = [sys.executable, "-m", "broker.localcluster", "start", "--home", "var/warren", "--nodes", "1",
            "--client-base", str(base_client), "--peer-base", str(base_peer), "--net-ticktime", "5",
            "--http-base", str(http_port - 1), "--log-format", "json"]
    home = cwd / "var" / "warren"
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, env=_plain_env(), cwd=cwd)
    hand = None
    try:
        assert r.returncode == 0, r.stderr
        assert f"client ports {base_client + 1}" in r.stdout
        assert f"http://127.0.0.1:{http_port}/" in r.stdout
        # the run registry records the management HTTP port as it records the others
        assert json.loads((home / "run" / "n1.json").read_text())["http"][1] == http_port
        pid = json.loads((home / PID_FILE).read_text())["n1"]
        assert is_node_process(pid, "n1")[0]
        # the extra flag went to warren-server: its log is JSON
        first = (home / "logs" / "n1.log").read_text().splitlines()[0]
        assert json.loads(first)["node"] == "n1"
        again = subprocess.run(args, capture_output=True, text=True, timeout=60, env=_plain_env(), cwd=cwd)
        assert again.returncode == 0 and "n1 of" in again.stdout and "already running: nothing to start" in again.stdout
        assert json.loads((home / PID_FILE).read_text())["n1"] == pid
        [hint] = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if line.startswith("use it from")]
        assert f"WARREN_HOME={home}" in hint
        pasted = subprocess.run(["bash", "-c", hint], capture_output=True, text=True, timeout=60,
                                env=_plain_env(), cwd="/")
        assert pasted.returncode == 0, pasted.stderr
        assert "Running nodes: n1" in pasted.stdout
        assert not (home / "cookie").exists(), "the hint must not leave a stray cookie"
        # a node started by hand in the same home, as the README's "one node by hand" block does
        hand_env = _plain_env(WARREN_HOME=str(home), WARREN_SECRET=c.env["WARREN_SECRET"])
        hand = subprocess.Popen([executable("warren-server"), "--name", "n4", "--client-port",
                                 str(c.client_port("n2")), "--peer-port", str(c.peer_port("n2")),
                                 "--amqp-port", str(free_port())],  # not 5673, another test's
                                env=hand_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        up = subprocess.run([executable("warrenctl"), "-n", "n4", "-t", "20", "await_startup"],
                            capture_output=True, text=True, timeout=60, env=hand_env)
        assert up.returncode == 0, up.stderr
    finally:
        stopped = _stop_cli(home)
        if hand is not None and hand.poll() is None:
            hand.wait(15)
    lines = stopped.stdout.splitlines()
    assert stopped.returncode == 0, stopped
    assert f"n1: stopped (pid {pid})" in lines and f"n4: stopped (pid {hand.pid})" in lines, lines
    assert hand.returncode == 0, "SIGTERM: a graceful exit"
    assert not is_node_process(pid, "n1")[0]
    assert _stop_cli(home).stdout.startswith("no node of")


def test_warrenctl_stop_stops_the_node_and_its_process(tmp_path):
    home = tmp_path / "home"
    env = _plain_env(WARREN_HOME=str(home), WARREN_SECRET="stop-test")
    log = tmp_path / "node.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([executable("warren-server"), "--name", "solo", "--client-port",
                                 str(free_port()), "--peer-port", str(free_port()),
                                 "--amqp-port", str(free_port())],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ctl = [executable("warrenctl"), "-n", "solo", "-t", "20"]
        up = subprocess.run([*ctl, "await_startup"], capture_output=True, text=True, timeout=60, env=env)
        assert up.returncode == 0, up.stderr
        # no -n: the only node running under the home's run registry
        r = subprocess.run([executable("warrenctl"), "stop"], capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "Stopping and halting node solo ..."
        assert proc.poll() == 0, "warrenctl stop returned while the node's process still ran"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (home / "run" / "solo.json").exists(), "a stopped node unregisters"
    text = log.read_text()
    assert "shutting down" in text and "reason='warrenctl stop'" in text
    assert "Traceback" not in text and "peer connection refused" not in text
    gone = subprocess.run([executable("warrenctl"), "-n", "solo", "status"], capture_output=True,
                          text=True, timeout=30, env=env)
    assert gone.returncode == 2 and "unknown node 'solo'" in gone.stderr


@pytest.fixture(scope="module")
def one(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1) as c:
        yield c


def test_a_node_runs_under_sched_batch_by_default(one):
    """So that a mirror or client it wakes does not preempt it mid-round (broker/server.py); the
    `other` policy is tested through a TOML file in test_config."""
    assert os.sched_getscheduler(one.procs["n1"].pid) == os.SCHED_BATCH


def test_sigstop_freezes_and_sigcont_thaws(one):
    one.sigstop("n1")
    try:
        frozen = one.ctl("n1", "status", "-t", "1", timeout=20)
        assert frozen.returncode != 0
    finally:
        one.sigcont("n1")
    one.wait_status("n1", timeout=10)


def test_sigterm_is_graceful_and_restart_brings_the_node_back(one):
    registry = one.home / "run" / "n1.json"
    assert registry.exists()
    old_pid = one.procs["n1"].pid
    assert one.sigterm("n1") == 0
    assert not registry.exists(), "a graceful stop unregisters the node"
    assert not one.alive("n1")
    one.restart("n1")
    assert one.procs["n1"].pid != old_pid and one.alive("n1")
    assert json.loads((one.home / PID_FILE).read_text())["n1"] == one.procs["n1"].pid
    assert one.cluster_status("n1")["running_nodes"] == ["n1"]


def test_kill9_leaves_the_registry_behind(one):
    one.kill9("n1")
    assert one.procs["n1"].returncode == -signal.SIGKILL
    assert (one.home / "run" / "n1.json").exists()
    one.restart("n1")
    assert one.ctl("n1", "status").returncode == 0
    assert os.path.exists(one.log_path("n1"))


def test_call_answers_as_warrenctl_does_and_says_why_it_cannot(one):
    """`LocalCluster.call` (what starting a cluster asks, without a warrenctl process per
    question) returns the value `warrenctl --formatter json` prints; a refusal and a node that
    does not answer are ControlErrors that name the command, the node and the reason."""
    from broker.localcluster import ControlError

    printed = json.loads(one.ctl_ok("n1", "cluster_status", "--formatter", "json"))
    assert one.call("n1", "cluster_status") == printed
    # a name no node registered: the node answers why (it used to drop the connection and log
    # a traceback)
    with pytest.raises(ControlError, match=r"^join_cluster on node n1: unknown node 'nowhere'"):
        one.call("n1", "join_cluster", {"node": "nowhere"})
    assert "Traceback" not in one.log_path("n1").read_text()
    stranger = ProcessCluster(1)  # never started: nothing listens on its ports
    try:
        with pytest.raises(ControlError, match=r"^status on node n1: not reachable on its peer port"):
            stranger.call("n1", "status", timeout=2)
        stranger.ports = one.ports  # n1's port, asked with another secret
        stranger.env["WARREN_SECRET"] = "not-the-cluster-secret"
        with pytest.raises(ControlError, match=r"^status on node n1: .*secret"):
            stranger.call("n1", "status")
    finally:
        stranger.cleanup()


async def test_call_works_from_inside_a_trio_run(one):
    """An async test may ask too: the call runs its own trio loop in a thread of its own."""
    assert one.call("n1", "status")["app_running"] is True


def test_warrenctl_join_cluster_to_a_bad_target_says_why(one):
    """Each bad target of join_cluster gets its own reason and exit 1, the node keeps the
    connection's answer and its log has no traceback (an unreachable target, a port out of
    range and a name nobody registered all used to drop the connection: "the node closed the
    connection without answering")."""
    unused = free_port()
    cases = [
        (f"127.0.0.1:{unused}",
         rf"^Error: cannot reach node 127\.0\.0\.1:{unused}: Connection refused\. Is it running\?$"),
        ("127.0.0.1:99999", r"^Error: bad node address '127\.0\.0\.1:99999': the port must be from 1 to 65535$"),
        ("nowhere", r"^Error: unknown node 'nowhere': no local node of that name is running"),
        ("n1", r"^Error: cannot cluster node n1 with itself$"),
        (f"127.0.0.1:{one.peer_port('n1')}", r"^Error: cannot cluster node n1 with itself$"),
    ]
    one.ctl_ok("n1", "stop_app")
    try:
        for target, said in cases:
            r = one.ctl("n1", "join_cluster", target)
            assert r.returncode == 1 and re.search(said, r.stderr.strip()), (target, r)
    finally:
        one.ctl_ok("n1", "start_app")
    assert one.call("n1", "cluster_status")["members"] == ["n1"]
    assert "Traceback" not in one.log_path("n1").read_text()


def test_the_reason_given_for_an_unreachable_target_is_the_system_s():
    """The reason join_cluster, warrenctl and LocalCluster.call give for a failed connect
    (broker.network.connect_reason): trio's "all attempts failed" unwrapped to the attempt's own
    error, and a name that does not resolve in getaddrinfo's words (its error numbers are
    negative: os.strerror would say "Unknown error -2")."""
    from broker.network import connect_reason

    refused = ConnectionRefusedError(111, "Error connecting to ('127.0.0.1', 1): Connection refused")
    attempts = OSError("all attempts to connect to 127.0.0.1:1 failed")
    attempts.__cause__ = ExceptionGroup("all attempts failed", [refused])
    assert connect_reason(attempts) == "Connection refused"
    assert connect_reason(socket.gaierror(-2, "Name or service not known")) == "Name or service not known"
    assert connect_reason(OSError("something else")) == "something else"


def test_wait_exited_waits_for_the_process_and_gives_up_after_its_timeout():
    """What `warrenctl stop` waits on: the node's process, known by its pid and name."""
    from broker.ctl import wait_exited

    fake = _spawned([sys.executable, "-c", "import time; time.sleep(60)", "warren-server", "--name", "fake"])
    try:
        t0 = time.monotonic()
        assert wait_exited(fake.pid, "fake", 0.3) is False
        assert time.monotonic() - t0 >= 0.3
        fake.kill()
        assert wait_exited(fake.pid, "fake", 5) is True  # a zombie has exited too
    finally:
        fake.kill()
        fake.wait()


def _cli(home, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "broker.localcluster", *args, "--home", str(home)],
                          capture_output=True, text=True, timeout=timeout, env=_plain_env())


def _ctl(home, node: str, *args: str) -> subprocess.CompletedProcess:
    env = _plain_env(WARREN_HOME=str(home), WARREN_SECRET="warren-local-demo-secret")
    return subprocess.run([executable("warrenctl"), "-n", node, *args], capture_output=True,
                          text=True, timeout=60, env=env)


def _until(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.2)
    return value


@pytest.mark.timeout(240)
def test_a_killed_node_started_alone_rejoins_and_its_mirrors_synchronise(tmp_path):
    """The README's kill -9, then `start n1`: the node comes back with its ports and settings,
    rejoins, and its mirror catches up; `start` alone starts only what is missing; `reset`
    refuses while nodes run and wipes the home once they are stopped."""
    import broker.client as pika

    home = tmp_path / "home"
    # every port of its own: the HTTP ports too (by default 15672-15674, which another test's
    # cluster may hold at the same time)
    client, peer, amqp, http = pick_free_ports(4, span=4)
    r = _cli(home, "start", "--client-base", str(client), "--peer-base", str(peer),
             "--amqp-base", str(amqp), "--http-base", str(http), "--net-ticktime", "5")
    try:
        assert r.returncode == 0, r.stderr
        assert (home / "cluster.json").stat().st_mode & 0o077 == 0, "it holds the secret"
        policy = _ctl(home, "n1", "set_policy", "ha-all", "^restart\\.",
                      '{"ha-mode":"all","ha-sync-mode":"automatic"}')
        assert policy.returncode == 0, policy.stderr
        connection = pika.BlockingConnection(pika.ConnectionParameters("localhost", client + 2))  # n2
        channel = connection.channel()
        channel.queue_declare("restart.orders", durable=True)
        channel.confirm_delivery()
        for i in range(300):
            channel.basic_publish("", "restart.orders", b"order-%d" % i)
        connection.close()
        pids = json.loads((home / PID_FILE).read_text())
        os.kill(pids["n1"], signal.SIGKILL)
        _until("n1's process to go", lambda: not is_node_process(pids["n1"], "n1")[0], 10)

        again = _cli(home, "start", "n1")
        assert again.returncode == 0, again.stderr
        assert again.stdout.startswith("started n1; client ports "
                                       f"{client + 1}, {client + 2}, {client + 3}"), again.stdout
        now = json.loads((home / PID_FILE).read_text())
        assert now["n2"] == pids["n2"] and now["n3"] == pids["n3"] and now["n1"] != pids["n1"]
        assert is_node_process(now["n1"], "n1")[0]
        status = _ctl(home, "n1", "cluster_status")
        assert "Running nodes: n1, n2, n3" in status.stdout, status

        def synchronised():
            rows = json.loads(_ctl(home, "n1", "list_queues", "name", "messages", "mirror_pids",
                                   "synchronised_mirror_pids", "--formatter", "json").stdout)
            row = next(r for r in rows if r["name"] == "restart.orders")
            return row if row["messages"] == 300 and len(row["synchronised_mirror_pids"]) == 2 else None

        row = _until("the restarted mirror to synchronise", synchronised)
        assert len(row["mirror_pids"]) == 2

        os.kill(now["n3"], signal.SIGKILL)
        _until("n3's process to go", lambda: not is_node_process(now["n3"], "n3")[0], 10)
        missing = _cli(home, "start")
        assert missing.returncode == 0, missing.stderr
        assert missing.stdout.startswith("started n3 (n1, n2 already running)"), missing.stdout
        assert json.loads((home / PID_FILE).read_text())["n1"] == now["n1"]

        refused = _cli(home, "reset")
        assert refused.returncode == 1 and "not wiping" in refused.stderr, refused
        assert "n1 (pid" in refused.stderr and "stop them first" in refused.stderr
        assert (home / "data" / "n1").is_dir(), "a refused reset wipes nothing"
    finally:
        stopped = _cli(home, "stop")
    assert stopped.returncode == 0, stopped.stderr
    wiped = _cli(home, "reset")
    assert wiped.returncode == 0, wiped.stderr
    assert f"removed {home / 'data'}" in wiped.stdout.splitlines()
    assert not home.exists()
    assert _cli(home, "reset").stdout.startswith("nothing to wipe in")
    unknown = _cli(home, "start", "n1")
    assert unknown.returncode == 1 and "no cluster to restart a node of" in unknown.stderr
