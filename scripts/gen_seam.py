"""Generate the client methods of the worker protocol's plain verbs from the table in
`atoll.core.seam`: `src/atoll/shared/seam_verbs.py` (the `RemoteVerbs` mixin of the control plane's
controlplane.remote_worker.RemoteWorker and of the edge's edge.seam.GrantedWorker; in `shared` so
that both processes may import it).

Each plain verb of the table becomes one method with the exact signature of
`core.worker_api.WorkerAPI` (read from the Protocol), which builds the path, the query, the body,
calls `self._call` and decodes the answer with `wire.load`. mypy (make lint) then proves the
generated methods satisfy the Protocol. Run after editing the table; `--check` (make lint) exits 1
while the checked-in file is stale.

    .venv/bin/python scripts/gen_seam.py           # regenerate
    .venv/bin/python scripts/gen_seam.py --check   # exit 1 if seam_verbs.py is out of date
"""

from __future__ import annotations

import argparse
import inspect
import re
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import stale_diff

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from atoll.core import seam  # noqa: E402
from atoll.core import worker_api as api  # noqa: E402

OUT = ROOT / "src" / "atoll" / "shared" / "seam_verbs.py"
WAIT = {"call": "CALL_TIMEOUT_S", "step": "STEP_TIMEOUT_S", "none": "None"}
HEADER = '''"""GENERATED FILE - do not edit. The worker protocol's plain verbs as a client calls them.

Written by `scripts/gen_seam.py` from the table in `atoll.core.seam` (edit the table and rerun the
script; `make lint` fails while this file is stale). `RemoteVerbs` is a mixin of the control
plane's controlplane.remote_worker.RemoteWorker (worker token: every verb) and of the edge's
edge.seam.GrantedWorker (a grant: one sandbox's data verbs), which provide `_call` and `name`;
streams and tunnels are written by hand there.
"""

from __future__ import annotations

import base64
import typing
from collections.abc import Sequence

from atoll.core import wire
from atoll.core import worker_api as api

CALL_TIMEOUT_S = 60.0
"""Reads and small changes (inventory, info, listings)."""
STEP_TIMEOUT_S = 900.0
"""Lifecycle steps: create (a first template build), pause, resume, delete, builds, fork."""


def _file(key: str, path: api.FilePath) -> dict[str, str]:
    """A file path as query parameters: `<key>`, or `<key>_b64` for bytes."""
    if isinstance(path, bytes):
        return {f"{key}_b64": base64.b64encode(path).decode("ascii")}
    return {key: path}


class RemoteVerbs:
    name: str

    async def _call(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None,
        effect: str | None,
        **kw: typing.Any,
    ) -> typing.Any:
        raise NotImplementedError
'''


def _seam_type(value: typing.Any) -> bool:
    """A type core.worker_api offers the seam: a class or type alias of its own, or one it takes
    from atoll (lifecycle's Tier and Phase, the guest agent's ExecSpec); not the standard
    library's helpers it merely imports (Sequence, Protocol, dataclass, ...)."""
    if isinstance(value, types.UnionType):  # FilePath, ExecEvent, ...: aliases defined there
        return True
    return isinstance(value, type) and value.__module__.startswith("atoll.")


# Names the generated code spells `api.X`: everything of that kind core.worker_api exports.
_OWN = {n for n, v in vars(api).items() if not n.startswith("_") and _seam_type(v)}


def _annotation(text: str) -> str:
    """A Protocol annotation (a string: the module has `from __future__ import annotations`)
    with worker_api's own names qualified as `api.X`."""
    return re.sub(
        r"\b([A-Za-z_][A-Za-z0-9_]*)\b",
        lambda m: f"api.{m.group(1)}" if m.group(1) in _OWN else m.group(1),
        text,
    )


def _type(tp: typing.Any) -> str:
    """A type of the table as source."""
    if tp is api.FilePath:
        return "api.FilePath"
    if tp is None or tp is type(None):
        return "None"
    if isinstance(tp, types.UnionType):
        return " | ".join(_type(a) for a in typing.get_args(tp))
    origin = typing.get_origin(tp)
    if origin is not None:
        args = typing.get_args(tp)
        parts = ", ".join("..." if a is Ellipsis else _type(a) for a in args)
        return f"{origin.__name__}[{parts}]"
    name = tp.__name__
    return f"api.{name}" if name in _OWN else name


