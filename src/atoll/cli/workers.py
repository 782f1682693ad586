"""`atoll worker drain NAME [--no-evacuate] [--undo] [--wait]`: drain a worker (every sandbox on it
moves to another worker; `--no-evacuate`: only no new ones go there) or make it ready again.
Registered on the `atoll worker` group by atoll.cli.main (whose callback runs a worker when no
subcommand is given).
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start.
import json
import time
import typing
from typing import Annotated

import typer

Connect = typing.Callable[[typer.Context, str | None, str | None], typing.ContextManager[typing.Any]]


def _find(client: typing.Any, name: str) -> dict:
    items = client.workers.list()
    for w in items:
        if name in (w["name"], w["id"]):
            return w
    known = ", ".join(sorted(w["name"] for w in items)) or "none"
    shown = repr(name) if len(name) <= 80 else f"{name[:80]!r}… ({len(name)} characters)"
    typer.echo(f"error: worker_not_found: no worker named {shown} (known: {known})", err=True)
    raise typer.Exit(1)


def _summary(w: dict) -> str:
    ev = w.get("evacuation")
    line = f"{w['name']}: {w['state']}, {w['sandboxes']} sandbox(es)"
    if ev:
        line += f"; evacuation {ev['state']}: {ev['moved']} moved, {len(ev['left'])} left"
        if ev.get("pending"):
            line += f", {ev['pending']} to go"
        if ev.get("resumed_at"):
            line += f" (resumed {ev['resumed_at']})"
        if ev.get("pool_members_dropped"):
            line += f", {ev['pool_members_dropped']} pool member(s) refilled elsewhere"
    if w.get("evacuated"):
        line += " (evacuated)"
    return line


def register(worker_app: typer.Typer, connect: Connect) -> None:
    @worker_app.command("drain")
    def drain(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(help="The worker's name (or id), as `atoll workers` lists it.")],
        no_evacuate: Annotated[
            bool, typer.Option("--no-evacuate", help="Only cordon: no new sandboxes; its own stay.")
        ] = False,
        undo: Annotated[
            bool, typer.Option("--undo", help="Undrain: ready again (an evacuation stops between sandboxes).")
        ] = False,
        wait: Annotated[
            bool, typer.Option("--wait", help="Wait until the evacuation ends; exit 2 if sandboxes stay.")
        ] = False,
        url: Annotated[
            str | None,
            typer.Option("--url", envvar="ATOLL_URL", help="Server URL (default http://127.0.0.1:7080)."),
        ] = None,
        api_key: Annotated[
            str | None, typer.Option("--api-key", envvar="ATOLL_API_KEY", help="API key.", show_default=False)
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the worker object as JSON.")] = False,
    ) -> None:
        """Drain worker NAME: every sandbox on it moves to another worker (running ones pause for
        seconds, state intact); those that cannot move stay and are listed with the reason."""
        if undo and (no_evacuate or wait):
            # --undo makes the worker ready again: a cordon or an evacuation to wait for is not
            # what it does, and silently ignoring the flag would hide that (exit 2, usage error)
            raise typer.BadParameter(
                f"--undo makes worker {name!r} ready again; {'--no-evacuate' if no_evacuate else '--wait'} "
                "applies to a drain only — give --undo alone, or drop --undo to drain",
                param_hint="--undo",
            )
        with connect(ctx, url, api_key) as client:
            wid = _find(client, name)["id"]
            if undo:
                w = client.workers.undrain(wid)
            else:
                w = client.workers.drain(wid, evacuate=not no_evacuate)
                while wait and not no_evacuate and (w.get("evacuation") or {}).get("state") == "running":
                    time.sleep(0.5)
                    w = client.workers.get(wid)
        if as_json:
            typer.echo(json.dumps(w, indent=2))
        else:
            typer.echo(_summary(w))
            for s in (w.get("evacuation") or {}).get("left", []):
                typer.echo(f"  {s['id']}: {s['reason']}")
        if wait and (w.get("evacuation") or {}).get("left"):
            raise typer.Exit(2)
