"""warren-server's configuration (broker/config.py): a TOML file, WARREN_* variables and flags,
which one wins, how bad input is refused, and a real server started from a TOML file alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from broker import config
from broker.config import ConfigError
from broker.localcluster import executable, free_port

FULL_TOML = """
name = "toml-node"
host = "127.0.0.1"
client_port = {client}
peer_port = {peer}
amqp_port = {amqp}
secret_file = "{secret_file}"
net_ticktime = 7.5
log_format = "json"
data_dir = "{data_dir}"
sched_policy = "other"
"""


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A private WARREN_HOME, so no test reads or creates the user's cookie."""
    monkeypatch.setenv("WARREN_HOME", str(tmp_path / "home"))
    for var in [v for v in os.environ if v.startswith("WARREN_") and v != "WARREN_HOME"]:
        monkeypatch.delenv(var)
    return tmp_path / "home"


def write(path, text: str):
    path.write_text(text)
    return str(path)


def full_file(tmp_path, client=6001, peer=26001, amqp=6002) -> str:
    secret_file = write(tmp_path / "secret", "from-the-secret-file\n")
    return write(tmp_path / "node.toml", FULL_TOML.format(
        client=client, peer=peer, amqp=amqp, secret_file=secret_file, data_dir=tmp_path / "data"))


def test_toml_file_sets_name_ports_secret_ticktime_and_log_format(tmp_path):
    cfg = config.load({"config": full_file(tmp_path)}, env={})
    assert (cfg.name, cfg.host, cfg.client_port, cfg.peer_port) == ("toml-node", "127.0.0.1", 6001, 26001)
    assert cfg.secret == b"from-the-secret-file"
    assert cfg.net_ticktime == 7.5
    assert cfg.log_format == "json"
    assert cfg.data_dir == str(tmp_path / "data")
    assert cfg.sched_policy == "other"


def test_toml_secret_string_is_used(tmp_path):
    path = write(tmp_path / "n.toml", 'name = "a"\nsecret = "inline-secret"\n')
    assert config.load({"config": path}, env={}).secret == b"inline-secret"


def test_config_file_from_environment_and_flag_beats_it(tmp_path):
    env_file = write(tmp_path / "env.toml", 'name = "from-env-file"\nsecret = "s"\n')
    flag_file = write(tmp_path / "flag.toml", 'name = "from-flag-file"\nsecret = "s"\n')
    assert config.load({}, env={"WARREN_CONFIG_FILE": env_file}).name == "from-env-file"
    assert config.load({"config": flag_file}, env={"WARREN_CONFIG_FILE": env_file}).name == "from-flag-file"


@pytest.mark.parametrize("layers, expected", [
    ((), 5672),                                  # the default
    (("file",), 1001),
    (("file", "env"), 2002),
    (("file", "env", "flag"), 3003),
    (("file", "flag"), 3003),
    (("env",), 2002),
])
def test_flags_override_environment_override_file(tmp_path, layers, expected):
    flags: dict = {"secret": "s"}
    env: dict = {}
    if "file" in layers:
        flags["config"] = write(tmp_path / "n.toml", "client_port = 1001\nlog_format = 'json'\n")
    if "env" in layers:
        env["WARREN_CLIENT_PORT"] = "2002"
    if "flag" in layers:
        flags["client_port"] = 3003
    cfg = config.load(flags, env=env)
    assert cfg.client_port == expected
    # a key only the file sets still comes from the file
    assert cfg.log_format == ("json" if "file" in layers else "console")


def test_amqp_port_from_flag_environment_or_file(tmp_path):
    assert config.load({"secret": "s"}, env={}).amqp_port == 5673  # 5672 is the client port
    path = write(tmp_path / "n.toml", "amqp_port = 6001\n")
    assert config.load({"secret": "s", "config": path}, env={}).amqp_port == 6001
    assert config.load({"secret": "s", "config": path}, env={"WARREN_AMQP_PORT": "6002"}).amqp_port == 6002
    assert config.load({"secret": "s", "config": path, "amqp_port": 6003},
                       env={"WARREN_AMQP_PORT": "6002"}).amqp_port == 6003
    with pytest.raises(config.ConfigError, match="amqp_port 70000 is not a TCP port"):
        config.load({"secret": "s", "amqp_port": 70000}, env={})
    assert server_flags(["--amqp-port", "6004"])["amqp_port"] == 6004


def server_flags(argv):
    from broker.server import parse_args
    return parse_args(argv)


