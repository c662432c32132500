"""The management API's users and permissions: `/api/users[/NAME]`, `/api/users/NAME/permissions`,
`/api/permissions[/VHOST/USER]` and `/api/vhosts/VHOST/permissions`, in RabbitMQ's JSON shapes,
for administrators only (the other tags get 401 "Not administrator user"). Changes go through
the node's user and permission commands (broker/access_control.py), so their checks and
messages are warrenctl's. A user is shown with its tags and never with its password or hash.
"""

from __future__ import annotations

from urllib.parse import unquote

from starlette.requests import Request

from wire.errors import ProtocolError

from .. import access_control as ac
from . import responses
from . import state

HASHING = "rabbit_password_hashing_sha256"


def user_json(user) -> dict:
    return {"name": user.name, "tags": list(user.tags), "hashing_algorithm": HASHING, "limits": {}}


class UserRoutes:
    """The handlers, over app.py's `Handlers` (its auth), answering with responses.py's errors
    and JSON."""

    def __init__(self, handlers):
        self.h = handlers
        self.node = handlers.node

    def _admin(self, request: Request) -> None:
        self.h.auth(request, "administrator")

    def _param(self, request: Request, key: str) -> str:
        return unquote(request.path_params[key])

    async def _call(self, fn, *args):
        try:
            return await fn(self.node, *args)
        except ProtocolError as exc:
            raise responses.from_protocol_error(exc) from None

    async def users(self, request: Request):
        self._admin(request)
        md = state.metadata(self.node)
        return responses._json([user_json(u) for u in sorted(md.users.values(), key=lambda u: u.name)])

    async def user(self, request: Request):
        self._admin(request)
        name = self._param(request, "name")
        md = state.metadata(self.node)
        if request.method == "GET":
            if name not in md.users:
                raise responses.not_found()
            return responses._json(user_json(md.users[name]))
        if request.method == "DELETE":
            if name not in md.users:
                raise responses.not_found()
            await self._call(ac.cmd_delete_user, {"name": name})
            return responses._no_content()
        body = await responses._body(request)
        created = await self._call(ac.put_user, name, body.get("password"),
                                   body.get("password_hash"), body.get("tags", ""))
        return responses._no_content(201 if created else 204)

    async def user_permissions(self, request: Request):
        self._admin(request)
        name = self._param(request, "name")
        if name not in state.metadata(self.node).users:
            raise responses.not_found()
        return responses._json(await self._call(ac.cmd_list_user_permissions, {"user": name}))

    async def permissions(self, request: Request):
        self._admin(request)
        vhost = self._param(request, "vhost") if "vhost" in request.path_params else None
        if vhost is not None and vhost not in state.metadata(self.node).vhosts:
            raise responses.not_found()
        return responses._json(await self._call(ac.cmd_list_permissions, {"vhost": vhost}))

    async def permission(self, request: Request):
        self._admin(request)
        vhost, user = self._param(request, "vhost"), self._param(request, "user")
        md = state.metadata(self.node)
        if vhost not in md.vhosts or user not in md.users:
            raise responses.not_found()
        existing = md.permissions.get((vhost, user))
        if request.method == "GET":
            if existing is None:
                raise responses.not_found()
            return responses._json(ac.permission_row(existing))
        if request.method == "DELETE":
            if existing is None:
                raise responses.not_found()
            await self._call(ac.cmd_clear_permissions, {"vhost": vhost, "user": user})
            return responses._no_content()
        body = await responses._body(request)
        missing = [k for k in ("configure", "write", "read") if not isinstance(body.get(k), str)]
        if missing:
            raise responses.bad_request(f"the body needs {', '.join(missing)} (regular expressions)")
        await self._call(ac.cmd_set_permissions, {"vhost": vhost, "user": user,
                                                  **{k: body[k] for k in ("configure", "write", "read")}})
        return responses._no_content(204 if existing is not None else 201)

    def routes(self, route) -> list:
        return [
            route("/api/users", self.users),
            route("/api/users/{name}", self.user, ("GET", "PUT", "DELETE")),
            route("/api/users/{name}/permissions", self.user_permissions),
            route("/api/permissions", self.permissions),
            route("/api/vhosts/{vhost}/permissions", self.permissions),
            route("/api/permissions/{vhost}/{user}", self.permission, ("GET", "PUT", "DELETE")),
        ]
