"""Generate the sync SDK client `src/atoll/_client/_sync.py` from the async one, `_async.py`.

Run by hand (or by `make`) after editing `_async.py`; `--check` is run by the unit tests and
CI and exits 1 when the checked-in `_sync.py` is stale.

How: the `unasync` library rewrites the tokens of `_async.py` (drops `async`/`await`, maps
`__aenter__`, `AsyncIterator`, `asynccontextmanager`, ... and the name pairs in REPLACEMENTS
below, e.g. `AsyncSandbox` -> `Sandbox`, `aiter_bytes` -> `iter_bytes`); this script then
replaces the module docstring with a "generated" header, drops `# noqa: ASYNC...` comments
(async-only lint rules) and formats the result with `ruff format`, so the output is stable
and lint-clean.

    .venv/bin/python scripts/unasync_sdk.py           # regenerate
    .venv/bin/python scripts/unasync_sdk.py --check   # exit 1 if _sync.py is out of date
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parents[1]
ASYNC_FILE = ROOT / "src" / "atoll" / "_client" / "_async.py"
SYNC_FILE = ROOT / "src" / "atoll" / "_client" / "_sync.py"

# Names unasync does not map by itself (its default turns AsyncX into SyncX).
REPLACEMENTS = {
    "AsyncClient": "Client",  # ours, and httpx.AsyncClient -> httpx.Client
    "AsyncBaseTransport": "BaseTransport",
    "AsyncSandboxes": "Sandboxes",
    "AsyncTemplates": "Templates",
    "AsyncWorkers": "Workers",
    "AsyncSecrets": "Secrets",
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
    "acall_callback": "call_callback",
    "arequest_body": "request_body",
    "asleep": "sleep",
    "aretrying": "retrying",
}

HEADER = '''"""GENERATED FILE - do not edit. The synchronous atoll client: `Client`, `Sandbox`, its files and processes.

Generated from `_async.py` by `scripts/unasync_sdk.py` (edit that file and rerun the script;
`--check` fails while this file is stale). Users reach it as `atoll.Client`; the CLI
(`atoll.cli.main`) uses it too.
"""'''

_DOCSTRING = re.compile(r'\A"""(.*?)"""', re.DOTALL)
# Suppressions of the async-only lint rules (ASYNC1xx...) mean nothing in the sync file.
_ASYNC_NOQA = re.compile(r"  # noqa: ASYNC\d+[^\n]*")


def _ruff() -> str:
    sibling = Path(sys.executable).with_name("ruff")
    found = str(sibling) if sibling.exists() else shutil.which("ruff")
    if not found:
        sys.exit("unasync_sdk: ruff is needed to format the generated file (pip install ruff)")
    return found


def generate() -> str:
    """The text `_sync.py` should have."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "_async" / "client.py"
        src.parent.mkdir()
        shutil.copyfile(ASYNC_FILE, src)
        rule = unasync.Rule(fromdir="/_async/", todir="/_sync/", additional_replacements=REPLACEMENTS)
        unasync.unasync_files([str(src)], rules=[rule])
        text = (Path(tmp) / "_sync" / "client.py").read_text(encoding="utf-8")
    text, count = _DOCSTRING.subn(HEADER, text, count=1)
    if count != 1:
        sys.exit(f"unasync_sdk: {ASYNC_FILE} must start with a module docstring")
    text = _ASYNC_NOQA.sub("", text)
    formatted = subprocess.run(
        [_ruff(), "format", "--stdin-filename", str(SYNC_FILE), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if formatted.returncode != 0:
        sys.exit(f"unasync_sdk: ruff format failed:\n{formatted.stderr}")
    return formatted.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if _sync.py is out of date")
    args = parser.parse_args(argv)
    expected = generate()
    current = SYNC_FILE.read_text(encoding="utf-8") if SYNC_FILE.exists() else ""
    rel = SYNC_FILE.relative_to(ROOT)
    if args.check:
        if current == expected:
            print(f"{rel} is up to date")
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True),
            expected.splitlines(keepends=True),
            f"{rel} (checked in)",
            f"{rel} (generated)",
        )
        sys.stdout.writelines(list(diff)[:200])
        print(f"\n{rel} is stale: run `python scripts/unasync_sdk.py`", file=sys.stderr)
        return 1
    if current == expected:
        print(f"{rel} is up to date")
    else:
        SYNC_FILE.write_text(expected, encoding="utf-8")
        print(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
