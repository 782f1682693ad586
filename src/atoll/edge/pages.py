"""Pages of the edge's lists (a sandbox's processes and terminals): `?limit=` and `?cursor=` ->
`{"items", "next_cursor"}`, as the API pages them (controlplane.paging: ordered by a unique key,
the items past the cursor's key, at most `limit`).

The worker hands these lists over whole; the edge pages them in memory. Its cursors are its own:
signed (HMAC-SHA256) with a key this edge process draws at start, so a cursor made up or changed
is `400 invalid_request`, and so is one from the API or from another edge process (start the list
again without it). Pure; used by edge.service.
"""

from __future__ import annotations

import dataclasses
import secrets
import typing
from collections.abc import Callable, Iterable, Mapping

from atoll.core import cursors, errors

MAX_LIMIT = cursors.MAX_LIMIT
DEFAULT_LIMIT = cursors.DEFAULT_LIMIT
_KEY = secrets.token_bytes(32)

T = typing.TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Page:
    """What a list request asks for: at most `limit` items past the key `after` (None: from the first)."""

    limit: int
    after: tuple | None
    kind: str

    @classmethod
    def of(cls, query: Mapping[str, str], kind: str) -> Page:
        """The page `query` asks for of the list `kind`; `400 invalid_request` for a bad limit or cursor."""
        limit = cursors.limit(query.get("limit"))
        raw = query.get("cursor")
        return cls(limit, None if raw in (None, "") else _check(raw, kind), kind)

    def cursor(self, key: tuple) -> str:
        return cursors.sign(self.kind, list(key), _KEY)

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
    return tuple(cursors.open_(raw, kind, _KEY, bad))
