"""Exchanges and bindings: their definitions, the equivalence rules of a re-declare, and routing
(which queues a message published to an exchange with a routing key reaches). Pure: no I/O.

The metadata (mirroring/metadata.py) keeps the definitions; this module owns what they mean.

* Built in, as in RabbitMQ: the default exchange "" (a direct exchange every queue is bound to by
  its own name; it cannot be declared, deleted or bound), `amq.direct`, `amq.fanout`,
  `amq.topic`, `amq.headers` and `amq.match` (headers). Names starting with `amq.` are reserved.
* direct: the binding key equals the routing key. fanout: every binding. topic: binding keys are
  dot-separated words where `*` stands for exactly one word and `#` for zero or more; words are
  split as RabbitMQ splits them (the empty key is zero words, "a." is "a" and ""). headers: the
  binding's `x-match` (`all`, the default, or `any`; `all-with-x` / `any-with-x` also compare
  `x-` keys) against the message's headers table; a binding value of void (None) asks only for
  the key's presence, and values match when their AMQP type class and value are equal.
* `Routes` compiles the bindings of one metadata version into lookup structures (a dict for
  direct, a word trie for topic) and caches topic results, so routing a message costs a dict
  lookup in the common case.
* Exchange-to-exchange bindings (`exchange.bind`) and alternate exchanges (`alternate-exchange`,
  argument or policy key) make a graph of exchanges, routed as RabbitMQ does (`Routes`); the
  `internal` flag refuses publishes to an exchange, which still routes what reaches it through
  an exchange binding.
"""

from __future__ import annotations

import datetime
import decimal

from wire.errors import ACCESS_REFUSED, COMMAND_INVALID, NOT_FOUND, PRECONDITION_FAILED, ProtocolError

from .policy import effective_policy
from .records import DEFAULT_VHOST, Binding, Exchange, in_vhost, qualify, split_key

TYPES = ("direct", "fanout", "topic", "headers")
BUILTIN = {
    "": "direct",
    "amq.direct": "direct",
    "amq.fanout": "fanout",
    "amq.topic": "topic",
    "amq.headers": "headers",
    "amq.match": "headers",
}
TOPIC_CACHE = 4096  # routing keys remembered per topic exchange


class ExchangeError(ProtocolError):
    pass


def builtin_exchanges(vhost: str = DEFAULT_VHOST) -> dict[str, Exchange]:
    """The built-in exchanges of `vhost`, by key: every vhost has its own."""
    return {qualify(vhost, name): make_exchange(name, kind, durable=True, vhost=vhost)
            for name, kind in BUILTIN.items()}


def make_exchange(name: str, kind: str, durable: bool = False, auto_delete: bool = False,
                  internal: bool = False, arguments: dict | None = None,
                  vhost: str = DEFAULT_VHOST) -> Exchange:
    return Exchange(name, kind, bool(durable), bool(auto_delete), bool(internal),
                    dict(arguments or {}), vhost)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def describe(key: str) -> str:
    """"exchange 'x' in vhost 'v'" for an exchange's key."""
    return in_vhost("exchange", key)


def check_declare(key: str, kind: str, passive: bool) -> None:
    """What a client may not declare at all (before looking at what exists)."""
    name = split_key(key)[1]
    if name == "":
        raise ExchangeError(ACCESS_REFUSED, "operation not permitted on the default exchange")
    if not passive:
        if kind not in TYPES:
            # RabbitMQ makes this a connection error
            raise ExchangeError(COMMAND_INVALID, f"unknown exchange type '{kind}'")
        if name.startswith("amq.") and name not in BUILTIN:
            raise ExchangeError(ACCESS_REFUSED,
                                f"{describe(key)} contains reserved prefix 'amq.*'")


def check_equivalent(existing: Exchange, wanted: Exchange) -> None:
    """RabbitMQ's 406 for a re-declare with other properties."""
    name = existing.key
    for prop in ("type", "durable", "auto_delete", "internal"):
        have, want = getattr(existing, prop), getattr(wanted, prop)
        if have != want:
            raise ExchangeError(PRECONDITION_FAILED,
                                f"inequivalent arg '{prop}' for {describe(name)}: received "
                                f"'{_fmt(want)}' but current is '{_fmt(have)}'")
    old, new = existing.arguments, wanted.arguments
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise ExchangeError(PRECONDITION_FAILED,
                                f"inequivalent arg '{key}' for {describe(name)}: received "
                                f"{_fmt(new.get(key, 'none'))!r} but current is "
                                f"{_fmt(old.get(key, 'none'))!r}")


