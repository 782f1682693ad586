"""`atoll template build|list|get|rm` and `atoll pool set|get`: templates from a spec file (YAML or
JSON, the same fields as the SDK's `templates.build`) or a Dockerfile, with the build's log shown
as it runs, and their warm pools. Registered on the `atoll` app by atoll.cli.main.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start
# and evaluating them from strings is slow (see atoll.cli.main).
import json
import os
import sys
import typing
from typing import Annotated

import typer

from atoll import errors

template_app = typer.Typer(
    help="Build templates (a spec file or a Dockerfile), list and delete them.", no_args_is_help=True
)
pool_app = typer.Typer(
    help="Warm pools: ready sandboxes of a template, claimed by creates.", no_args_is_help=True
)

Session = typing.Callable[[typer.Context], typing.ContextManager[typing.Any]]
_session: Session


def register(app: typer.Typer, session: Session) -> None:
    global _session
    _session = session
    app.add_typer(template_app, name="template")
    app.add_typer(pool_app, name="pool")


def _is_dockerfile(path: str, text: str) -> bool:
    base = os.path.basename(path).lower()
    if base == "dockerfile" or base.endswith(".dockerfile") or base.startswith("dockerfile."):
        return True
    if path.endswith((".yaml", ".yml", ".json")):
        return False
    first = next(
        (ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), ""
    )
    return first.upper().startswith("FROM ")


def _load_spec(path: str, text: str) -> dict:
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise typer.BadParameter(f"{path} is not a valid YAML/JSON spec: {e}", param_hint="-f") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(
            f"{path} must hold a mapping (name, from, apt, pip, run, ...)", param_hint="-f"
        )
    return data


@template_app.command("build")
def build(
    ctx: typer.Context,
    file: Annotated[
        str,
        typer.Option(
            "-f", "--file", help="A spec (.yaml/.json) or a Dockerfile (its directory is the build context)."
        ),
    ],
    name: Annotated[
        str | None, typer.Option("--name", help="The template's name (else the spec's `name`).")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only the result.")] = False,
) -> None:
    """Build a template; its log streams here until the build ends (exit 1 if it fails)."""
    try:
        with open(file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise typer.BadParameter(f"cannot read {file}: {e.strerror}", param_hint="-f") from None
    on_log = None if quiet else (lambda line: (sys.stderr.write(line + "\n"), sys.stderr.flush()))
    with _session(ctx) as client:
        try:
            if _is_dockerfile(file, text):
                if not name:
                    raise typer.BadParameter("a Dockerfile build needs --name", param_hint="--name")
                t = client.templates.build_dockerfile(name, file, on_log=on_log)
            else:
                spec = _load_spec(file, text)
                spec_name = name or spec.pop("name", None)
                spec.pop("name", None)
                if not spec_name:
                    raise typer.BadParameter(
                        "give the template a name: `name:` in the spec or --name", param_hint="--name"
                    )
                from_ = spec.pop("from", spec.pop("from_", "base"))
                t = client.templates.build(spec_name, from_=from_, on_log=on_log, **spec)
        except TypeError as e:
            raise typer.BadParameter(f"the spec has an unknown field: {e}", param_hint="-f") from None
        except errors.BuildFailed as e:
            typer.echo(f"error: {e.message}", err=True)
            raise typer.Exit(1) from None
    typer.echo(
        f"{t.name} ready (build {t.build_id}"
        + (f", start {t.get('start_mode')}" if t.get("start_mode") else "")
        + ")"
    )


@template_app.command("list")
def list_(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List templates: built in and yours, with their status."""
    with _session(ctx) as client:
        items = client.templates.list()
    if as_json:
        typer.echo(json.dumps([t.to_dict() for t in items], indent=2, sort_keys=True))
        return
    from rich.console import Console  # here, not at the top: the CLI's start-up cost
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("NAME", "STATUS", "BUILD", "FROM", "ERROR"):
        table.add_column(col, overflow="fold")
    for t in items:
        table.add_row(t.name, t.status, t.build_id or "-", t.get("from") or "-", (t.error or "")[:120])
    console = Console()
    if not console.is_terminal:
        console = Console(width=1000)
    console.print(table)


@template_app.command("get")
def get(ctx: typer.Context, name: Annotated[str, typer.Argument(metavar="NAME")]) -> None:
    """Show a template as JSON."""
    with _session(ctx) as client:
        t = client.templates.get(name)
    typer.echo(json.dumps(t.to_dict(), indent=2, sort_keys=True))


@template_app.command("rm")
def rm(ctx: typer.Context, name: Annotated[str, typer.Argument(metavar="NAME")]) -> None:
    """Delete a template (refused while sandboxes use it)."""
    with _session(ctx) as client:
        client.templates.delete(name)
    typer.echo(name)


@pool_app.command("set")
def pool_set(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME", help="The template.")],
    min_: Annotated[int, typer.Option("--min", help="Sandboxes kept ready.")] = 0,
    max_: Annotated[
        int | None, typer.Option("--max", help="At most this many ready (default: --min, at least 1).")
    ] = None,
    schedule: Annotated[
        list[str] | None,
        typer.Option("--schedule", help="HH:MM-HH:MM=N: at least N ready in that UTC window (repeat)."),
    ] = None,
) -> None:
    """Size a template's warm pool."""
    windows = []
    for item in schedule or []:
        span, sep, n = item.partition("=")
        start, dash, end = span.partition("-")
        if not sep or not dash or not n.isdigit():
            raise typer.BadParameter(f"expected HH:MM-HH:MM=N, got {item!r}", param_hint="--schedule")
        windows.append({"from": start, "to": end, "min": int(n)})
    with _session(ctx) as client:
        pool = client.templates.set_pool(
            name, min=min_, max=max_ if max_ is not None else max(min_, 1), schedule=windows or None
        )
    typer.echo(json.dumps(pool, indent=2, sort_keys=True))


@pool_app.command("get")
def pool_get(ctx: typer.Context, name: Annotated[str, typer.Argument(metavar="NAME")]) -> None:
    """Show a template's pool: desired, ready, claimed, last error."""
    with _session(ctx) as client:
        pool = client.templates.get_pool(name)
    typer.echo(json.dumps(pool, indent=2, sort_keys=True))
