"""Client-side exceptions, named after pika's where pika has one."""


class AMQPError(Exception):
    pass


class AMQPConnectionError(AMQPError):
    """No node of the list could be reached (after the retries asked for)."""


class ConnectionClosedByBroker(AMQPConnectionError):
    def __init__(self, code: int, text: str):
        super().__init__(f"({code}) {text}")
        self.reply_code = code
        self.reply_text = text


class ConnectionLost(AMQPConnectionError):
    """The connection broke while a request was in flight (the client reconnects on its own)."""


class ChannelClosedByBroker(AMQPError):
    def __init__(self, code: int, text: str):
        super().__init__(f"({code}) {text}")
        self.reply_code = code
        self.reply_text = text


class ChannelClosed(AMQPError):
    pass


class NackError(AMQPError):
    """A publish was negatively confirmed (or lost with its connection)."""


class UnroutableError(AMQPError):
    """Mandatory messages no queue took (in confirm mode); `messages` lists them, each with
    `method` (reply_code, reply_text, exchange, routing_key), `properties` and `body`."""

    def __init__(self, messages):
        super().__init__(f"{len(messages)} unroutable message(s) returned")
        self.messages = messages
