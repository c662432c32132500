"""Bad input and unreachable things on the command lines: each is one clear line on stderr and a
non-zero exit, never a traceback, and nothing is created on the way.

Covered: warren-server with a port in use, a `--cluster-seed` naming no node or cluster state
saved in an older format, warrenctl with no secret to be had, warren-bench throughput --nodes
pointing at nothing, the analysis given a missing or empty INPUT (also as `warren-bench
analyze`), and the help texts of warren-bench and warrenctl (a description; every command with a
one-line description).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from broker.localcluster import executable, free_port

pytestmark = [pytest.mark.process, pytest.mark.timeout(60)]  # every test runs a command


@pytest.fixture
def env(tmp_path):
    """A private WARREN_HOME and no WARREN_* settings from the caller's shell."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("WARREN_")}
    e["WARREN_HOME"] = str(tmp_path / "home")
    return e


def _run(args, env, timeout=30.0) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


def one_line_error(r: subprocess.CompletedProcess, *parts: str) -> str:
    """Assert a non-zero exit and a stderr of exactly one line holding every part."""
    assert r.returncode != 0, f"exit 0: {r.stdout}{r.stderr}"
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.stderr}"
    assert "Traceback" not in r.stderr
    for part in parts:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def busy_port():
    """A port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("which", ["--client-port", "--peer-port", "--http-port", "--amqp-port"])
def test_server_port_in_use(env, busy_port, which):
    # every other port a free one (the AMQP port's default, 5673, may be another test's)
    ports = {"--client-port": str(free_port()), "--peer-port": str(free_port()),
             "--amqp-port": str(free_port())}
    ports[which] = str(busy_port)
    r = _run([executable("warren-server"), "--name", "p", "--secret", "s",
              *[x for kv in ports.items() for x in kv]], env)
    line = one_line_error(r, "warren-server:", f"127.0.0.1:{busy_port}", which, "address already in use")
    assert r.returncode == 1, line
    assert not (os.path.exists(os.path.join(env["WARREN_HOME"], "run", "p.json")))


def test_server_cluster_seed_naming_no_node(env):
    r = _run([executable("warren-server"), "--name", "n9", "--secret", "s", "--client-port",
              str(free_port()), "--peer-port", str(free_port()), "--cluster-seed", "nosuch"], env)
    one_line_error(r, "warren-server: --cluster-seed nosuch: unknown node 'nosuch'", "HOST:PEER_PORT")
    assert r.returncode == 2


@pytest.mark.process
def test_server_with_cluster_state_of_an_older_format_says_how_to_reset(env, tmp_path):
    """A data dir written before the metadata's changes were typed (a list per change, no format
    number in the file) cannot be read: the node is reset, not started on a guess."""
    import msgpack
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    old = {"term": 1, "voted_for": None, "snap_index": 0, "snap_term": 0, "snap_config": ["o"],
           "snap_data": None, "entries": [[1, ["noop"]]]}
    (data_dir / "raft.msgpack").write_bytes(msgpack.packb({"raft": old, "commit": 1}))
    r = _run([executable("warren-server"), "--name", "o", "--secret", "s", "--client-port",
              str(free_port()), "--peer-port", str(free_port()), "--amqp-port", str(free_port()),
              "--data-dir", str(data_dir)], env)
    one_line_error(r, "warren-server:", "raft.msgpack", "python -m broker.localcluster reset",
                   str(data_dir))
    assert r.returncode == 1


def test_warrenctl_without_a_secret_creates_no_cookie(env):
    r = _run([executable("warrenctl"), "-n", "127.0.0.1:1", "status"], env)
    one_line_error(r, "Error: no cluster secret", "WARREN_SECRET", os.path.join(env["WARREN_HOME"], "cookie"))
    assert r.returncode == 2
    assert not os.path.exists(os.path.join(env["WARREN_HOME"], "cookie"))


def test_warrenctl_node_not_running(env):
    r = _run([executable("warrenctl"), "--secret", "s", "-n", f"127.0.0.1:{free_port()}", "status"], env)
    one_line_error(r, "Error: unable to perform an operation on node", "Is the node running?")


def test_warrenctl_await_startup_times_out_naming_what_it_waited_for(env):
    t0 = time.monotonic()
    r = _run([executable("warrenctl"), "--secret", "s", "-n", "ghost", "-t", "1", "await_startup"], env)
    one_line_error(r, "timed out after 1 s waiting for node 'ghost' to start", "unknown node 'ghost'")
    assert time.monotonic() - t0 < 10


def test_bench_throughput_nodes_pointing_at_nothing(env):
    port = free_port()
    r = _run([executable("warren-bench"), "throughput", "--seconds", "1", "--nodes", f"127.0.0.1:{port}"], env)
    one_line_error(r, "warren-bench throughput: error", f"could not connect to 127.0.0.1:{port}",
                   "Connection refused")
    assert r.returncode == 1


@pytest.mark.parametrize("command", [[sys.executable, "-m", "bench.analysis"],
                                     ["warren-bench", "analyse"], ["warren-bench", "analyze"]])
def test_analysis_of_a_missing_input_fails_at_once_and_writes_nothing(env, tmp_path, command):
    missing = tmp_path / "nonexistent"
    if command[0] == "warren-bench":
        command = [executable("warren-bench"), *command[1:]]
    t0 = time.monotonic()
    r = _run([*command, str(missing)], env)
    one_line_error(r, f"{missing}: no such file or directory")
    assert r.returncode == 2
    assert time.monotonic() - t0 < 15, "it must not start Spark first"
    assert not missing.exists()


def test_analysis_of_a_folder_without_logs(env, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _run([sys.executable, "-m", "bench.analysis", str(empty), "--out", str(tmp_path / "out")], env)
    one_line_error(r, f"no benchmark logs under {empty}", "RUN_ID/SCENARIO/TARGET/publish.jsonl")
    assert r.returncode == 2
    assert list(empty.iterdir()) == [] and not (tmp_path / "out").exists()


def test_bench_help_has_a_description_and_names_both_spellings(env):
    r = _run([executable("warren-bench"), "--help"], env)
    assert r.returncode == 0
    head = r.stdout.split("\n\n")[1]
    assert "Benchmarks of warren" in head
    assert "analyse (analyze)" in r.stdout
    for command in ("throughput", "run", "sync", "check"):
        assert f"\n    {command} " in r.stdout


def test_warrenctl_help_lists_every_command_with_a_description(env):
    from broker.control import COMMANDS
    from broker.ctl import COMMAND_HELP, build_parser

    r = _run([executable("warrenctl"), "--help"], dict(env, COLUMNS="100"))
    assert r.returncode == 0
    listed = {}
    name = None  # a name too long for the column has its description on the next line
    for line in r.stdout.split("commands:", 1)[1].splitlines():
        words = line.split(None, 1)
        if name is not None and line.startswith(" " * 8) and words:
            listed[name] = line.strip()
            name = None
        elif line.startswith("    ") and not line.startswith(" " * 5) and len(words) == 1 \
                and words[0] != "COMMAND":
            name = words[0]
        elif line.startswith("    ") and len(words) == 2:
            listed[words[0]] = words[1]
    parser_commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert set(listed) == parser_commands == set(COMMAND_HELP)
    assert all(listed[name] == COMMAND_HELP[name] for name in listed)
    # every control command a user can give is on the command line (the rest are node-to-node)
    internal = {"add_member", "remove_member", "sync_status", "maintenance_status"}
    assert set(COMMANDS) - internal <= parser_commands
    for name in ("stop", "await_startup", "await_online_nodes", "set_policy", "list_queues"):
        assert name in listed


def test_warrenctl_mistyped_command_or_column_gets_the_nearest(env):
    r = _run([executable("warrenctl"), "sttus"], env)
    one_line_error(r, "warrenctl: error: unknown command 'sttus': did you mean 'status'?",
                   "warrenctl --help")
    assert r.returncode == 2
    r = _run([executable("warrenctl"), "lis_queues"], env)
    one_line_error(r, "did you mean 'list_queues'?")
    r = _run([executable("warrenctl"), "xyzzy"], env)
    line = one_line_error(r, "unknown command 'xyzzy'")
    assert "did you mean" not in line
    r = _run([executable("warrenctl"), "--secret", "s", "-n", "127.0.0.1:1", "list_queues", "nme"], env)
    one_line_error(r, "Error: unknown column 'nme': did you mean 'name'?")


def _fake_nodes(home, names: list[str]) -> list[subprocess.Popen]:
    """Processes that look like running warren-servers of those names, registered under HOME/run."""
    import json

    fakes = []
    (home / "run").mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                                 "warren-server", "--name", name])
        fakes.append(fake)
        (home / "run" / f"{name}.json").write_text(json.dumps(
            {"name": name, "peer": ["127.0.0.1", 1 + i], "client": ["127.0.0.1", 1], "pid": fake.pid}))
    deadline = time.monotonic() + 5
    from broker.localcluster import running_registered
    while len(running_registered(home)) < len(names) and time.monotonic() < deadline:
        time.sleep(0.02)  # until each has exec'ed
    return fakes


def test_warrenctl_without_n_names_the_nodes_it_could_mean(env, tmp_path):
    """No -n and no $WARREN_NODE: the only local node (test_localcluster stops one so); with
    none or several, one line that says how to name a node, listing the running ones. A node
    killed with -9 (its registry entry left behind) does not count."""
    from pathlib import Path

    home = Path(env["WARREN_HOME"])
    r = _run([executable("warrenctl"), "--secret", "s", "status"], env)
    one_line_error(r, "Error: no node given and no local node runs under", "-n NAME", "HOST:PEER_PORT")
    assert r.returncode == 2
    fakes = _fake_nodes(home, ["n1", "n2"])
    dead = _fake_nodes(home, ["n3"])[0]
    dead.kill()
    dead.wait()
    try:
        r = _run([executable("warrenctl"), "--secret", "s", "cluster_status"], env)
        one_line_error(r, "Error: no node given and 2 local nodes run", "n1, n2;",
                       "e.g. warrenctl -n n1 cluster_status")
        assert "n3" not in r.stderr
        gone = fakes.pop()
        gone.kill()
        gone.wait()
        r = _run([executable("warrenctl"), "--secret", "s", "-t", "1", "status"], env)
        # the one left is n1 (a fake that does not answer on its port, so the error names it)
        one_line_error(r, "node 'n1'")
    finally:
        for fake in fakes:
            fake.kill()
            fake.wait()
