"""`atoll tenant create|list|get|update|rm` and `atoll key create|list|rm`: tenants, their quotas
and API keys (an admin key is needed). A new key is printed once and never shown again.
Registered on the `atoll` app by atoll.cli.main.
"""

# No `from __future__ import annotations`: typer reads the commands' annotations at every start.
import json
import typing
from enum import StrEnum
from typing import Annotated

import typer

from atoll.cli.listing import show_list

Session = typing.Callable[[typer.Context], typing.ContextManager[typing.Any]]
_session: Session

QUOTA_OPTIONS = (
    ("max_running", "--max-running", "Running sandboxes at once."),
    ("max_memory_mb", "--max-memory-mb", "Memory of its running sandboxes, in MB."),
    ("max_standby_gb", "--max-standby-gb", "Standby storage (disk + archive tiers), in GB."),
    ("max_volume_gb", "--max-volume-gb", "Volume and drive storage, in GB."),
    ("creates_per_minute", "--creates-per-minute", "Sandbox creates per minute."),
    ("max_pool_slots", "--max-pool-slots", "Warm pool slots of its templates."),
    ("build_minutes_per_day", "--build-minutes-per-day", "Template build minutes per day."),
    ("max_snapshots", "--max-snapshots", "Named snapshots kept at once."),
    ("max_snapshot_gb", "--max-snapshot-gb", "Named snapshots' storage, in GB."),
)


def _quota_option(i: int) -> typing.Any:
    _, flag, text = QUOTA_OPTIONS[i]
    return Annotated[float | None, typer.Option(flag, help=text)]


# the quota options of `tenant create` and `tenant update`
_QMaxRunning = _quota_option(0)
_QMaxMemoryMb = _quota_option(1)
_QMaxStandbyGb = _quota_option(2)
_QMaxVolumeGb = _quota_option(3)
_QCreatesPerMinute = _quota_option(4)
_QMaxPoolSlots = _quota_option(5)
_QBuildMinutesPerDay = _quota_option(6)
_QMaxSnapshots = _quota_option(7)
_QMaxSnapshotGb = _quota_option(8)


def _numbers(values: dict[str, typing.Any]) -> dict[str, float | None]:
    """The quota options' values in a command's `locals()`, whole numbers as ints."""
    return {k: _number(values[k]) for k, _, _ in QUOTA_OPTIONS}


class Scope(StrEnum):
    admin = "admin"
    worker = "worker"


def _quotas(values: dict[str, float | None], clear: list[str] | None) -> dict[str, float | None] | None:
    known = {k for k, _, _ in QUOTA_OPTIONS}
    out: dict[str, float | None] = {k: v for k, v in values.items() if v is not None}
    for name in clear or []:
        key = name.replace("-", "_")
        if key not in known:
            raise typer.BadParameter(
                f"unknown quota {name!r}; known: {', '.join(sorted(known))}", param_hint="--unset"
            )
        out[key] = None
    return out or None


def _number(v: float | None) -> float | int | None:
    return int(v) if v is not None and float(v).is_integer() else v


def _tenant_row(t: dict) -> str:
    quotas = " ".join(f"{k}={v}" for k, v in sorted((t.get("quotas") or {}).items())) or "-"
    return f"{t['id']:20} {t['name']:24} {quotas}"


def _show_tenants(items: list[dict], as_json: bool) -> None:
    show_list(items, as_json, empty="no tenants", header=f"{'ID':20} {'NAME':24} QUOTAS", row=_tenant_row)


def _show_key(k: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(k, indent=2))
        return
    typer.echo(k["key"])
    where = f" for tenant {k['tenant_id']}" if k.get("tenant_id") else ""
    expiry = f", expires {k['expires_at']}" if k.get("expires_at") else ""
    typer.echo(
        f"{k['id']}: a {k['scope']} key{where}{expiry}. It is shown only this once: keep it now.", err=True
    )