def check_deletable(key: str) -> None:
    name = split_key(key)[1]
    if name == "":
        raise ExchangeError(ACCESS_REFUSED, "operation not permitted on the default exchange")
    if name.startswith("amq."):
        raise ExchangeError(ACCESS_REFUSED, f"{describe(key)} contains reserved prefix 'amq.*'")


def check_bindable(key: str) -> None:
    if split_key(key)[1] == "":
        raise ExchangeError(ACCESS_REFUSED, "operation not permitted on the default exchange")


def not_found(key: str) -> ExchangeError:
    return ExchangeError(NOT_FOUND, f"no {describe(key)}")


# --- argument tables ---------------------------------------------------------------------------

def plain(value):
    """An AMQP field value as a value metadata can store and ship (msgpack): decimals become
    their text, timestamps seconds since the epoch, byte arrays bytes; tables and arrays are
    converted throughout."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.timezone.utc)
        return int(value.timestamp())
    return value


# --- topic matching ----------------------------------------------------------------------------

def split_words(key: str) -> list[str]:
    """RabbitMQ's split: "" is no word at all, otherwise every dot separates two words."""
    return key.split(".") if key else []


class TopicTrie:
    """Binding keys as a trie over words; `match` walks it once per routing key."""

    __slots__ = ("root",)

    def __init__(self):
        self.root = _Node()

    def add(self, binding_key: str, dest) -> None:
        node = self.root
        for w in split_words(binding_key):
            nxt = node.children.get(w)
            if nxt is None:
                nxt = node.children[w] = _Node()
            node = nxt
        node.dests.append(dest)

    def match(self, routing_key: str) -> list:
        words = split_words(routing_key)
        n = len(words)
        out: list = []
        seen: set = set()  # (node id, position) pairs visited: '#' can reach one twice
        stack = [(self.root, 0)]
        while stack:
            node, i = stack.pop()
            key = (id(node), i)
            if key in seen:
                continue
            seen.add(key)
            if i == n:
                out.extend(node.dests)
            children = node.children
            hash_node = children.get("#")
            if hash_node is not None:
                # '#' takes zero or more words: try every remaining suffix
                for j in range(i, n + 1):
                    stack.append((hash_node, j))
            if i < n:
                exact = children.get(words[i])
                if exact is not None:
                    stack.append((exact, i + 1))
                star = children.get("*")
                if star is not None:
                    stack.append((star, i + 1))
        return out


class _Node:
    __slots__ = ("children", "dests")

    def __init__(self):
        self.children: dict[str, _Node] = {}
        self.dests: list = []


# --- headers matching --------------------------------------------------------------------------

def _type_class(v) -> str:
    if v is None:
        return "void"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, (str, bytes, bytearray)):
        return "binary"
    if isinstance(v, decimal.Decimal):
        return "decimal"
    if isinstance(v, datetime.datetime):
        return "timestamp"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "table"
    return type(v).__name__


def _same(a, b) -> bool:
    a, b = plain(a), plain(b)
    if isinstance(a, str):
        a = a.encode()
    if isinstance(b, str):
        b = b.encode()
    return a == b


def headers_match(arguments: dict, headers: dict | None) -> bool:
    """RabbitMQ's headers exchange rule for one binding."""
    headers = headers or {}
    how = arguments.get("x-match", "all")
    if isinstance(how, bytes):
        how = how.decode(errors="replace")
    with_x = how in ("all-with-x", "any-with-x")
    want_all = how in ("all", "all-with-x")
    matched_any = False
    for key, want in arguments.items():
        if key == "x-match" or (key.startswith("x-") and not with_x):
            continue
        if key not in headers:
            if want_all:
                return False
            continue
        have = headers[key]
        ok = want is None or (_type_class(want) == _type_class(have) and _same(want, have))
        if ok:
            matched_any = True
            if not want_all:
                return True
        elif want_all:
            return False
    return True if want_all else matched_any


def check_binding_arguments(kind: str, arguments: dict) -> None:
    if kind == "headers":
        how = arguments.get("x-match", "all")
        if isinstance(how, bytes):
            how = how.decode(errors="replace")
        if how not in ("all", "any", "all-with-x", "any-with-x"):
            raise ExchangeError(PRECONDITION_FAILED,
                                f"Invalid x-match field value {how!r}; expected all, any, "
                                "all-with-x, or any-with-x")


