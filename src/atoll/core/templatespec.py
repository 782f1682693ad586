"""User template build specs: what a template is built from, its steps, and their content hashes.

A user template is a root file system built in steps over a bottom layer (`base`, another user
template, or an OCI image archive), like a Docker image. Two ways to write one:

  * the JSON body of `POST /v1/templates` (`from_request`): `{name, from, apt, pip, files, run, env,
    workdir, user, start, ready}`; steps in the order apt, pip, files, then each run command;
  * a Dockerfile subset, parsed by `core.dockerfile` (which builds on this module; this module
    does not import it).

Both give a `TemplateSpec` of frozen dataclasses that validate themselves, so a spec that exists is
a valid one. `to_wire` / `from_wire` carry it from the control plane to a worker over HTTP.
`step_keys` names each step's layer by the hash of everything it and the steps below it depend on
(a rebuild reuses every unchanged layer); `snapshot_key` adds what a booted snapshot depends on.

What the builder is promised: every step runs with its own `env`, `workdir` and `user`; the builder
creates a step's workdir (`mkdir -p`) before running it, and the spec's final workdir before the
snapshot, so a Dockerfile WORKDIR emits no step of its own. apt and pip steps always run as root;
their packages are meant to be passed as separate arguments, not through a shell (pip
requirements may hold '<', '>' and spaces). A run step's command is run by `/bin/sh -c`; files
are written as root with their mode, replacing what is at their paths (a symbolic link is written as
itself, never followed), each path resolved first through the image's links of its parent
directories, as Docker resolves a COPY destination (`/bin/x` over `/bin -> usr/bin` is
`/usr/bin/x`); a path that is a directory of the image or a link to one fails the build. Env
values are literal (no `$VAR` expansion in the JSON shape; a Dockerfile's ENV substitutes when it
is parsed, as Docker does).

Pure: standard library only, no I/O. Called by the control plane's template routes (validating a
request, sending the spec to a worker), by core.dockerfile (the model and its validators), and by
the worker's template builder (from_wire, keys).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from atoll.core import errors

MAX_PATH = 4096
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH a sandbox gets when nothing sets one (worker.host.bundle uses the same)."""
MAX_NAME_COMPONENT = 255
MAX_PACKAGES = 200
MAX_PIP_REQUIREMENT = 200
MAX_RUN = 100
"""Run commands in the JSON shape."""
MAX_COMMAND = 64 * 1024
"""Bytes (UTF-8) of one shell command: a run step, `start`, `ready.cmd`."""
MAX_FILES = 1000
"""Files in one template, all steps together."""
MAX_FILE_BYTES = 16 * 1024 * 1024
"""File data in one template, all steps together."""
MAX_ENV = 200
MAX_ENV_VALUE = 64 * 1024
MAX_STEPS = 128
"""Steps in one spec (the JSON shape makes at most MAX_RUN + 3, a Dockerfile
dockerfile.MAX_DOCKERFILE_STEPS)."""
READY_TIMEOUT_RANGE = (1.0, 1800.0)
KEY_VERSION = "atoll-template-v1"
"""Part of every key: changing what a step means (the builder's promises) changes this."""
FILES_LAYOUT = 2
"""Part of a files step's key: how the worker lays its paths out in the layer. 2: each path is
resolved through the image's symbolic links, as Docker resolves a COPY destination (`/bin/x` over
`/bin -> usr/bin` is `usr/bin/x`), and directories the layer makes keep the image's modes. Layers
of layout 1 (a real `bin/` that hid the image's `/bin`) are never reused."""

STEP_KINDS = ("apt", "pip", "run", "files")
REQUEST_KEYS = ("name", "from", "apt", "pip", "run", "files", "env", "workdir", "user", "start", "ready")
OCI_PREFIX = "oci-archive:"

_TEMPLATE_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_APT_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+:~-]+)?")
_PIP_REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-\[\],<>=!~*+ ]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}|[0-9]{1,10}")


