"""Pages of every list of the public API: `?limit=` and `?cursor=` -> `{"items", "next_cursor"}`.

A list is in a stable order by a key (sandboxes, tenants, keys and snapshots: `(created_at, id)`;
named resources: their name); a page is the first `limit` items whose key is past the cursor's
(keyset paging, so a record inserted or deleted meanwhile never makes another one appear twice or
be skipped). The cursor is the last key of the page and the list's name, as base64url JSON signed
with an HMAC derived from the installation's secrets key: opaque to callers and tamper-evident — a
cursor that was changed, made up, cut short or taken from another list is `400 invalid_request`
saying so, never a 500.

Lists held in the database page there (`sandboxes`, `tenants`, `keys`, `snapshots`: a WHERE on
the key and a LIMIT, never every row read); the short lists a service or a worker hands over whole (secrets,
templates, volumes, drives, workers, processes, terminals) page in memory with the same cursors.
Called by the list routes (controlplane.routes_*).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import re
import typing
from collections.abc import Callable, Iterable, Sequence

import sqlalchemy as sa
from fastapi import Request

from atoll.controlplane import auth
from atoll.controlplane import db as dbm
from atoll.controlplane.context import ctx
from atoll.core import cursors, errors
from atoll.core.lifecycle import State, Tier

MAX_LIMIT = cursors.MAX_LIMIT
DEFAULT_LIMIT = cursors.DEFAULT_LIMIT
_SAFE_JSON_KEY = re.compile(r"[A-Za-z0-9_.:/@+-]{1,128}")
"""Metadata keys the database filters by (the SQLite JSON path of others needs quoting we don't
trust); every key is checked again in Python, so an odd key only costs a larger read."""

T = typing.TypeVar("T")

PARAMETERS = [
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "description": f"Items per page, 1-{MAX_LIMIT} (default {DEFAULT_LIMIT})",
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
    },
    {
        "name": "cursor",
        "in": "query",
        "required": False,
        "description": "The `next_cursor` of the previous page (opaque); leave it out for the first page",
        "schema": {"type": "string"},
    },
]
"""The paging query parameters, for a list route's `openapi_extra` (read by `page`, not FastAPI)."""
OPENAPI = {"parameters": PARAMETERS}


@dataclasses.dataclass(frozen=True)
class Page:
    """What a list request asks for: at most `limit` items after the key `after` (None: from the
    first)."""

    limit: int
    after: tuple | None
    kind: str
    _key: bytes

    def cursor(self, key: Sequence[typing.Any]) -> str:
        """The cursor of the page that ends at `key`."""
        return cursors.sign(self.kind, [_enc(v) for v in key], self._key)


def _enc(v: typing.Any) -> typing.Any:
    if isinstance(v, dt.datetime):
        return {"t": v.isoformat()}
    if v is None or isinstance(v, str | int | float):
        return v
    raise TypeError(f"cannot put {type(v).__name__} in a cursor")


def _dec(v: typing.Any) -> typing.Any:
    if isinstance(v, dict):
        t = v.get("t")
        if len(v) != 1 or not isinstance(t, str):
            raise ValueError("bad key")
        return dt.datetime.fromisoformat(t)
    if v is None or isinstance(v, str | int | float):
        return v
    raise ValueError("bad key")


def cursor_key(request: Request) -> bytes:
    """The HMAC key of cursors: derived from the installation's secrets key (so every server of
    the installation accepts the others' cursors, and a restart keeps them valid)."""
    return hmac.new(ctx(request).secrets.key, b"atoll list cursor v1", hashlib.sha256).digest()


def page(request: Request, kind: str) -> Page:
    """The page `request` asks for, of the list `kind`; `400 invalid_request` for a bad limit or
    cursor."""
    q = request.query_params
    once(request, "limit", "cursor")
    limit = cursors.limit(q.get("limit"))
    key = cursor_key(request)
    raw = q.get("cursor")
    after = None if raw in (None, "") else _check(raw, kind, key)
    return Page(limit, after, kind, key)


