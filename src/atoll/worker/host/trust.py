"""The installation's CA in a sandbox: written into its own root file system, never the template.

Templates may be shared by installations (ATOLL_TEMPLATE_DIR), so the CA goes into each sandbox's
writable layer at create: `/etc/atoll/ca.crt` (the CA alone), `/etc/atoll/ca-bundle.crt` (the
template's bundle and the CA) and, when the template has one as a regular file, the system bundle
`/etc/ssl/certs/ca-certificates.crt` rewritten to the same (so programs that read only the system
store trust it too). Every path is opened component by component without following a symlink —
the template's files are not trusted to point inside the sandbox. `ENV` names the bundles for
Python, requests, curl and Node.js. The certificates are the installation CA and the worker's
ATOLL_SANDBOX_CA_FILE ones (`combine`; `host` there = the worker's system bundle), so a sandbox can
verify a private service's certificate. Called by worker.sandboxes (rootfs preparation) and
worker.node (the sandbox's env, the certificates it trusts).
"""

from __future__ import annotations

import contextlib
import os

from atoll.core import pki

CA = "/etc/atoll/ca.crt"
BUNDLE = "/etc/atoll/ca-bundle.crt"
SYSTEM_BUNDLE = ("etc", "ssl", "certs", "ca-certificates.crt")
ENV = {
    "SSL_CERT_FILE": BUNDLE,
    "REQUESTS_CA_BUNDLE": BUNDLE,
    "CURL_CA_BUNDLE": BUNDLE,
    "NODE_EXTRA_CA_CERTS": CA,
}
_MAX_BUNDLE = 8 * 1024 * 1024
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _opendir(parent: int, name: str, create: bool = False) -> int | None:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent)
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except (FileNotFoundError, NotADirectoryError, OSError):
        return None


def _write(dirfd: int, name: str, data: bytes) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dirfd)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dirfd)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_regular(dirfd: int, name: str) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        import stat

        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(_MAX_BUNDLE)


def certificates(text: str) -> str:
    """Only the PEM certificate blocks of `text`, one per line group: what an operator's CA file
    (ATOLL_SANDBOX_CA_FILE) adds to sandboxes. Anything else in the file — a private key kept
    beside the certificate, comments — never reaches a sandbox. (The worker's settings have
    checked at start-up that every certificate block of the file is one whole certificate,
    pki.check_certificates.)"""
    return "".join(m.group(0).replace("\r\n", "\n") + "\n" for m in pki.CERTIFICATE_BLOCK.finditer(text))


def combine(installation_pem: str, extra_pem: str) -> str:
    """The certificates a sandbox trusts besides its template's: the installation CA (from the
    control plane, SandboxSpec.trust_pem) and the worker's ATOLL_SANDBOX_CA_FILE ones."""
    parts = [p.strip() + "\n" for p in (installation_pem, extra_pem) if p.strip()]
    return "".join(parts)


def install(rootfs: str, pem: str) -> None:
    ca = pem.encode()
    if not ca.endswith(b"\n"):
        ca += b"\n"
    root = os.open(rootfs, _DIR)
    fds = [root]
    try:
        etc = _opendir(root, "etc", create=True)
        if etc is None:
            raise OSError(f"{rootfs}/etc is not a directory")
        fds.append(etc)
        system, certs = None, None
        ssl_dir = _opendir(etc, "ssl")
        if ssl_dir is not None:
            fds.append(ssl_dir)
            certs = _opendir(ssl_dir, "certs")
            if certs is not None:
                fds.append(certs)
                system = _read_regular(certs, SYSTEM_BUNDLE[-1])
        bundle = (system.rstrip(b"\n") + b"\n" if system else b"") + ca
        atoll = _opendir(etc, "atoll", create=True)
        if atoll is None:
            raise OSError(f"{rootfs}/etc/atoll is not a directory")
        fds.append(atoll)
        _write(atoll, "ca.crt", ca)
        _write(atoll, "ca-bundle.crt", bundle)
        if certs is not None and system is not None:
            _write(certs, SYSTEM_BUNDLE[-1], bundle)
    finally:
        for fd in reversed(fds):
            os.close(fd)
