"""Handshake payload helpers: nonces and the HMAC proof of the cluster secret.

The secret itself never crosses the wire: each side sends a random nonce and the other answers
with HMAC-SHA256(SHA-256(secret), context || nonce). The context binds the proof to the
direction and role so a proof cannot be replayed the other way. The key is the secret's digest,
not the secret: HMAC pads a short key with zero bytes, so cookies that differ only by trailing
NULs ("abc" and "abc\0") would otherwise prove each other.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 16


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(secret: bytes, nonce: bytes, context: str) -> bytes:
    key = hashlib.sha256(secret).digest()
    return hmac.new(key, context.encode() + b"\0" + nonce, hashlib.sha256).digest()


def check_proof(secret: bytes, nonce: bytes, context: str, given: bytes) -> bool:
    return hmac.compare_digest(proof(secret, nonce, context), given)
