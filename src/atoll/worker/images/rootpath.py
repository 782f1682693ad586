"""Where a files step's destination really is in the template's root file system, resolved the
way Docker resolves a COPY destination: `/bin/tool` over Debian's `/bin -> usr/bin` is
`usr/bin/tool` of the new layer, never a real `bin/` directory that would hide the image's `/bin`.
Called by worker.images.layers (files_layer) before each host-side write.

The root file system is the overlay of a layer stack (`View`): the layer being written (read live,
it changes as the step writes), then the layers below it, top first. It is read on the host
without ever following a link there: each layer is walked from its own root component by
component with O_NOFOLLOW. A whiteout (a 0/0 character device) hides what lower layers hold at
its path, and an opaque directory (`trusted.overlay.opaque`) what they hold below it, as the
kernel's overlayfs (worker.host.storage) shows them to the sandbox.

Links are followed in this view only, inside the image's root (`follow`): an absolute target
starts again at the image's root, `..` stops at it, a missing component is kept as named (it is
made, as Docker makes a dangling link's target), and past MAX_LINKS links the path is a loop.
`destination` follows the links of a path's parent directories; the last component is replaced
(a file, a link to a file, a dangling link) unless it is a directory or a link to one, which a file
cannot replace without hiding everything in it: that is refused, naming the path.
"""

from __future__ import annotations

import contextlib
import os
import stat
import typing
from dataclasses import dataclass

from atoll.core import errors

MAX_LINKS = 40
"""Links followed while resolving one path (Linux's MAXSYMLINKS)."""
MAX_PATH = 4096
"""Bytes of a resolved path, and components looked at while resolving one (links' targets
included): a bound on the work a layer's crafted links can ask of the host (Linux's PATH_MAX)."""

Parts = tuple[str, ...]


@dataclass(frozen=True)
class Entry:
    """What a path is in the merged view."""

    kind: str
    """"dir", "link", "file" (anything else that is not a directory) or "absent"."""
    target: str = ""
    """A link's target, as stored."""
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    """A directory's permission bits and owner (of its topmost layer)."""


ABSENT = Entry("absent")


class NotADirectory(Exception):
    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


class LinkLoop(Exception):
    def __init__(self, path: str):
        super().__init__(path)
        self.path = path


class TooLong(Exception):
    pass


def show(parts: typing.Sequence[str]) -> str:
    return "/" + "/".join(parts)


class View:
    """The merged root file system of `top` (the layer being written, or None) over `lower` (host
    paths of layer directories, top first; lower layers never change, so their answers are kept)."""

    def __init__(self, top: str | None, lower: typing.Sequence[str]):
        self.top = top
        self.lower = list(lower)
        self._lower_dirs: dict[Parts, list[int]] = {(): list(range(len(self.lower)))}
        """Merged directories of the lower layers: the layers that hold each (top first)."""
        self._lower_entries: dict[tuple[Parts, str], Entry] = {}

    def lookup(self, parent: Parts, name: str) -> Entry:
        """`parent/name` (parent: a directory of the view, its real components) as the view shows it."""
        below = self._lower_lookup(parent, name)
        if self.top is not None:
            probed = _probe(self.top, parent, name)
            if probed is not None:
                return probed[0]
        return below

    def kind(self, parts: Parts) -> str:
        return "dir" if not parts else self.lookup(parts[:-1], parts[-1]).kind

    def lower_dir(self, parts: Parts) -> Entry | None:
        """The lower layers' directory at `parts` (for its mode and owner), or None."""
        if not parts:
            return None
        e = self._lower_lookup(parts[:-1], parts[-1])
        return e if e.kind == "dir" else None

    def _layers_of(self, parent: Parts) -> list[int]:
        if parent not in self._lower_dirs and parent:
            self._lower_lookup(parent[:-1], parent[-1])
        return self._lower_dirs.get(parent, [])

    def _lower_lookup(self, parent: Parts, name: str) -> Entry:
        key = (parent, name)
        cached = self._lower_entries.get(key)
        if cached is not None:
            return cached
        entry: Entry = ABSENT
        holders: list[int] = []
        for i in self._layers_of(parent):
            probed = _probe(self.lower[i], parent, name)
            if probed is None:  # not in this layer: the next one down may have it
                continue
            e, opaque = probed
            if e.kind == "dir":
                if not holders:
                    entry = e
                holders.append(i)
                if opaque:
                    break
                continue
            if not holders:  # a file, link or whiteout over what lies below
                entry = e
            break  # below a directory: a non-directory ends the merge
        if entry.kind == "dir":
            self._lower_dirs[parent + (name,)] = holders
        self._lower_entries[key] = entry
        return entry