def _signature(verb: seam.Verb) -> str:
    sig = inspect.signature(getattr(api.WorkerAPI, verb.name))
    parts = []
    star = False
    for p in sig.parameters.values():
        if p.name == "self":
            parts.append("self")
            continue
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = f"{p.name}: {_annotation(str(p.annotation))}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {p.default!r}"
        parts.append(text)
    return f"    async def {verb.name}({', '.join(parts)}) -> {_annotation(str(sig.return_annotation))}:"


def _value(arg: seam.Arg) -> str:
    if arg.where == "path":
        return f"{{int({arg.name})}}" if arg.type is int else f"{{{arg.name}}}"
    raise AssertionError(arg)


def _method(verb: seam.Verb) -> str:
    lines = [_signature(verb)]
    path = verb.path
    for a in verb.args:
        if a.where == "path":
            path = path.replace("{" + a.name + "}", _value(a))
    lines.append(f'        url = f"{path}"' if "{" in path else f'        url = "{path}"')
    kw: list[str] = []
    query = [a for a in verb.args if a.where in ("query", "file")]
    if query:
        lines.append("        params: dict[str, str] = {}")
        for a in query:
            if a.where == "file":
                lines.append(f'        params.update(_file("{a.wire_name}", {a.name}))')
            elif a.type is bool:
                lines.append(f'        params["{a.wire_name}"] = "1" if {a.name} else "0"')
            else:
                lines.append(f'        params["{a.wire_name}"] = str(int({a.name}))')
        kw.append("params=params")
    body = [a for a in verb.args if a.where == "body"]
    fields = [a for a in verb.args if a.where == "field"]
    if body:
        (a,) = body
        kw.append(f"json=wire.dump({a.name}, {_type(a.type)})")
    elif fields:
        items = ", ".join(f'"{a.wire_name}": wire.dump({a.name}, {_type(a.type)})' for a in fields)
        kw.append(f"json={{{items}}}")
    raw = [a for a in verb.args if a.where == "raw"]
    if raw:
        kw.append(f"content={raw[0].name}")
        kw.append('headers={"Content-Type": "application/octet-stream"}')
    kw.append(f"timeout={WAIT[verb.wait]}")
    kw.append(f"effect={verb.effect!r}")
    call = f'await self._call("{verb.method}", url, {", ".join(kw)})'
    what = f"{verb.name.replace('_', ' ')} answer"
    if verb.answer is None:
        lines.append(f"        {call}")
    elif verb.answer_key:
        lines.append(f"        data = {call}")
        lines.append(f'        answer = wire.load(dict[str, {_type(verb.answer)}], data, "{what}")')
        lines.append(f'        return answer["{verb.answer_key}"]')
    else:
        lines.append(f"        data = {call}")
        lines.append(f'        return wire.load({_type(verb.answer)}, data, "{what}")')
    return "\n".join(lines)


def _ruff() -> str:
    sibling = Path(sys.executable).with_name("ruff")
    found = str(sibling) if sibling.exists() else shutil.which("ruff")
    if not found:
        sys.exit("gen_seam: ruff is needed to format the generated file")
    return found


def generate() -> str:
    text = HEADER + "\n" + "\n\n".join(_method(v) for v in seam.VERBS) + "\n"
    formatted = subprocess.run(
        [_ruff(), "format", "--stdin-filename", str(OUT), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if formatted.returncode != 0:
        sys.exit(f"gen_seam: ruff format failed:\n{formatted.stderr}")
    return formatted.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if seam_verbs.py is out of date")
    args = parser.parse_args(argv)
    expected = generate()
    current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
    rel = OUT.relative_to(ROOT)
    if current == expected:
        print(f"{rel} is up to date")
        return 0
    if args.check:
        stale_diff.print_diff(str(rel), current, expected, max_lines=200)
        stale_diff.print_stale(str(rel), "gen_seam.py")
        return 1
    OUT.write_text(expected, encoding="utf-8")
    print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
