"""API key digests and signatures, both HMAC-SHA256 keyed by the gateways' secret (auth.secret).

- A key is kept only as `HMAC(secret, SHA-256(key))`. The inner SHA-256 lets a config file name a
  key by its plain SHA-256 (`api_key_sha256`, which never leaves the file); the outer HMAC makes
  what sits in Redis useless without the secret: no dictionary of digests can be built from it.
- A tenant record in Redis carries `HMAC(secret, record)`, so a write to Redis alone cannot create
  or change a tenant (gateway/tenancy/records.py).

Each use has its own label, so a digest can never pass for a signature or the other way round.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

MIN_API_KEY_CHARS = 32
# 32 characters: `openssl rand -hex 16` (128 bits). Even a key of 32 lowercase letters holds
# 150 bits; at a billion guesses a second, 2^128 guesses take ~10^22 years.
MIN_SECRET_CHARS = 32  # the HMAC key: as many characters as an API key, for the same reason

_DIGEST_LABEL = b"cachelane api key digest v1\0"
_SIGNATURE_LABEL = b"cachelane tenant record v1\0"


def sha256_hex(api_key: str) -> str:
    return hashlib.sha256(api_key.encode("utf-8", "surrogatepass")).hexdigest()


class Keyring:
    """Digests keys and signs records with one secret. Without a configured secret (no Redis)
    a random one is made per process: digests then never leave it."""

    def __init__(self, secret: str | None) -> None:
        self._secret = (secret or secrets.token_hex(32)).encode()

    def digest(self, api_key: str) -> str:
        return self.digest_of_sha256(sha256_hex(api_key))

    def digest_of_sha256(self, sha256: str) -> str:
        return self._mac(_DIGEST_LABEL, sha256.lower().encode())

    def sign(self, payload: bytes) -> str:
        return self._mac(_SIGNATURE_LABEL, payload)

    def verify(self, payload: bytes, signature: str) -> bool:
        return hmac.compare_digest(self.sign(payload), signature)

    def _mac(self, label: bytes, data: bytes) -> str:
        return hmac.new(self._secret, label + data, hashlib.sha256).hexdigest()
