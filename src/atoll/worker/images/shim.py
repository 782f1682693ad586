"""atoll's compatibility shim for gVisor (compat/atoll-compat.c, see its header): built with the
host's gcc into every template's bottom layer and preloaded through /etc/ld.so.preload.

`install(rootfs)` compiles and preloads it; `digest()` names the source and the flags, so a layer's
key changes when either does. Called by worker.images.templates (the built-in base layer) and
worker.images.layers (a layer unpacked from an OCI archive).
"""

from __future__ import annotations

import hashlib
import os
import shutil

from atoll.core import errors
from atoll.worker.host import hostcmd

# The shim's source ships as package data; the compiled library and the preload entry in a layer.
COMPAT_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compat", "atoll-compat.c")
COMPAT_LIBRARY = "/usr/lib/atoll/libatoll-compat.so"
# -z noseparate-code: two LOAD segments instead of four, so every program start maps the shim with
# fewer mmap/mprotect calls (each a trap to the sentry on the ptrace platform).
COMPAT_CFLAGS = (
    "-shared",
    "-fPIC",
    "-O2",
    "-fno-stack-protector",
    "-Wl,-z,noseparate-code",
    "-Wall",
    "-Wextra",
    "-Werror",
)


def digest() -> str:
    """The shim's identity: its source and how it is compiled."""
    with open(COMPAT_SOURCE, "rb") as f:
        return hashlib.sha256(f.read() + repr(COMPAT_CFLAGS).encode()).hexdigest()


async def install(rootfs: str, source: str | None = None) -> str:
    """Compile the shim into `rootfs` and preload it into every dynamically linked program there.

    /etc/ld.so.preload (unlike LD_PRELOAD) survives a user clearing the environment and applies to
    setuid programs too. The host compiler builds for the host's architecture, which is the
    template's (mmdebstrap builds the native one). Returns the library's path on the host.
    """
    cc = shutil.which("gcc")
    if cc is None:
        raise errors.RuntimeFailure(
            "building a template needs gcc and libc6-dev on the host (for atoll's compatibility shim); "
            "install them with scripts/install-deps.sh or `apt-get install gcc libc6-dev`"
        )
    out = os.path.join(rootfs, COMPAT_LIBRARY.lstrip("/"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    await hostcmd.run(cc, *COMPAT_CFLAGS, "-o", out, source or COMPAT_SOURCE)
    os.chmod(out, 0o644)
    with open(os.path.join(rootfs, "etc/ld.so.preload"), "w") as f:
        f.write(COMPAT_LIBRARY + "\n")
    return out
