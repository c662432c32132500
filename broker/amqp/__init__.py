"""AMQP 0-9-1 in front of warren's session core: pika, aio-pika, kombu and Celery speak to a
node unchanged. `codec` (frames on pamqp), `protocol` (the sans-IO connection state machine)
and `server` (the trio I/O around it). What a session means is broker/session.py's business.
"""
