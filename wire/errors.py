"""The one error type for "the other side broke the protocol", plus AMQP-like reply codes."""

# Reply codes borrowed from AMQP 0-9-1 so RabbitMQ users recognise them (the AMQP port sends
# them as they are: below 500 a channel error, from 500 on a connection error).
REPLY_SUCCESS = 200
CONTENT_TOO_LARGE = 311
NO_ROUTE = 312
NO_CONSUMERS = 313
CHANNEL_ERROR = 504
RESOURCE_ERROR = 506
NOT_IMPLEMENTED = 540
FRAME_ERROR = 501
SYNTAX_ERROR = 502
COMMAND_INVALID = 503
UNEXPECTED_FRAME = 505
ACCESS_REFUSED = 403
NOT_FOUND = 404
RESOURCE_LOCKED = 405
PRECONDITION_FAILED = 406
NOT_ALLOWED = 530
CONNECTION_FORCED = 320
INTERNAL_ERROR = 541
VERSION_MISMATCH = 505

CODE_NAMES = {
    REPLY_SUCCESS: "OK",
    CONTENT_TOO_LARGE: "CONTENT_TOO_LARGE",
    NO_ROUTE: "NO_ROUTE",
    NO_CONSUMERS: "NO_CONSUMERS",
    CHANNEL_ERROR: "CHANNEL_ERROR",
    RESOURCE_ERROR: "RESOURCE_ERROR",
    NOT_IMPLEMENTED: "NOT_IMPLEMENTED",
    FRAME_ERROR: "FRAME_ERROR",
    SYNTAX_ERROR: "SYNTAX_ERROR",
    COMMAND_INVALID: "COMMAND_INVALID",
    UNEXPECTED_FRAME: "UNEXPECTED_FRAME",
    ACCESS_REFUSED: "ACCESS_REFUSED",
    NOT_FOUND: "NOT_FOUND",
    RESOURCE_LOCKED: "RESOURCE_LOCKED",
    PRECONDITION_FAILED: "PRECONDITION_FAILED",
    NOT_ALLOWED: "NOT_ALLOWED",
    CONNECTION_FORCED: "CONNECTION_FORCED",
    INTERNAL_ERROR: "INTERNAL_ERROR",
}


class ProtocolError(Exception):
    """The peer sent something we cannot accept. `code` is an AMQP-style reply code."""

    def __init__(self, code: int, text: str):
        super().__init__(f"{CODE_NAMES.get(code, code)} - {text}")
        self.code = code
        self.text = text


class FrameError(ProtocolError):
    """The byte stream itself is broken: bad length, oversized, or not msgpack."""

    def __init__(self, text: str):
        super().__init__(FRAME_ERROR, text)
