"""Workload files: the YAML schema, its validation and the expansion into scenarios.

This module owns what a workload *means*; it does no I/O beyond reading the file. A file holds
either one scenario (its fields at the top level) or several:

    defaults: {message_size: 1024, duration: 10}     # merged under every scenario
    scenarios:                                        # explicit scenarios ...
      - {name: one, producers: 2}
    matrix:                                           # ... and/or the cross product of lists
      name: "tput-r{replicas}-{message_size}"
      replicas: [1, 2, 3]
      message_size: [128, 1024, 65536]

Every field is checked on load and an error names the file and the field, e.g.
``workloads/x.yaml: scenarios[2].producers: must be a positive integer, got -1``.
"""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ACTIONS = ("kill", "sigstop", "sigcont", "stop_app", "start_app", "restart", "add_node", "sync_queue")


class WorkloadError(ValueError):
    """A workload file that does not follow the schema; the message names the file and field."""


# --- field checkers: each returns the normalised value or raises _Bad(reason) -------------------

class _Bad(Exception):
    pass


def _int(minimum: int):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise _Bad(f"must be {kind}, got {v!r}")
        return v
    return check


def _number(minimum: float):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < minimum:
            raise _Bad(f"must be a number >= {minimum:g}, got {v!r}")
        return float(v)
    return check


def _bool(v):
    if not isinstance(v, bool):
        raise _Bad(f"must be true or false, got {v!r}")
    return v


def _choice(*options):
    def check(v):
        if v not in options:
            raise _Bad(f"must be one of {', '.join(map(str, options))}, got {v!r}")
        return v
    return check


def _name(v):
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,79}", v):
        raise _Bad(f"must be a name of letters, digits, '_', '.', '-' (at most 80), got {v!r}")
    return v


def _policy(v):
    if v is None:
        return None
    if not isinstance(v, dict) or not v:
        raise _Bad(f"must be a mapping of ha-* keys (the JSON of set_policy) or null, got {v!r}")
    for k in v:
        if not isinstance(k, str):
            raise _Bad(f"keys must be strings, got {k!r}")
    if "ha-mode" not in v:
        raise _Bad("needs an 'ha-mode' key (all, exactly or nodes)")
    if v["ha-mode"] not in ("all", "exactly", "nodes"):
        raise _Bad(f"ha-mode must be all, exactly or nodes, got {v['ha-mode']!r}")
    return dict(v)


def _replicas(v):
    if v is None:
        return None
    return _int(1)(v)


def _size(v):
    v = _int(8)(v) if not isinstance(v, str) else _parse_size(v)
    return v


def _parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|k|K|M)?\s*", s)
    if not m:
        raise _Bad(f"must be a size in bytes (an integer >= 8, or like '1 KiB'), got {s!r}")
    n = int(m.group(1)) * {None: 1, "B": 1, "KiB": 1024, "k": 1024, "K": 1024,
                           "MiB": 1 << 20, "M": 1 << 20}[m.group(2)]
    if n < 8:
        raise _Bad(f"must be at least 8 bytes (the body starts with the 8-byte message id), got {s!r}")
    return n


def _faults(v):
    if v is None:
        return []
    if not isinstance(v, list):
        raise _Bad(f"must be a list of {{at, action, target, queue}}, got {v!r}")
    out = []
    for i, f in enumerate(v):
        where = f"[{i}]"
        if not isinstance(f, dict):
            raise _Bad(f"{where}: must be a mapping like {{at: 10, action: kill, target: leader}}, got {f!r}")
        unknown = set(f) - {"at", "action", "target", "queue"}
        if unknown:
            raise _Bad(f"{where}.{min(unknown)}: unknown key (known: at, action, target, queue)")
        try:
            at = _number(0)(f.get("at"))
        except _Bad as exc:
            raise _Bad(f"{where}.at: {exc}") from None
        if f.get("action") not in ACTIONS:
            raise _Bad(f"{where}.action: must be one of {', '.join(ACTIONS)}, got {f.get('action')!r}")
        target = f.get("target", "leader")
        if not isinstance(target, str) or not target:
            raise _Bad(f"{where}.target: must be 'leader' or a node name, got {target!r}")
        queue = f.get("queue", 0)
        if isinstance(queue, bool) or not isinstance(queue, (int, str)) or (isinstance(queue, int) and queue < 0):
            raise _Bad(f"{where}.queue: must be a queue index (0 = the first) or name, got {queue!r}")
        out.append({"at": at, "action": f["action"], "target": target, "queue": queue})
    return sorted(out, key=lambda f: f["at"])


