"""The Dockerfile subset a user template can be written in, parsed into a `templatespec.TemplateSpec`.

`parse` takes FROM, RUN, COPY, ADD, ENV, WORKDIR, USER, CMD and ENTRYPOINT; anything else is
refused with its line number, never ignored. It keeps Docker's line handling (parser directives,
the escape character, continuation lines), its word splitting and `$VAR` substitution for ENV,
WORKDIR, USER and COPY/ADD arguments, and resolves COPY/ADD sources against the build context sent
with the Dockerfile. What it makes is an ordinary spec: the model, its validation and its keys are
`core.templatespec`'s, whose validators it reuses so both ways of writing a template refuse the
same values in the same words.

Pure: standard library only, no I/O. Builds on core.templatespec (which does not import this
module). Called by the control plane's template routes (a Dockerfile body, or a tar build context
with a Dockerfile at its root).
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
import shlex
from collections.abc import Mapping

from atoll.core import errors, templatespec
from atoll.core.templatespec import (
    _ENV_NAME,
    _TEMPLATE_NAME,
    MAX_COMMAND,
    MAX_ENV,
    MAX_ENV_VALUE,
    MAX_FILE_BYTES,
    MAX_FILES,
    OCI_PREFIX,
    _abs_path,
    _fail,
    _from,
    _new_name,
    _show,
    _text,
    _type_name,
    _user,
)

MAX_DOCKERFILE = 1024 * 1024
MAX_DOCKERFILE_STEPS = 100
DEFAULT_PATH = templatespec.DEFAULT_PATH
"""The PATH a Dockerfile's `$PATH` means when the caller does not say what the FROM image has."""

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
# copies into it, as Docker does when the destination is an existing directory (/bin, /lib, /lib64
# and /sbin are links to /usr's: the worker writes through them, worker.images.rootpath).
_IMAGE_DIRS = frozenset(
    "/ /bin /boot /etc /etc/apt /etc/default /etc/profile.d /etc/ssl /etc/ssl/certs /home /lib /lib64 /media "
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
    """What the instructions so far have made (parse's state)."""

    def __init__(
        self,
        name: str,
        context: dict[str, tuple[bytes, int, str | None]] | None,
        inherited: dict[str, str],
        esc: str,
    ):
        self.name, self.context, self.inherited, self.esc = name, context, inherited, esc
        self.from_: str | None = None
        self.steps: list[templatespec.Step] = []
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

    def add_step(self, step: templatespec.Step) -> None:
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
        self.add_step(
            templatespec.Step(
                "run", command=command, env=self.step_env(), workdir=self.workdir, user=self.user
            )
        )

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
            if key == "PATH" and (problem := templatespec.path_problem(value)):
                raise _fail(f"ENV {problem}")  # here, with this line's number (not at the spec's end)
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
        items: dict[str, templatespec.FileItem] = {}
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
                data, file_mode, link = self.context[p]
                if instruction == "ADD" and not is_dir and _archive_like(p, data):
                    raise _fail(
                        f"ADD {p}: archive auto-extraction is not supported; COPY the archive and "
                        "unpack it with RUN tar -xf"
                    )
                # a symbolic link is copied as itself, never followed (its target may lead out of
                # the context; it is resolved inside the sandbox)
                items[path] = templatespec.FileItem(path, data, mode if mode is not None else file_mode, link)
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
        self.add_step(templatespec.Step("files", files=files, env=self.step_env(), workdir=self.workdir))

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


ContextEntry = tuple[bytes, int] | tuple[bytes, int, str | None]
"""A build context member: (content, mode) of a file, or (b"", mode, target) of a symbolic link."""


def _context(context: Mapping[str, ContextEntry]) -> dict[str, tuple[bytes, int, str | None]]:
    if not isinstance(context, Mapping):
        raise _fail(
            f"the build context must be a mapping of paths to (content, mode), got {_type_name(context)}"
        )
    out: dict[str, tuple[bytes, int, str | None]] = {}
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
        if not isinstance(value, tuple) or len(value) not in (2, 3):
            raise _fail(
                f"build context entry {path} must be (content bytes, mode) or (b'', mode, link "
                f"target), got {_type_name(value)}"
            )
        data, mode, link = value if len(value) == 3 else (*value, None)
        if not isinstance(data, bytes) or not isinstance(mode, int) or isinstance(mode, bool) or mode < 0:
            raise _fail(
                f"build context entry {path} must be (content bytes, mode int), got ({_type_name(data)}, {_show(mode)})"
            )
        if link is not None and (not isinstance(link, str) or data):
            raise _fail(f"build context symbolic link {path} must be (b'', mode, target str)")
        out[path] = (data, mode & 0o7777, link)  # a stat st_mode's file type bits are dropped
    for path in out:
        parent = posixpath.dirname(path)
        while parent:
            if parent in out:
                kind = "symbolic link" if out[parent][2] is not None else "file"
                raise _fail(f"build context has both the {kind} {parent} and {path} below it; drop one")
            parent = posixpath.dirname(parent)
    return out


def parse(
    text: str,
    name: str,
    context: Mapping[str, ContextEntry] | None = None,
    *,
    inherited_env: Mapping[str, str] | None = None,
) -> templatespec.TemplateSpec:
    """The spec of a Dockerfile (the subset above) for template `name`. `context` maps build
    context paths ("app/main.py") to (content, mode) for COPY and ADD, or (b"", mode, target) for
    a symbolic link, which COPY copies as a link (never following it). `inherited_env` is the FROM
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
        if not line.split():  # a continuation of nothing (a line that is only the escape)
            continue
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
        return templatespec.TemplateSpec(
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
