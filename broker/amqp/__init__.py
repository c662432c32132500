"""AMQP 0-9-1 in front of warren's session core: pika, aio-pika, kombu and Celery speak to a
node unchanged. `codec` (frames on pamqp), `protocol` (the sans-IO connection state machine,
with `connection_level` and `output`) and `server` (the port's connections: broker/connection.py
driving the protocol). What a session means is broker/session/'s business.
"""