def _probe(layer: str, parent: Parts, name: str) -> tuple[Entry, bool] | None:
    """`name` in `layer/parent` walked with O_NOFOLLOW: (its entry, whether it is an opaque
    directory), ABSENT for a whiteout, or None when the layer does not hold it."""
    try:
        fd = os.open(layer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        for part in parent:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:  # missing, or not a directory in this layer
                return None
            os.close(fd)
            fd = nxt
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode):
            opaque = False
            with contextlib.suppress(OSError):
                d = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                try:
                    opaque = os.getxattr(d, "trusted.overlay.opaque") == b"y"
                finally:
                    os.close(d)
            return Entry("dir", mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid), opaque
        if stat.S_ISLNK(st.st_mode):
            return Entry("link", target=os.readlink(name, dir_fd=fd)), False
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            return ABSENT, False
        return Entry("file"), False
    finally:
        os.close(fd)


def follow(view: View, parts: typing.Iterable[str]) -> Parts:
    """The real components of a path in the view, every link on the way (the last one too)
    followed inside the root. Raises NotADirectory (a component below a non-directory), LinkLoop
    (more than MAX_LINKS links) or TooLong (past MAX_PATH bytes or components)."""
    todo = list(parts)
    done: list[str] = []
    links = steps = 0
    while todo:
        steps += 1
        if steps > MAX_PATH or _too_long(done):
            raise TooLong()
        name = todo.pop(0)
        if name in ("", "."):
            continue
        if name == "..":  # `done` holds real directories only: their lexical parent is the real one
            if done:
                done.pop()
            continue
        e = view.lookup(tuple(done), name)
        if e.kind == "link":
            links += 1
            if links > MAX_LINKS:
                raise LinkLoop(show([*done, name]))
            if e.target.startswith("/"):
                done = []
            todo[:0] = e.target.split("/")
            continue
        done.append(name)
        if e.kind == "file" and any(todo):
            raise NotADirectory(show(done))
    if _too_long(done):
        raise TooLong()
    return tuple(done)


def _too_long(parts: typing.Sequence[str]) -> bool:
    return sum(len(p.encode("utf-8", "surrogateescape")) + 1 for p in parts) > MAX_PATH


def destination(view: View, path: str) -> tuple[Parts, str]:
    """Where a files step writes `path` (absolute, normalised): its parent directory's real
    components in the view (links followed inside the root) and its name there. Refuses a path
    below a file or a loop of links, and one that is a directory of the image or a link to one."""
    parent_path, name = os.path.split(path.lstrip("/"))
    try:
        parent = follow(view, parent_path.split("/"))
        if view.kind(parent) == "file":
            raise NotADirectory(show(parent))
        if _too_long((*parent, name)):
            raise TooLong()
    except NotADirectory as e:
        raise errors.InvalidRequest(
            f"files: {path} is below {e.path}, which is a file in the template, not a directory; "
            "write it somewhere else, or replace that file first"
        ) from None
    except LinkLoop as e:
        raise errors.InvalidRequest(
            f"files: {path} cannot be resolved: the symbolic links on its way loop (at {e.path}, "
            f"after {MAX_LINKS} links); fix the links or write to the real path"
        ) from None
    except TooLong:
        raise errors.InvalidRequest(
            f"files: {path} cannot be resolved: through the template's symbolic links it is longer "
            f"than {MAX_PATH} bytes (or {MAX_PATH} components); fix the links or write to the real path"
        ) from None
    real = show((*parent, name))
    at = view.lookup(parent, name)
    if at.kind == "dir":
        where = "" if real == path else f" ({real}, through the template's symbolic links)"
        raise errors.InvalidRequest(
            f"files: {path} is a directory in the template{where}; a file or link cannot replace it "
            f"(it would hide everything in it): write the file into it ({path}/NAME; in a "
            f"Dockerfile, COPY SRC {path}/ with a trailing '/')"
        )
    if at.kind == "link":
        try:
            target = follow(view, (*parent, name))
        except (NotADirectory, LinkLoop, TooLong):
            target = None
        if target is not None and view.kind(target) == "dir":
            raise errors.InvalidRequest(
                f"files: {path} is a symbolic link to the directory {show(target)} in the template; "
                f"a file or link cannot replace it (the template's {path}/... would be gone): "
                f"write the file into it ({path}/NAME; in a Dockerfile, COPY SRC {path}/ with a "
                "trailing '/')"
            )
    return parent, name