def once(request: Request, *names: str) -> None:
    """`400 invalid_request` when one of these query parameters is given more than once (the web
    framework would silently keep only the last)."""
    for name in names:
        given = request.query_params.getlist(name)
        if len(given) > 1:
            raise errors.InvalidRequest(
                f"query parameter {name!r} is given {len(given)} times ({', '.join(map(repr, given[:5]))}); "
                "give it once"
            )


def _check(raw: str, kind: str, key: bytes) -> tuple:
    bad = (
        f"cursor {raw[:40]!r}{'…' if len(raw) > 40 else ''} is not one this server handed out for "
        f"GET {kind} (it is changed, cut short or made up); pass next_cursor from the previous page "
        "exactly, or leave cursor out to start from the first page"
    )
    values = cursors.open_(raw, kind, key, bad)
    try:
        return tuple(_dec(v) for v in values)
    except (ValueError, TypeError):
        raise errors.InvalidRequest(bad) from None


def answer(items: list, next_cursor: str | None) -> dict:
    return {"items": items, "next_cursor": next_cursor}


# ---- in memory --------------------------------------------------------------------------------------


def of_list(p: Page, items: Iterable[T], key: Callable[[T], tuple]) -> tuple[list[T], str | None]:
    """A page of a list held whole in memory, ordered by `key` (unique per item): the items and
    the next cursor (None on the last page)."""
    rows = sorted(items, key=key)
    if p.after is not None:
        after = p.after
        try:
            rows = [r for r in rows if key(r) > after]
        except TypeError:  # a signed cursor whose key has other types than this list's
            raise errors.InvalidRequest(
                f"this cursor does not fit GET {p.kind}; start again without it"
            ) from None
    out = rows[: p.limit]
    nxt = p.cursor(key(out[-1])) if len(rows) > p.limit else None
    return out, nxt


# ---- in the database --------------------------------------------------------------------------------


def _past(cols: Sequence[typing.Any], values: tuple, desc: bool = False) -> typing.Any:
    """`(cols) > (values)` (`<` with `desc`) in the order of the columns, written without row
    values (every database we support takes it, and the first column's index serves it)."""
    if len(values) != len(cols):
        raise errors.InvalidRequest("this cursor does not fit this list; start again without it")
    head, *rest = cols
    beyond = head < values[0] if desc else head > values[0]
    if not rest:
        return beyond
    return sa.or_(beyond, sa.and_(head == values[0], _past(rest, values[1:], desc)))


def of_query(
    p: Page,
    session: typing.Any,
    stmt: sa.Select,
    cols: Sequence[typing.Any],
    key: Callable[[typing.Any], tuple],
    keep: Callable[[typing.Any], bool] | None = None,
    *,
    rows: bool = False,
    desc: bool = False,
) -> tuple[list, str | None]:
    """A page of `stmt` (of one ORM entity, or of columns with `rows=True`) in the order of `cols`
    (unique together; newest first with `desc`), read with `WHERE (cols) > cursor ... LIMIT`.
    `keep` re-checks a filter the database could not apply exactly; then the read goes on in
    batches until the page is full or the rows run out."""
    stmt = stmt.order_by(*(c.desc() for c in cols)) if desc else stmt.order_by(*cols)
    after = p.after
    out: list = []
    batch = p.limit + 1
    while True:
        q = stmt if after is None else stmt.where(_past(cols, after, desc))
        got = (
            [Row(r._asdict()) for r in session.execute(q.limit(batch))]
            if rows
            else list(session.scalars(q.limit(batch)))
        )
        out += [r for r in got if keep is None or keep(r)]
        if len(out) > p.limit or len(got) < batch:
            break
        after = key(got[-1])
    nxt = p.cursor(key(out[p.limit - 1])) if len(out) > p.limit else None
    return out[: p.limit], nxt


def _created_key(rec: typing.Any) -> tuple:
    return (rec.created_at, rec.id)


class Row:
    """A row read as columns, its values as attributes (reading them is a dict lookup: a
    SQLAlchemy Row's attribute access costs several times more, for 35 fields by 1000 rows)."""

    def __init__(self, values: dict[str, typing.Any]) -> None:
        self.__dict__ = values


_COLUMNS: list | None = None


