"""broker.client: talk to a warren cluster.

* `broker.client.aio`: the trio-native client (`open_connection`).
* The blocking client, whose surface follows pika's BlockingConnection/BlockingChannel, is
  importable from here, so `import broker.client as pika` runs pika tutorial code unchanged
  except for the connection parameters; its exceptions are also `broker.client.exceptions`, as
  pika's are `pika.exceptions`.
"""

from . import errors as exceptions
from .blocking import BasicProperties, BlockingChannel, BlockingConnection, ConnectionParameters
from .errors import (AMQPConnectionError, AMQPError, ChannelClosed, ChannelClosedByBroker,
                     ConnectionClosedByBroker, ConnectionLost, NackError, UnroutableError)

__all__ = [
    "BlockingConnection", "BlockingChannel", "ConnectionParameters", "BasicProperties", "exceptions",
    "AMQPError", "AMQPConnectionError", "ChannelClosed", "ChannelClosedByBroker",
    "ConnectionClosedByBroker", "ConnectionLost", "NackError", "UnroutableError",
]