def _show(value: object) -> str:
    """The value as an error message quotes it: repr, cut to about 100 characters."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _fail(message: str) -> errors.InvalidRequest:
    return errors.InvalidRequest(message)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _text(value: object, what: str, *, limit: int, empty: bool = False) -> str:
    """A string without NUL that encodes as UTF-8 and fits `limit` bytes."""
    if not isinstance(value, str):
        raise _fail(f"{what} must be a string, got {_type_name(value)} {_show(value)}")
    if not value and not empty:
        raise _fail(f"{what} is empty; give a non-empty string")
    if "\0" in value:
        raise _fail(f"{what} contains a NUL character: {_show(value)}; remove it")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _fail(f"{what} is not valid Unicode text (a lone surrogate): {_show(value)}") from None
    if size > limit:
        raise _fail(f"{what} is {size} bytes, more than {limit}: {_show(value)}; shorten it")
    return value


def _abs_path(value: object, what: str, *, root_ok: bool = True) -> str:
    """An absolute path in normal form (no `.`, `..`, `//`, trailing `/`)."""
    path = _text(value, what, limit=MAX_PATH)
    if not path.startswith("/"):
        raise _fail(f"{what} must be an absolute path (starting with /), got {_show(path)}")
    parts = path.split("/")[1:]
    if ".." in parts:
        raise _fail(f"{what} may not contain '..' components, got {_show(path)}; write the path it means")
    normal = "/" + "/".join(p for p in parts if p not in ("", "."))
    if normal != path:
        raise _fail(f"{what} must be a normalised path, got {_show(path)}; write {_show(normal)}")
    if path == "/" and not root_ok:
        raise _fail(f"{what} may not be / itself; give a file's path")
    for part in parts:
        if len(part.encode("utf-8")) > MAX_NAME_COMPONENT:
            raise _fail(f"{what} has a component longer than {MAX_NAME_COMPONENT} bytes: {_show(part)}")
    return path


def _template_name(value: object, what: str = "name") -> str:
    if not isinstance(value, str):
        raise _fail(f"{what} must be a string, got {_type_name(value)} {_show(value)}")
    if not _TEMPLATE_NAME.fullmatch(value):
        raise _fail(
            f"{what} {_show(value)} is not a template name: use 1 to 63 lowercase letters, digits "
            "and dashes, starting with a letter or digit (e.g. 'py-tools')"
        )
    return value


def _new_name(value: object) -> str:
    """The name of a template being defined (not the built-in `base`)."""
    _template_name(value)
    if value == "base":
        raise _fail("name 'base' is the built-in template; choose another name for yours")
    return value  # type: ignore[return-value]


def _user(value: object, what: str = "user") -> str:
    if not isinstance(value, str) or not _USER.fullmatch(value):
        raise _fail(
            f"{what} {_show(value)} is not a user name: use up to 32 lowercase letters, digits, '_' "
            "and '-' starting with a letter or '_' (e.g. 'app'), or a numeric uid"
        )
    return value


def _from(value: object) -> str:
    if isinstance(value, str) and value.startswith(OCI_PREFIX):
        _abs_path(value[len(OCI_PREFIX) :], "from oci-archive: path", root_ok=False)
        return value
    if isinstance(value, str) and _TEMPLATE_NAME.fullmatch(value):
        return value
    raise _fail(
        f"from {_show(value)} is neither a template name ('base' or a template you built) nor "
        "'oci-archive:/absolute/path/to/image.tar' (an OCI image archive on the server)"
    )


def _env_pairs(value: object, what: str) -> tuple[tuple[str, str], ...]:
    """Sorted (name, value) pairs from a mapping or an iterable of pairs; names unique."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise _fail(f"{what} must be a mapping of names to values, got {_type_name(value)} {_show(value)}")
    if len(items) > MAX_ENV:
        raise _fail(f"{what} has {len(items)} variables, more than {MAX_ENV}; set fewer")
    out: dict[str, str] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise _fail(f"{what} entries must be (name, value) pairs, got {_show(item)}")
        name, val = item
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name) or len(name) > 256:
            raise _fail(
                f"{what} name {_show(name)} is not a variable name: use letters, digits and '_', "
                "not starting with a digit (e.g. 'APP_MODE')"
            )
        if name in out:
            raise _fail(f"{what} sets {name} twice; set it once")
        out[name] = _text(val, f"{what} {name}", limit=MAX_ENV_VALUE, empty=True)
        if name == "PATH" and (problem := path_problem(out[name])):
            raise _fail(f"{what}: {problem}")
    return tuple(sorted(out.items()))


