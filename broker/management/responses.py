"""The management API's answers: RabbitMQ's error JSON (`ApiError` and its 400 and 404
makers), JSON bodies that hold what JSON cannot (bytes, sets, Decimals as text), and reading a
request's JSON body. Shared by the route modules (app.py, users.py)."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wire.errors import NOT_FOUND, ProtocolError


class ApiError(Exception):
    def __init__(self, status: int, error: str, reason: str):
        super().__init__(reason)
        self.status, self.error, self.reason = status, error, reason


def not_found(reason: str = "Not Found") -> ApiError:
    return ApiError(404, "Object Not Found", reason)


def bad_request(reason: str) -> ApiError:
    return ApiError(400, "bad_request", reason)


def from_protocol_error(exc: ProtocolError) -> ApiError:
    return not_found(exc.text) if exc.code == NOT_FOUND else bad_request(exc.text)


def _plain(value):
    """What JSON cannot hold as it is (bytes in queue arguments or message headers, a
    Decimal, a timestamp) as text."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


class ApiJSON(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, default=_plain, ensure_ascii=False, allow_nan=False,
                          separators=(",", ":")).encode("utf-8")


def _json(value, status: int = 200) -> JSONResponse:
    return ApiJSON(value, status_code=status)


def _no_content(status: int = 204) -> Response:
    return Response(status_code=status)


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object")
    return value
