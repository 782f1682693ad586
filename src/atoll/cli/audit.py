"""`atoll audit [--from --to --tenant --action --limit --json]`: the audit trail (an admin key), a
table of every mutation — when, which key and tenant, what, on what, the result, from where —
oldest first, all pages followed. Registered on the `atoll` app by atoll.cli.main.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start
# and evaluating them from strings is slow (see atoll.cli.main).
import json
import typing
from typing import Annotated

import typer

Session = typing.Callable[[typer.Context], typing.ContextManager[typing.Any]]


def _result(entry: typing.Any) -> str:
    return f"{entry.status} {entry.error}" if entry.error else str(entry.status)


def _show(items: list) -> None:
    from rich.console import Console  # here, not at the top: the CLI's start-up cost
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("TIME", "KEY", "TENANT", "ACTION", "TARGET", "RESULT", "SOURCE", "REQUEST"):
        table.add_column(col, no_wrap=col not in ("TARGET",))
    for e in items:
        table.add_row(
            e.at.replace("+00:00", "Z"),
            e.key_id or "-",
            e.tenant_id or "-",
            e.action,
            e.target or "-",
            _result(e),
            e.source or "-",
            e.request_id or "-",
            style="red" if e.status >= 400 else None,
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=1000)
    console.print(table)


def register(app: typer.Typer, session: Session) -> None:
    @app.command("audit")
    def audit_(
        ctx: typer.Context,
        from_: Annotated[
            str | None,
            typer.Option("--from", help="From this time, inclusive (ISO 8601, e.g. 2026-12-01T00:00:00Z)."),
        ] = None,
        to: Annotated[str | None, typer.Option("--to", help="Up to this time, exclusive (ISO 8601).")] = None,
        tenant: Annotated[
            str | None, typer.Option("--tenant", help="Only this tenant's (tn-… or default).")
        ] = None,
        action: Annotated[
            str | None,
            typer.Option(
                "--action", help='Only this action ("sandbox.create"), or a prefix with * ("key.*").'
            ),
        ] = None,
        limit: Annotated[
            int | None, typer.Option("--limit", min=1, help="At most this many rows (default: all).")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
    ) -> None:
        """The audit trail (an admin key): who changed what, when, with what result."""
        with session(ctx) as client:
            items = client.audit(from_=from_, to=to, tenant_id=tenant, action=action, limit=limit)
        if as_json:
            typer.echo(json.dumps([e.data for e in items], indent=2))
        elif not items:
            typer.echo("no audit entries", err=True)
        else:
            _show(items)