def path_problem(value: str) -> str | None:
    """Why `value` cannot be a sandbox's PATH, or None. PATH is how the commands of the template
    (its steps, its start command) and of its callers are found; the sandbox's own agent is started
    by its absolute path, whatever PATH says. A PATH with a control character (`"/usr/bin\\n/bin"`
    is one directory that cannot exist, not two) or without one absolute directory finds nothing,
    and every command fails with "command not found". A relative or empty entry beside absolute
    ones is left alone (it is searched in the working directory, as in any shell;
    `ENV PATH=./node_modules/.bin:$PATH` is common). Shared by template specs, Dockerfiles and
    sandbox env."""
    bad = next((i for i, c in enumerate(value) if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None:
        return (
            f"PATH {_show(value)} contains the control character {value[bad]!r} (at position {bad}); "
            f"PATH is one line of directories joined by ':' (e.g. '{DEFAULT_PATH}'): remove it"
        )
    if any(entry.startswith("/") for entry in value.split(":")):
        return None
    return (
        f"PATH {_show(value)} has no absolute directory, so no command of the sandbox can be found "
        f"by name; list absolute directories joined by ':' (e.g. '{DEFAULT_PATH}') or leave PATH "
        "out to keep the default"
    )


def _strings(value: object, what: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _fail(f"{what} must be a list of strings, got {_type_name(value)} {_show(value)}")
    return tuple(value)


@dataclass(frozen=True)
class Ready:
    """When a template's sandbox counts as ready: something listens on `port`, or `cmd` exits 0."""

    port: int | None = None
    """A TCP port (1-65535) inside the sandbox."""
    cmd: str | None = None
    """A shell command, run by /bin/sh -c until it exits 0."""
    timeout_s: float = 120.0
    """How long to wait (1-1800 s) before the build fails."""

    def __post_init__(self) -> None:
        if (self.port is None) == (self.cmd is None):
            raise _fail(
                f"ready needs exactly one of port and cmd, got port={self.port!r} cmd={_show(self.cmd)}"
            )
        if self.port is not None and (
            not isinstance(self.port, int) or isinstance(self.port, bool) or not 1 <= self.port <= 65535
        ):
            raise _fail(f"ready.port must be a TCP port number 1-65535, got {_show(self.port)}")
        if self.cmd is not None:
            _text(self.cmd, "ready.cmd", limit=MAX_COMMAND)
        t = self.timeout_s
        low, high = READY_TIMEOUT_RANGE
        if (
            not isinstance(t, (int, float))
            or isinstance(t, bool)
            or not math.isfinite(t)
            or not low <= t <= high
        ):
            raise _fail(
                f"ready.timeout_s must be a number of seconds from {low:g} to {high:g}, got {_show(t)}"
            )
        object.__setattr__(self, "timeout_s", float(t))


@dataclass(frozen=True)
class FileItem:
    """A file a files step writes (as root, replacing what is there), or a symbolic link."""

    path: str
    """Absolute and normalised; not / itself."""
    data: bytes
    mode: int = 0o644
    """Permission bits only (0 to 0o7777); a link's are 0o777 (Linux ignores them)."""
    link: str | None = None
    """A symbolic link's target, kept as written (absolute, relative, even dangling or leading
    out of the build context): the link is resolved inside the sandbox, against the sandbox's
    own root, and the worker writes it without following it (a link's data is empty)."""

    def __post_init__(self) -> None:
        _abs_path(self.path, "file path", root_ok=False)
        if isinstance(self.data, (bytearray, memoryview)):
            object.__setattr__(self, "data", bytes(self.data))
        if not isinstance(self.data, bytes):
            raise _fail(f"file {self.path} data must be bytes, got {_type_name(self.data)}")
        if not isinstance(self.mode, int) or isinstance(self.mode, bool) or not 0 <= self.mode <= 0o7777:
            raise _fail(f"file {self.path} mode must be permission bits 0 to 0o7777, got {_show(self.mode)}")
        if self.link is not None:
            _text(self.link, f"symbolic link {self.path} target", limit=MAX_PATH)
            if self.data:
                raise _fail(f"symbolic link {self.path} has data; a link holds only its target")
            object.__setattr__(self, "mode", 0o777)


@dataclass(frozen=True)
class Step:
    """One build step: one layer of the template."""

    kind: str
    """"apt" | "pip" | "run" | "files"."""
    packages: tuple[str, ...] = ()
    """apt: Debian package names (optionally `=version`); pip: requirement strings."""
    command: str = ""
    """run: a shell command line, run by /bin/sh -c."""
    files: tuple[FileItem, ...] = ()
    """files: sorted by path."""
    env: tuple[tuple[str, str], ...] = ()
    """The environment the step runs with (sorted pairs, added to the image's)."""
    workdir: str = "/"
    """The directory it runs in (the builder creates it first)."""
    user: str = "root"
    """The user it runs as (apt, pip and files steps always as root)."""

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise _fail(f"step kind {_show(self.kind)} is unknown; use one of {', '.join(STEP_KINDS)}")
        packages = _strings(self.packages, f"{self.kind} packages")
        object.__setattr__(self, "packages", packages)
        if not isinstance(self.files, (list, tuple)):
            raise _fail(f"a step's files must be a tuple of FileItem, got {_type_name(self.files)}")
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "env", _env_pairs(self.env, "step env"))
        _abs_path(self.workdir, "step workdir")
        _user(self.user, "step user")
        if self.kind in ("apt", "pip"):
            if not packages:
                raise _fail(f"the {self.kind} step needs at least one package")
            if len(packages) > MAX_PACKAGES:
                raise _fail(
                    f"{self.kind} lists {len(packages)} packages, more than {MAX_PACKAGES}; split them"
                )
            check = _apt_package if self.kind == "apt" else _pip_requirement
            for p in packages:
                check(p)
        elif packages:
            raise _fail(f"a {self.kind} step takes no packages, got {_show(packages)}")
        if self.kind == "run":
            _text(self.command, "run command", limit=MAX_COMMAND)
            if not self.command.strip():
                raise _fail("a run command is blank; give a shell command")
        elif self.command:
            raise _fail(f"a {self.kind} step takes no command, got {_show(self.command)}")
        if self.kind == "files":
            _check_files(self.files)
        elif self.files:
            raise _fail(f"a {self.kind} step takes no files")
        if self.kind != "run" and self.user != "root":
            raise _fail(f"{self.kind} steps run as root, got user {_show(self.user)}")

    def describe(self) -> str:
        """One short line for build logs."""
        if self.kind in ("apt", "pip"):
            line = f"{self.kind} install {' '.join(self.packages)}"
        elif self.kind == "run":
            line = "RUN " + " ".join(self.command.split())
        elif len(self.files) == 1:
            line = f"COPY {self.files[0].path}"
        else:
            line = f"COPY {len(self.files)} files"
        return line if len(line) <= 120 else line[:117] + "..."


def _apt_package(p: str) -> None:
    if not _APT_PACKAGE.fullmatch(p):
        raise _fail(
            f"apt package {_show(p)} is not a Debian package name: lowercase letters, digits and "
            "'+.-', at least 2 characters, optionally '=VERSION' (e.g. 'jq' or 'curl=7.88.1-10')"
        )


def _pip_requirement(p: str) -> None:
    if p.startswith("-"):
        raise _fail(
            f"pip requirement {_show(p)} is an option; pip options (--index-url, -e, -r) are not "
            "accepted, give requirements only (e.g. 'requests>=2.31')"
        )
    if "\0" in p or "\n" in p or "\r" in p:
        raise _fail(
            f"pip requirement {_show(p)} contains a NUL or line break; give one requirement per entry"
        )
    if len(p) > MAX_PIP_REQUIREMENT:
        raise _fail(f"pip requirement {_show(p)} is longer than {MAX_PIP_REQUIREMENT} characters")
    if not _PIP_REQUIREMENT.fullmatch(p):
        raise _fail(
            f"pip requirement {_show(p)} is not a requirement atoll accepts: a project name with "
            "optional [extras] and version specifiers (letters, digits, ._-[],<>=!~*+ and spaces; "
            "no URLs or environment markers), e.g. 'uvicorn[standard]>=0.30'"
        )


def _check_files(files: tuple[FileItem, ...]) -> None:
    if not files:
        raise _fail("the files step needs at least one file")
    if not all(isinstance(f, FileItem) for f in files):
        raise _fail("a files step's files must be FileItem values")
    paths = [f.path for f in files]
    if paths != sorted(paths):
        raise _fail("a files step's files must be sorted by path")
    seen = set(paths)
    if len(seen) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise _fail(f"files lists {dup} twice; give each path once")
    for p in paths:
        parent = posixpath.dirname(p)
        while parent != "/":
            if parent in seen:
                raise _fail(
                    f"files has both {parent} and {p} (a file or a symbolic link cannot also be a "
                    "directory: nothing is written through a link); drop one"
                )
            parent = posixpath.dirname(parent)


@dataclass(frozen=True)
class TemplateSpec:
    """What a user template is: its bottom layer, its steps, and what its sandboxes start with."""

    name: str
    from_: str
    """"base", another template's name, or "oci-archive:/abs/path"."""
    steps: tuple[Step, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    """The final environment (sorted pairs) its sandboxes get, added to the FROM image's."""
    workdir: str | None = None
    """Default working directory of exec/files calls in its sandboxes."""
    user: str | None = None
    """Default user of exec."""
    start: str | None = None
    """A long-running shell command, started before the snapshot is taken."""
    ready: Ready | None = None
    """When the snapshot may be taken (without `start`: a check of the snapshot moment)."""

    def __post_init__(self) -> None:
        _new_name(self.name)
        _from(self.from_)
        if self.from_ == self.name:
            raise _fail(f"template {self.name!r} cannot be built from itself; give another 'from'")
        steps = tuple(self.steps)
        if not all(isinstance(s, Step) for s in steps):
            raise _fail("steps must be Step values")
        if len(steps) > MAX_STEPS:
            raise _fail(f"the template has {len(steps)} steps, more than {MAX_STEPS}; merge commands")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "env", _env_pairs(self.env, "env"))
        if self.workdir is not None:
            _abs_path(self.workdir, "workdir")
        if self.user is not None:
            _user(self.user)
        if self.start is not None:
            _text(self.start, "start", limit=MAX_COMMAND)
            if not self.start.strip():
                raise _fail("start is blank; give a shell command or leave it out")
        if self.ready is not None and not isinstance(self.ready, Ready):
            raise _fail("ready must be a Ready value")
        items = [f for s in steps for f in s.files]
        if len(items) > MAX_FILES:
            raise _fail(
                f"the template has {len(items)} files, more than {MAX_FILES}; pack them (a tar + RUN)"
            )
        size = sum(len(f.data) for f in items)
        if size > MAX_FILE_BYTES:
            raise _fail(
                f"the template's files hold {size} bytes, more than {MAX_FILE_BYTES}; install big "
                "files in a run step instead"
            )

    @property
    def from_kind(self) -> str:
        """ "base" | "template" | "oci-archive"."""
        if self.from_ == "base":
            return "base"
        return "oci-archive" if self.from_.startswith(OCI_PREFIX) else "template"

    @property
    def oci_path(self) -> str | None:
        """The archive's path when the template is built FROM an OCI image archive."""
        return self.from_[len(OCI_PREFIX) :] if self.from_.startswith(OCI_PREFIX) else None

    def to_wire(self) -> dict:
        """A JSON-safe dict (file data in base64) that `from_wire` turns back into this spec."""
        return {
            "name": self.name,
            "from": self.from_,
            "steps": [
                {
                    "kind": s.kind,
                    "packages": list(s.packages),
                    "command": s.command,
                    "files": [
                        {
                            "path": f.path,
                            "data": base64.b64encode(f.data).decode("ascii"),
                            "mode": f.mode,
                            **({} if f.link is None else {"link": f.link}),
                        }
                        for f in s.files
                    ],
                    "env": dict(s.env),
                    "workdir": s.workdir,
                    "user": s.user,
                }
                for s in self.steps
            ],
            "env": dict(self.env),
            "workdir": self.workdir,
            "user": self.user,
            "start": self.start,
            "ready": None
            if self.ready is None
            else {"port": self.ready.port, "cmd": self.ready.cmd, "timeout_s": self.ready.timeout_s},
        }


def _object(value: object, what: str, keys: Iterable[str]) -> dict:
    keys = tuple(keys)
    if not isinstance(value, dict):
        raise _fail(f"{what} must be a JSON object, got {_type_name(value)} {_show(value)}")
    unknown = sorted(str(k) for k in value if k not in keys)
    if unknown:
        raise _fail(f"{what} has unknown keys {', '.join(unknown)}; the accepted keys are {', '.join(keys)}")
    return value


def from_wire(d: dict) -> TemplateSpec:
    """The spec `TemplateSpec.to_wire` made, validated again (it arrived over HTTP)."""
    step_keys_ = ("kind", "packages", "command", "files", "env", "workdir", "user")
    d = _object(d, "template spec", ("name", "from", "steps", "env", "workdir", "user", "start", "ready"))
    for key in ("name", "from", "steps"):
        if key not in d:
            raise _fail(f"template spec has no {key!r}")
    if not isinstance(d["steps"], list):
        raise _fail(f"template spec steps must be a list, got {_type_name(d['steps'])}")
    steps = []
    for i, raw in enumerate(d["steps"]):
        s = _object(raw, f"template spec step {i}", step_keys_)
        files_raw = s.get("files", [])
        if not isinstance(files_raw, list):
            raise _fail(f"template spec step {i} files must be a list, got {_type_name(files_raw)}")
        files = []
        for f in files_raw:
            f = _object(f, f"template spec step {i} file", ("path", "data", "mode", "link"))
            if not isinstance(f.get("data"), str):
                raise _fail(f"template spec step {i} file data must be a base64 string")
            try:
                data = base64.b64decode(f["data"], validate=True)
            except (binascii.Error, ValueError):
                raise _fail(
                    f"template spec step {i} file {_show(f.get('path'))} data is not valid base64"
                ) from None
            files.append(FileItem(f.get("path"), data, f.get("mode", 0o644), f.get("link")))  # type: ignore[arg-type]
        steps.append(
            Step(
                kind=s.get("kind"),  # type: ignore[arg-type]
                packages=s.get("packages", ()),
                command=s.get("command", ""),
                files=tuple(files),
                env=s.get("env", {}),
                workdir=s.get("workdir", "/"),
                user=s.get("user", "root"),
            )
        )
    ready = d.get("ready")
    if ready is not None:
        ready = _object(ready, "template spec ready", ("port", "cmd", "timeout_s"))
        ready = Ready(ready.get("port"), ready.get("cmd"), ready.get("timeout_s", 120.0))
    return TemplateSpec(
        name=d["name"],
        from_=d["from"],
        steps=tuple(steps),
        env=d.get("env", {}),
        workdir=d.get("workdir"),
        user=d.get("user"),
        start=d.get("start"),
        ready=ready,
    )


def from_request(body: dict, name: str | None = None) -> TemplateSpec:
    """The spec of a `POST /v1/templates` JSON body; `name` is the template's name when the body
    does not carry one (e.g. it is in the URL)."""
    body = _object(body, "the template request", REQUEST_KEYS)
    body_name = body.get("name")
    if body_name is not None and name is not None and body_name != name:
        raise _fail(
            f"the body names the template {_show(body_name)} but the request names it {_show(name)}; give one name"
        )
    name = body_name if body_name is not None else name
    if name is None:
        raise _fail("the template has no name; give 'name' (lowercase letters, digits and dashes)")
    _new_name(name)
    from_ = body.get("from")
    from_ = "base" if from_ is None else from_
    env = _env_pairs(_expect(body, "env", dict, "an object of NAME: value", {}), "env")
    workdir = body.get("workdir")
    if workdir is not None:
        _abs_path(workdir, "workdir")
    user = body.get("user")
    if user is not None:
        _user(user)
    wd = workdir or "/"
    steps: list[Step] = []
    for kind in ("apt", "pip"):
        packages = _expect(
            body, kind, list, "a list of package names" if kind == "apt" else "a list of requirements", []
        )
        if packages:
            steps.append(Step(kind, packages=_strings(packages, kind), env=env, workdir=wd))
    files = _expect(body, "files", dict, "an object of '/absolute/path': 'text content'", {})
    if files:
        if len(files) > MAX_FILES:
            raise _fail(f"files has {len(files)} files, more than {MAX_FILES}; pack them (a tar + RUN)")
        items = []
        for path, content in files.items():
            _abs_path(path, "files path", root_ok=False)
            items.append(
                FileItem(path, _text(content, f"files {path}", limit=MAX_FILE_BYTES, empty=True).encode())
            )
        steps.append(Step("files", files=tuple(sorted(items, key=lambda f: f.path)), env=env, workdir=wd))
    run = body.get("run")
    if isinstance(run, str):
        run = [run]
    run = _expect({"run": run}, "run", list, "a list of shell commands (or one string)", [])
    if len(run) > MAX_RUN:
        raise _fail(f"run has {len(run)} commands, more than {MAX_RUN}; join some with '&&'")
    for i, command in enumerate(run):
        _text(command, f"run[{i}]", limit=MAX_COMMAND)
        # as root, like apt and pip (a `run` may be what creates `user`); `user` is the default
        # user of the template's sandboxes and of its start command
        steps.append(Step("run", command=command, env=env, workdir=wd))
    ready = _expect(body, "ready", dict, 'an object {"port": N} or {"cmd": "..."}', None)
    if ready is not None:
        ready = _object(ready, "ready", ("port", "cmd", "timeout_s"))
        ready = Ready(ready.get("port"), ready.get("cmd"), ready.get("timeout_s", 120.0))
    return TemplateSpec(name, from_, tuple(steps), env, workdir, user, body.get("start"), ready)


def _expect(body: dict, key: str, kind: type, shape: str, default: object):
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise _fail(f"{key} must be {shape}, got {_type_name(value)} {_show(value)}")
    return value


# --- keys -------------------------------------------------------------------------------------


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _step_canonical(step: Step) -> bytes:
    return _canonical(
        {
            "kind": step.kind,
            "packages": list(step.packages),
            "command": step.command,
            "files": [
                {
                    "path": f.path,
                    "sha256": hashlib.sha256(f.data).hexdigest(),
                    "mode": f.mode,
                    **({} if f.link is None else {"link": f.link}),  # keys of files without links unchanged
                }
                for f in step.files
            ],
            "env": [list(p) for p in step.env],
            "workdir": step.workdir,
            "user": step.user,
            **({"layout": FILES_LAYOUT} if step.kind == "files" else {}),  # other steps' keys unchanged
        }
    )


def _hash(prev: str, payload: bytes) -> str:
    h = hashlib.sha256(f"{KEY_VERSION}\n{prev}\n".encode())
    h.update(payload)
    return h.hexdigest()[:24]


def step_keys(spec: TemplateSpec, base_key: str) -> list[str]:
    """The layer key of each step: the hash of the key below it (the bottom layer's `base_key`
    for step 0) and everything the step is, so a key names the whole chain up to its step."""
    if not isinstance(base_key, str) or not base_key:
        raise _fail(f"base_key must be a non-empty string, got {_show(base_key)}")
    keys: list[str] = []
    prev = base_key
    for step in spec.steps:
        prev = _hash(prev, _step_canonical(step))
        keys.append(prev)
    return keys


def snapshot_key(spec: TemplateSpec, layer_key: str) -> str:
    """The key of a booted snapshot of the template: its top layer's key (the bottom layer's when
    it has no steps) and what the sandbox is started with."""
    if not isinstance(layer_key, str) or not layer_key:
        raise _fail(f"layer_key must be a non-empty string, got {_show(layer_key)}")
    ready = spec.ready
    return _hash(
        "snapshot:" + layer_key,
        _canonical(
            {
                "env": [list(p) for p in spec.env],
                "workdir": spec.workdir,
                "user": spec.user,
                "start": spec.start,
                "ready": None if ready is None else [ready.port, ready.cmd, ready.timeout_s],
            }
        ),
    )
