"""User template build specs: what a template is built from, its steps, and their content hashes.

A user template is a root file system built in steps over a bottom layer (`base`, another user
template, or an OCI image archive), like a Docker image. Two ways to write one:

  * the JSON body of `POST /v1/templates` (`from_request`): `{name, from, apt, pip, files, run, env,
    workdir, user, start, ready}`; steps in the order apt, pip, files, then each run command;
  * a Dockerfile subset (`parse_dockerfile`): FROM, RUN, COPY, ADD, ENV, WORKDIR, USER, CMD,
    ENTRYPOINT; anything else is refused with its line number, never ignored.

Both give a `TemplateSpec` of frozen dataclasses that validate themselves, so a spec that exists is
a valid one. `to_wire` / `from_wire` carry it from the control plane to a worker over HTTP.
`step_keys` names each step's layer by the hash of everything it and the steps below it depend on
(a rebuild reuses every unchanged layer); `snapshot_key` adds what a booted snapshot depends on.

What the builder is promised: every step runs with its own `env`, `workdir` and `user`; the builder
creates a step's workdir (`mkdir -p`) before running it, and the spec's final workdir before the
snapshot, so a Dockerfile WORKDIR emits no step of its own. apt and pip steps always run as root;
their packages are meant to be passed as separate arguments, not through a shell (pip
requirements may hold '<', '>' and spaces). A run step's command is run by `/bin/sh -c`; files
are written as root with their mode, replacing what is at their paths. Env values are literal (no `$VAR`
expansion in the JSON shape; a Dockerfile's ENV substitutes when it is parsed, as Docker does).

Pure: standard library only, no I/O. Called by the control plane's template routes (validating a
request, sending the spec to a worker) and by the worker's template builder (from_wire, keys).
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import hashlib
import json
import math
import posixpath
import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from atoll.core import errors

MAX_PATH = 4096
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
"""Steps in one spec (the JSON shape makes at most MAX_RUN + 3, a Dockerfile MAX_DOCKERFILE_STEPS)."""
MAX_DOCKERFILE = 1024 * 1024
MAX_DOCKERFILE_STEPS = 100
READY_TIMEOUT_RANGE = (1.0, 1800.0)
KEY_VERSION = "atoll-template-v1"
"""Part of every key: changing what a step means (the builder's promises) changes this."""

STEP_KINDS = ("apt", "pip", "run", "files")
REQUEST_KEYS = ("name", "from", "apt", "pip", "run", "files", "env", "workdir", "user", "start", "ready")
OCI_PREFIX = "oci-archive:"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The PATH a Dockerfile's `$PATH` means when the caller does not say what the FROM image has."""

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
    return tuple(sorted(out.items()))


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
    """A file a files step writes (as root, replacing what is there)."""

    path: str
    """Absolute and normalised; not / itself."""
    data: bytes
    mode: int = 0o644
    """Permission bits only (0 to 0o7777)."""

    def __post_init__(self) -> None:
        _abs_path(self.path, "file path", root_ok=False)
        if isinstance(self.data, (bytearray, memoryview)):
            object.__setattr__(self, "data", bytes(self.data))
        if not isinstance(self.data, bytes):
            raise _fail(f"file {self.path} data must be bytes, got {_type_name(self.data)}")
        if not isinstance(self.mode, int) or isinstance(self.mode, bool) or not 0 <= self.mode <= 0o7777:
            raise _fail(f"file {self.path} mode must be permission bits 0 to 0o7777, got {_show(self.mode)}")


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
                raise _fail(f"files has both {parent} and {p} (a file cannot also be a directory); drop one")
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
                        {"path": f.path, "data": base64.b64encode(f.data).decode("ascii"), "mode": f.mode}
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
            f = _object(f, f"template spec step {i} file", ("path", "data", "mode"))
            if not isinstance(f.get("data"), str):
                raise _fail(f"template spec step {i} file data must be a base64 string")
            try:
                data = base64.b64decode(f["data"], validate=True)
            except (binascii.Error, ValueError):
                raise _fail(
                    f"template spec step {i} file {_show(f.get('path'))} data is not valid base64"
                ) from None
            files.append(FileItem(f.get("path"), data, f.get("mode", 0o644)))  # type: ignore[arg-type]
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
        steps.append(Step("run", command=command, env=env, workdir=wd, user=user or "root"))
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
                {"path": f.path, "sha256": hashlib.sha256(f.data).hexdigest(), "mode": f.mode}
                for f in step.files
            ],
            "env": [list(p) for p in step.env],
            "workdir": step.workdir,
            "user": step.user,
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


