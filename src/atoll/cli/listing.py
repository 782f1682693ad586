"""What the CLI's `list` commands share: a JSON array with --json, else a table (a header line and
a line an item), or a note on stderr when there is nothing."""

import json
import typing

import typer


def show_list(
    items: list[dict], as_json: bool, *, empty: str, header: str, row: typing.Callable[[dict], str]
) -> None:
    """Print `items` as indented JSON (`as_json`), else `empty` on stderr when there are none, else
    `header` and `row(item)` for each item."""
    if as_json:
        typer.echo(json.dumps(items, indent=2))
        return
    if not items:
        typer.echo(empty, err=True)
        return
    typer.echo(header)
    for item in items:
        typer.echo(row(item))