def test_secret_order(tmp_path, home):
    files = {name: write(tmp_path / name, f"{name}-secret") for name in ("flagfile", "envfile", "tomlfile")}
    toml = write(tmp_path / "n.toml", f'secret = "toml"\nsecret_file = "{files["tomlfile"]}"\n')
    flags = {"config": toml, "secret": "flag", "secret_file": files["flagfile"]}
    env = {"WARREN_SECRET": "env", "WARREN_SECRET_FILE": files["envfile"]}
    seen = []
    for drop_flag, drop_env in (("secret", None), ("secret_file", None), (None, "WARREN_SECRET"),
                                (None, "WARREN_SECRET_FILE")):
        seen.append(config.load(flags, env=env).secret.decode())
        if drop_flag:
            flags.pop(drop_flag)
        if drop_env:
            env.pop(drop_env)
    seen.append(config.load(flags, env=env).secret.decode())
    write(tmp_path / "n.toml", f'secret_file = "{files["tomlfile"]}"\n')
    seen.append(config.load(flags, env=env).secret.decode())
    write(tmp_path / "n.toml", 'name = "n"\n')
    cookie = config.load(flags, env=env).secret
    assert seen == ["flag", "flagfile-secret", "env", "envfile-secret", "toml", "tomlfile-secret"]
    assert cookie == (home / "cookie").read_bytes().strip() and len(cookie) == 40


@pytest.mark.parametrize("text, message", [
    ("name = \n", "is not valid TOML"),
    ("name = 'x'\n[[", "is not valid TOML"),
    ("client-port = 5\n", "unknown key client-port (known keys: "),
    ("bogus = 1\nother = 2\n", "unknown keys bogus, other"),
    ("client_port = '5672'\n", "client_port must be an integer, not a string '5672'"),
    ("net_ticktime = true\n", "net_ticktime must be a number, not a boolean True"),
    ("users = { guest = 1 }\n", "users must map user names to password strings"),
    ("loopback_users = 'guest'\n", "loopback_users must be an array, not a string 'guest'"),
    ("log_format = 'xml'\nsecret = 's'\n", "log_format must be 'console' or 'json'"),
    ("peer_port = 70000\nsecret = 's'\n", "peer_port 70000 is not a TCP port"),
    ("secret_file = '/nonexistent/secret'\n", "cannot read secret file /nonexistent/secret"),
])
def test_bad_file_is_a_clear_error(tmp_path, text, message):
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(ConfigError) as info:
        config.load({"config": path}, env={})
    assert message in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file .*nope.toml: No such file"):
        config.load({"config": str(tmp_path / "nope.toml")}, env={})


