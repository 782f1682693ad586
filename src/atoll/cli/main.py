"""The `atoll` command line (typer + rich): `atoll up`, `atoll server`, `atoll worker`, `atoll edge`,
`atoll workers`, `atoll sandbox ...` and `atoll mcp` (atoll.integrations.mcp, the `mcp` extra).

Entry point of the `atoll` console script (`atoll = atoll.cli.main:app`). `atoll up`, `atoll server`
and `atoll worker` start processes by importing their modules lazily (`atoll.up`,
`atoll.controlplane.main`, `atoll.worker.service.main`), so the CLI works with the SDK alone; every
`atoll sandbox` command talks to a server through the sync SDK client built by
`make_client` (tests monkeypatch it to inject an `httpx.MockTransport`). SDK errors are
printed as `error: <code>: <message>` on stderr with exit status 1, never as a traceback.

Start-up cost is part of the CLI's contract (docs/specification.md): this module and the command
modules it registers import only typer and `atoll.errors` at the top; rich, httpx and the SDK are
imported inside the commands that use them. They do not use `from __future__ import annotations`:
typer turns every command into a click command at each start, reading its annotations, and
evaluating them from strings (each `typer.Option(...)` again) cost ~40 ms of every command.
"""

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from atoll import errors
from atoll.cli import argv as cli_argv
from atoll.cli import audit as cli_audit
from atoll.cli import coercion as cli_coercion
from atoll.cli import files as cli_files
from atoll.cli import shell as cli_shell
from atoll.cli import snapshots as cli_snapshots
from atoll.cli import stores as cli_stores
from atoll.cli import templates as cli_templates
from atoll.cli import tenants as cli_tenants
from atoll.cli import usage as cli_usage
from atoll.cli import workers as cli_workers

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from atoll._client import Client, Sandbox


cli_coercion.install()


class _Atoll(typer.Typer):
    """The `atoll` entry point: global options are accepted anywhere (cli.argv) before typer parses."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # httpx's package imports its own command line (httpx._main: click, rich's progress bars and
        # syntax highlighting, pygments) whenever click and rich are installed: ~50 ms of every
        # command that talks to a server. atoll never calls `httpx.main`; a None entry makes that
        # import fail and httpx falls back to its stub `main` (as without its `cli` extra).
        sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
        if not args and "args" not in kwargs:
            kwargs["args"] = cli_argv.normalize(sys.argv[1:])
        return super().__call__(*args, **kwargs)


app = _Atoll(
    name="atoll",
    help="Self-hostable sandboxes for AI agents.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_enable=False,
)
sandbox_app = typer.Typer(help="Create, inspect and drive sandboxes.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")
secret_app = typer.Typer(
    help="Secrets: values the egress gateway sends only to their hosts (sandboxes see placeholders).",
    no_args_is_help=True,
)
app.add_typer(secret_app, name="secret")


def make_client(url: str | None, api_key: str | None, ca_file: str | None = None) -> "Client":
    """The SDK client every command that talks to a server uses; None means "from the
    environment" ($ATOLL_URL, $ATOLL_API_KEY, $ATOLL_CA_FILE). A `ca_file` here came from
    `--ca-file`, and its errors say so."""
    from atoll._client import Client, _base

    ca = _base.SourcedPath(ca_file, "--ca-file") if ca_file is not None else None
    return Client(base_url=url, api_key=api_key, ca_file=ca)


def _sandbox(client: "Client", sandbox_id: str) -> "Sandbox":
    """A handle on a sandbox by id, without fetching it."""
    from atoll._client import Sandbox

    return Sandbox(client, {"id": sandbox_id})


def _table(**kwargs: Any) -> "Table":
    from rich.table import Table

    return Table(box=None, header_style="bold", pad_edge=False, **kwargs)


def _console() -> "Console":
    """A rich console for tables; piped, one line per row whatever the width."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=1000)


class OnTimeout(StrEnum):
    pause = "pause"
    delete = "delete"


class OnWorkerLost(StrEnum):
    fail = "fail"
    restore = "restore"


_ON_WORKER_LOST_HELP = (
    "Once its worker has been lost for ATOLL_WORKER_GONE_S: fail, or restore (on another worker "
    "from its last archive)."
)


class Tier(StrEnum):
    memory = "memory"
    disk = "disk"
    archive = "archive"