# --- Dockerfile -------------------------------------------------------------------------------

DOCKERFILE_INSTRUCTIONS = ("FROM", "RUN", "COPY", "ADD", "ENV", "WORKDIR", "USER", "CMD", "ENTRYPOINT")
_UNSUPPORTED = {
    "ARG": "use ENV for values the build needs",
    "EXPOSE": "remove the line",
    "LABEL": "remove the line",
    "MAINTAINER": "remove the line",
    "VOLUME": "remove the line (a sandbox's file system is all writable)",
    "HEALTHCHECK": "give readiness with the JSON shape's 'ready' field instead",
    "ONBUILD": "write the instructions into the templates built FROM this one",
    "SHELL": "RUN commands run with /bin/sh -c; call another shell inside the command",
    "STOPSIGNAL": "remove the line",
}
# Directories every Debian-based image has: a COPY of one file to one of these (no trailing '/')
# copies into it, as Docker does when the destination is an existing directory.
_IMAGE_DIRS = frozenset(
    "/ /bin /boot /etc /etc/apt /etc/default /etc/profile.d /etc/ssl /etc/ssl/certs /home /lib /media "
    "/mnt /opt /root /run /sbin /srv /tmp /usr /usr/bin /usr/include /usr/lib /usr/libexec /usr/local "
    "/usr/local/bin /usr/local/etc /usr/local/include /usr/local/lib /usr/local/sbin /usr/local/share "
    "/usr/local/share/ca-certificates /usr/local/src /usr/sbin /usr/share /usr/src /var /var/cache "
    "/var/lib /var/local /var/log /var/opt /var/tmp".split()
)
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar.zst")
_DIRECTIVE = re.compile(r"#[ \t]*([A-Za-z][A-Za-z0-9]*)[ \t]*=[ \t]*(.*?)[ \t]*")
_VAR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEREDOC = re.compile(r"\d*<<-?([^<]*)")
_FLAG = re.compile(r"--([A-Za-z][A-Za-z0-9-]*)(?:=(\S*))?(?:\s+|$)")


def _archive_like(path: str, data: bytes) -> bool:
    return (
        path.lower().endswith(_ARCHIVE_SUFFIXES)
        or data[:2] == b"\x1f\x8b"
        or data[:3] == b"BZh"
        or data[:6] == b"\xfd7zXZ\x00"
        or data[:4] == b"\x28\xb5\x2f\xfd"
        or data[257:262] == b"ustar"
    )


