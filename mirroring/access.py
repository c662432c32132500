"""Who may log in and what they may touch: password hashes, user tags and the compiled
permission patterns a session checks its operations against.

Passwords are kept as RabbitMQ keeps them (`rabbit_password_hashing_sha256`): a random 4-byte
salt followed by SHA-256 of salt + password, base64-encoded; a login is checked by hashing the
offered password with the stored salt and comparing in constant time.

Permissions are RabbitMQ's: per user and vhost, three regular expressions (configure, write,
read) matched, as Erlang's `re:run` does, anywhere in a resource's name unless anchored; the
default exchange is named "amq.default" for the match. `Access` is one user's compiled
permissions in one vhost, with the answers it gave memoised (a session asks the same question
for every publish).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

from wire.errors import ACCESS_REFUSED, PRECONDITION_FAILED, ProtocolError

SALT_BYTES = 4
# the tags a user can carry, and the access each one implies (RabbitMQ's management tags)
TAG_IMPLIES = {
    "administrator": ("administrator", "policymaker", "monitoring", "management"),
    "policymaker": ("policymaker", "management"),
    "monitoring": ("monitoring", "management"),
    "management": ("management",),
}
FULL = ".*"  # the pattern RabbitMQ's default user gets for all three permissions
CONFIGURE, WRITE, READ = "configure", "write", "read"


def hash_password(password: str, salt: bytes) -> str:
    """The stored form of `password`: base64(salt + sha256(salt + password)); `salt` is
    SALT_BYTES random bytes (the caller draws them: broker/access_control.py `new_hash`)."""
    digest = hashlib.sha256(salt + password.encode("utf-8")).digest()
    return base64.b64encode(salt + digest).decode("ascii")


def valid_hash(password_hash: str) -> bool:
    """Is this the stored form `hash_password` makes (whatever the password)?"""
    try:
        raw = base64.b64decode(password_hash, validate=True)
    except (ValueError, TypeError):
        return False
    return len(raw) == SALT_BYTES + hashlib.sha256().digest_size


def check_password(password_hash: str, password: str) -> bool:
    """Does `password` match the stored hash? (constant time in the digest comparison)"""
    if not valid_hash(password_hash):
        return False
    raw = base64.b64decode(password_hash)
    salt, digest = raw[:SALT_BYTES], raw[SALT_BYTES:]
    offered = hashlib.sha256(salt + password.encode("utf-8")).digest()
    return hmac.compare_digest(offered, digest)


def parse_tags(text: str) -> tuple[str, ...]:
    """`administrator,management` (or space separated) -> the tags, in order, without repeats.
    Tags RabbitMQ does not know are kept (RabbitMQ keeps them too) but grant nothing."""
    tags: list[str] = []
    for word in re.split(r"[,\s]+", text.strip()):
        if word and word not in tags:
            tags.append(word)
    return tuple(tags)


def implied_tags(tags) -> set[str]:
    """The management access a user's tags give (administrator implies every other one)."""
    out: set[str] = set()
    for tag in tags:
        out.update(TAG_IMPLIES.get(tag, ()))
    return out


def check_pattern(pattern: str) -> None:
    """A permission's regular expression must compile; PRECONDITION_FAILED otherwise."""
    try:
        re.compile(pattern)
    except re.error as exc:
        raise ProtocolError(PRECONDITION_FAILED,
                            f"invalid regular expression '{pattern}': {exc}") from None


def resource_name(kind: str, name: str) -> str:
    """The name a permission pattern is matched against (the default exchange is amq.default)."""
    return "amq.default" if kind == "exchange" and name == "" else name


def refused(kind: str, name: str, vhost: str, user: str) -> ProtocolError:
    """RabbitMQ's channel error for an operation the user's permissions do not allow."""
    return ProtocolError(ACCESS_REFUSED, f"access to {kind} '{resource_name(kind, name)}' in vhost "
                                         f"'{vhost}' refused for user '{user}'")


def _compile(pattern: str):
    """A matcher for one permission: None when it allows everything, else `re.search`."""
    if pattern == FULL:
        return None
    if pattern == "":
        return False  # RabbitMQ: the empty pattern matches nothing
    return re.compile(pattern).search


class Access:
    """One user's permissions in one vhost, compiled, at one version of them (`version`: the
    metadata's `access_version` it was built from). `allowed` memoises its answers by
    (permission, kind, name), so the hot path pays one dict lookup per check."""

    __slots__ = ("user", "vhost", "version", "_match", "_known")

    def __init__(self, user: str, vhost: str, version: int, permission=None):
        self.user = user
        self.vhost = vhost
        self.version = version
        if permission is None:
            self._match = {CONFIGURE: False, WRITE: False, READ: False}
        else:
            self._match = {CONFIGURE: _compile(permission.configure),
                           WRITE: _compile(permission.write), READ: _compile(permission.read)}
        self._known: dict[tuple[str, str, str], bool] = {}

    def allowed(self, what: str, kind: str, name: str) -> bool:
        key = (what, kind, name)
        ok = self._known.get(key)
        if ok is None:
            match = self._match[what]
            ok = match is None or (match is not False and match(resource_name(kind, name)) is not None)
            if len(self._known) >= 4096:  # names chosen by clients: keep the memo bounded
                self._known.clear()
            self._known[key] = ok
        return ok

    def check(self, what: str, kind: str, name: str) -> None:
        """Raise RabbitMQ's ACCESS_REFUSED when `what` on the resource is not allowed."""
        if not self.allowed(what, kind, name):
            raise refused(kind, name, self.vhost, self.user)
