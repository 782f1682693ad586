"""Pack the guest agent (the `atoll.guest.agent` package) into the one file a sandbox runs as PID 1.

`Worker.start()` calls `build()` at every start; it writes three files into `$ATOLL_HOME/agent`
(bind-mounted read-only at /opt/atoll in every sandbox):

* `agent.pyc` (COMPILED): one bytecode file, compiled by this interpreter, for templates whose
  python3 has this interpreter's version. It holds a ~20-line importer and, after it, every module
  of the package as a marshalled code object, which the importer reads once and serves from
  memory: `python3 -I -S -u /opt/atoll/agent.pyc` reads one file and compiles nothing. (A zipapp of .pyc files cost ~45 ms
  more per cold boot inside gVisor: runpy's extra imports and one archive read per module.)
* `agent-source.pyz` (SOURCE): a zipapp of the .py files, for a template whose python3 is another
  version; its top-level `__main__` calls the package's `main()`.
* `interpreter.py` (INTERPRETER): the code interpreter service of `code-interpreter-v1` sandboxes.
* `atoll-init` (INIT): the PID 1 of the sandbox's user processes (`atoll/guest/init/atoll-init.c`),
  compiled with the host's gcc, linked statically so that it runs on any template's C library
  (or none). Compiled again only when its source or the compiler changed (`atoll-init.key`).

Each file is written to a temp file and renamed over the old one, with fixed names, dates and
order (hash-based .pyc). What a sandbox runs is named by `digest`: the sources, the packing and
this interpreter's bytecode version — not the bytes of the .pyc, which may differ between
processes (marshal marks the objects it finds referenced more than once, and that depends on the
process's state). The runtime key of every snapshot includes it (worker.host.snapshots.RuntimeKey):
a changed agent makes the worker snapshot its templates again. Tests build and run the same files.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import marshal
import os
import py_compile
import shutil
import subprocess
import tempfile
import zipfile

from atoll.core import errors

SOURCE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "guest", "agent"
)
COMPILED = "agent.pyc"
SOURCE = "agent-source.pyz"
INIT = "atoll-init"
INTERPRETER = "interpreter.py"
"""The code interpreter service (atoll.guest.interpreter), copied as is: a `code-interpreter-v1`
sandbox runs it with its own python3 (`/opt/atoll/interpreter.py`); nothing else reads it, so it
is not part of `digest`."""
INTERPRETER_SOURCE = os.path.join(os.path.dirname(SOURCE_DIR), "interpreter.py")
INIT_SOURCE = os.path.join(os.path.dirname(SOURCE_DIR), "init", "atoll-init.c")
INIT_CFLAGS = ("-O2", "-static", "-s", "-Wall", "-Wextra", "-Werror")
PACKAGE = "agent"  # the package's name inside the archives
_MAIN = f"from {PACKAGE}.__main__ import main\n\nmain()\n"
_DATE = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: the bytes do not depend on file times


# The importer at the top of COMPILED. The file goes on after its code with a marshalled
# {module name: (is_package, code)} and that table's size (8 bytes, little-endian) at the very end:
# read once at start, and not kept as a constant of the running code (~0.4 MB in every idle sandbox,
# and in every snapshot). A .pyc run as a script holds one code object; what follows it is not read.
_BOOT = """\
import marshal, sys

with open(__file__, "rb") as _f:
    _f.seek(-8, 2)
    _size = int.from_bytes(_f.read(8), "little")
    _f.seek(-8 - _size, 2)
    _MODULES = marshal.loads(_f.read(_size))
del _f, _size
_bootstrap = sys.modules["_frozen_importlib"]


class _Loader:
    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        exec(_MODULES[module.__name__][1], module.__dict__)


class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        entry = _MODULES.get(name)
        return None if entry is None else _bootstrap.ModuleSpec(name, _Loader, is_package=entry[0])


sys.meta_path.insert(0, _Finder)
from PACKAGE.__main__ import main