def _server(*args, env=None, timeout=20.0) -> subprocess.CompletedProcess:
    return subprocess.run([executable("warren-server"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env or dict(os.environ))


@pytest.mark.process
@pytest.mark.parametrize("text, message", [
    ("[server\nname = 'x'\n", "is not valid TOML"),
    ("name = 'x'\nclient_prot = 5672\n", "unknown key client_prot"),
])
def test_server_refuses_a_bad_file_and_exits_non_zero(tmp_path, text, message):
    path = write(tmp_path / "bad.toml", text)
    r = _server("--config", path)
    assert r.returncode == 2
    assert r.stderr.startswith(f"warren-server: config file {path}")
    assert message in r.stderr


@pytest.mark.process
@pytest.mark.timeout(60)
def test_server_runs_from_a_toml_file(tmp_path, home):
    client, peer = free_port(), free_port()
    path = full_file(tmp_path, client, peer, free_port())  # no default port another test may hold
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([executable("warren-server"), "--config", path], env=dict(os.environ),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ctl = [executable("warrenctl"), "-n", "toml-node", "--formatter", "json"]
    try:
        deadline = time.monotonic() + 20
        while True:
            r = subprocess.run([*ctl, "--secret-file", str(tmp_path / "secret"), "status", "-t", "2"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode == 0 or time.monotonic() > deadline or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert r.returncode == 0, f"{r.stderr}\n{(tmp_path / 'server.log').read_text()}"
        status = json.loads(r.stdout)
        assert (status["node"], status["client_port"], status["peer_port"]) == ("toml-node", client, peer)
        assert status["net_ticktime"] == 7.5
        # the file's sched_policy = "other" (a default node is SCHED_BATCH: test_localcluster)
        assert os.sched_getscheduler(proc.pid) == os.SCHED_OTHER
        wrong = subprocess.run([*ctl, "--secret", "not-it", "status", "-t", "2"],
                               capture_output=True, text=True, timeout=20)
        assert wrong.returncode != 0
        assert (tmp_path / "data").is_dir()
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
        log.close()
    lines = (tmp_path / "server.log").read_text().splitlines()
    events = [json.loads(line) for line in lines]   # log_format = "json": every line is JSON
    assert events and all(e["node"] == "toml-node" for e in events)


def test_users_and_loopback_users_from_environment_and_flags(tmp_path):
    env = {"WARREN_SECRET": "s", "WARREN_USERS": "guest:guest,app:pa:ss", "WARREN_LOOPBACK_USERS": "none"}
    cfg = config.load({}, env=env)
    assert cfg.users == {"guest": "guest", "app": "pa:ss"}  # the first ':' splits
    assert cfg.loopback_users == []
    cfg = config.load({"users": "ops:x", "loopback_users": "ops,guest"}, env=env)
    assert cfg.users == {"ops": "x"} and cfg.loopback_users == ["ops", "guest"]
    defaults = config.load({}, env={"WARREN_SECRET": "s"})
    assert defaults.users == {"guest": "guest"} and defaults.loopback_users == ["guest"]


@pytest.mark.parametrize("env, message", [
    ({"WARREN_USERS": "guest"}, "WARREN_USERS: 'guest' is not NAME:PASSWORD"),
    ({"WARREN_USERS": "a:b,:c"}, "WARREN_USERS: ':c' is not NAME:PASSWORD"),
    ({"WARREN_LOOPBACK_USERS": "guest,,x"}, "WARREN_LOOPBACK_USERS: 'guest,,x' is not a comma-separated"),
    ({"WARREN_LOG_LEVEL": "chatty"}, "log_level must be 'debug', 'info', 'warning' or 'error'"),
    ({"WARREN_SCHED_POLICY": "fifo"}, "sched_policy must be 'batch' or 'other', not 'fifo'"),
])
def test_bad_environment_values_are_clear_errors(env, message):
    with pytest.raises(ConfigError) as info:
        config.load({}, env={"WARREN_SECRET": "s", **env})
    assert message in str(info.value)


def test_log_level_is_case_insensitive():
    assert config.load({"log_level": "WARNING"}, env={"WARREN_SECRET": "s"}).log_level == "warning"


def test_a_client_never_creates_the_cookie(home):
    """warrenctl resolves the secret with create=False: no secret anywhere is an error naming
    where it looked, and no cookie file appears (a stray one would never match a node's)."""
    with pytest.raises(ConfigError, match=r"no cluster secret: .*WARREN_SECRET.*no cookie file .*cookie"):
        config.resolve_secret(None, None, env={}, create=False)
    assert not (home / "cookie").exists()
    config.resolve_secret(None, None, env={})  # a node creates it
    assert (home / "cookie").exists()
    assert config.resolve_secret(None, None, env={}, create=False) == (home / "cookie").read_bytes().strip()


@pytest.mark.process  # a python process of its own: tune_gc would stay with the test's
def test_a_node_process_freezes_its_start_up_objects_and_collects_young_garbage_less_often():
    code = ("import gc; from broker.server import GC_THRESHOLDS, tune_gc; tune_gc(); "
            "print(gc.get_threshold() == GC_THRESHOLDS, gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_a_node_named_the_rabbitmqctl_way_is_found_by_the_name_after_the_at(home):
    """`-n warren@n1` (cluster_status shows the cluster as warren@n1) or `-n rabbit@n1` from
    habit reach node n1; a node whose own name holds an '@' is still found by that name; an
    unknown node is still a clear error."""
    from broker.config import ConfigError, lookup, node_name, register
    register("n1", ("127.0.0.1", 25691), ("127.0.0.1", 5691), os.getpid())
    register("edge@rack2", ("127.0.0.1", 25699), ("127.0.0.1", 5699), os.getpid())
    assert lookup("n1") == lookup("warren@n1") == lookup("rabbit@n1") == ("127.0.0.1", 25691)
    assert lookup("edge@rack2") == ("127.0.0.1", 25699)
    assert lookup("10.0.0.5:25672") == ("10.0.0.5", 25672)
    with pytest.raises(ConfigError, match="unknown node 'warren@n7'"):
        lookup("warren@n7")
    assert node_name("warren@n3", ["n1", "n2", "n3"]) == "n3"
    assert node_name("warren@n9", ["n1", "n2", "n3"]) == "warren@n9"  # then "not a member"
    assert node_name("a@b", ["a@b", "b"]) == "a@b"


def test_managed_ha_from_flag_environment_or_file(tmp_path):
    assert config.load({"name": "n1", "secret": "s"}, {}).managed_ha is False
    assert config.load({"name": "n1", "secret": "s", "managed_ha": True}, {}).managed_ha
    for word, value in (("true", True), ("1", True), ("off", False)):
        env = {"WARREN_MANAGED_HA": word}
        assert config.load({"name": "n1", "secret": "s"}, env).managed_ha is value, word
    with pytest.raises(ConfigError, match="WARREN_MANAGED_HA='maybe' is not a boolean"):
        config.load({"name": "n1", "secret": "s"}, {"WARREN_MANAGED_HA": "maybe"})
    good = tmp_path / "on.toml"
    good.write_text('name = "n1"\nsecret = "s"\nmanaged_ha = true\n')
    assert config.load({"config": str(good)}, {}).managed_ha is True
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "n1"\nsecret = "s"\nmanaged_ha = "yes"\n')
    with pytest.raises(ConfigError, match="managed_ha must be a boolean"):
        config.load({"config": str(bad)}, {})
    # booleans stay refused where a number is wanted
    num = tmp_path / "num.toml"
    num.write_text('name = "n1"\nsecret = "s"\nmax_frame = true\n')
    with pytest.raises(ConfigError, match="max_frame must be an integer"):
        config.load({"config": str(num)}, {})