@dataclass(frozen=True)
class _Connection:
    url: str | None
    api_key: str | None
    ca_file: str | None = None


_CA_FILE_HELP = (
    "The installation CA (PEM: what the server's GET /v1/ca.crt answers) to check an https:// "
    "server's certificate against (default $ATOLL_CA_FILE, else the system's CAs)."
)


def _top(ctx: typer.Context) -> _Connection:
    """The options given to `atoll` itself (`atoll --url U --ca-file F worker drain NAME`)."""
    obj = ctx.find_root().obj
    return obj if isinstance(obj, _Connection) else _Connection(None, None)


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@contextmanager
def _session(ctx: typer.Context) -> "Iterator[Client]":
    """A client for one command; SDK errors become `error: <code>: <message>` and exit 1."""
    conn: _Connection = ctx.obj or _Connection(None, None)
    try:
        with make_client(conn.url, conn.api_key, conn.ca_file) as client:
            yield client
    except errors.AtollError as exc:
        _fail(f"{exc.code}: {exc.message}")
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


cli_templates.register(app, _session)
cli_stores.register(app, _session)
cli_tenants.register(app, _session)
cli_snapshots.register(app, _session)
cli_audit.register(app, _session)
cli_usage.register(app, _session, _table, _console)
cli_files.register(sandbox_app, _session)


def _version(value: bool) -> None:
    if value:
        from atoll._version import __version__

        typer.echo(f"atoll {__version__}")
        raise typer.Exit()