def _sandbox_columns() -> list:
    """Every column of a sandbox record, labelled with its attribute's name: a page is read as
    plain rows that look like records to `schemas.sandbox_view` (rec.metadata_, rec.id, ...), without
    the ORM's per-object bookkeeping — a third of the time of a page of 1000."""
    global _COLUMNS
    if _COLUMNS is None:
        _COLUMNS = [a.columns[0].label(a.key) for a in sa.inspect(dbm.SandboxRecord).column_attrs]
    return _COLUMNS


def sandboxes(
    request: Request,
    p: Page,
    *,
    state: str | None = None,
    tier: str | None = None,
    template: str | None = None,
    metadata: dict[str, str] | None = None,
    created_after: dt.datetime | None = None,
    created_before: dt.datetime | None = None,
    desc: bool = False,
) -> tuple[list[typing.Any], str | None]:
    """A page of the caller's sandboxes, oldest first (newest first with `desc`): what
    `SandboxManager.list` answers (not pooled, not deleted unless `state` names `deleted`, the
    caller's tenant), filtered in the database by state (one, or several separated by commas:
    any of them), standby tier, template, metadata and creation time (`created_after` <
    created_at < `created_before`). The items are read-only rows with the record's attribute
    names (see `_sandbox_columns`), not SandboxRecords."""
    states = None if state is None else [x.strip() for x in state.split(",")]
    for one in states or ():
        if one not in {s.value for s in State}:
            raise errors.InvalidRequest(
                f"unknown state filter {one!r} (in state={state!r}); use one or several, separated "
                f"by commas, of: {', '.join(s.value for s in State)}"
            )
    if tier is not None and tier not in {t.value for t in Tier}:
        raise errors.InvalidRequest(
            f"unknown tier filter {tier!r}; use one of: {', '.join(t.value for t in Tier)}"
        )
    R = dbm.SandboxRecord
    stmt = sa.select(*_sandbox_columns()).where(R.pooled.is_(False))
    tenant = auth.list_tenant()
    if tenant is not None:
        stmt = stmt.where(R.tenant_id == tenant)
    stmt = stmt.where(R.state.in_(states)) if states else stmt.where(R.state != State.DELETED.value)
    if created_after is not None:
        stmt = stmt.where(R.created_at > created_after)
    if created_before is not None:
        stmt = stmt.where(R.created_at < created_before)
    if tier is not None:
        stmt = stmt.where(R.standby_tier == tier)
    if template is not None:
        stmt = stmt.where(R.template == template)
    md = metadata or {}
    for k, v in md.items():
        if _SAFE_JSON_KEY.fullmatch(k):
            stmt = stmt.where(R.metadata_[k].as_string() == v)

    def keep(r: typing.Any) -> bool:
        return all((r.metadata_ or {}).get(k) == v for k, v in md.items())

    db = ctx(request).manager.db
    with db.session() as s:
        return of_query(
            p, s, stmt, (R.created_at, R.id), _created_key, keep if md else None, rows=True, desc=desc
        )


def tenants(request: Request, p: Page) -> tuple[list[auth.TenantRecord], str | None]:
    R = auth.TenantRecord
    with ctx(request).manager.db.session() as s:
        return of_query(p, s, sa.select(R), (R.created_at, R.id), _created_key)


def keys(request: Request, p: Page, tenant_id: str | None) -> tuple[list[auth.KeyRecord], str | None]:
    R = auth.KeyRecord
    stmt = sa.select(R)
    if tenant_id is not None:
        stmt = stmt.where(R.tenant_id == tenant_id)
    with ctx(request).manager.db.session() as s:
        return of_query(p, s, stmt, (R.created_at, R.id), _created_key)


def snapshots(
    request: Request, p: Page, tenant: str | None, sandbox_id: str | None, name: str | None
) -> tuple[list[dbm.SnapshotRecord], str | None]:
    """The snapshots of `tenant` (None: every tenant's), oldest first."""
    R = dbm.SnapshotRecord
    stmt = sa.select(R)
    if tenant is not None:
        stmt = stmt.where(R.tenant_id == tenant)
    if sandbox_id:
        stmt = stmt.where(R.sandbox_id == sandbox_id)
    if name:
        stmt = stmt.where(R.name == name)
    with ctx(request).manager.db.session() as s:
        return of_query(p, s, stmt, (R.created_at, R.id), _created_key)
