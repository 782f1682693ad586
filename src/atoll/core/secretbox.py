"""Sealing secret values at rest: AES-256-GCM with a random nonce, bound to what they belong to.

`seal(key, value, aad)` returns printable text (`v1.` + base64 of nonce and ciphertext); `unseal`
reverses it and fails (`BadSeal`) on a wrong key, a changed text or another `aad` (the secret's
name, so a sealed value cannot be moved to another record). `new_key()` makes a 32-byte key.
Pure: no I/O (the key files live with their process). Called by controlplane.secrets (the secret
store) and worker.runtime (the sandbox's bindings it keeps across a worker restart).
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
_PREFIX = "v1."


class BadSeal(Exception):
    """The text is not a value sealed with this key for this name."""


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def check_key(key: bytes, where: str) -> bytes:
    if len(key) != KEY_BYTES:
        raise ValueError(f"{where} must hold {KEY_BYTES} bytes, it holds {len(key)}")
    return key


def seal(key: bytes, value: str, aad: str) -> str:
    nonce = os.urandom(12)
    ct = AESGCM(key).encrypt(nonce, value.encode(), aad.encode())
    return _PREFIX + base64.b64encode(nonce + ct).decode()


def unseal(key: bytes, text: str, aad: str) -> str:
    if not text.startswith(_PREFIX):
        raise BadSeal("not a sealed value (no v1. prefix)")
    try:
        raw = base64.b64decode(text[len(_PREFIX) :], validate=True)
        return AESGCM(key).decrypt(raw[:12], raw[12:], aad.encode()).decode()
    except (ValueError, InvalidTag) as e:
        raise BadSeal(f"the value does not open with this key ({type(e).__name__})") from None
