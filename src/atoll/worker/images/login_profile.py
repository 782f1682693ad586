"""The base template's login profile without program starts: the same PATH, environment and umask.

Every string command runs as `bash -l -c` (guest/agent/shells.py), so Debian's login profile runs
before each one: /etc/profile runs `id -u` to choose PATH, root's ~/.profile runs `mesg n`. Each
is a fork and exec under gVisor's ptrace platform (~20 ms apiece, bench/bench_shell.py). The
edits below give the same result without starting a program:

- `$(id -u)` becomes `${EUID:-$(id -u)}`: bash knows its effective uid (EUID, read-only, never
  exported); other shells (dash reading /etc/profile as `sh -l`) still ask `id -u`.
- `mesg n` (deny other users' `write` to this terminal) runs only when standard input or output is
  a terminal: those are the descriptors it looks for one on (its standard error is sent to
  /dev/null here), and without one it fails and `|| true` ignored it.

`patch(rootfs)` is called by templates._customize after mmdebstrap; the edits are part of the
layer's content hash (templates.Recipe.content_hash via `digest()`), so a cached layer, and the
template images made from it, are rebuilt with the new profile. tests/integration/test_login_profile.py
compares what a login shell sees against the unedited profile, in a sandbox.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

log = logging.getLogger(__name__)

# (file in the rootfs, text Debian 12 ships, what replaces it); each text is replaced everywhere.
EDITS: tuple[tuple[str, str, str], ...] = (
    ("etc/profile", 'if [ "$(id -u)" -eq 0 ]; then', 'if [ "${EUID:-$(id -u)}" -eq 0 ]; then'),
    (
        "root/.profile",
        "mesg n 2> /dev/null || true",
        "if [ -t 0 ] || [ -t 1 ]; then\n  mesg n 2> /dev/null || true\nfi",
    ),
)


def digest() -> str:
    """The edits' identity, for the layer's content hash."""
    return hashlib.sha256(json.dumps(EDITS).encode()).hexdigest()[:16]


def patch(rootfs: str) -> list[str]:
    """Apply EDITS to the profile files under `rootfs`; returns the files changed. A file without
    the expected text (another distribution's) is left as it is and logged."""
    changed = []
    for rel in dict.fromkeys(path for path, _, _ in EDITS):
        path = os.path.join(rootfs, rel)
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            log.warning("login profile: %s is missing; left as it is", rel)
            continue
        new = text
        for _, old, replacement in (e for e in EDITS if e[0] == rel):
            if replacement in new:  # edited already (the replacement may contain the old text)
                continue
            if old not in new:
                log.warning("login profile: %s does not contain %r; left as it is", rel, old)
                continue
            new = new.replace(old, replacement)
        if new != text:
            st = os.stat(path)
            with open(path, "w") as f:
                f.write(new)
            os.chmod(path, st.st_mode & 0o7777)
            changed.append(rel)
    return changed


def unpatch(text: str, rel: str) -> str:
    """The file as Debian ships it, from its edited text (what the tests compare against)."""
    for path, old, replacement in EDITS:
        if path == rel:
            text = text.replace(replacement, old)
    return text
