"""`atoll usage`: what was used and what it cost (GET /v1/usage), as a table and a bar chart.

Registered on the `atoll` app by cli.main; prints through the sync SDK client's `usage`.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start.

import json
import typing
from enum import StrEnum
from typing import Annotated

import typer

Session = typing.Callable[[typer.Context], typing.ContextManager[typing.Any]]

COLUMNS = (
    ("cpu_seconds", "CPU s"),
    ("memory_gb_seconds", "MEM GB·s"),
    ("standby_memory_gb_seconds", "STANDBY GB·s"),
    ("snapshot_gb_seconds", "SNAPSHOT GB·s"),
    ("volume_gb_seconds", "VOLUME GB·s"),
    ("drive_gb_seconds", "DRIVE GB·s"),
    ("build_seconds", "BUILD s"),
    ("cost", "COST"),
)
BAR_WIDTH = 30


class By(StrEnum):
    sandbox = "sandbox"
    day = "day"
    tenant = "tenant"


def _label(item: dict, by: str) -> str:
    if by == "day":
        return str(item.get("day"))
    if by == "tenant":
        return str(item.get("tenant_id"))
    return str(item.get("sandbox_id") or item.get("subject"))


def _num(v: float) -> str:
    if v == 0:
        return "0"
    return f"{v:,.4f}" if abs(v) < 1 else f"{v:,.1f}"


def bars(items: list[dict], by: str, field: str = "cost", width: int = BAR_WIDTH) -> list[str]:
    """One line per item: its label, a bar of `field` scaled to the largest, the value."""
    top = max((float(i.get(field) or 0) for i in items), default=0.0)
    labels = [_label(i, by) for i in items]
    pad = max((len(x) for x in labels), default=0)
    out = []
    for label, i in zip(labels, items, strict=True):
        v = float(i.get(field) or 0)
        n = round(width * v / top) if top > 0 else 0
        out.append(f"{label:<{pad}} {'█' * n}{'·' * (width - n)} {_num(v)}")
    return out


def register(app: typer.Typer, session: Session, table: typing.Callable, console: typing.Callable) -> None:
    @app.command("usage")
    def usage(
        ctx: typer.Context,
        from_: Annotated[
            str | None, typer.Option("--from", help="Start, ISO 8601 (default: 24 h before --to).")
        ] = None,
        to: Annotated[str | None, typer.Option("--to", help="End, ISO 8601 (default: now).")] = None,
        by: Annotated[By, typer.Option("--by", help="Group by sandbox, day or tenant.")] = By.sandbox,
        chart: Annotated[
            str, typer.Option("--chart", help="The field the bar chart shows (e.g. cpu_seconds).")
        ] = "cost",
        as_json: Annotated[bool, typer.Option("--json", help="Print the answer as JSON.")] = False,
    ) -> None:
        """What sandboxes, volumes, drives and builds used, and what it cost, with a bar chart."""
        if chart not in {c for c, _ in COLUMNS} | {"egress_bytes", "ingress_bytes"}:
            raise typer.BadParameter(f"{chart!r} is not a usage field", param_hint="--chart")
        with session(ctx) as client:
            body = client.usage(from_=from_, to=to, group_by=by.value)
        if as_json:
            typer.echo(json.dumps(body, indent=2))
            return
        items = body.get("items") or []
        typer.echo(f"usage from {body.get('from')} to {body.get('to')}, by {by.value}")
        if not items:
            typer.echo("no usage in this range", err=True)
            return
        t = table()
        t.add_column(by.value.upper(), no_wrap=True)
        for _, title in COLUMNS:
            t.add_column(title, justify="right", no_wrap=True)
        for i in items:
            t.add_row(_label(i, by.value), *(_num(float(i.get(f) or 0)) for f, _ in COLUMNS))
        total = body.get("total") or {}
        t.add_row("TOTAL", *(_num(float(total.get(f) or 0)) for f, _ in COLUMNS), style="bold")
        c = console()
        c.print(t)
        typer.echo("")
        typer.echo(f"{chart}:")
        for line in bars(items, by.value, chart):
            typer.echo(line)