# --- routing -----------------------------------------------------------------------------------

def _compile(binds, kind: str):
    """The lookup structure of one exchange's bindings, `binds` (destination, key, arguments)
    triples: a dict by key (direct), a list (fanout), a word trie (topic), or (destination,
    arguments) pairs (headers)."""
    if kind == "direct":
        table: dict[str, list] = {}
        for dest, key, _ in binds:
            lst = table.setdefault(key, [])
            if dest not in lst:
                lst.append(dest)
        return table
    if kind == "fanout":
        out: list = []
        for dest, _, _ in binds:
            if dest not in out:
                out.append(dest)
        return out
    if kind == "topic":
        trie = TopicTrie()
        for dest, key, _ in binds:
            trie.add(key, dest)
        return trie
    return [(dest, args) for dest, _, args in binds]


class Routes:
    """The routing structures of one metadata version (build a new one when it changes).

    An exchange that is the source of exchange bindings, or has an alternate exchange (its
    `alternate-exchange` argument, or else its policy's key, as RabbitMQ), routes through the
    graph (`_through`): each exchange reached adds the queues its bindings match and passes the
    message on to the exchanges its exchange bindings match; one whose bindings match nothing at
    all passes it to its alternate exchange. Each exchange is visited once (cycles end there) and
    each queue is reached once. Every other exchange routes by its own bindings alone, as
    before: the graph costs only where it exists."""

    def __init__(self, exchanges: dict[str, Exchange], bindings: dict[str, list[Binding]],
                 queues: dict, exchange_bindings: dict | None = None,
                 policies: dict | None = None):
        self.exchanges = exchanges
        self.bindings = bindings
        self.queues = queues
        self.exchange_bindings = exchange_bindings or {}
        self._compiled: dict[str, object] = {}
        self._compiled_x: dict[str, object] = {}  # the same over exchange bindings
        self._topic_cache: dict[str, dict] = {}
        self.alternates = alternate_exchanges(exchanges, policies or {})
        # the exchanges that route through the graph
        self.graph = frozenset(self.exchange_bindings) | frozenset(self.alternates)
        # exchanges whose messages route one by one, by their own headers: headers exchanges,
        # and those whose graph reaches one
        self.by_headers = frozenset(x for x in self.graph if any(
            self.exchanges[r].type == "headers" for r in self._reachable(x)))

    def _reachable(self, start: str) -> set[str]:
        seen = {start}
        todo = [start]
        while todo:
            name = todo.pop()
            nxt = [b.destination for b in self.exchange_bindings.get(name, ())]
            if name in self.alternates:
                nxt.append(self.alternates[name])
            for d in nxt:
                if d not in seen and d in self.exchanges:
                    seen.add(d)
                    todo.append(d)
        return seen

    def route(self, exchange: str, routing_key: str, headers=None) -> list[str]:
        """The queues a message reaches (each once, in binding order). `headers` is the
        message's headers table, or a callable returning it (decoded only for headers
        exchanges). Raises NOT_FOUND for a missing exchange."""
        if exchange == "":
            return [routing_key] if routing_key in self.queues else []
        if exchange in self.graph:
            return self._through(exchange, routing_key, headers)
        x = self.exchanges.get(exchange)
        if x is None:
            raise not_found(exchange)
        kind = x.type
        if kind == "direct":  # the common case, without a call more
            compiled = self._compiled.get(exchange)
            if compiled is not None:
                hit = compiled.get(routing_key)
                if hit is not None or x.name:
                    return hit or []
        return self._own(x, exchange, kind, routing_key, headers)

    def _own(self, x: Exchange, exchange: str, kind: str, routing_key: str, headers) -> list[str]:
        """The queues the exchange's own bindings match."""
        compiled = self._compiled.get(exchange)
        if compiled is None:
            compiled = self._compiled[exchange] = _compile(
                [(b.queue, b.key, b.arguments) for b in self.bindings.get(exchange, ())], kind)
        if kind == "direct":
            hit = compiled.get(routing_key)
            if hit is not None:
                return hit
            if x.name == "":  # another vhost's default exchange (sessions resolve it themselves)
                key = qualify(x.vhost, routing_key)
                return [key] if key in self.queues else []
            return []
        if kind == "fanout":
            return compiled
        if kind == "topic":
            cache = self._topic_cache.setdefault(exchange, {})
            hit = cache.get(routing_key)
            if hit is None:
                hit = _unique(compiled.match(routing_key))
                if len(cache) >= TOPIC_CACHE:
                    cache.clear()
                cache[routing_key] = hit
            return hit
        if callable(headers):
            headers = headers()
        return _unique([dest for dest, args in compiled if headers_match(args, headers)])

    def _next(self, exchange: str, kind: str, routing_key: str, headers) -> list[str]:
        """The exchanges the exchange's exchange bindings match."""
        compiled = self._compiled_x.get(exchange)
        if compiled is None:
            compiled = self._compiled_x[exchange] = _compile(
                [(b.destination, b.key, b.arguments)
                 for b in self.exchange_bindings.get(exchange, ())], kind)
        if kind == "direct":
            return compiled.get(routing_key, [])
        if kind == "fanout":
            return compiled
        if kind == "topic":
            return compiled.match(routing_key)
        return [dest for dest, args in compiled if headers_match(args, headers)]

    def _through(self, exchange: str, routing_key: str, headers) -> list[str]:
        if exchange not in self.exchanges:
            raise not_found(exchange)
        if callable(headers):
            headers = headers()
        out: list[str] = []
        reached: set[str] = set()
        seen = {exchange}
        todo = [exchange]
        while todo:
            name = todo.pop(0)
            x = self.exchanges.get(name)
            if x is None:
                continue  # a missing alternate exchange: nothing more this way
            queues = self._own(x, name, x.type, routing_key, headers)
            nxt = self._next(name, x.type, routing_key, headers) if name in self.exchange_bindings else []
            if not queues and not nxt and name in self.alternates:
                nxt = [self.alternates[name]]
            for q in queues:
                if q not in reached:
                    reached.add(q)
                    out.append(q)
            for d in nxt:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return out


