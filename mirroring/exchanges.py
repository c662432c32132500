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
"""

from __future__ import annotations

import datetime
import decimal

from wire.errors import ACCESS_REFUSED, COMMAND_INVALID, NOT_FOUND, PRECONDITION_FAILED, ProtocolError

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

class Routes:
    """The routing structures of one metadata version (build a new one when it changes)."""

    def __init__(self, exchanges: dict[str, Exchange], bindings: dict[str, list[Binding]],
                 queues: dict):
        self.exchanges = exchanges
        self.bindings = bindings
        self.queues = queues
        self._compiled: dict[str, object] = {}
        self._topic_cache: dict[str, dict] = {}

    def _compile(self, name: str, kind: str):
        binds = self.bindings.get(name, ())
        if kind == "direct":
            table: dict[str, list] = {}
            for b in binds:
                lst = table.setdefault(b.key, [])
                if b.queue not in lst:
                    lst.append(b.queue)
            return table
        if kind == "fanout":
            out: list = []
            for b in binds:
                if b.queue not in out:
                    out.append(b.queue)
            return out
        if kind == "topic":
            trie = TopicTrie()
            for b in binds:
                trie.add(b.key, b.queue)
            return trie
        return [(b.queue, b.arguments) for b in binds]

    def route(self, exchange: str, routing_key: str, headers=None) -> list[str]:
        """The queues a message reaches (each once, in binding order). `headers` is the
        message's headers table, or a callable returning it (decoded only for headers
        exchanges). Raises NOT_FOUND for a missing exchange."""
        if exchange == "":
            return [routing_key] if routing_key in self.queues else []
        x = self.exchanges.get(exchange)
        if x is None:
            raise not_found(exchange)
        kind = x.type
        compiled = self._compiled.get(exchange)
        if compiled is None:
            compiled = self._compiled[exchange] = self._compile(exchange, kind)
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
                hit = []
                for q in compiled.match(routing_key):
                    if q not in hit:
                        hit.append(q)
                if len(cache) >= TOPIC_CACHE:
                    cache.clear()
                cache[routing_key] = hit
            return hit
        if callable(headers):
            headers = headers()
        out: list = []
        for queue, args in compiled:
            if queue not in out and headers_match(args, headers):
                out.append(queue)
        return out
