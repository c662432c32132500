"""What a client session means, whatever protocol speaks it: channels, delivery tags, publish
sequence numbers, routing through exchanges, confirms, returns, transactions, credit, and
resends to a queue's new leader.

A front end (broker/native.py for warren's msgpack protocol, broker/amqp/ for AMQP 0-9-1)
decodes client frames into the command messages of wire/messages.py (ChannelOpen, Publish,
PublishTo, Ack, QueueBind, ...), hands them to the session's driver, and turns what the session
emits (`out`: Reply, Fail, Deliver, Confirm, Cancelled, Returned) into frames.

* core.py: `Session`, the synchronous core (commands and queue events in, output and
  operations for the queues' leaders out, actions for the driver returned), in parts by
  responsibility: channels.py (channels and delivery tags), publishing.py (publishes in
  flight, confirms, credit), consumers.py (consumers and deliveries).
* host.py: `SessionHost`, what the core may ask of its node, and `NodeHost`, the node's side.
* driver.py: `SessionDriver`, the awaiting: the log, a full peer link, the credit window.
"""

from .channels import CLOSE, Channel, ChannelError, as_channel_error
from .core import INLINE, DeclareQueue, Propose, Session
from .driver import SessionDriver
from .host import NodeHost, SessionHost
from .publishing import WINDOW_BYTES, WINDOW_MSGS

__all__ = ["CLOSE", "Channel", "ChannelError", "DeclareQueue", "INLINE", "NodeHost", "Propose", "Session",
           "SessionDriver", "SessionHost", "WINDOW_BYTES", "WINDOW_MSGS", "as_channel_error"]