main()
"""


def build(dest_dir: str, *, dir_in_sandbox: str = "/opt/atoll") -> None:
    """Write COMPILED, SOURCE and INIT into `dest_dir`. Code objects name their source as it is in
    the package (`<dir_in_sandbox>/agent/<module>.py`) for tracebacks."""
    build_init(dest_dir)
    names = _module_names()
    source_entries = {"__main__.py": _MAIN.encode()}
    modules: dict[str, tuple[bool, object]] = {}
    for name in names:
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            src = f.read()
        source_entries[f"{PACKAGE}/{name}"] = src
        mod = PACKAGE if name == "__init__.py" else f"{PACKAGE}.{name[:-3]}"
        code = compile(src, f"{dir_in_sandbox}/{PACKAGE}/{name}", "exec", dont_inherit=True)
        modules[mod] = (name == "__init__.py", code)
    blob = marshal.dumps(dict(sorted(modules.items())))
    boot = _BOOT.replace("PACKAGE", PACKAGE)
    with tempfile.TemporaryDirectory(prefix="atoll-agent-") as tmp:
        boot_path = os.path.join(tmp, "boot.py")
        with open(boot_path, "w") as f:
            f.write(boot)
        tmp_pyc = os.path.join(dest_dir, COMPILED + ".tmp")
        py_compile.compile(
            boot_path,
            cfile=tmp_pyc,
            dfile=f"{dir_in_sandbox}/{COMPILED}",
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        with open(tmp_pyc, "ab") as f:
            f.write(blob)
            f.write(len(blob).to_bytes(8, "little"))
        os.replace(tmp_pyc, os.path.join(dest_dir, COMPILED))
    _write_zip(os.path.join(dest_dir, SOURCE), source_entries)
    shutil.copyfile(INTERPRETER_SOURCE, os.path.join(dest_dir, INTERPRETER + ".tmp"))
    os.replace(os.path.join(dest_dir, INTERPRETER + ".tmp"), os.path.join(dest_dir, INTERPRETER))


def build_init(dest_dir: str) -> str:
    """Compile INIT into `dest_dir` unless the one there was made from the same source by the same
    compiler; returns its path. The file is replaced by a rename: a running init keeps its own."""
    out = os.path.join(dest_dir, INIT)
    key = init_key()
    key_path = out + ".key"
    try:
        with open(key_path) as f:
            if f.read() == key and os.access(out, os.X_OK):
                return out
    except OSError:
        pass
    tmp = out + ".tmp"
    proc = subprocess.run(
        [_compiler(), *INIT_CFLAGS, "-o", tmp, INIT_SOURCE],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise errors.RuntimeFailure(
            "cannot compile the guest's atoll-init with gcc (it needs libc6-dev for a static link; "
            "scripts/install-deps.sh installs it)",
            detail=proc.stderr[-2000:],
        )
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    with open(key_path + ".tmp", "w") as f:
        f.write(key)
    os.replace(key_path + ".tmp", key_path)
    return out


def _compiler() -> str:
    cc = shutil.which("gcc")
    if cc is None:
        raise errors.RuntimeFailure(
            "the guest's atoll-init is compiled on the host: install gcc and libc6-dev "
            "(scripts/install-deps.sh, or `apt-get install gcc libc6-dev`)"
        )
    return cc


@functools.cache
def init_key() -> str:
    """What INIT's bytes depend on: its source, the flags, the compiler's version and the static C
    library it links (path, size, modification time)."""
    cc = _compiler()
    version = subprocess.run(
        [cc, "-dumpfullversion"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
    ).stdout.strip()
    libc_a = subprocess.run(
        [cc, "-print-file-name=libc.a"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
    ).stdout.strip()
    try:
        st = os.stat(libc_a)
        libc = f"{os.path.realpath(libc_a)} {st.st_size} {st.st_mtime_ns}"
    except OSError:
        libc = f"{libc_a} (missing)"
    h = hashlib.blake2b(digest_size=16)
    with open(INIT_SOURCE, "rb") as f:
        h.update(f.read())
    h.update("\0".join([*INIT_CFLAGS, cc, version, libc]).encode())
    return h.hexdigest()


def digest(source_dir: str = SOURCE_DIR) -> str:
    """The identity of the agent `build` packs from `source_dir`: every module's source, the
    importer and entry the archives add, this interpreter's bytecode version (COMPILED is
    its bytecode) and INIT's `init_key`."""
    h = hashlib.blake2b(digest_size=16)
    for part in (_BOOT, _MAIN, PACKAGE, importlib.util.MAGIC_NUMBER.hex(), init_key()):
        h.update(part.encode() + b"\0")
    for name in _module_names(source_dir):
        with open(os.path.join(source_dir, name), "rb") as f:
            src = f.read()
        h.update(f"{name}\0{len(src)}\0".encode())
        h.update(src)
    return h.hexdigest()


def _module_names(source_dir: str = SOURCE_DIR) -> list[str]:
    return sorted(n for n in os.listdir(source_dir) if n.endswith(".py"))


def _write_zip(path: str, entries: dict[str, bytes]) -> None:
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
        for arcname in sorted(entries):
            info = zipfile.ZipInfo(arcname, date_time=_DATE)
            info.external_attr = 0o644 << 16
            z.writestr(info, entries[arcname])
    os.replace(tmp, path)
