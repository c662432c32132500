"""Node configuration: flags, then WARREN_* environment variables, then a TOML file, then defaults.

The first of these that sets a key wins, so a file can hold a node's settings and the environment
(docker-compose, systemd) or the command line override single keys, as RABBITMQ_* variables
override rabbitmq-env.conf. The TOML file (`--config` or WARREN_CONFIG_FILE) uses the NodeConfig
field names as top-level keys, plus `secret_file`; an unknown key, a value of the wrong type or bad
TOML is a ConfigError naming the file and the key.

Also where the cluster secret comes from (like Erlang's cookie: a flag, an environment variable,
a file, or a generated `$WARREN_HOME/cookie`), and the small run registry that lets `warrenctl -n
NAME` find a local node's ports (the role epmd plays for rabbitmqctl).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from mirroring.alarm import Watermark, parse_watermark
from wire.frames import DEFAULT_MAX_FRAME, MIN_MAX_FRAME


class ConfigError(Exception):
    pass


def warren_home() -> Path:
    return Path(os.environ.get("WARREN_HOME") or Path.home() / ".warren")


@dataclass
class NodeConfig:
    name: str = "warren"
    host: str = "127.0.0.1"
    advertise_host: str = ""
    client_port: int = 5672  # warren's own (msgpack) client protocol
    amqp_port: int = 5673  # AMQP 0-9-1 (5672, AMQP's usual port, is warren's client port here)
    peer_port: int = 25672
    http_port: int | None = None  # the management HTTP API, /metrics and the web UI; off unless set
    secret: bytes = b""
    net_ticktime: float = 60.0
    log_format: str = "console"
    log_level: str = "info"
    data_dir: str = ""
    cluster_seed: str = ""
    max_frame: int = DEFAULT_MAX_FRAME
    users: dict = field(default_factory=lambda: {"guest": "guest"})
    loopback_users: list = field(default_factory=lambda: ["guest"])
    queue_leader_locator: str = "client-local"
    mirroring_sync_batch_size: int = 4096  # default ha-sync-batch-size, as RabbitMQ
    mirroring_sync_max_throughput: int = 0  # bytes/s for batch sync; 0 = no limit
    # a fraction of the memory (RabbitMQ's default 0.4) or an absolute size ("512MiB", "2GB")
    memory_high_watermark: str | float = "0.4"
    # Linux scheduling policy of the node process: "batch" (SCHED_BATCH: a peer it wakes does not
    # preempt it mid-round; see broker/server.py) or "other" (SCHED_OTHER, the usual one)
    sched_policy: str = "batch"
    # TLS (broker/tls.py): off unless tls_cert is set; then the peer and client ports speak only
    # TLS, AMQPS listens on amqps_port beside the plain amqp_port, and the HTTP port takes TLS
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_verify_peer: bool = False  # ask clients for a certificate, check any given against tls_ca
    tls_fail_if_no_peer_cert: bool = False  # refuse a client without one (implies verify_peer)
    amqps_port: int = 5671
    # Amazon MQ's managed HA policy (mirroring/policy.py): the cluster keeps the system policy
    # {"ha-mode": "all", "ha-sync-mode": "automatic"} and forces those keys into every policy
    managed_ha: bool = False
    # abuse bounds (docs/operations.md, "Limits"): what one client, or a stranger, can hold
    handshake_timeout: float = 10.0  # seconds a client connection has to log in (RabbitMQ's)
    login_failure_delay: float = 1.0  # seconds before a refused login is answered
    max_connections: int = 0  # client connections per node (AMQP and native); 0 = no limit
    channel_max: int = 2047  # channels per connection (RabbitMQ's default)
    max_tx_bytes: int = 64 << 20  # uncommitted publish bytes a transaction may hold

    @property
    def memory_watermark(self) -> Watermark:
        return parse_watermark(self.memory_high_watermark)

    def validate(self) -> "NodeConfig":
        import re
        if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,64}", self.name):
            raise ConfigError(f"node name {self.name!r}: use 1-64 letters, digits, '_', '.', '@', '-'")
        for key in ("client_port", "amqp_port", "peer_port", "http_port", "amqps_port"):
            port = getattr(self, key)
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{key} {port} is not a TCP port")
        if self.net_ticktime <= 0:
            raise ConfigError("net_ticktime must be positive")
        self.log_level = self.log_level.lower()
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level must be 'debug', 'info', 'warning' or 'error', not {self.log_level!r}")
        if self.log_format not in ("console", "json"):
            raise ConfigError(f"log_format must be 'console' or 'json', not {self.log_format!r}")
        if self.max_frame < MIN_MAX_FRAME:
            raise ConfigError(f"max_frame must be at least {MIN_MAX_FRAME}")
        if self.queue_leader_locator not in ("client-local", "balanced"):
            raise ConfigError("queue_leader_locator must be 'client-local' or 'balanced'")
        if self.sched_policy not in ("batch", "other"):
            raise ConfigError(f"sched_policy must be 'batch' or 'other', not {self.sched_policy!r}")
        if self.handshake_timeout <= 0:
            raise ConfigError("handshake_timeout must be positive")
        if self.login_failure_delay < 0:
            raise ConfigError("login_failure_delay must be 0 or more seconds")
        if self.max_connections < 0:
            raise ConfigError("max_connections must be 0 (no limit) or a positive number")
        if not 1 <= self.channel_max <= 65535:
            raise ConfigError("channel_max must be between 1 and 65535")
        if self.max_tx_bytes < 1:
            raise ConfigError("max_tx_bytes must be a positive number of bytes")
        if self.mirroring_sync_batch_size < 1:
            raise ConfigError("mirroring_sync_batch_size must be at least 1")
        if self.mirroring_sync_max_throughput < 0:
            raise ConfigError("mirroring_sync_max_throughput must be 0 (no limit) or a positive number of bytes/s")
        try:
            self.memory_watermark
        except ValueError as exc:
            raise ConfigError(f"memory_high_watermark: {exc}") from None
        if not self.secret:
            raise ConfigError("no cluster secret")
        if (self.tls_key or self.tls_ca) and not self.tls_cert:
            raise ConfigError("tls_key and tls_ca need tls_cert (TLS is on when tls_cert is set)")
        if self.tls_cert and not self.tls_ca:
            raise ConfigError("tls_cert needs tls_ca: the peer port checks every node's certificate against it")
        if not self.advertise_host:
            self.advertise_host = self.host if self.host not in ("0.0.0.0", "::") else os.uname().nodename
        if not self.data_dir:
            self.data_dir = str(warren_home() / "data" / self.name)
        return self


# key -> (env var, type)
_FIELDS = {
    "name": ("WARREN_NODE_NAME", str),
    "host": ("WARREN_HOST", str),
    "advertise_host": ("WARREN_ADVERTISE_HOST", str),
    "client_port": ("WARREN_CLIENT_PORT", int),
    "amqp_port": ("WARREN_AMQP_PORT", int),
    "peer_port": ("WARREN_PEER_PORT", int),
    "http_port": ("WARREN_HTTP_PORT", int),
    "net_ticktime": ("WARREN_NET_TICKTIME", float),
    "log_format": ("WARREN_LOG_FORMAT", str),
    "log_level": ("WARREN_LOG_LEVEL", str),
    "data_dir": ("WARREN_DATA_DIR", str),
    "cluster_seed": ("WARREN_CLUSTER_SEED", str),
    "max_frame": ("WARREN_MAX_FRAME", int),
    "queue_leader_locator": ("WARREN_QUEUE_LEADER_LOCATOR", str),
    "mirroring_sync_batch_size": ("WARREN_MIRRORING_SYNC_BATCH_SIZE", int),
    "mirroring_sync_max_throughput": ("WARREN_MIRRORING_SYNC_MAX_THROUGHPUT", int),
    "memory_high_watermark": ("WARREN_MEMORY_HIGH_WATERMARK", str),
    "sched_policy": ("WARREN_SCHED_POLICY", str),
    "users": ("WARREN_USERS", "users"),
    "loopback_users": ("WARREN_LOOPBACK_USERS", "names"),
    "tls_cert": ("WARREN_TLS_CERT", str),
    "tls_key": ("WARREN_TLS_KEY", str),
    "tls_ca": ("WARREN_TLS_CA", str),
    "tls_verify_peer": ("WARREN_TLS_VERIFY_PEER", "bool"),
    "tls_fail_if_no_peer_cert": ("WARREN_TLS_FAIL_IF_NO_PEER_CERT", "bool"),
    "amqps_port": ("WARREN_AMQPS_PORT", int),
    "managed_ha": ("WARREN_MANAGED_HA", "bool"),
    "handshake_timeout": ("WARREN_HANDSHAKE_TIMEOUT", float),
    "login_failure_delay": ("WARREN_LOGIN_FAILURE_DELAY", float),
    "max_connections": ("WARREN_MAX_CONNECTIONS", int),
    "channel_max": ("WARREN_CHANNEL_MAX", int),
    "max_tx_bytes": ("WARREN_MAX_TX_BYTES", int),
}


def parse_users(text: str, what: str = "WARREN_USERS") -> dict:
    """`NAME:PASSWORD,NAME:PASSWORD` (the flag and environment form of the TOML `users` table)."""
    users = {}
    for item in text.split(","):
        name, sep, password = item.strip().partition(":")
        if not sep or not name or not password:
            raise ConfigError(f"{what}: {item.strip()!r} is not NAME:PASSWORD "
                              "(expected NAME:PASSWORD,NAME:PASSWORD,...)")
        users[name] = password
    return users


def parse_names(text: str, what: str = "WARREN_LOOPBACK_USERS") -> list:
    """`NAME,NAME` or `none` (the flag and environment form of the TOML `loopback_users` array)."""
    if text.strip() == "none":
        return []
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of user names (or 'none')")
    return names


def parse_bool(text: str, what: str) -> bool:
    """`true`/`false` (also 1/0, yes/no, on/off), the environment form of a TOML boolean."""
    word = text.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{what}={text!r} is not a boolean (true or false)")


_PARSERS = {"users": parse_users, "names": parse_names, "bool": parse_bool}


# TOML key -> the Python types it accepts (bool is an int to Python: never accepted for numbers)
def _toml_types() -> dict[str, tuple[type, ...]]:
    types = {"secret": (str,), "secret_file": (str,), "users": (dict,), "loopback_users": (list,),
             "memory_high_watermark": (str, int, float), "http_port": (int,)}
    for f in dataclasses.fields(NodeConfig):
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in types or default is None:
            continue
        types[f.name] = (int, float) if isinstance(default, float) else (type(default),)
    return types


_TOML_NAMES = {str: "a string", int: "an integer", float: "a float", bool: "a boolean",
               dict: "a table", list: "an array"}


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    types = _toml_types()
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ConfigError(f"config file {path}: unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(unknown)} (known keys: {', '.join(sorted(types))})")
    for key, value in data.items():
        if (isinstance(value, bool) and bool not in types[key]) or not isinstance(value, types[key]):
            want = "a number" if float in types[key] else _TOML_NAMES[types[key][0]]
            if str in types[key] and float in types[key]:
                want = "a number or a string"
            got = _TOML_NAMES.get(type(value), type(value).__name__)
            raise ConfigError(f"config file {path}: {key} must be {want}, not {got} {value!r}")
    if "users" in data and not all(isinstance(k, str) and isinstance(v, str)
                                   for k, v in data["users"].items()):
        raise ConfigError(f"config file {path}: users must map user names to password strings")
    if "loopback_users" in data and not all(isinstance(u, str) for u in data["loopback_users"]):
        raise ConfigError(f"config file {path}: loopback_users must be a list of user names")
    return data


def load(flags: dict, env: dict | None = None) -> NodeConfig:
    """Build a config. `flags` holds only the options given on the command line (None = unset)."""
    env = os.environ if env is None else env
    values: dict = {}
    config_file = flags.get("config") or env.get("WARREN_CONFIG_FILE")
    if config_file:
        values.update(_read_toml(config_file))
    file_secret = values.pop("secret", None)
    file_secret_file = values.pop("secret_file", None)
    for key, (var, typ) in _FIELDS.items():
        if env.get(var):
            if typ in _PARSERS:
                values[key] = _PARSERS[typ](env[var], var)
                continue
            try:
                values[key] = typ(env[var])
            except ValueError:
                raise ConfigError(f"{var}={env[var]!r} is not a valid {typ.__name__}") from None
    for key, value in flags.items():
        if value is not None and key in _FIELDS:
            typ = _FIELDS[key][1]
            if typ in _PARSERS and isinstance(value, str):
                value = _PARSERS[typ](value, "--" + key.replace("_", "-"))
            values[key] = value
    secret = resolve_secret(flags.get("secret"), flags.get("secret_file"), env,
                            file_secret=file_secret, file_secret_file=file_secret_file)
    return NodeConfig(**values, secret=secret).validate()


def _read_secret_file(path: str) -> bytes:
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {path}: {exc.strerror}") from None
    if not data:
        raise ConfigError(f"secret file {path} is empty")
    return data


def resolve_secret(flag: str | None, file_flag: str | None, env: dict | None = None, *,
                   file_secret: str | None = None, file_secret_file: str | None = None,
                   create: bool = True) -> bytes:
    """The cluster secret, from the first of: --secret, --secret-file, WARREN_SECRET,
    WARREN_SECRET_FILE, the config file's `secret`, its `secret_file`, else the cookie file
    $WARREN_HOME/cookie (created with a random secret when missing, as Erlang does, unless
    `create` is false: a client such as warrenctl must not invent a secret no node has)."""
    env = os.environ if env is None else env
    for value, is_file in ((flag, False), (file_flag, True),
                           (env.get("WARREN_SECRET"), False), (env.get("WARREN_SECRET_FILE"), True),
                           (file_secret, False), (file_secret_file, True)):
        if value:
            return _read_secret_file(value) if is_file else value.encode()
    cookie = warren_home() / "cookie"
    if not cookie.exists() and not create:
        raise ConfigError(f"no cluster secret: give --secret or --secret-file, or set WARREN_SECRET "
                          f"or WARREN_SECRET_FILE (there is no cookie file {cookie}; is "
                          f"WARREN_HOME the nodes' home?)")
    if not cookie.exists():
        cookie.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cookie, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(20))
    return cookie.read_bytes().strip()


# --- run registry ------------------------------------------------------------------------------

def registry_path(name: str) -> Path:
    return warren_home() / "run" / f"{name}.json"


def register(name: str, peer: tuple, client: tuple, pid: int, amqp: tuple | None = None,
             http: tuple | None = None) -> None:
    path = registry_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    record = {"name": name, "peer": list(peer), "client": list(client), "pid": pid}
    if amqp is not None:
        record["amqp"] = list(amqp)
    if http is not None:
        record["http"] = list(http)
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def unregister(name: str) -> None:
    try:
        registry_path(name).unlink()
    except FileNotFoundError:
        pass


def node_name(text: str, known) -> str:
    """`text` as one of the `known` node names: itself if it is one, else, written the
    rabbitmqctl way as PREFIX@NAME (`warren@n1`, as cluster_status shows the cluster's name;
    `rabbit@n1` from habit), the NAME after the last '@' if that is one; else `text` unchanged."""
    if text not in known and "@" in text and ":" not in text:
        name = text.rpartition("@")[2]
        if name in known:
            return name
    return text


class _Registered:
    """The local node names, as `in` asks them (the registry under WARREN_HOME)."""

    def __contains__(self, name: str) -> bool:
        return bool(name) and registry_path(name).exists()


def lookup(node: str) -> tuple[str, int]:
    """Resolve `-n NODE`: `host:port` of a peer port, or a local node name from the registry
    (also written PREFIX@NAME: `node_name`)."""
    node = node_name(node, _Registered())
    if ":" in node:
        host, _, port = node.rpartition(":")
        try:
            number = int(port)
        except ValueError:
            raise ConfigError(f"bad node address {node!r}: expected HOST:PORT or a node name") from None
        if not 1 <= number <= 65535:
            raise ConfigError(f"bad node address {node!r}: the port must be from 1 to 65535")
        return host or "127.0.0.1", number
    try:
        data = json.loads(registry_path(node).read_text())
    except (OSError, ValueError):
        raise ConfigError(
            f"unknown node {node!r}: no local node of that name is running "
            f"(looked in {registry_path(node)}); give HOST:PEER_PORT instead") from None
    return data["peer"][0], data["peer"][1]
