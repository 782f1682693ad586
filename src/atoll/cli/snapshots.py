"""`atoll snapshot create|list|get|rm`: named snapshots of sandboxes (a sandbox's state kept on its
worker; `atoll sandbox create --snapshot ID_OR_NAME` makes sandboxes from one).
Registered on the `atoll` app by atoll.cli.main.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start.
import json
import typing
from typing import Annotated

import typer

from atoll.cli.listing import show_list

Session = typing.Callable[[typer.Context], typing.ContextManager[typing.Any]]
_session: Session


def _row(s: dict) -> str:
    kind = "memory" if s.get("memory") else "files"
    mb = f"{s.get('bytes', 0) / 2**20:.1f}"
    created = (s.get("created_at") or "-").replace("T", " ")[:19]
    return (
        f"{s['id']:21} {s.get('name') or '-':24} {s.get('tenant_id') or '-':19} {s['sandbox_id']:20} "
        f"{kind:7} {mb:>8} {created}"
    )


def _show(items: list[dict], as_json: bool) -> None:
    show_list(
        items,
        as_json,
        empty="no snapshots",
        header=f"{'ID':21} {'NAME':24} {'TENANT':19} {'SANDBOX':20} {'KIND':7} {'MB':>8} CREATED",
        row=_row,
    )


def _commands() -> typer.Typer:
    sub = typer.Typer(
        help="Named snapshots: a sandbox's state kept on its worker, to create sandboxes from.",
        no_args_is_help=True,
    )

    @sub.command("create")
    def create(
        ctx: typer.Context,
        sandbox_id: Annotated[str, typer.Argument(metavar="SANDBOX_ID")],
        name: Annotated[str | None, typer.Option("--name", help="A name unique in your tenant.")] = None,
        files_only: Annotated[
            bool,
            typer.Option("--files-only", help="Keep its files only (sandboxes made from it boot cold)."),
        ] = False,
        replace: Annotated[
            bool, typer.Option("--replace", help="Give the name to this one, deleting the one that had it.")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the snapshot object as JSON.")] = False,
    ) -> None:
        """Snapshot a running sandbox (it is stopped for one checkpoint and runs on); print its id."""
        from atoll._client import Sandbox

        with _session(ctx) as client:
            sb = Sandbox(client, {"id": sandbox_id})
            snap = sb.snapshot(name, memory=not files_only, replace=replace).to_dict()
        if as_json:
            typer.echo(json.dumps(snap, indent=2))
        else:
            typer.echo(snap["id"])

    @sub.command("list")
    def list_(
        ctx: typer.Context,
        sandbox: Annotated[
            str | None, typer.Option("--sandbox", help="Only snapshots of this sandbox.")
        ] = None,
        name: Annotated[str | None, typer.Option("--name", help="Only the snapshot of this name.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
    ) -> None:
        """List your snapshots, oldest first (an admin key: every tenant's, each row naming its tenant)."""
        with _session(ctx) as client:
            items = [s.to_dict() for s in client.snapshots.list(sandbox_id=sandbox, name=name)]
        _show(items, as_json)

    @sub.command("get")
    def get(ctx: typer.Context, snapshot_id: Annotated[str, typer.Argument(metavar="ID_OR_NAME")]) -> None:
        """Print one snapshot as JSON (named by id or by name)."""
        with _session(ctx) as client:
            typer.echo(json.dumps(client.snapshots.get(snapshot_id).to_dict(), indent=2))

    @sub.command("rm")
    def rm(ctx: typer.Context, snapshot_id: Annotated[str, typer.Argument(metavar="ID_OR_NAME")]) -> None:
        """Delete a snapshot, named by id or by name (sandboxes made from it live on)."""
        with _session(ctx) as client:
            client.snapshots.delete(snapshot_id)
        typer.echo(snapshot_id)

    return sub


def register(app: typer.Typer, session: Session) -> None:
    global _session
    _session = session
    app.add_typer(_commands(), name="snapshot")