CHAOS_KEYS = {"schedules", "seed", "kinds", "faults", "scale", "net_ticktime", "rate"}


def _chaos(v):
    """A chaos campaign (bench/chaos) instead of a load: {schedules, seed, kinds, faults, scale,
    net_ticktime, rate}; every key optional."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _Bad(f"must be a mapping like {{schedules: 10, seed: 1}}, got {v!r}")
    unknown = set(v) - CHAOS_KEYS
    if unknown:
        raise _Bad(f"unknown key {min(unknown)!r} (known: {', '.join(sorted(CHAOS_KEYS))})")
    out = {"schedules": 10, "seed": 1, "kinds": None, "faults": [1, 3], "scale": 1.0,
           "net_ticktime": 3.0, "rate": None}
    for key in ("schedules", "seed"):
        if key in v:
            try:
                out[key] = _int(1 if key == "schedules" else 0)(v[key])
            except _Bad as exc:
                raise _Bad(f".{key}: {exc}") from None
    if v.get("kinds") is not None:
        from bench.chaos.schedule import KINDS
        kinds = v["kinds"] if isinstance(v["kinds"], list) else str(v["kinds"]).split(",")
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise _Bad(f".kinds: must be fault kinds among {', '.join(KINDS)}, got {v['kinds']!r}")
        out["kinds"] = list(kinds)
    if "faults" in v:
        f = v["faults"]
        lo, _, hi = str(f).partition("-")
        if not (lo.isdigit() and (not hi or hi.isdigit())) or int(lo) < 1 or int(hi or lo) < int(lo):
            raise _Bad(f".faults: must be N or MIN-MAX (at least 1), got {f!r}")
        out["faults"] = [int(lo), int(hi or lo)]
    for key in ("scale", "net_ticktime"):
        if key in v:
            if isinstance(v[key], bool) or not isinstance(v[key], (int, float)) or v[key] <= 0:
                raise _Bad(f".{key}: must be a number > 0, got {v[key]!r}")
            out[key] = float(v[key])
    if v.get("rate") is not None:
        try:
            out["rate"] = _int(1)(v["rate"])
        except _Bad as exc:
            raise _Bad(f".rate: {exc}") from None
    return out


# name -> (checker, default, help). The order is the order of `warren-bench describe`.
FIELDS: dict[str, tuple] = {
    "name": (_name, None, "scenario name (folder name in the results)"),
    "message_size": (_size, 1024, "body bytes; the body starts with the 8-byte big-endian message id"),
    "producers": (_int(1), 1, "producer connections"),
    "consumers": (_int(0), 1, "consumer connections (0: publish only)"),
    "queues": (_int(1), 1, "queues; producer p publishes round-robin over the queues q with q % producers == p"),
    "producer_rate": (_number(0), 0, "total msgs/s over all producers; 0 = as fast as it goes"),
    "messages": (_int(0), 0, "stop publishing after this many messages in total (0: use duration)"),
    "duration": (_number(0), 10, "seconds of publishing after warmup"),
    "warmup": (_number(0), 0, "seconds of publishing before the measured window"),
    "confirms": (_bool, True, "publisher confirms"),
    "confirm_window": (_int(1), 1000, "max unconfirmed messages per producer"),
    "prefetch": (_int(0), 1000, "consumer prefetch (basic.qos), 0 = unlimited"),
    "ack": (_choice("manual", "multiple", "auto"), "manual",
            "manual: one basic.ack per message; multiple: one multiple=true ack per read (AMQP) or "
            "per batch (warren-native); auto: no acks (auto-ack)"),
    "durable": (_bool, False, "declare the queues durable"),
    "replicas": (_replicas, None, ("shorthand for policy {ha-mode: exactly, ha-params: N, "
                                   "ha-sync-mode: automatic}; 1 or null = not mirrored")),
    "policy": (_policy, None, "the ha-* JSON given to set_policy, or null (overrides replicas)"),
    "consume_after_publish": (_bool, False, "consumers start only after publishing ends (a backlog)"),
    "drain": (_bool, True, "after publishing, consume until every published message arrived"),
    "drain_timeout": (_number(0), 30, "give up draining after this many seconds without a delivery"),
    "log": (_choice("per-message", "interval"), "per-message",
            "per-message lines, or a 1-in-sample_every sample plus intervals"),
    "sample_every": (_int(1), 100, "with log: interval, keep one message line in this many"),
    "faults": (_faults, [], "list of {at: s after load start, action, target: leader|NODE, queue}"),
    "needs": (lambda v: _choice("sync")(v) if v is not None else None, None,
              "a broker feature the scenario needs (sync: the sync_queue command)"),
    "leaders": (_choice("first", "spread"), "first",
                ("first: every queue declared through the first node; spread: queue i declared "
                 "through node i % nodes (its leader there), and each producer and consumer "
                 "connected to the node of its first queue")),
    "procs": (lambda v: _int(1)(v) if v is not None else None, None,
              "generator processes per role (null: the --procs of the command line)"),
    "idle_connections": (_int(0), 0, ("an idle-connection scenario: open this many connections "
                                      "(one channel each) to node idle_node, hold them idle_seconds, "
                                      "measure the node's memory (no load; 0: a load scenario)")),
    "idle_node": (_int(0), 0, "index of the node that holds the idle connections (0 = the first)"),
    "idle_seconds": (_number(0), 10, "how long the idle connections are held before the memory is read"),
    "declare_queues": (_int(0), 0, ("a declare scenario: one connection per node declares its share "
                                    "of this many queues (queue i through node i % nodes), one call "
                                    "at a time, then each deletes the ones it declared; times both "
                                    "phases and every call (no load; 0: not a declare scenario)")),
    "rpc_clients": (_int(0), 0, ("an rpc scenario: this many clients (client i through node i % nodes, "
                                 "spread over procs processes) each connect, open a channel and declare "
                                 "an exclusive server-named queue, as RPC callers do for their replies; "
                                 "times until all hold one, then until the broker lists none after "
                                 "they close (no load; 0: not an rpc scenario)")),
    "chaos": (_chaos, None, ("a chaos campaign instead of a load: {schedules, seed, kinds, faults, "
                             "scale, net_ticktime, rate} (bench/chaos); warren only")),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    message_size: int
    producers: int
    consumers: int
    queues: int
    producer_rate: float
    messages: int
    duration: float
    warmup: float
    confirms: bool
    confirm_window: int
    prefetch: int
    ack: str
    durable: bool
    replicas: int | None
    policy: dict | None
    consume_after_publish: bool
    drain: bool
    drain_timeout: float
    log: str
    sample_every: int
    faults: list = field(default_factory=list)
    needs: str | None = None
    leaders: str = "first"
    procs: int | None = None
    idle_connections: int = 0
    idle_node: int = 0
    idle_seconds: float = 10
    declare_queues: int = 0
    rpc_clients: int = 0
    chaos: dict | None = None
    source: str = ""

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in FIELDS} | {"source": self.source}

    @property
    def sampled(self) -> bool:
        return self.log == "interval"

    @property
    def effective_policy(self) -> dict | None:
        if self.policy is not None:
            return self.policy
        if self.replicas and self.replicas > 1:
            return {"ha-mode": "exactly", "ha-params": self.replicas, "ha-sync-mode": "automatic"}
        return None

    def queue_names(self) -> list[str]:
        return [f"bench.{self.name}.{i}" for i in range(self.queues)]

    @property
    def idle(self) -> bool:
        return self.idle_connections > 0

    @property
    def declaring(self) -> bool:
        """A declare scenario (declare_queues > 0): it times queue.declare and queue.delete."""
        return self.declare_queues > 0

    def declare_names(self) -> list[str]:
        """The queues a declare scenario declares and deletes: bench.NAME.0 .. bench.NAME.N-1."""
        return [f"bench.{self.name}.{i}" for i in range(self.declare_queues)]

    @property
    def rpc(self) -> bool:
        """An rpc scenario (rpc_clients > 0): clients that each hold an exclusive reply queue."""
        return self.rpc_clients > 0

    def queue_node(self, q: int, nodes: int) -> int:
        """Index of the node queue q is declared through (its leader, for client-local brokers)."""
        return q % nodes if self.leaders == "spread" else 0

    def producer_queues(self, p: int) -> list[int]:
        """Queues producer p publishes to, round-robin: those q with q % producers == p; with
        fewer queues than producers, producers share: p publishes to queue p % queues."""
        if self.queues >= self.producers:
            return [q for q in range(self.queues) if q % self.producers == p]
        return [p % self.queues]

    def consumer_queues(self, c: int) -> list[int]:
        """Queues consumer c reads: q with q % consumers == c; with fewer queues than consumers,
        consumer c shares queue c % queues."""
        if self.queues >= self.consumers:
            return [q for q in range(self.queues) if q % self.consumers == c]
        return [c % self.queues]


def _check_fields(raw, where: str, origin: str, allow_lists: bool = False) -> dict:
    if not isinstance(raw, dict):
        raise WorkloadError(f"{origin}: {where}: must be a mapping of fields, got {raw!r}")
    out = {}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in FIELDS:
            near = difflib.get_close_matches(str(key), FIELDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise WorkloadError(f"{origin}: {path}: unknown field{hint}")
        checker = FIELDS[key][0]
        values = value if allow_lists else [value]
        if allow_lists and (not isinstance(value, list) or not value):
            raise WorkloadError(f"{origin}: {path}: a matrix entry must be a non-empty list, got {value!r}")
        checked = []
        for i, v in enumerate(values):
            try:
                checked.append(checker(v))
            except _Bad as exc:
                sub = f"{path}[{i}]" if allow_lists else path
                msg = str(exc)
                # fault and chaos errors already carry their own [index].key / .key prefix
                sep = "" if msg.startswith(("[", ".")) else ": "
                raise WorkloadError(f"{origin}: {sub}{sep}{msg}") from None
        out[key] = checked if allow_lists else checked[0]
    return out


def _finish(fields: dict, where: str, origin: str) -> Scenario:
    where = f"{where}." if where else ""
    if "name" not in fields:
        raise WorkloadError(f"{origin}: {where}name: every scenario needs a name")
    full = {k: d for k, (_, d, _) in FIELDS.items()} | fields
    if full["messages"] == 0 and full["duration"] + full["warmup"] <= 0:
        raise WorkloadError(f"{origin}: {where}duration: must be > 0 when messages is 0")
    if full["idle_connections"] and full["faults"]:
        raise WorkloadError(f"{origin}: {where}faults: an idle-connection scenario takes no faults")
    for kind_field in ("declare_queues", "rpc_clients"):
        if full[kind_field]:
            _check_no_load(kind_field, fields, full, where, origin)
    if full["consume_after_publish"] and full["consumers"] == 0:
        raise WorkloadError(f"{origin}: {where}consume_after_publish: needs consumers >= 1")
    for i, f in enumerate(full["faults"]):
        if isinstance(f["queue"], int) and f["queue"] >= full["queues"]:
            raise WorkloadError(f"{origin}: {where}faults[{i}].queue: index {f['queue']} but the "
                                f"scenario has {full['queues']} queue(s)")
    return Scenario(**full, source=origin)


# the kinds of scenario that carry no messages, by the field that makes one, and their name (with
# its article) in error messages
NO_LOAD_KINDS = {"idle_connections": "an idle-connection", "declare_queues": "a declare",
                 "rpc_clients": "an rpc"}
# fields that drive a load: a declare or rpc scenario runs none, so giving one of them is a mistake
NO_LOAD_REFUSES = ("producers", "consumers", "queues", "producer_rate", "messages", "consume_after_publish")


def _check_no_load(kind_field: str, fields: dict, full: dict, where: str, origin: str) -> None:
    """A declare or rpc scenario (kind_field: declare_queues or rpc_clients) only declares its own
    plain queues: no load, faults, policy, durable queues, other kind of scenario or chaos alongside."""
    bad = f"{origin}: {where}"
    what = f"{NO_LOAD_KINDS[kind_field]} scenario"
    for key in NO_LOAD_REFUSES:
        if key in fields:
            raise WorkloadError(f"{bad}{key}: {what} runs no producers or consumers "
                                f"({kind_field} is its only load); drop {key}")
    if full["faults"]:
        raise WorkloadError(f"{bad}faults: {what} takes no faults")
    kinds = [k for k in NO_LOAD_KINDS if full[k]]
    if len(kinds) > 1:  # named by the first of the two, in the order of NO_LOAD_KINDS
        raise WorkloadError(f"{bad}{kinds[0]}: a scenario is {NO_LOAD_KINDS[kinds[0]]} one or "
                            f"{NO_LOAD_KINDS[kinds[1]]} one, not both")
    if full["chaos"] is not None:
        raise WorkloadError(f"{bad}chaos: {what} is not a chaos campaign")
    if full["policy"] is not None or (full["replicas"] or 1) > 1:
        key = "policy" if full["policy"] is not None else "replicas"
        raise WorkloadError(f"{bad}{key}: {what} sets no policy (its queues are plain, non-mirrored)")
    if full["durable"]:
        raise WorkloadError(f"{bad}durable: {what} declares non-durable queues")


def parse(data, origin: str = "<workload>") -> list[Scenario]:
    """Scenarios of one parsed YAML document; raises WorkloadError naming the bad field."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{origin}: the file must be a mapping (fields, or defaults/scenarios/matrix)")
    blocks = {"defaults", "scenarios", "matrix", "description"}
    if not (set(data) & (blocks - {"description"})):
        return [_finish(_check_fields(data, "", origin), "", origin)]
    extra = set(data) - blocks
    if extra:
        key = min(extra)
        raise WorkloadError(f"{origin}: {key}: unknown top-level key (known: description, defaults, "
                            f"scenarios, matrix; or put scenario fields alone at the top level)")
    defaults = _check_fields(data.get("defaults") or {}, "defaults", origin)
    out: list[Scenario] = []
    scenarios = data.get("scenarios") or []
    if not isinstance(scenarios, list):
        raise WorkloadError(f"{origin}: scenarios: must be a list of scenarios, got {scenarios!r}")
    for i, raw in enumerate(scenarios):
        where = f"scenarios[{i}]"
        out.append(_finish(defaults | _check_fields(raw, where, origin), where, origin))
    if data.get("matrix") is not None:
        matrix = dict(data["matrix"]) if isinstance(data["matrix"], dict) else data["matrix"]
        if not isinstance(matrix, dict):
            raise WorkloadError(f"{origin}: matrix: must be a mapping of field: [values], got {matrix!r}")
        template = matrix.pop("name", None)
        if not isinstance(template, str):
            raise WorkloadError(f"{origin}: matrix.name: needs a name template like 'tput-{{message_size}}'")
        axes = _check_fields(matrix, "matrix", origin, allow_lists=True)
        keys = list(axes)
        for combo in itertools.product(*(axes[k] for k in keys)):
            fields = dict(zip(keys, combo))
            try:
                shown = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in fields.items()}
                name = template.format(**shown)
            except (KeyError, IndexError) as exc:
                raise WorkloadError(f"{origin}: matrix.name: template refers to {exc} which is not a matrix field") from None
            where = f"matrix[{', '.join(f'{k}={v}' for k, v in fields.items())}]"
            try:
                fields["name"] = _name(name)
            except _Bad as exc:
                raise WorkloadError(f"{origin}: matrix.name: {exc}") from None
            out.append(_finish(defaults | fields, where, origin))
    if not out:
        raise WorkloadError(f"{origin}: scenarios: the file defines no scenario")
    seen = set()
    for s in out:
        if s.name in seen:
            raise WorkloadError(f"{origin}: {s.name}: two scenarios have this name")
        seen.add(s.name)
    return out


