"""The CLI's start-up stays light: atoll.cli.coercion's shortcut agrees with typer's own coercion
for every parameter of every atoll command, and running a command that talks to a server, or
`atoll --version`, imports neither pydantic, rich, websockets nor importlib.metadata (what made a
command start slowly; the timed figures are in bench/ and docs/benchmarks.md, not here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer
from typer import _click

from atoll.cli import coercion
from atoll.cli import main as cli

SAMPLES = ["abc", "", "a b  c", "é→✓", "--", "0", "sb-0123456789abcdef"]


def _params() -> list[tuple[str, _click.Command, typer.core._TyperParameter]]:
    out = []

    def walk(cmd: _click.Command, path: str) -> None:
        for param in cmd.params:
            if isinstance(param, typer.core._TyperParameter):
                out.append((path, cmd, param))
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(cli.app), "atoll")
    return out


def test_every_command_parameter_is_covered():
    params = _params()
    names = {path for path, _, _ in params}
    assert {"atoll", "atoll sandbox exec", "atoll sandbox create", "atoll template build"} <= names
    kinds = {repr(p.type_descriptor.annotation) for _, _, p in params}
    assert "<class 'str'>" in kinds and "list[str]" in kinds  # the two the shortcut answers


@pytest.mark.parametrize("value", SAMPLES + [tuple(SAMPLES), ["x"], ()])
def test_shortcut_equals_typers_adapter(value):
    checked = 0
    for path, cmd, param in _params():
        desc = param.type_descriptor
        got = coercion.shortcut(desc, value)
        if got is None:
            continue
        expected = coercion._ORIGINAL(desc).coerce(value, param=param, ctx=_click.Context(cmd))
        assert got == expected and type(got) is type(expected), (path, param.name, value)
        checked += 1
    assert checked > 0


def test_other_values_go_through_typers_adapter():
    by_name = {(path, p.name): (cmd, p) for path, cmd, p in _params()}
    cmd, timeout = by_name[("atoll sandbox exec", "timeout")]
    deferred = coercion.build_runtime_param(timeout.type_descriptor)
    assert isinstance(deferred, coercion.DeferredRuntimeParam)
    assert deferred.coerce("2.5", param=timeout, ctx=_click.Context(cmd)) == 2.5
    with pytest.raises(_click.exceptions.BadParameter) as exc:
        deferred.coerce("soon", param=timeout, ctx=_click.Context(cmd))
    with pytest.raises(_click.exceptions.BadParameter) as original:
        coercion._ORIGINAL(timeout.type_descriptor).coerce("soon", param=timeout, ctx=_click.Context(cmd))
    assert exc.value.message == original.value.message
    assert deferred.coerce(None, param=timeout, ctx=_click.Context(cmd)) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["sandbox", "exec", "--timeout", "soon", "sb-x", "--", "true"],
        ["sandbox", "create", "--on-timeout", "later"],
        ["sandbox", "create", "--memory-mb", "lots"],
        ["sandbox", "exec"],
    ],
)
def test_bad_values_are_reported_as_typer_reports_them(argv):
    """The whole error output equals what typer prints without the shortcut installed."""

    def run(setup: str) -> subprocess.CompletedProcess[str]:
        code = f"{setup}from atoll.cli.main import app; app()"
        env = {"COLUMNS": "100", "PATH": "/usr/bin:/bin", "TERM": "dumb"}
        return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env)

    ours = run("")
    typers = run("import atoll.cli.coercion as c; c.install = lambda: None; ")
    assert ours.returncode == typers.returncode == 2
    assert ours.stderr == typers.stderr
    assert "Invalid value" in ours.stderr or "Missing argument" in ours.stderr
    assert ours.stdout == typers.stdout


HEAVY = ("pydantic", "rich", "websockets", "importlib.metadata", "httpx._main", "pygments")
PROBE = """
import json, sys
from atoll.cli.main import app
try:
    app(sys.argv[1:])
except SystemExit:
    pass
heavy = %r
print(json.dumps(sorted(m for m, mod in sys.modules.items() if mod is not None and (m.split(".")[0] in heavy or m in heavy))))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        # a command that talks to a server (loopback port 1: refused at once)
        ["sandbox", "--url", "http://127.0.0.1:1", "exec", "-n", "sb-x", "--", "true"],
        ["sandbox", "--url", "http://127.0.0.1:1", "get", "sb-x"],
    ],
)
def test_commands_do_not_import_heavy_modules(argv):
    out = subprocess.run(
        [sys.executable, "-c", PROBE % (HEAVY,), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"{argv}: {loaded}\n{out.stderr}"