def _tenant_commands() -> typer.Typer:
    sub = typer.Typer(
        help="Tenants: whose sandboxes, templates, secrets and volumes are whose, and their quotas.",
        no_args_is_help=True,
    )

    @sub.command("create")
    def create(
        ctx: typer.Context,
        name: Annotated[str, typer.Argument(metavar="NAME")],
        max_running: _QMaxRunning = None,
        max_memory_mb: _QMaxMemoryMb = None,
        max_standby_gb: _QMaxStandbyGb = None,
        max_volume_gb: _QMaxVolumeGb = None,
        creates_per_minute: _QCreatesPerMinute = None,
        max_pool_slots: _QMaxPoolSlots = None,
        build_minutes_per_day: _QBuildMinutesPerDay = None,
        max_snapshots: _QMaxSnapshots = None,
        max_snapshot_gb: _QMaxSnapshotGb = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON.")] = False,
    ) -> None:
        """Make a tenant (quotas left out are unlimited); prints its id."""
        quotas = _quotas(
            _numbers(locals()),
            None,
        )
        with _session(ctx) as client:
            t = client.tenants.create(name, quotas=quotas)
        _show_tenants([t], True) if as_json else typer.echo(t["id"])

    @sub.command("list")
    def list_(
        ctx: typer.Context,
        as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
    ) -> None:
        """List tenants with their quotas (every page)."""
        with _session(ctx) as client:
            items = client.tenants.list()
        _show_tenants(items, as_json)

    @sub.command("get")
    def get(ctx: typer.Context, tenant_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
        """Show one as JSON."""
        with _session(ctx) as client:
            typer.echo(json.dumps(client.tenants.get(tenant_id), indent=2))

    @sub.command("update")
    def update(
        ctx: typer.Context,
        tenant_id: Annotated[str, typer.Argument(metavar="ID")],
        name: Annotated[str | None, typer.Option("--name", help="A new name.")] = None,
        max_running: _QMaxRunning = None,
        max_memory_mb: _QMaxMemoryMb = None,
        max_standby_gb: _QMaxStandbyGb = None,
        max_volume_gb: _QMaxVolumeGb = None,
        creates_per_minute: _QCreatesPerMinute = None,
        max_pool_slots: _QMaxPoolSlots = None,
        build_minutes_per_day: _QBuildMinutesPerDay = None,
        max_snapshots: _QMaxSnapshots = None,
        max_snapshot_gb: _QMaxSnapshotGb = None,
        unset: Annotated[
            list[str] | None,
            typer.Option("--unset", help="Remove a quota (unlimited), e.g. max-running (repeat)."),
        ] = None,
    ) -> None:
        """Rename a tenant or change its quotas (lowering one below the current use refuses new
        admissions; nothing running is stopped)."""
        quotas = _quotas(
            _numbers(locals()),
            unset,
        )
        if name is None and quotas is None:
            raise typer.BadParameter("nothing to change: give --name, a quota option or --unset")
        with _session(ctx) as client:
            t = client.tenants.update(tenant_id, name=name, quotas=quotas)
        _show_tenants([t], False)

    @sub.command("rm")
    def rm(ctx: typer.Context, tenant_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
        """Delete an empty tenant (one that owns anything is refused, with what it owns)."""
        with _session(ctx) as client:
            client.tenants.delete(tenant_id)
        typer.echo(tenant_id)

    return sub


def _key_commands() -> typer.Typer:
    sub = typer.Typer(
        help="API keys: tenant, admin and worker keys (shown once), listed by id, revoked.",
        no_args_is_help=True,
    )

    @sub.command("create")
    def create(
        ctx: typer.Context,
        tenant: Annotated[
            str | None, typer.Option("--tenant", help="A tenant key for this tenant id (else --scope).")
        ] = None,
        scope: Annotated[
            Scope | None, typer.Option("--scope", help="admin or worker (without --tenant; default admin).")
        ] = None,
        expires: Annotated[
            str | None, typer.Option("--expires", help="Expiry, ISO 8601 (e.g. 2027-01-31T00:00:00Z).")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print it as JSON (with the key).")] = False,
    ) -> None:
        """Make a key and print it (only this once)."""
        if tenant is not None and scope is not None:
            raise typer.BadParameter(
                "a key is for a --tenant or has a --scope, not both", param_hint="--scope"
            )
        with _session(ctx) as client:
            if tenant is not None:
                k = client.tenants.create_key(tenant, expires_at=expires)
            else:
                k = client.keys.create(scope=(scope or Scope.admin).value, expires_at=expires)
        _show_key(k, as_json)

    @sub.command("list")
    def list_(
        ctx: typer.Context,
        tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's keys.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
    ) -> None:
        """List keys by id (never the keys themselves)."""
        with _session(ctx) as client:
            items = client.keys.list(tenant_id=tenant)
        show_list(
            items,
            as_json,
            empty="no keys",
            header=f"{'ID':20} {'SCOPE':7} {'TENANT':20} {'EXPIRES':26} REVOKED",
            row=lambda k: (
                f"{k['id']:20} {k['scope']:7} {k.get('tenant_id') or '-':20} "
                f"{k.get('expires_at') or '-':26} {k.get('revoked_at') or '-'}"
            ),
        )

    @sub.command("rm")
    def rm(ctx: typer.Context, key_id: Annotated[str, typer.Argument(metavar="KEY_ID")]) -> None:
        """Revoke a key: its next request is refused (401)."""
        with _session(ctx) as client:
            client.keys.revoke(key_id)
        typer.echo(key_id)

    return sub


def register(app: typer.Typer, session: Session) -> None:
    global _session
    _session = session
    app.add_typer(_tenant_commands(), name="tenant")
    app.add_typer(_key_commands(), name="key")
