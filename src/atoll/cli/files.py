"""`atoll sandbox upload ID LOCAL REMOTE` and `atoll sandbox download ID REMOTE LOCAL`: a local file
or directory tree into a sandbox and back (a directory as one tar stream, see the SDK's
`files.upload_dir` / `download_dir`). Registered on the `sandbox` app by atoll.cli.main.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start
# and evaluating them from strings is slow (see atoll.cli.main).
import contextlib
import os
import typing
from typing import Annotated

import typer

from atoll import errors

Session = typing.Callable[[typer.Context], typing.ContextManager[typing.Any]]


@contextlib.contextmanager
def _local_errors() -> typing.Iterator[None]:
    """A local file that cannot be read or written, or a tar the safe extract refuses: one line."""
    import tarfile  # here, not at the top: the CLI's start-up cost (the SDK imports it anyway)

    try:
        yield
    except (OSError, tarfile.TarError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None


def register(sandbox_app: typer.Typer, session: Session) -> None:
    @sandbox_app.command("upload")
    def upload(
        ctx: typer.Context,
        sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
        local: Annotated[str, typer.Argument(metavar="LOCAL", help="A local file or directory.")],
        remote: Annotated[str, typer.Argument(metavar="REMOTE", help="Its path in the sandbox.")],
    ) -> None:
        """Copy a local file, or a directory tree (one tar stream), into the sandbox."""
        if not os.path.exists(local):
            raise typer.BadParameter(f"{local!r} does not exist", param_hint="LOCAL")
        with session(ctx) as client, _local_errors():
            files = client.sandboxes.get(sandbox_id).files
            if os.path.isdir(local):
                done = files.upload_dir(local, remote)
                typer.echo(
                    f"{remote}: {done['files']} files, {done['dirs']} directories, {done['links']} links, "
                    f"{done['bytes']} bytes"
                )
            else:
                with open(local, "rb") as fh:
                    files.write(remote, fh)
                typer.echo(f"{remote}: {os.path.getsize(local)} bytes")

    @sandbox_app.command("download")
    def download(
        ctx: typer.Context,
        sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
        remote: Annotated[str, typer.Argument(metavar="REMOTE", help="A file or directory in the sandbox.")],
        local: Annotated[
            str, typer.Argument(metavar="LOCAL", help="Where to put it (a directory is created).")
        ],
    ) -> None:
        """Copy a file, or a directory tree (extracted safely), out of the sandbox."""
        with session(ctx) as client, _local_errors():
            files = client.sandboxes.get(sandbox_id).files
            if files.stat(remote).is_dir:
                n = files.download_dir(remote, local)
                typer.echo(f"{local}: {n} entries")
                return
            if os.path.isdir(local):
                local = os.path.join(local, os.path.basename(remote.rstrip("/")))
            tmp = f"{local}.atoll-download"
            try:
                with open(tmp, "wb") as fh:
                    n = files.read_to(remote, fh)
                os.replace(tmp, local)
            except (errors.AtollError, OSError):
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            typer.echo(f"{local}: {n} bytes")