class _Expander:
    """Docker's word processing for ENV, WORKDIR, USER, COPY/ADD arguments: quotes removed, the
    escape character honoured, `$VAR`, `${VAR}`, `${VAR:-x}`, `${VAR:+x}`, `${VAR:?x}` (and the
    same without ':') substituted; an unset variable is empty."""

    def __init__(self, text: str, lookup: Mapping[str, str], esc: str):
        self.s, self.i, self.lookup, self.esc = text, 0, lookup, esc

    def run(self, stop: str | None = None) -> str:
        s, out = self.s, list[str]()
        while self.i < len(s):
            c = s[self.i]
            if c == stop:
                return "".join(out)
            self.i += 1
            if c == self.esc:
                if self.i < len(s):
                    out.append(s[self.i])
                    self.i += 1
            elif c == "'":
                end = s.find("'", self.i)
                if end < 0:
                    raise _fail(f"unterminated single quote in {_show(s)}; close it with '")
                out.append(s[self.i : end])
                self.i = end + 1
            elif c == '"':
                out.append(self._double())
            elif c == "$":
                out.append(self._dollar())
            else:
                out.append(c)
        if stop is not None:
            raise _fail(f"unterminated ${{...}} in {_show(s)}; close it with }}")
        return "".join(out)

    def _double(self) -> str:
        s, out = self.s, list[str]()
        while self.i < len(s):
            c = s[self.i]
            self.i += 1
            if c == '"':
                return "".join(out)
            if c == "$":
                out.append(self._dollar())
            elif c == self.esc and self.i < len(s) and s[self.i] in ('"', "$", self.esc):
                out.append(s[self.i])
                self.i += 1
            else:
                out.append(c)
        raise _fail(f'unterminated double quote in {_show(s)}; close it with "')

    def _dollar(self) -> str:
        s = self.s
        braced = self.i < len(s) and s[self.i] == "{"
        m = _VAR.match(s, self.i + braced)
        if not braced:
            if m is None:
                return "$"
            self.i = m.end()
            return self.lookup.get(m.group(), "")
        if m is None:
            raise _fail(f"bad substitution in {_show(s)}: '${{' needs a variable name")
        name, self.i = m.group(), m.end()
        value = self.lookup.get(name)
        if s.startswith("}", self.i):
            self.i += 1
            return value or ""
        op = ":" if s.startswith(":", self.i) else ""
        self.i += len(op)
        if self.i >= len(s):
            raise _fail(f"unterminated ${{...}} in {_show(s)}; close it with }}")
        if s[self.i] not in "-+?":
            raise _fail(
                f"unsupported substitution in {_show(s)}: atoll supports ${{VAR}}, ${{VAR:-default}}, "
                "${VAR:+alternative}, ${VAR:?message} (and the same without ':')"
            )
        op += s[self.i]
        self.i += 1
        word = self.run(stop="}")
        self.i += 1
        is_set = value is not None and (value != "" or ":" not in op)
        if op[-1] == "-":
            return value if is_set else word  # type: ignore[return-value]
        if op[-1] == "+":
            return word if is_set else ""
        if not is_set:
            raise _fail(f"{name} is not set: {word or 'a value is required'}")
        return value  # type: ignore[return-value]


def _split_words(s: str, esc: str) -> list[str]:
    """Split on whitespace outside quotes, keeping quotes and escapes for `_Expander`."""
    words: list[str] = []
    cur: list[str] = []
    quote = ""
    i = 0
    while i < len(s):
        c = s[i]
        if not quote and c in " \t":
            if cur:
                words.append("".join(cur))
                cur = []
        elif c == esc and quote != "'" and i + 1 < len(s):
            cur.append(s[i : i + 2])
            i += 1
        else:
            if not quote and c in "'\"":
                quote = c
            elif c == quote:
                quote = ""
            cur.append(c)
        i += 1
    if cur:
        words.append("".join(cur))
    return words


def _json_argv(rest: str) -> list[str] | None:
    """The exec (JSON array) form's argv, or None for the shell form (as Docker decides)."""
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _directives(lines: list[str]) -> str:
    """The escape character from the parser directives at the top (`# escape=\\` or '`')."""
    esc, seen = "\\", set()
    for n, line in enumerate(lines, 1):
        m = _DIRECTIVE.fullmatch(line.rstrip("\r"))
        if m is None:
            break
        key, value = m.group(1).lower(), m.group(2)
        if key not in ("escape", "syntax", "check"):
            continue  # an unknown directive is a comment (Docker)
        if key in seen:
            raise _fail(f"Dockerfile line {n}: the {key} parser directive is given twice; give it once")
        seen.add(key)
        if key == "escape":
            if value not in ("\\", "`"):
                raise _fail(
                    f"Dockerfile line {n}: escape directive {_show(value)} is not \\ or `; use one of those"
                )
            esc = value
    return esc


def _logical_lines(lines: list[str], esc: str) -> list[tuple[int, str]]:
    """(line number where it starts, text) of each instruction: comments and blank lines dropped,
    continuation lines joined (comment and blank lines inside a continuation skipped, as Docker)."""
    cont = re.compile(re.escape(esc) + r"[ \t]*$")
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        start, text = i + 1, lines[i].rstrip("\r").lstrip()
        i += 1
        if not text or text.startswith("#"):
            continue
        while cont.search(text):
            text = cont.sub("", text)
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            if i == len(lines):
                break
            text += lines[i].rstrip("\r")
            i += 1
        out.append((start, text.strip()))
    return out