def _unique(items: list) -> list:
    out: list = []
    for i in items:
        if i not in out:
            out.append(i)
    return out


def binding_rows(queues, bindings: dict, exchange_bindings: dict) -> list[tuple]:
    """Every binding as (source, destination, "queue" or "exchange", key, arguments), as
    RabbitMQ lists them: the default exchange's implicit one to each queue first, then the
    declared ones by source, a source's bindings to exchanges after those to queues."""
    rows = [("", q, "queue", q, {}) for q in sorted(queues)]
    for x in sorted(set(bindings) | set(exchange_bindings)):
        for b in sorted(bindings.get(x, ()), key=lambda b: (b.queue, b.key)):
            rows.append((x, b.queue, "queue", b.key, dict(b.arguments)))
        for e in sorted(exchange_bindings.get(x, ()), key=lambda e: (e.destination, e.key)):
            rows.append((x, e.destination, "exchange", e.key, dict(e.arguments)))
    return rows


def named_binding_rows(queues, bindings: dict, exchange_bindings: dict,
                       vhost: str | None = None) -> list[tuple]:
    """`binding_rows` by name, as listings show them: (vhost, source, destination, its type,
    routing key, arguments), of `vhost` only when one is given."""
    rows = []
    for src, dest, kind, key, args in binding_rows(queues, bindings, exchange_bindings):
        dv, dname = split_key(dest)
        if vhost is None or dv == vhost:
            rows.append((dv, split_key(src)[1] if src else "", dname, kind, key if src else dname, args))
    return rows


def alternate_exchanges(exchanges: dict[str, Exchange], policies: dict) -> dict[str, str]:
    """exchange -> its alternate exchange, for those that have one: the `alternate-exchange`
    argument, or else the key of the exchange's policy (RabbitMQ's precedence)."""
    out = {}
    with_key = {n: p for n, p in policies.items() if "alternate-exchange" in p.definition}
    for key, x in exchanges.items():
        ae = x.arguments.get("alternate-exchange")
        if ae is None and with_key:
            p = effective_policy(policies, x.name, x.vhost, "exchanges")
            if p is not None:
                ae = p.definition.get("alternate-exchange")
        if isinstance(ae, bytes):
            ae = ae.decode(errors="replace")
        if isinstance(ae, str) and x.name:
            out[key] = qualify(x.vhost, ae)  # a name of the exchange's own vhost
    return out
