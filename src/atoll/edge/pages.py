"""Pages of the edge's lists (a sandbox's processes and terminals): `?limit=` and `?cursor=` ->
`{"items", "next_cursor"}`, as the API pages them (controlplane.paging: ordered by a unique key,
the items past the cursor's key, at most `limit`).

The worker hands these lists over whole; the edge pages them in memory. Its cursors are its own:
signed (HMAC-SHA256) with a key this edge process draws at start, so a cursor made up or changed
is `400 invalid_request`, and so is one from the API or from another edge process (start the list
again without it). Pure; used by edge.service.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import json
import re
import secrets
import typing
from collections.abc import Callable, Iterable, Mapping

from atoll.core import errors

MAX_LIMIT = 1000
DEFAULT_LIMIT = 1000
_KEY = secrets.token_bytes(32)
_SIG_BYTES = 16
_MAX_CURSOR = 2048

T = typing.TypeVar("T")


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


@dataclasses.dataclass(frozen=True)
class Page:
    """What a list request asks for: at most `limit` items past the key `after` (None: from the first)."""

    limit: int
    after: tuple | None
    kind: str

    @classmethod
    def of(cls, query: Mapping[str, str], kind: str) -> Page:
        """The page `query` asks for of the list `kind`; `400 invalid_request` for a bad limit or cursor."""
        raw_limit = query.get("limit")
        if raw_limit is None or raw_limit == "":
            limit = DEFAULT_LIMIT
        else:
            limit = int(raw_limit) if re.fullmatch(r"[0-9]{1,4}", raw_limit) else 0
            if not 1 <= limit <= MAX_LIMIT:
                raise errors.InvalidRequest(
                    f"limit {raw_limit[:20]!r} is not a whole number from 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT})"
                )
        raw = query.get("cursor")
        return cls(limit, None if raw in (None, "") else _check(raw, kind), kind)

    def cursor(self, key: tuple) -> str:
        payload = json.dumps([self.kind, list(key)], separators=(",", ":")).encode()
        return _b64(payload) + "." + _b64(hmac.new(_KEY, payload, hashlib.sha256).digest()[:_SIG_BYTES])

    def answer(self, items: Iterable[T], key: Callable[[T], tuple]) -> dict:
        """`{"items", "next_cursor"}` of this page of `items` (dataclasses) ordered by `key`."""
        rows = sorted(items, key=key)
        if self.after is not None:
            after = self.after
            try:
                rows = [r for r in rows if key(r) > after]
            except TypeError:
                raise errors.InvalidRequest(
                    f"this cursor does not fit GET {self.kind}; start again without it"
                ) from None
        out = rows[: self.limit]
        nxt = self.cursor(key(out[-1])) if len(rows) > self.limit else None
        return {"items": [dataclasses.asdict(typing.cast(typing.Any, r)) for r in out], "next_cursor": nxt}


def _check(raw: str, kind: str) -> tuple:
    bad = (
        f"cursor {raw[:40]!r}{'…' if len(raw) > 40 else ''} is not one this edge handed out for GET {kind} "
        "(changed, cut short, made up, from the API or from an edge since restarted); pass next_cursor "
        "from the previous page of this edge exactly, or leave cursor out to start from the first page"
    )
    if len(raw) > _MAX_CURSOR or raw.count(".") != 1:
        raise errors.InvalidRequest(bad)
    body, sig = raw.split(".")
    try:
        payload, got = _unb64(body), _unb64(sig)
    except (binascii.Error, ValueError):
        raise errors.InvalidRequest(bad) from None
    if not hmac.compare_digest(hmac.new(_KEY, payload, hashlib.sha256).digest()[:_SIG_BYTES], got):
        raise errors.InvalidRequest(bad)
    try:
        name, values = json.loads(payload)
        after = tuple(values)
    except (ValueError, TypeError):
        raise errors.InvalidRequest(bad) from None
    if name != kind:
        raise errors.InvalidRequest(
            f"this cursor belongs to GET {name}, not GET {kind}; pass each list its own next_cursor"
        )
    return after