def load(path) -> list[Scenario]:
    """Read and validate one workload file."""
    path = Path(path)
    origin = _display(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"{origin}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{origin}: not valid YAML: {exc}") from None
    return parse(data, origin)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def select(scenarios: list[Scenario], names: list[str] | None) -> list[Scenario]:
    """The scenarios named in `names` (`warren-bench run --scenario`), in the files' order; all of
    them when `names` is None. A name no file defines is an error that lists the ones they do."""
    if names is None:
        return scenarios
    known = [s.name for s in scenarios]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise WorkloadError(f"--scenario: no scenario named {', '.join(unknown)} in these workloads "
                            f"(they define: {', '.join(known)})")
    return [s for s in scenarios if s.name in names]


WORKLOAD_DIR = Path(__file__).parent / "workloads"


def resolve(arg: str) -> Path:
    """A workload argument: a path, or the name of a shipped suite (`smoke` -> bench/workloads/smoke.yaml)."""
    p = Path(arg)
    if p.exists():
        return p
    shipped = WORKLOAD_DIR / f"{arg}.yaml"
    if shipped.exists():
        return shipped
    known = ", ".join(sorted(x.stem for x in WORKLOAD_DIR.glob("*.yaml")))
    raise WorkloadError(f"{arg}: no such file and no shipped suite of that name (shipped: {known})")
