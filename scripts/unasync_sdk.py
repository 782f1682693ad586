"""Generate the sync SDK `src/atoll/_client/_sync/` from the async one, `_async/`, file by file.

Run by hand (or by `make`) after editing a file of `_async/`; `--check` is run by the unit tests
and CI and exits 1 when a checked-in file of `_sync/` is stale (or one is missing or left over).

How: the `unasync` library rewrites the tokens of each `_async/*.py` (drops `async`/`await`, maps
`__aenter__`, `AsyncIterator`, `asynccontextmanager`, ... and the name pairs in REPLACEMENTS
below, e.g. `AsyncSandbox` -> `Sandbox`, `aiter_bytes` -> `iter_bytes`); this script then
replaces each module docstring with a "generated" header, drops `# noqa: ASYNC...` comments
(async-only lint rules) and formats the result with `ruff format`, so the output is stable
and lint-clean.

    .venv/bin/python scripts/unasync_sdk.py           # regenerate
    .venv/bin/python scripts/unasync_sdk.py --check   # exit 1 if _sync/ is out of date
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import stale_diff
import unasync

ROOT = Path(__file__).resolve().parents[1]
ASYNC_DIR = ROOT / "src" / "atoll" / "_client" / "_async"
SYNC_DIR = ROOT / "src" / "atoll" / "_client" / "_sync"

# Names unasync does not map by itself (its default turns AsyncX into SyncX).
REPLACEMENTS = {
    "AsyncClient": "Client",  # ours, and httpx.AsyncClient -> httpx.Client
    "AsyncBaseTransport": "BaseTransport",
    "AsyncSandboxes": "Sandboxes",
    "AsyncTemplates": "Templates",
    "AsyncWorkers": "Workers",
    "AsyncSecrets": "Secrets",
    "AsyncSnapshots": "Snapshots",
    "AsyncTenants": "Tenants",
    "AsyncKeys": "Keys",
    "AsyncStore": "Store",
    "AsyncVolumes": "Volumes",
    "AsyncVolume": "Volume",
    "AsyncDrives": "Drives",
    "AsyncDriveFiles": "DriveFiles",
    "AsyncDrive": "Drive",
    "AsyncSandbox": "Sandbox",
    "AsyncProcess": "Process",
    "AsyncProcesses": "Processes",
    "AsyncFiles": "Files",
    "AsyncWatch": "Watch",
    "AsyncTerminal": "Terminal",
    "asyncio": "sync",  # websockets.asyncio.client -> websockets.sync.client
    "arecv": "recv",
    "AsyncUploadData": "UploadData",
    "aclose": "close",
    "aread": "read",
    "aiter_bytes": "iter_bytes",
    "aiter_lines": "iter_lines",
    "alines": "lines",  # atoll.shared.ndjson
    "acall_callback": "call_callback",
    "arequest_body": "request_body",
    "asleep": "sleep",
    "aretrying": "retrying",
    "AbstractAsyncContextManager": "AbstractContextManager",
    "ws_ssl": "ws_ssl_sync",  # the sync terminal's TLS context (capped at 1.2: _base.ws_ssl_sync)
}

HEADER = '''"""GENERATED FILE - do not edit. {summary}

Generated from `_async/{name}` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach the sync client as `atoll.Client`; the CLI
(`atoll.cli`) uses it too.
"""'''
_ASYNC_NAME = re.compile(r"\bAsync([A-Z]\w*)")

_DOCSTRING = re.compile(r'\A"""(.*?)"""', re.DOTALL)
# Suppressions of the async-only lint rules (ASYNC1xx...) mean nothing in the sync file.
_ASYNC_NOQA = re.compile(r"  # noqa: ASYNC\d+[^\n]*")


def _ruff() -> str:
    sibling = Path(sys.executable).with_name("ruff")
    found = str(sibling) if sibling.exists() else shutil.which("ruff")
    if not found:
        sys.exit("unasync_sdk: ruff is needed to format the generated file (pip install ruff)")
    return found


def generate_one(src_file: Path) -> str:
    """The text the sync twin of `_async/<name>.py` should have."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "_async" / src_file.name
        src.parent.mkdir()
        shutil.copyfile(src_file, src)
        rule = unasync.Rule(fromdir="/_async/", todir="/_sync/", additional_replacements=REPLACEMENTS)
        unasync.unasync_files([str(src)], rules=[rule])
        text = (Path(tmp) / "_sync" / src_file.name).read_text(encoding="utf-8")
    doc = _DOCSTRING.search(src_file.read_text(encoding="utf-8"))
    if doc is None:
        sys.exit(f"unasync_sdk: {src_file} must start with a module docstring")
    first = doc.group(1).split("\n")[0].replace("asynchronous", "synchronous")
    summary = _ASYNC_NAME.sub(lambda m: REPLACEMENTS.get(m.group(0), m.group(1)), first)
    text = _DOCSTRING.sub(lambda _m: HEADER.format(summary=summary, name=src_file.name), text, count=1)
    text = _ASYNC_NOQA.sub("", text)
    formatted = subprocess.run(
        [_ruff(), "format", "--stdin-filename", str(SYNC_DIR / src_file.name), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if formatted.returncode != 0:
        sys.exit(f"unasync_sdk: ruff format failed:\n{formatted.stderr}")
    return formatted.stdout


def generate() -> dict[str, str]:
    """File name -> the text each file of `_sync/` should have."""
    return {f.name: generate_one(f) for f in sorted(ASYNC_DIR.glob("*.py"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if _sync/ is out of date")
    args = parser.parse_args(argv)
    expected = generate()
    present = {f.name for f in SYNC_DIR.glob("*.py")} if SYNC_DIR.exists() else set()
    stale = [
        n
        for n, text in expected.items()
        if not (SYNC_DIR / n).exists() or (SYNC_DIR / n).read_text(encoding="utf-8") != text
    ]
    extra = sorted(present - set(expected))
    rel = SYNC_DIR.relative_to(ROOT)
    if args.check:
        if not stale and not extra:
            print(f"{rel}/ is up to date")
            return 0
        for name in stale:
            current = (SYNC_DIR / name).read_text(encoding="utf-8") if (SYNC_DIR / name).exists() else ""
            stale_diff.print_diff(f"{rel}/{name}", current, expected[name], max_lines=100)
        for name in extra:
            print(f"{rel}/{name} has no source in _async/")
        stale_diff.print_stale(f"{rel}/", "unasync_sdk.py")
        return 1
    SYNC_DIR.mkdir(exist_ok=True)
    for name in stale:
        (SYNC_DIR / name).write_text(expected[name], encoding="utf-8")
        print(f"wrote {rel}/{name}")
    for name in extra:
        (SYNC_DIR / name).unlink()
        print(f"removed {rel}/{name}")
    if not stale and not extra:
        print(f"{rel}/ is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
