"""Generate the Python of E2B's envd services next to their .proto files, `src/atoll/e2b/proto/`:
`*_pb.py` (protobuf-py messages) and `*_connect.py` (connectrpc's async ASGI application and client
for each service), with `protoc` from grpcio-tools and the two pinned plugins (the dev extra).

Run by hand after editing a .proto; `--check` (run by `make lint`, so by CI) regenerates into a
temporary directory and exits 1 when a checked-in file differs, is missing or is left over.

    .venv/bin/python scripts/gen_e2b_stubs.py           # regenerate
    .venv/bin/python scripts/gen_e2b_stubs.py --check   # exit 1 if a stub is out of date
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import stale_diff

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "src" / "atoll" / "e2b" / "proto"
PROTOS = ["process/process.proto", "filesystem/filesystem.proto"]
BIN = Path(sys.executable).parent


def generate(out: Path) -> None:
    """The stubs of PROTOS under `out` (its package directories with their `__init__.py`)."""
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--plugin=protoc-gen-py={BIN / 'protoc-gen-py'}",
        f"--py_out={out}",
        f"--plugin=protoc-gen-connectrpc={BIN / 'protoc-gen-connectrpc'}",
        f"--connectrpc_out=io=async:{out}",
        *PROTOS,
    ]
    subprocess.run(cmd, check=True)
    (out / "__init__.py").unlink(missing_ok=True)  # the package's own __init__ is hand-written


def _generated(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*.py"))
        if p.name != "__init__.py" or p.parent != root
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a checked-in stub is stale")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generate(out)
        want = _generated(out)
        if args.check:
            have = _generated(PROTO_DIR)
            stale = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
            for rel in stale:
                stale_diff.print_diff(rel, have.get(rel, ""), want.get(rel, ""), 40)
            if stale:
                stale_diff.print_stale("src/atoll/e2b/proto/ (" + ", ".join(stale) + ")", "gen_e2b_stubs.py")
                return 1
            print("src/atoll/e2b/proto/ is up to date")
            return 0
        for rel, text in want.items():
            (PROTO_DIR / rel).write_text(text)
            print(f"wrote {PROTO_DIR.relative_to(ROOT) / rel}")
        for rel in _generated(PROTO_DIR).keys() - want.keys():
            (PROTO_DIR / rel).unlink()
            print(f"removed {PROTO_DIR.relative_to(ROOT) / rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
