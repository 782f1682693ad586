"""Signed list cursors and the `?limit=` rule, shared by every paged list: the API's
(controlplane.paging, keyed by the installation's secrets key) and the edge's (edge.pages, keyed
per edge process).

A cursor is `base64url(JSON [list name, key values]) "." base64url(HMAC-SHA256 truncated)`: opaque
to callers and tamper-evident. A cursor that was changed, cut short, made up or signed with another
key is `400 invalid_request` with the caller's own explanation; one from another list is `400`
naming both lists. Pure.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import typing

from atoll.core import errors

MAX_LIMIT = 1000
DEFAULT_LIMIT = 1000
_SIG_BYTES = 16
_MAX_CURSOR = 2048


def limit(raw: str | None) -> int:
    """The `?limit=` a list asked for: `DEFAULT_LIMIT` when absent or empty; `400 invalid_request`
    unless a whole number from 1 to `MAX_LIMIT`."""
    if raw is None or raw == "":
        return DEFAULT_LIMIT
    n = int(raw) if re.fullmatch(r"[0-9]{1,4}", raw) else 0
    if not 1 <= n <= MAX_LIMIT:
        raise errors.InvalidRequest(
            f"limit {raw[:20]!r} is not a whole number from 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT})"
        )
    return n


def sign(kind: str, values: list[typing.Any], key: bytes) -> str:
    """The cursor naming the list `kind` and the JSON-able key `values`, signed with `key`."""
    payload = json.dumps([kind, values], separators=(",", ":")).encode()
    return _b64(payload) + "." + _b64(hmac.new(key, payload, hashlib.sha256).digest()[:_SIG_BYTES])


def open_(raw: str, kind: str, key: bytes, bad: str) -> list[typing.Any]:
    """The key values of a cursor `sign` made for `kind` with `key`; `400 invalid_request` with the
    message `bad` when it is not one (too long, malformed, not signed with `key`)."""
    if len(raw) > _MAX_CURSOR or raw.count(".") != 1:
        raise errors.InvalidRequest(bad)
    body, sig = raw.split(".")
    try:
        payload, got = _unb64(body), _unb64(sig)
    except (binascii.Error, ValueError):
        raise errors.InvalidRequest(bad) from None
    if not hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).digest()[:_SIG_BYTES], got):
        raise errors.InvalidRequest(bad)
    try:
        name, values = json.loads(payload)
    except (ValueError, TypeError):
        raise errors.InvalidRequest(bad) from None
    if not isinstance(values, list):
        raise errors.InvalidRequest(bad)
    if name != kind:
        raise errors.InvalidRequest(
            f"this cursor belongs to GET {name}, not GET {kind}; pass each list its own next_cursor"
        )
    return values


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))
