"""Pack the guest agent (the `atoll.guest.agent` package) into the one file a sandbox runs as PID 1.

`Worker.start()` calls `build()` at every start; it writes two zipapps into `$ATOLL_HOME/agent`
(bind-mounted read-only at /opt/atoll in every sandbox):

* `agent.pyz` (COMPILED): bytecode only, compiled by this interpreter. A template whose python3 has
  this interpreter's version runs it, so no sandbox compiles the agent at boot (~20 ms in gVisor).
* `agent-source.pyz` (SOURCE): the .py files, for a template whose python3 is another version.

Inside both the package is named `agent`, and the archive's top-level `__main__` calls its `main()`:
`python3 -I -S -u /opt/atoll/agent.pyz --port 49999` (see `bundle.py`). Each archive is written to
a temp file and renamed over the old one. Its bytes depend only on the sources and, for the
bytecode, this interpreter (hash-based .pyc files, fixed names, dates and order), because the
template-image key hashes them (`Worker._compute_template_key`). Entries are stored uncompressed:
loading them needs no zlib and no inflating inside gVisor. Tests build and run the same archives.
"""

from __future__ import annotations

import os
import py_compile
import tempfile
import zipfile

SOURCE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "guest", "agent")
COMPILED = "agent.pyz"
SOURCE = "agent-source.pyz"
PACKAGE = "agent"  # the package's name inside the archives
_MAIN = f"from {PACKAGE}.__main__ import main\n\nmain()\n"
_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: the bytes do not depend on file times


def build(dest_dir: str, *, dir_in_sandbox: str = "/opt/atoll") -> None:
    """Write COMPILED and SOURCE into `dest_dir`. The .pyc files name their source as it would be
    inside the sandbox (`<dir_in_sandbox>/agent.pyz/agent/<module>.py`) for tracebacks."""
    sources = {f"{PACKAGE}/{name}": os.path.join(SOURCE_DIR, name) for name in _module_names()}
    source_entries = {"__main__.py": _MAIN.encode()}
    for arcname, path in sources.items():
        with open(path, "rb") as f:
            source_entries[arcname] = f.read()
    compiled_entries: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-agent-") as tmp:
        main_path = os.path.join(tmp, "__main__.py")
        with open(main_path, "wb") as f:
            f.write(source_entries["__main__.py"])
        for arcname, path in {"__main__.py": main_path, **sources}.items():
            cfile = os.path.join(tmp, "out.pyc")
            py_compile.compile(
                path,
                cfile=cfile,
                dfile=f"{dir_in_sandbox}/{COMPILED}/{arcname}",
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
            with open(cfile, "rb") as f:
                compiled_entries[arcname + "c"] = f.read()
    _write_zip(os.path.join(dest_dir, COMPILED), compiled_entries)
    _write_zip(os.path.join(dest_dir, SOURCE), source_entries)


def _module_names() -> list[str]:
    return sorted(n for n in os.listdir(SOURCE_DIR) if n.endswith(".py"))


def _write_zip(path: str, entries: dict[str, bytes]) -> None:
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
        for arcname in sorted(entries):
            info = zipfile.ZipInfo(arcname, date_time=_DATE)
            info.external_attr = 0o644 << 16
            z.writestr(info, entries[arcname])
    os.replace(tmp, path)
