"""wire: bytes <-> typed messages.

Owns framing (4-byte big-endian length + one msgpack value), the message schemas and their
validation, size limits and the handshake payloads. Knows nothing of queues or trio tasks.
"""
