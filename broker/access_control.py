"""The node's side of `warrenctl`'s user and permission commands (add_user, delete_user,
change_password, set_user_tags, list_users, set_permissions, clear_permissions,
list_permissions, list_user_permissions), shared with the management API's users and
permissions paths. Each change goes through the cluster's metadata log (mirroring/changes.py
`UserAdd` ... `PermissionClear`), so every node applies it in one committed order. Passwords
are hashed here, on the node that got the command (mirroring/access.py): only the hash enters
the log, the state file or any answer.
"""

from __future__ import annotations

import os

import msgspec

from mirroring.access import SALT_BYTES, check_pattern, hash_password, parse_tags, valid_hash
from mirroring.changes import PermissionClear, PermissionSet, UserAdd, UserDelete, UserUpdate
from mirroring.records import Permission, User
from wire.errors import NOT_ALLOWED, NOT_FOUND, PRECONDITION_FAILED, ProtocolError


def new_hash(password: str) -> str:
    """The stored form of a password, with a fresh random salt."""
    return hash_password(password, os.urandom(SALT_BYTES))


def _running_md(node):
    if not node.app_running:
        raise ProtocolError(NOT_ALLOWED, f"node {node.name} is not running (its app is stopped): "
                                         "run start_app")
    return node.md


def _user(md, name: str) -> User:
    user = md.users.get(name)
    if user is None:
        raise ProtocolError(NOT_FOUND, f"user '{name}' does not exist")
    return user


def _tags(value) -> tuple[str, ...]:
    if isinstance(value, str):
        return parse_tags(value)
    return parse_tags(" ".join(str(t) for t in value or ()))


async def cmd_add_user(node, args):
    _running_md(node)
    name, password = str(args["name"]), str(args["password"])
    if not name:
        raise ProtocolError(PRECONDITION_FAILED, "user name must not be empty")
    await node.cluster.propose(UserAdd(User(name, new_hash(password), _tags(args.get("tags")))))
    return None


async def cmd_delete_user(node, args):
    _user(_running_md(node), args["name"])
    await node.cluster.propose(UserDelete(args["name"]))
    return None


async def cmd_change_password(node, args):
    user = _user(_running_md(node), args["name"])
    await node.cluster.propose(UserUpdate(msgspec.structs.replace(
        user, password_hash=new_hash(str(args["password"])))))
    return None


async def cmd_set_user_tags(node, args):
    user = _user(_running_md(node), args["name"])
    await node.cluster.propose(UserUpdate(msgspec.structs.replace(user, tags=_tags(args["tags"]))))
    return None


async def put_user(node, name: str, password: str | None, password_hash: str | None,
                   tags) -> bool:
    """The management API's PUT of a user: create it, or replace its password (when one is
    given) and tags. `password_hash` is a hash as mirroring/access.py makes them (RabbitMQ's
    definitions carry them). True when the user was created."""
    md = _running_md(node)
    if password is not None:
        password_hash = new_hash(str(password))
    elif password_hash is not None and not valid_hash(str(password_hash)):
        raise ProtocolError(PRECONDITION_FAILED, "password_hash is not a salted SHA-256 hash "
                                                 "(base64 of a 4-byte salt and a 32-byte digest)")
    existing = md.users.get(name)
    if existing is None:
        if password_hash is None:
            raise ProtocolError(PRECONDITION_FAILED, "a new user needs a password or a password_hash")
        if not name:
            raise ProtocolError(PRECONDITION_FAILED, "user name must not be empty")
        await node.cluster.propose(UserAdd(User(name, str(password_hash), _tags(tags))))
        return True
    await node.cluster.propose(UserUpdate(User(name, str(password_hash or existing.password_hash),
                                               _tags(tags))))
    return False


async def cmd_list_users(node, args):
    """name and tags: never the password or its hash."""
    return [{"user": u.name, "tags": list(u.tags)}
            for u in sorted(node.md.users.values(), key=lambda u: u.name)]


def _vhost_exists(md, vhost: str) -> None:
    if vhost not in md.vhosts:
        raise ProtocolError(NOT_FOUND, f"vhost '{vhost}' does not exist")


async def cmd_set_permissions(node, args):
    md = _running_md(node)
    vhost = args.get("vhost", "/")
    _user(md, args["user"])
    _vhost_exists(md, vhost)
    patterns = [str(args[k]) for k in ("configure", "write", "read")]
    for pattern in patterns:
        check_pattern(pattern)
    await node.cluster.propose(PermissionSet(Permission(args["user"], vhost, *patterns)))
    return None


async def cmd_clear_permissions(node, args):
    md = _running_md(node)
    vhost = args.get("vhost", "/")
    _user(md, args["user"])
    _vhost_exists(md, vhost)
    await node.cluster.propose(PermissionClear(args["user"], vhost))
    return None


def permission_row(p: Permission) -> dict:
    return {"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write,
            "read": p.read}


async def cmd_list_permissions(node, args):
    """Every user's permissions in a vhost (every vhost's with `"vhost": None`)."""
    md = node.md
    vhost = args.get("vhost", "/")
    if vhost is not None:
        _vhost_exists(md, vhost)
    return [permission_row(p) for p in sorted(md.permissions.values(), key=lambda p: (p.vhost, p.user))
            if vhost is None or p.vhost == vhost]


async def cmd_list_user_permissions(node, args):
    md = node.md
    _user(md, args["user"])
    return [permission_row(p) for p in sorted(md.permissions.values(), key=lambda p: p.vhost)
            if p.user == args["user"]]


COMMANDS = {
    "add_user": cmd_add_user, "delete_user": cmd_delete_user,
    "change_password": cmd_change_password, "set_user_tags": cmd_set_user_tags,
    "list_users": cmd_list_users, "set_permissions": cmd_set_permissions,
    "clear_permissions": cmd_clear_permissions, "list_permissions": cmd_list_permissions,
    "list_user_permissions": cmd_list_user_permissions,
}
