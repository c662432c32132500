"""broker.client: talk to a warren cluster.

* `broker.client.aio`: the trio-native client (`open_connection`).
* The blocking client, whose surface follows pika's BlockingConnection/BlockingChannel, is
  importable from here, so `import broker.client as pika` runs pika tutorial code unchanged
  except for the connection parameters; its exceptions are also `broker.client.exceptions`, as
  pika's are `pika.exceptions`.
"""

from enum import Enum

from . import errors as exceptions
from .blocking import BasicProperties, BlockingChannel, BlockingConnection, ConnectionParameters
from .errors import (AMQPConnectionError, AMQPError, ChannelClosed, ChannelClosedByBroker,
                     ConnectionClosedByBroker, ConnectionLost, NackError, UnroutableError)



class DeliveryMode(Enum):
    """pika's names for the delivery_mode property (warren keeps every message in memory)."""
    Transient = 1
    Persistent = 2


class ExchangeType(Enum):
    """pika's names for the exchange kinds."""
    direct = "direct"
    fanout = "fanout"
    headers = "headers"
    topic = "topic"


__all__ = [
    "BlockingConnection", "BlockingChannel", "ConnectionParameters", "BasicProperties", "exceptions",
    "DeliveryMode", "ExchangeType",
    "AMQPError", "AMQPConnectionError", "ChannelClosed", "ChannelClosedByBroker",
    "ConnectionClosedByBroker", "ConnectionLost", "NackError", "UnroutableError",
]