class _Build:
    """What the instructions so far have made (parse_dockerfile's state)."""

    def __init__(
        self, name: str, context: dict[str, tuple[bytes, int]] | None, inherited: dict[str, str], esc: str
    ):
        self.name, self.context, self.inherited, self.esc = name, context, inherited, esc
        self.from_: str | None = None
        self.steps: list[Step] = []
        self.env: dict[str, str] = {}
        self.workdir, self.workdir_set = "/", False
        self.user, self.user_set = "root", False
        self.cmd: list[str] | str | None = None  # exec form argv, or the shell form's string
        self.entrypoint: list[str] | str | None = None
        self.files = self.file_bytes = 0
        self.dirs = set(_IMAGE_DIRS)  # directories the image is known to have
        self.context_dirs = {"."}
        for p in context or ():
            parent = posixpath.dirname(p)
            while parent:
                self.context_dirs.add(parent)
                parent = posixpath.dirname(parent)

    def expand(self, word: str) -> str:
        return _Expander(word, {**self.inherited, **self.env}, self.esc).run()

    def add_step(self, step: Step) -> None:
        if len(self.steps) >= MAX_DOCKERFILE_STEPS:
            raise _fail(f"more than {MAX_DOCKERFILE_STEPS} steps; join RUN commands with '&&'")
        self.steps.append(step)

    def step_env(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self.env.items()))

    def do_from(self, rest: str) -> None:
        if self.from_ is not None:
            raise _fail(
                "a second FROM: multi-stage builds are not supported; build each stage as its own "
                "template and start the next one FROM it by name"
            )
        words = rest.split()
        if words and words[0].startswith("--"):
            raise _fail(f"FROM {words[0]} is not supported; write FROM IMAGE")
        if len(words) == 3 and words[1].lower() == "as":
            words = words[:1]  # the stage name: there is one stage, so nothing refers to it
        if len(words) != 1:
            raise _fail(f"FROM takes one image (optionally 'AS name'), got {_show(rest)}")
        image = words[0]
        if image.startswith(OCI_PREFIX):
            _from(image)
        elif not _TEMPLATE_NAME.fullmatch(image):
            if any(c in image for c in ":/@"):
                raise _fail(
                    f"FROM {_show(image)} looks like a registry image, and atoll reaches no registry: "
                    "FROM takes a template name ('base' or one you built) or oci-archive:/path/to/image.tar "
                    "(`docker save IMAGE -o FILE` on a machine that has it); pulling from a registry is future work"
                )
            raise _fail(
                f"FROM {_show(image)} is not a template name (lowercase letters, digits, dashes) "
                "nor oci-archive:/path/to/image.tar"
            )
        if image == self.name:
            raise _fail(f"template {self.name!r} cannot be built FROM itself; give another template")
        self.from_ = image

    def do_run(self, rest: str) -> None:
        if rest.startswith("--"):
            flag = rest.split()[0].split("=")[0]
            raise _fail(
                f"RUN {flag} is not supported (no BuildKit mounts, network or security modes); write RUN COMMAND"
            )
        argv = _json_argv(rest)
        if argv is None:
            for word in rest.split():
                m = _HEREDOC.fullmatch(word)
                if m and m.group(1).strip("'\""):
                    raise _fail(
                        f"heredocs ({word}) are not supported; continue lines with {self.esc} instead"
                    )
            command = rest
        else:
            command = shlex.join(argv)
        if not command.strip():
            raise _fail("RUN needs a command")
        _text(command, "RUN command", limit=MAX_COMMAND)
        self.add_step(Step("run", command=command, env=self.step_env(), workdir=self.workdir, user=self.user))

    def do_env(self, rest: str) -> None:
        words = _split_words(rest, self.esc)
        if not words:
            raise _fail("ENV needs NAME=value")
        pairs = []
        if "=" not in words[0]:  # the legacy `ENV NAME value` form: the rest of the line is the value
            parts = rest.split(None, 1)
            if len(parts) < 2:
                raise _fail(f"ENV {parts[0]} has no value; write ENV {parts[0]}=value")
            pairs.append((parts[0], self.expand(parts[1])))
        else:
            for word in words:
                if "=" not in word:
                    raise _fail(f"ENV {_show(word)} is not NAME=value; quote values that hold spaces")
                key, value = word.split("=", 1)
                pairs.append((key, self.expand(value)))  # all from the env before this line (Docker)
        for key, value in pairs:
            if not _ENV_NAME.fullmatch(key):
                raise _fail(
                    f"ENV name {_show(key)} is not a variable name: letters, digits and '_', not starting with a digit"
                )
            _text(value, f"ENV {key}", limit=MAX_ENV_VALUE, empty=True)
        self.env.update(pairs)
        if len(self.env) > MAX_ENV:
            raise _fail(f"more than {MAX_ENV} environment variables; set fewer")

    def do_workdir(self, rest: str) -> None:
        path = self.expand(rest)
        if not path:
            raise _fail("WORKDIR needs a path")
        self.workdir = _abs_path(_join(self.workdir, path), "WORKDIR")
        self.workdir_set = True
        self._add_dirs(self.workdir)

    def do_user(self, rest: str) -> None:
        user = self.expand(rest).split(":", 1)[0]  # a group is not kept: the user's own group applies
        self.user = _user(user, "USER")
        self.user_set = True

    def do_start(self, instruction: str, rest: str) -> None:
        argv = _json_argv(rest)
        if argv is None and not rest:
            raise _fail(f"{instruction} needs a command")
        for part in argv if argv is not None else [rest]:
            _text(part, instruction, limit=MAX_COMMAND, empty=True)
        value = argv if argv is not None else rest
        if instruction == "CMD":
            self.cmd = value
        else:
            self.entrypoint = value

    def start(self) -> str | None:
        """Docker's rules: ENTRYPOINT exec + CMD (exec, or shell as /bin/sh -c); a shell-form
        ENTRYPOINT ignores CMD; a shell form alone is kept as it was written."""
        ep, cmd = self.entrypoint, self.cmd
        if ep is not None and isinstance(ep, str):
            return ep
        if not ep and isinstance(cmd, str):
            return cmd
        argv = list(ep or [])
        if cmd is not None:
            argv += cmd if isinstance(cmd, list) else ["/bin/sh", "-c", cmd]
        return shlex.join(argv) if argv else None

    def _add_dirs(self, path: str) -> None:
        while path not in self.dirs:
            self.dirs.add(path)
            path = posixpath.dirname(path)

    def do_copy(self, instruction: str, rest: str) -> None:
        mode = None
        while (m := _FLAG.match(rest)) is not None:
            flag, value = m.group(1).lower(), m.group(2)
            rest = rest[m.end() :]
            if flag == "from":
                raise _fail(
                    f"{instruction} --from is not supported (multi-stage builds); copy from the build context"
                )
            if flag == "chown":
                raise _fail(
                    f"{instruction} --chown is not supported (files are written as root); add RUN chown USER PATH after it"
                )
            if flag == "chmod":
                if value is None or not re.fullmatch(r"[0-7]{3,4}", value):
                    raise _fail(f"{instruction} --chmod={value} is not an octal mode; write e.g. --chmod=755")
                mode = int(value, 8)
            elif flag != "link":  # --link changes how Docker caches the layer, not what is in it
                raise _fail(
                    f"{instruction} --{flag} is not supported; atoll takes --chmod=OCTAL (and --link)"
                )
        argv = _json_argv(rest)
        args = [self.expand(a) for a in (argv if argv is not None else _split_words(rest, self.esc))]
        if len(args) < 2:
            raise _fail(f"{instruction} needs a source and a destination, got {_show(rest)}")
        *sources, dest = args
        if self.context is None:
            raise _fail(
                f"{instruction} {sources[0]}: no build context was sent, so {sources[0]!r} cannot be "
                "found; send the build context (the directory) with the Dockerfile"
            )
        matches: list[tuple[str, bool]] = []  # (context path, is a directory)
        for src in sources:
            matches += self._sources(instruction, src)
        if not dest:
            raise _fail(f"{instruction} has an empty destination")
        target = _join(self.workdir, dest)
        into = (
            dest.endswith("/")
            or posixpath.basename(dest) in (".", "..")
            or len(matches) > 1
            or matches[0][1]
            or target in self.dirs
        )
        items: dict[str, FileItem] = {}
        for src, is_dir in matches:
            if is_dir:
                prefix = "" if src == "." else src + "/"
                pairs = [
                    (p, posixpath.join(target, p[len(prefix) :]))
                    for p in self.context
                    if p.startswith(prefix)
                ]
            else:
                pairs = [(src, posixpath.join(target, posixpath.basename(src)) if into else target)]
            for p, path in pairs:
                data, file_mode = self.context[p]
                if instruction == "ADD" and not is_dir and _archive_like(p, data):
                    raise _fail(
                        f"ADD {p}: archive auto-extraction is not supported; COPY the archive and "
                        "unpack it with RUN tar -xf"
                    )
                items[path] = FileItem(path, data, mode if mode is not None else file_mode)
        self.files += len(items)
        self.file_bytes += sum(len(f.data) for f in items.values())
        if self.files > MAX_FILES:
            raise _fail(
                f"{instruction} brings the template to {self.files} files, more than {MAX_FILES}; pack them (COPY a tar + RUN tar -xf)"
            )
        if self.file_bytes > MAX_FILE_BYTES:
            raise _fail(
                f"{instruction} brings the template's files to {self.file_bytes} bytes, more than "
                f"{MAX_FILE_BYTES}; download or build big files in a RUN step"
            )
        for path in items:
            self._add_dirs(posixpath.dirname(path))
        files = tuple(sorted(items.values(), key=lambda f: f.path))
        self.add_step(Step("files", files=files, env=self.step_env(), workdir=self.workdir))

    def _sources(self, instruction: str, src: str) -> list[tuple[str, bool]]:
        if instruction == "ADD" and (re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", src) or src.startswith("git@")):
            raise _fail(
                f"ADD {_show(src)}: ADD does not download (builds reach no network for it); put the "
                "file in the build context, or fetch it in a RUN step"
            )
        if src.startswith("/"):
            raise _fail(
                f"{instruction} source {_show(src)} is absolute; sources are paths relative to the build context"
            )
        path = posixpath.normpath(src) if src else ""
        if not path or "\0" in path:
            raise _fail(f"{instruction} source {_show(src)} is not a path")
        if path == ".." or path.startswith("../"):
            raise _fail(
                f"{instruction} source {_show(src)} is outside the build context; copy from inside it"
            )
        assert self.context is not None
        if any(c in path for c in "*?["):
            parts = path.split("/")
            found = [
                (p, is_dir)
                for candidates, is_dir in ((self.context, False), (self.context_dirs - {"."}, True))
                for p in candidates
                if len(p.split("/")) == len(parts)
                and all(fnmatch.fnmatchcase(a, b) for a, b in zip(p.split("/"), parts, strict=True))
            ]
            if not found:
                raise _fail(f"{instruction} source {_show(src)} matches nothing in the build context")
            return sorted(found)
        if path in self.context:
            return [(path, False)]
        if path in self.context_dirs and (path != "." or self.context):
            return [(path, True)]
        raise _fail(f"{instruction} source {_show(src)} is not in the build context")


def _join(workdir: str, path: str) -> str:
    """`path` made absolute against `workdir`, normalised as Docker does (lexically)."""
    joined = posixpath.normpath(posixpath.join(workdir, path))
    return "/" + joined.lstrip("/")


def _context(context: Mapping[str, tuple[bytes, int]]) -> dict[str, tuple[bytes, int]]:
    if not isinstance(context, Mapping):
        raise _fail(
            f"the build context must be a mapping of paths to (content, mode), got {_type_name(context)}"
        )
    out: dict[str, tuple[bytes, int]] = {}
    for path, value in context.items():
        if (
            not isinstance(path, str)
            or not path
            or "\0" in path
            or path.startswith("/")
            or any(p in ("", ".", "..") for p in path.split("/"))
        ):
            raise _fail(
                f"build context path {_show(path)} is not a relative normalised path (like 'app/main.py': "
                "no leading '/' or './', no '.' or '..' parts)"
            )
        if not isinstance(value, tuple) or len(value) != 2:
            raise _fail(f"build context entry {path} must be (content bytes, mode), got {_type_name(value)}")
        data, mode = value
        if not isinstance(data, bytes) or not isinstance(mode, int) or isinstance(mode, bool) or mode < 0:
            raise _fail(
                f"build context entry {path} must be (content bytes, mode int), got ({_type_name(data)}, {_show(mode)})"
            )
        out[path] = (data, mode & 0o7777)  # a stat st_mode's file type bits are dropped
    for path in out:
        parent = posixpath.dirname(path)
        while parent:
            if parent in out:
                raise _fail(f"build context has both the file {parent} and {path} below it; drop one")
            parent = posixpath.dirname(parent)
    return out


def parse_dockerfile(
    text: str,
    name: str,
    context: Mapping[str, tuple[bytes, int]] | None = None,
    *,
    inherited_env: Mapping[str, str] | None = None,
) -> TemplateSpec:
    """The spec of a Dockerfile (the subset above) for template `name`. `context` maps build
    context paths ("app/main.py") to (content, mode) for COPY and ADD. `inherited_env` is the FROM
    image's environment as `$VAR` in ENV, WORKDIR, USER and COPY sees it (default: PATH only,
    DEFAULT_PATH); it is not copied into the spec, whose env is what the Dockerfile sets.

    Docker semantics kept: variables in one ENV line see the env before it; a directory source
    copies its contents; a destination ending in '/', several sources, or a directory the image
    is known to have (the FHS ones, WORKDIRs, where earlier COPYs wrote) is a directory, any other
    is the file's new path; the last CMD and ENTRYPOINT win."""
    _new_name(name)
    if not isinstance(text, str):
        raise _fail(f"the Dockerfile must be text, got {_type_name(text)}")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_DOCKERFILE:
        raise _fail(f"the Dockerfile is {size} bytes, more than {MAX_DOCKERFILE}; shorten it")
    if "\0" in text:
        raise _fail(
            f"Dockerfile line {text.count(chr(10), 0, text.index(chr(0))) + 1}: a NUL character; remove it"
        )
    lines = text.removeprefix("\ufeff").split("\n")
    esc = _directives(lines)
    inherited = {"PATH": DEFAULT_PATH} if inherited_env is None else dict(inherited_env)
    b = _Build(name, None if context is None else _context(context), inherited, esc)
    for lineno, line in _logical_lines(lines, esc):
        word, rest = (line.split(None, 1) + [""])[:2]
        instruction = word.upper()
        try:
            if instruction in _UNSUPPORTED:
                raise _fail(
                    f"{instruction} is not supported (atoll supports {', '.join(DOCKERFILE_INSTRUCTIONS)}); "
                    f"{_UNSUPPORTED[instruction]}"
                )
            if instruction not in DOCKERFILE_INSTRUCTIONS:
                raise _fail(
                    f"unknown instruction {_show(word)} (atoll supports {', '.join(DOCKERFILE_INSTRUCTIONS)}); "
                    f"if it continues the line above, end that line with {esc}"
                )
            if instruction != "FROM" and b.from_ is None:
                raise _fail(
                    f"{instruction} before FROM; a Dockerfile starts with FROM (a template name or oci-archive:PATH)"
                )
            if instruction == "FROM":
                b.do_from(rest)
            elif instruction == "RUN":
                b.do_run(rest)
            elif instruction in ("COPY", "ADD"):
                b.do_copy(instruction, rest)
            elif instruction == "ENV":
                b.do_env(rest)
            elif instruction == "WORKDIR":
                b.do_workdir(rest)
            elif instruction == "USER":
                b.do_user(rest)
            else:
                b.do_start(instruction, rest)
        except errors.InvalidRequest as e:
            raise _fail(f"Dockerfile line {lineno}: {e.message}") from None
    if b.from_ is None:
        raise _fail(
            "the Dockerfile has no FROM line; start it with FROM base (or a template name, or oci-archive:PATH)"
        )
    try:
        return TemplateSpec(
            name=name,
            from_=b.from_,
            steps=tuple(b.steps),
            env=tuple(sorted(b.env.items())),
            workdir=b.workdir if b.workdir_set else None,
            user=b.user if b.user_set else None,
            start=b.start(),
        )
    except errors.InvalidRequest as e:
        raise _fail(f"Dockerfile: {e.message}") from None
