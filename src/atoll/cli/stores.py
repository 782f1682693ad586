"""`atoll volume create|list|get|rm|clone|export|import` and the same for `atoll drive` (plus
`atoll drive put|get|ls`): volumes and drives, state that outlives a sandbox. Registered on the
`atoll` app by atoll.cli.main; mount them with `atoll sandbox create --volume NAME:PATH[:ro]`.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start.
import json
import sys
import typing
from typing import Annotated

import typer

Session = typing.Callable[[typer.Context], typing.ContextManager[typing.Any]]
_session: Session


def _resource(client: typing.Any, kind: str) -> typing.Any:
    return client.volumes if kind == "volume" else client.drives


def _show(items: list, as_json: bool, kind: str) -> None:
    if as_json:
        typer.echo(json.dumps([s.data for s in items], indent=2))
        return
    if not items:
        typer.echo(f"no {kind}s", err=True)
        return
    typer.echo(f"{'NAME':24} {'SIZE_MB':>8} {'USED_MB':>8}  ATTACHED_TO")
    for s in items:
        att = s.attached_to
        att = ", ".join(att) if isinstance(att, list) else (att or "-")
        used = "?" if s.used_mb is None else f"{s.used_mb:g}"
        typer.echo(f"{s.name:24} {s.size_mb:>8} {used:>8}  {att or '-'}")


def _commands(kind: str) -> typer.Typer:
    sub = typer.Typer(
        help=(
            "Volumes: disks one sandbox at a time mounts; they outlive sandboxes."
            if kind == "volume"
            else "Drives: shared trees many sandboxes mount at once, with files reachable from the API."
        ),
        no_args_is_help=True,
    )

    @sub.command("create")
    def create(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(metavar="NAME")],
        size_mb: Annotated[int, typer.Option("--size-mb", help="Size limit in MB (8 .. 1048576).")] = 1024,
        as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON.")] = False,
    ) -> None:
        """Make one (an ext4 filesystem of that size on a worker)."""
        with _session(ctx) as client:
            store = _resource(client, kind).create(name, size_mb)
        _show([store], as_json, kind) if as_json else typer.echo(store.name)

    @sub.command("list")
    def list_(
        ctx: typer.Context,
        as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
    ) -> None:
        """List them with their size, use and holders."""
        with _session(ctx) as client:
            items = _resource(client, kind).list()
        _show(items, as_json, kind)

    @sub.command("get")
    def get(ctx: typer.Context, name: Annotated[str, typer.Argument(metavar="NAME")]) -> None:
        """Show one as JSON."""
        with _session(ctx) as client:
            typer.echo(json.dumps(_resource(client, kind).get(name).data, indent=2))

    @sub.command("rm")
    def rm(ctx: typer.Context, name: Annotated[str, typer.Argument(metavar="NAME")]) -> None:
        """Delete it with its data (refused while a sandbox mounts it)."""
        with _session(ctx) as client:
            _resource(client, kind).delete(name)
        typer.echo(name)

    @sub.command("clone")
    def clone(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(metavar="NAME")],
        new_name: Annotated[str, typer.Argument(metavar="NEW_NAME")],
    ) -> None:
        """A point-in-time copy."""
        with _session(ctx) as client:
            typer.echo(_resource(client, kind).get(name).clone(new_name).name)

    @sub.command("export")
    def export(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(metavar="NAME")],
        out: Annotated[str, typer.Option("--out", "-o", help="Tar file to write ('-': stdout).")] = "-",
    ) -> None:
        """Write its whole tree as a tar."""
        with _session(ctx) as client:
            store = _resource(client, kind).get(name)
            f = sys.stdout.buffer if out == "-" else open(out, "wb")  # noqa: SIM115
            try:
                for chunk in store.export_tar():
                    f.write(chunk)
            finally:
                if f is not sys.stdout.buffer:
                    f.close()

    @sub.command("import")
    def import_(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(metavar="NAME")],
        tar_file: Annotated[str, typer.Argument(metavar="TAR", help="Tar file to unpack ('-': stdin).")],
    ) -> None:
        """Unpack a tar into its root."""
        with _session(ctx) as client:
            store = _resource(client, kind).get(name)
            if tar_file == "-":
                counts = store.import_tar(sys.stdin.buffer)
            else:
                with open(tar_file, "rb") as f:
                    counts = store.import_tar(f)
        typer.echo(json.dumps(counts))

    if kind == "drive":

        @sub.command("put")
        def put(
            ctx: typer.Context,
            name: Annotated[str, typer.Argument(metavar="NAME")],
            local: Annotated[str, typer.Argument(metavar="LOCAL_FILE", help="'-': stdin")],
            path: Annotated[str, typer.Argument(metavar="PATH", help="Absolute path in the drive")],
        ) -> None:
            """Upload a file into the drive."""
            with _session(ctx) as client:
                drive = client.drives.get(name)
                if local == "-":
                    drive.files.write(path, sys.stdin.buffer)
                else:
                    with open(local, "rb") as f:
                        drive.files.write(path, f)
            typer.echo(path)

        @sub.command("cat")
        def cat(
            ctx: typer.Context,
            name: Annotated[str, typer.Argument(metavar="NAME")],
            path: Annotated[str, typer.Argument(metavar="PATH")],
        ) -> None:
            """Print a file of the drive."""
            with _session(ctx) as client:
                sys.stdout.buffer.write(client.drives.get(name).files.read(path))

        @sub.command("ls")
        def ls(
            ctx: typer.Context,
            name: Annotated[str, typer.Argument(metavar="NAME")],
            path: Annotated[str, typer.Argument(metavar="PATH")] = "/",
        ) -> None:
            """List a directory of the drive."""
            with _session(ctx) as client:
                for e in client.drives.get(name).files.list(path):
                    typer.echo(f"{e.type:7} {e.size:>12}  {e.name}")

    return sub


def register(app: typer.Typer, session: Session) -> None:
    global _session
    _session = session
    app.add_typer(_commands("volume"), name="volume")
    app.add_typer(_commands("drive"), name="drive")


def parse_mounts(values: typing.Sequence[str], option: str) -> list[dict]:
    """`NAME:PATH[:ro]` values of --volume / --drive."""
    out = []
    for v in values:
        parts = v.split(":")
        if (
            len(parts) not in (2, 3)
            or not parts[0]
            or not parts[1]
            or (len(parts) == 3 and parts[2] not in ("ro", "rw"))
        ):
            raise typer.BadParameter(f"{v!r}: use NAME:PATH or NAME:PATH:ro", param_hint=option)
        out.append({"name": parts[0], "path": parts[1], "read_only": len(parts) == 3 and parts[2] == "ro"})
    return out