@app.callback()
def atoll_main(
    ctx: typer.Context,
    url: Annotated[
        str | None, typer.Option("--url", help="Server URL (default $ATOLL_URL or http://127.0.0.1:7080).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", help="API key (default $ATOLL_API_KEY).", show_default=False)
    ] = None,
    ca_file: Annotated[Path | None, typer.Option("--ca-file", help=_CA_FILE_HELP, show_default=False)] = None,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Self-hostable sandboxes for AI agents. --url, --api-key, --ca-file and --json may go anywhere."""
    ctx.obj = _Connection(url, api_key, str(ca_file) if ca_file is not None else None)


cli_shell.register(sandbox_app, _session)


def _pairs(values: list[str] | None, option: str) -> dict[str, str] | None:
    """Parse repeated `KEY=VALUE` options."""
    if not values:
        return None
    result: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint=option)
        result[key] = value
    return result


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


def _write(stream_name: str) -> Callable[[str], None]:
    def write(text: str) -> None:
        # Look the stream up per call: test runners swap sys.stdout / sys.stderr.
        stream = sys.stdout if stream_name == "stdout" else sys.stderr
        stream.write(text)
        stream.flush()

    return write


def exit_status(exit_code: int | None, timed_out: bool) -> int:
    """The CLI's exit status for a finished command: its own, 128+N for signal N, 124 on timeout."""
    if exit_code is None:
        return 124 if timed_out else 1
    if exit_code < 0:
        return 128 + min(-exit_code, 127)
    return min(exit_code, 255)


# ---------------------------------------------------------------- atoll up


@app.command()
def up(
    port: Annotated[int | None, typer.Option(help="Port to listen on (default $ATOLL_PORT or 7080).")] = None,
    home: Annotated[
        Path | None,
        typer.Option(help="State directory: database, images, snapshots (default $ATOLL_HOME)."),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Address to bind (default $ATOLL_HOST or 127.0.0.1).")
    ] = None,
    slots: Annotated[
        int | None,
        typer.Option(
            help="The most sandboxes holding the local worker's resources (creating, running, memory "
            "standby; disk and archive standby take none) it takes (default $ATOLL_WORKER_SLOTS, "
            "else 0: no limit).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run atoll on this machine in the foreground: the control plane and one local worker."""
    try:
        from atoll import up as _up
    except ImportError as exc:
        _fail(f"the atoll server is not installed ({exc}); install it with: pip install 'atoll[server]'")
    _up.main(port=port, home=str(home) if home is not None else None, host=host, slots=slots)


@app.command()
def server(
    port: Annotated[int | None, typer.Option(help="Port to listen on (default $ATOLL_PORT or 7080).")] = None,
    home: Annotated[
        Path | None, typer.Option(help="State directory: records and the admin key (default $ATOLL_HOME).")
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Address to bind (default $ATOLL_HOST or 127.0.0.1).")
    ] = None,
) -> None:
    """Run the control plane alone in the foreground; workers join it with `atoll worker`."""
    try:
        from atoll.controlplane import main as _server
    except ImportError as exc:
        _fail(f"the atoll server is not installed ({exc}); install it with: pip install 'atoll[server]'")
    _server.main(port=port, home=str(home) if home is not None else None, host=host)


@app.command("mcp")
def mcp_(
    ctx: typer.Context,
    http: Annotated[
        bool, typer.Option("--http", help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio.")
    ] = False,
    host: Annotated[str, typer.Option(help="Address to bind with --http (beyond loopback: no auth!).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to listen on with --http.", min=1, max=65535)] = 7090,
) -> None:
    """Run an MCP server whose tools create, drive and delete sandboxes (stdio by default).

    It calls the atoll server at $ATOLL_URL with the key in $ATOLL_API_KEY (or --url, --api-key,
    --ca-file) and can do what that key can. Over stdio, stdout carries only JSON-RPC; logs go to stderr.
    """
    try:
        from atoll.integrations import mcp as _mcp
    except ImportError as exc:
        _fail(f"the MCP server is not installed ({exc}); install it with: pip install 'atoll[mcp]'", 2)
    top = _top(ctx)
    _mcp.main(url=top.url, api_key=top.api_key, ca_file=top.ca_file, http=http, host=host, port=port)


@app.command()
def edge(
    ctx: typer.Context,
    server: Annotated[
        str,
        typer.Option(
            help="The API server's base URL, without /v1, which grants each call (e.g. https://atoll.example:7080)."
        ),
    ],
    ca_file: Annotated[
        Path | None,
        typer.Option(
            help="The installation CA (the server's GET /v1/ca.crt): checks the server and https workers."
        ),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="Address to bind (default $ATOLL_EDGE_HOST or 127.0.0.1).")
    ] = None,
    port: Annotated[
        int | None, typer.Option(help="Port to listen on (default $ATOLL_EDGE_PORT or 7083).")
    ] = None,
    tls_cert_file: Annotated[
        Path | None,
        typer.Option(help="Serve https with this certificate (PEM; default $ATOLL_EDGE_TLS_CERT_FILE)."),
    ] = None,
    tls_key_file: Annotated[
        Path | None, typer.Option(help="Its private key (PEM; default $ATOLL_EDGE_TLS_KEY_FILE).")
    ] = None,
    e2b_port: Annotated[
        int | None,
        typer.Option(
            help="Also serve E2B's API (the e2b SDKs' E2B_API_URL / E2B_SANDBOX_URL) on this port "
            "(default $ATOLL_E2B_PORT; 0: none).",
            min=0,
            max=65535,
        ),
    ] = None,
) -> None:
    """Run the edge in the foreground: sandboxes' exec, process, file and terminal calls, relayed
    straight to their workers with grants from the server, so a server restart does not cut a
    stream; with --e2b-port, E2B's API too (docs/e2b-compat.md)."""
    try:
        from atoll.edge import service as _edge
    except ImportError as exc:
        _fail(f"the atoll edge is not installed ({exc}); install it with: pip install 'atoll[server]'")
    _edge.main(
        server,
        # `atoll edge --ca-file F` reaches atoll's own option (cli.argv moves it there)
        ca_file=str(ca_file) if ca_file is not None else _top(ctx).ca_file,
        host=host,
        port=port,
        tls_cert_file=str(tls_cert_file) if tls_cert_file is not None else None,
        tls_key_file=str(tls_key_file) if tls_key_file is not None else None,
        e2b_port=e2b_port,
    )


worker_app = typer.Typer(
    help="Run a worker (`atoll worker --server URL --name NAME`), or drain one (`atoll worker drain NAME`)."
)
app.add_typer(worker_app, name="worker")


@contextmanager
def _client_for(ctx: typer.Context, url: str | None, api_key: str | None) -> "Iterator[Client]":
    """`_session` for a command with its own --url and --api-key; those given to `atoll` itself
    (where cli.argv moves them from `atoll worker drain NAME --url U`) fill in, and --ca-file."""
    top = _top(ctx)
    try:
        with make_client(
            url if url is not None else top.url, api_key if api_key is not None else top.api_key, top.ca_file
        ) as client:
            yield client
    except errors.AtollError as exc:
        _fail(f"{exc.code}: {exc.message}")


cli_workers.register(worker_app, _client_for)


@worker_app.callback(invoke_without_command=True)
def worker(
    ctx: typer.Context,
    server_url: Annotated[
        str | None,
        typer.Option(
            "--server",
            envvar="ATOLL_SERVER_URL",
            help="URL of the atoll server to join; several servers sharing one database as "
            "URL1,URL2 (it joins one, and moves to the next when its heartbeats stop reaching it).",
        ),
    ] = None,
    name: Annotated[
        str | None,
        typer.Option(help="This worker's name at the server (default $ATOLL_WORKER_NAME or 'local')."),
    ] = None,
    home: Annotated[
        Path | None,
        typer.Option(
            help="State directory: sandboxes, snapshots, images (default $ATOLL_HOME); one per worker."
        ),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(help="HOST:PORT the worker API listens on (default 127.0.0.1:0, a free port)."),
    ] = None,
    advertise: Annotated[
        str | None,
        typer.Option(
            help="URL the server calls this worker at (default http(s)://<listen address>: https "
            "when --server is https)."
        ),
    ] = None,
    ca_file: Annotated[
        Path | None,
        typer.Option(
            "--ca-file",
            help="The installation CA (the server's GET /v1/ca.crt) this worker trusts for an "
            "https:// --server (default $ATOLL_CA_FILE, else the system trust store).",
            show_default=False,
        ),
    ] = None,
    slots: Annotated[
        int | None,
        typer.Option(
            help="The most sandboxes holding this worker's resources (creating, running, memory "
            "standby; disk and archive standby take none) it takes (default $ATOLL_WORKER_SLOTS, "
            "else 0: no limit).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run a worker in the foreground: it registers with the server, heartbeats and runs sandboxes.
    Needs root and ATOLL_API_KEY: a `worker`-scoped key (`atoll key create --scope worker`); the
    server's admin key is still accepted, with a deprecation warning in the server's log."""
    if ctx.invoked_subcommand is not None:  # `atoll worker drain NAME`
        return
    top_ca = _top(ctx).ca_file  # `atoll --ca-file F worker …` (where cli.argv moves it)
    try:
        from atoll.worker.service import main as _worker
    except ImportError as exc:
        _fail(f"the atoll worker is not installed ({exc}); install it with: pip install 'atoll[server]'")
    _worker.main(
        server=server_url,
        name=name,
        home=str(home) if home is not None else None,
        listen=listen,
        advertise=advertise,
        ca_file=str(ca_file) if ca_file is not None else top_ca,
        slots=slots,
    )


@app.command("workers")
def workers_(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option("--url", envvar="ATOLL_URL", help="Server URL (default http://127.0.0.1:7080)."),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="ATOLL_API_KEY", help="API key.", show_default=False)
    ] = None,
    ca_file: Annotated[Path | None, typer.Option("--ca-file", help=_CA_FILE_HELP, show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List the server's workers: name, state, sandboxes, slots and memory allocated of capacity."""
    ca = str(ca_file) if ca_file is not None else _top(ctx).ca_file
    try:
        with make_client(url, api_key, ca) as client:
            items = client.workers.list()
    except errors.AtollError as exc:
        _fail(f"{exc.code}: {exc.message}")
    if as_json:
        _print_json(items)
        return
    if not items:
        typer.echo("no workers", err=True)
        return
    table = _table()
    for col in ("NAME", "STATE", "SANDBOXES", "SLOTS", "MEMORY (MB)", "VERSION", "ID"):
        table.add_column(col, no_wrap=True)
    for w in items:
        mem = f"{int(w['allocated']['memory_mb'])}/{int(w['capacity']['memory_mb'])}"
        limit = w["capacity"].get("slots") or 0  # 0: no limit
        slots = f"{w['allocated'].get('slots', 0)}/{limit or '-'}"
        table.add_row(
            w["name"], w["state"], str(w["sandboxes"]), slots, mem, str(w.get("version") or "-"), w["id"]
        )
    console = _console()
    console.print(table)


# ---------------------------------------------------------------- atoll sandbox


@sandbox_app.callback()
def sandbox_main(
    ctx: typer.Context,
    url: Annotated[
        str | None,
        typer.Option("--url", envvar="ATOLL_URL", help="Server URL (default http://127.0.0.1:7080)."),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option("--api-key", envvar="ATOLL_API_KEY", help="API key.", show_default=False)
    ] = None,
    ca_file: Annotated[Path | None, typer.Option("--ca-file", help=_CA_FILE_HELP, show_default=False)] = None,
) -> None:
    """Create, inspect and drive sandboxes."""
    top: _Connection = ctx.obj or _Connection(None, None)  # `atoll --url X sandbox ...`
    ctx.obj = _Connection(
        url if url is not None else top.url,
        api_key if api_key is not None else top.api_key,
        str(ca_file) if ca_file is not None else top.ca_file,
    )


@sandbox_app.command("create")
def create(
    ctx: typer.Context,
    template: Annotated[str, typer.Option(help="Template to start from.")] = "base",
    env: Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE environment variable.")] = None,
    metadata: Annotated[list[str] | None, typer.Option("--metadata", help="KEY=VALUE label.")] = None,
    idle_timeout: Annotated[
        float | None, typer.Option("--idle-timeout", help="Seconds idle before memory standby.")
    ] = None,
    disk_after: Annotated[
        float | None, typer.Option("--disk-after", help="Seconds in memory standby before moving to disk.")
    ] = None,
    memory_mb: Annotated[int | None, typer.Option("--memory-mb", help="Memory limit in MiB.")] = None,
    cpus: Annotated[float | None, typer.Option("--cpus", help="CPU limit.")] = None,
    allow_out: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-out", help="Egress allowed to: pypi.org, *.github.com:443, 10.0.0.0/8, * (repeat)."
        ),
    ] = None,
    deny_out: Annotated[
        list[str] | None,
        typer.Option("--deny-out", help="Egress refused to (wins over --allow-out; repeat)."),
    ] = None,
    secret: Annotated[
        list[str] | None,
        typer.Option(
            "--secret", help="ENV=SECRET_NAME: ENV holds a placeholder for the stored secret (repeat)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the sandbox object as JSON.")] = False,
    lifetime: Annotated[
        float | None, typer.Option("--lifetime", help="Lifetime in seconds (timeout_s; default none).")
    ] = None,
    on_timeout: Annotated[
        OnTimeout | None,
        typer.Option("--on-timeout", help="At the lifetime's end: pause (to disk) or delete."),
    ] = None,
    on_worker_lost: Annotated[
        OnWorkerLost | None, typer.Option("--on-worker-lost", help=_ON_WORKER_LOST_HELP)
    ] = None,
    volume: Annotated[
        list[str] | None, typer.Option("--volume", help="NAME:PATH[:ro]: mount a volume (repeat).")
    ] = None,
    drive: Annotated[
        list[str] | None, typer.Option("--drive", help="NAME:PATH[:ro]: mount a drive (repeat).")
    ] = None,
    snapshot: Annotated[
        str | None,
        typer.Option("--snapshot", help="Start from this snapshot (id or name) instead of a template."),
    ] = None,
) -> None:
    """Create a sandbox and print its id once it is running (no network way out unless --allow-out).
    While its template is still being built, shows the build's progress and waits."""
    from atoll.cli import progress as cli_progress

    env_vars = _pairs(env, "--env")
    secrets = _pairs(secret, "--secret")
    labels = _pairs(metadata, "--metadata")
    network = {"allow_out": allow_out or [], "deny_out": deny_out or []} if allow_out or deny_out else None
    with _session(ctx) as client:
        if snapshot is None:
            cli_progress.wait_for_template(client, template)
        sandbox = client.sandboxes.create(
            snapshot=snapshot,
            timeout_s=lifetime,
            on_timeout=on_timeout.value if on_timeout is not None else None,
            on_worker_lost=on_worker_lost.value if on_worker_lost is not None else None,
            template=template,
            env=env_vars,
            metadata=labels,
            idle_timeout_s=idle_timeout,
            disk_after_s=disk_after,
            memory_mb=memory_mb,
            cpus=cpus,
            network=network,
            secrets=secrets,
            volumes=cli_stores.parse_mounts(volume or [], "--volume") or None,
            drives=cli_stores.parse_mounts(drive or [], "--drive") or None,
        )
    if as_json:
        _print_json(sandbox.to_dict())
    else:
        typer.echo(sandbox.id)


def _sandbox_table(sandboxes: "list[Sandbox]") -> "Table":
    table = _table()
    table.add_column("ID", no_wrap=True, min_width=max(len(sb.id) for sb in sandboxes))
    table.add_column("STATE", no_wrap=True)
    table.add_column("TIER", no_wrap=True)
    table.add_column("TEMPLATE")
    table.add_column("CREATED", no_wrap=True)
    table.add_column("METADATA", overflow="fold")
    for sb in sandboxes:
        labels = ",".join(f"{k}={v}" for k, v in sorted(sb.metadata.items()))
        created = (sb.created_at or "-").replace("T", " ")[:19]
        table.add_row(sb.id, sb.state, sb.standby_tier or "-", sb.template or "-", created, labels)
    return table


@sandbox_app.command("list")
def list_(
    ctx: typer.Context,
    state: Annotated[
        str | None,
        typer.Option(help="Only sandboxes in this state, or any of several: running,standby."),
    ] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", help="KEY=VALUE the sandbox must carry.")
    ] = None,
    newest_first: Annotated[bool, typer.Option("--newest-first", help="Newest first.")] = False,
    created_after: Annotated[
        str | None, typer.Option(help="Only those created after this time (RFC 3339).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List sandboxes."""
    labels = _pairs(metadata, "--metadata")
    with _session(ctx) as client:
        sandboxes = client.sandboxes.list(
            state=state,
            metadata=labels,
            order="desc" if newest_first else None,
            created_after=created_after,
        )
    if as_json:
        _print_json([sb.to_dict() for sb in sandboxes])
    elif not sandboxes:
        typer.echo("no sandboxes", err=True)
    else:
        console = _console()
        console.print(_sandbox_table(sandboxes))


@sandbox_app.command("get")
def get(ctx: typer.Context, sandbox_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
    """Print a sandbox as JSON."""
    with _session(ctx) as client:
        sandbox = client.sandboxes.get(sandbox_id)
    _print_json(sandbox.to_dict())


@sandbox_app.command("exec")
def exec_(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    cmd: Annotated[
        list[str],
        typer.Argument(
            metavar="-- CMD...",
            help="The command, after `--`. One argument with spaces runs through the shell.",
        ),
    ],
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="Kill the command after this many seconds.")
    ] = None,
    cwd: Annotated[str | None, typer.Option(help="Working directory inside the sandbox.")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE environment variable.")] = None,
    user: Annotated[str | None, typer.Option(help="User to run as inside the sandbox.")] = None,
    shell: Annotated[
        str | None, typer.Option(help="bash (bash -l -c) or sh (sh -c) for a string command.")
    ] = None,
    no_stdin: Annotated[
        bool, typer.Option("--no-stdin", "-n", help="Do not forward standard input (as if /dev/null).")
    ] = False,
) -> None:
    """Run a command in a sandbox, streaming its output; exit with its exit code.

    Standard input is forwarded when it is not a terminal (`echo hi | atoll sandbox exec ID -- cat`).
    """
    from atoll.cli import forward as cli_forward

    command: str | list[str] = cmd[0] if len(cmd) == 1 and any(c.isspace() for c in cmd[0]) else list(cmd)
    env_vars = _pairs(env, "--env")
    text, head = (None, b"")
    forwarding = cli_forward.stdin_forwarded(no_stdin)
    if forwarding:
        text, head = cli_forward.read_inline(sys.stdin.buffer)
    args: dict[str, Any] = {"timeout_s": timeout, "cwd": cwd, "env": env_vars, "user": user, "shell": shell}
    with _session(ctx) as client:
        sandbox = _sandbox(client, sandbox_id)
        if forwarding and text is None:  # large or binary: streamed through the stdin route
            result = cli_forward.run_streamed(
                sandbox, command, head, sys.stdin.buffer, lambda kind, t: _write(kind)(t), **args
            )
        else:
            result = sandbox.exec(
                command, stdin=text or None, on_stdout=_write("stdout"), on_stderr=_write("stderr"), **args
            )
    if result.timed_out:
        typer.echo(f"error: timed_out: the command did not finish within {timeout}s", err=True)
    raise typer.Exit(exit_status(result.exit_code, result.timed_out))


@sandbox_app.command("pause")
def pause(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    tier: Annotated[
        Tier,
        typer.Option(
            help="memory: fast resume; disk: frees the memory; archive: frees the disk too (object store).",
            case_sensitive=False,
        ),
    ] = Tier.memory,
) -> None:
    """Put a sandbox in standby."""
    with _session(ctx) as client:
        sandbox = _sandbox(client, sandbox_id).pause(tier=tier.value)
    typer.echo(f"{sandbox.id} {sandbox.state} ({sandbox.standby_tier or '-'})")


@sandbox_app.command("network")
def network(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    allow_out: Annotated[
        list[str] | None, typer.Option("--allow-out", help="Egress allowed to (repeat).")
    ] = None,
    deny_out: Annotated[
        list[str] | None, typer.Option("--deny-out", help="Egress refused to (repeat).")
    ] = None,
    show: Annotated[bool, typer.Option("--show", help="Print the policy without changing it.")] = False,
) -> None:
    """Replace a sandbox's egress policy, live (no options: no way out); --show prints it."""
    with _session(ctx) as client:
        sb = _sandbox(client, sandbox_id)
        policy = sb.refresh().network if show else sb.set_network(allow_out or [], deny_out or [])
    _print_json(policy)


@sandbox_app.command("resume")
def resume(ctx: typer.Context, sandbox_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
    """Bring a sandbox back from standby."""
    with _session(ctx) as client:
        sandbox = _sandbox(client, sandbox_id).resume()
    typer.echo(f"{sandbox.id} {sandbox.state}")


@sandbox_app.command("rm")
def rm(ctx: typer.Context, sandbox_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
    """Delete a sandbox."""
    with _session(ctx) as client:
        client.sandboxes.delete(sandbox_id)
    typer.echo(sandbox_id)


@sandbox_app.command("preview")
def preview(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    port: Annotated[
        int, typer.Argument(metavar="PORT", help="A TCP port a program in the sandbox listens on.")
    ],
    public: Annotated[
        bool | None,
        typer.Option("--public/--private", help="Serve the port without a token, or require one again."),
    ] = None,
    expires_in: Annotated[
        float | None, typer.Option("--expires-in", help="Seconds the signed URL stays valid (default 3600).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the preview object as JSON.")] = False,
) -> None:
    """Print the preview URL of a sandbox's port, its access token and a signed URL."""
    with _session(ctx) as client:
        sb = _sandbox(client, sandbox_id)
        if public is not None:
            sb.set_preview(port, public)
        pv = sb.preview(port, expires_in_s=expires_in)
    if as_json:
        _print_json(pv.to_dict())
        return
    typer.echo(f"url:        {pv.url}")
    typer.echo(
        f"public:     {'yes' if pv.public else 'no (send the token as the Atoll-Access-Token header)'}"
    )
    typer.echo(f"token:      {pv.token}")
    typer.echo(f"signed url: {pv.signed_url}")
    typer.echo("headers:    " + " ".join(f"{k}: {v}" for k, v in pv.data.get("headers", {}).items()))


def _secret_value(value: str | None) -> str:
    if value is not None:
        return value
    if not sys.stdin.isatty():
        data = sys.stdin.read()
        return data[:-1] if data.endswith("\n") else data
    return typer.prompt("value", hide_input=True)


@secret_app.command("create")
def secret_create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(metavar="NAME")],
    value_arg: Annotated[
        str | None,
        typer.Argument(
            metavar="[VALUE]", help="The value (else --value, standard input or a hidden prompt)."
        ),
    ] = None,
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            "--hosts",
            help="Host the value may be sent to: api.example.com, *.example.com (repeat, or comma-separated).",
        ),
    ] = None,
    value: Annotated[str | None, typer.Option("--value", help="The value.")] = None,
    replace: Annotated[
        bool, typer.Option("--replace", help="Replace an existing secret of that name.")
    ] = False,
    allow_http: Annotated[
        bool,
        typer.Option(
            "--allow-http",
            help="Also put the value in plain-HTTP requests to its hosts (clear text); default HTTPS only.",
        ),
    ] = False,
) -> None:
    """Store a secret (sealed on the server; never shown again)."""
    hosts = [h.strip() for item in host or [] for h in item.split(",") if h.strip()]
    if not hosts:
        raise typer.BadParameter("give at least one --host the secret may be sent to", param_hint="--host")
    if value_arg is not None and value is not None:
        raise typer.BadParameter("give the value once: as VALUE or as --value", param_hint="--value")
    secret_value = _secret_value(value if value is not None else value_arg)
    with _session(ctx) as client:
        if replace:
            rec = client.secrets.replace(name, secret_value, hosts, allow_http=allow_http)
        else:
            rec = client.secrets.create(name, secret_value, hosts, allow_http=allow_http)
    typer.echo(f"{rec.name} ({', '.join(rec.hosts)}{'; plain HTTP too' if rec.allow_http else ''})")


@secret_app.command("list")
def secret_list(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List secrets: names and hosts (never values)."""
    with _session(ctx) as client:
        items = client.secrets.list()
    if as_json:
        _print_json([s.to_dict() for s in items])
    elif not items:
        typer.echo("no secrets", err=True)
    else:
        table = _table()
        table.add_column("NAME", no_wrap=True)
        table.add_column("HOSTS", overflow="fold")
        for s in items:
            table.add_row(s.name, ", ".join(s.hosts))
        console = _console()
        console.print(table)


@secret_app.command("rm")
def secret_rm(ctx: typer.Context, name: Annotated[str, typer.Argument(metavar="NAME")]) -> None:
    """Delete a secret (bound sandboxes' placeholders are no longer replaced)."""
    with _session(ctx) as client:
        client.secrets.delete(name)
    typer.echo(name)


# ---------------------------------------------------------------- lifetime, settings, figures


@sandbox_app.command("update")
def update(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    lifetime: Annotated[
        float | None, typer.Option("--lifetime", help="New lifetime in seconds from now (timeout_s).")
    ] = None,
    no_lifetime: Annotated[bool, typer.Option("--no-lifetime", help="Remove the lifetime.")] = False,
    on_timeout: Annotated[OnTimeout | None, typer.Option("--on-timeout", help="pause or delete.")] = None,
    on_worker_lost: Annotated[
        OnWorkerLost | None, typer.Option("--on-worker-lost", help=_ON_WORKER_LOST_HELP)
    ] = None,
    idle_timeout: Annotated[
        float | None, typer.Option("--idle-timeout", help="Seconds idle before standby.")
    ] = None,
    disk_after: Annotated[
        float | None, typer.Option("--disk-after", help="Seconds in memory before disk.")
    ] = None,
    metadata: Annotated[
        list[str] | None, typer.Option("--metadata", help="KEY=VALUE label (replaces all labels; repeat).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the sandbox object as JSON.")] = False,
) -> None:
    """Change a sandbox's lifetime and settings live (PATCH), without resuming it."""
    if lifetime is not None and no_lifetime:
        raise typer.BadParameter("give --lifetime or --no-lifetime, not both", param_hint="--no-lifetime")
    extra: dict[str, Any] = {"timeout_s": None} if no_lifetime else {}
    if lifetime is not None:
        extra["timeout_s"] = lifetime
    with _session(ctx) as client:
        sb = _sandbox(client, sandbox_id).update(
            idle_timeout_s=idle_timeout,
            disk_after_s=disk_after,
            on_timeout=on_timeout.value if on_timeout is not None else None,
            on_worker_lost=on_worker_lost.value if on_worker_lost is not None else None,
            metadata=_pairs(metadata, "--metadata"),
            **extra,
        )
    if as_json:
        _print_json(sb.to_dict())
    else:
        typer.echo(f"{sb.id} expires_at={sb.expires_at or '-'} on_timeout={sb.on_timeout}")


@sandbox_app.command("metrics")
def metrics(
    ctx: typer.Context,
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """CPU, memory, disk and process figures of a sandbox now (a standby one is not woken)."""
    with _session(ctx) as client:
        m = _sandbox(client, sandbox_id).metrics()
    if as_json:
        _print_json(m.to_dict())
        return
    table = _table(show_header=False)
    table.add_column("FIGURE", no_wrap=True)
    table.add_column("VALUE", no_wrap=True)
    state = m.state + (f" ({m.get('standby_tier')})" if m.get("standby_tier") else "")
    table.add_row("state", state)
    table.add_row("cpu", f"{m.cpu_percent:.1f}% of one core")
    table.add_row("memory", f"{m.memory_used_mb:.1f} / {m.memory_limit_mb} MB")
    table.add_row("disk", f"{m.disk_used_mb:.1f} / {m.disk_limit_mb} MB")
    table.add_row("processes", "-" if m.processes is None else str(m.processes))
    console = _console()
    console.print(table)
