"""The installation's certificate authority: what sandboxes trust, what the edge signs with.

One root CA per installation, made at first start under `$ATOLL_HOME/ca/` (`root.crt`, and
`root.key` mode 0600). It never enters a template (templates may be shared between installations,
ATOLL_TEMPLATE_DIR): each sandbox gets the root certificate in its spec and the worker installs it
in that sandbox's own root file system. Each worker gets an intermediate CA at adoption (its egress
gateway signs the leaves of intercepted HTTPS with it, core.worker_api.Authority); the ingress
router's certificate (`*.{ATOLL_PREVIEW_DOMAIN}`) comes from the root unless the operator supplies
one (ATOLL_INGRESS_CERT_FILE / ATOLL_INGRESS_KEY_FILE). The API's own certificate
(ATOLL_TLS_NAMES) comes from the root too (`api_cert_files`), and so does each remote worker's
(`sign_worker`: over the key of the CSR it sends before registering, naming it); the server calls a
worker through `worker_client_context`, which trusts the root alone, and checks the name on top
(core.pki.check_worker_certificate, in controlplane.remote_worker).
Called by controlplane.main (start-up), controlplane.workers (adoption), controlplane.lifecycle
(specs) and controlplane.routes_workers (worker certificates); uses core.pki.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import ssl
import urllib.parse

from atoll.core import config, pki
from atoll.core import worker_api as api

log = logging.getLogger(__name__)


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Authority:
    def __init__(self, root_pem: bytes, key_pem: bytes):
        self.root_pem = root_pem
        self._key_pem = key_pem

    @classmethod
    def open(cls, home: str, installation: str = "") -> Authority:
        """Load the installation's CA, or make it (first start). A half-written pair (a crash
        between the two files) is made again: nothing was issued from it yet that outlives it."""
        d = os.path.join(home, "ca")
        os.makedirs(d, mode=0o700, exist_ok=True)
        crt, key = os.path.join(d, "root.crt"), os.path.join(d, "root.key")
        if os.path.exists(crt) and os.path.exists(key):
            with open(crt, "rb") as f:
                root = f.read()
            with open(key, "rb") as f:
                kp = f.read()
            if b"BEGIN CERTIFICATE" not in root or b"PRIVATE KEY" not in kp:
                raise config.SettingsError(
                    f"{d} holds no usable CA (root.crt / root.key); move the directory away to make a new one"
                )
            return cls(root, kp)
        for p in (crt, key, crt + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        root, kp = pki.new_root_ca(f"atoll installation CA {installation}".strip())
        _write_private(key, kp)
        _write_private(crt + ".tmp", root)
        os.chmod(crt + ".tmp", 0o644)
        os.replace(crt + ".tmp", crt)
        log.info("made the installation's certificate authority", extra={"path": crt})
        return cls(root, kp)

    def for_worker(self, name: str) -> api.Authority:
        cert, key = pki.issue_intermediate(self.root_pem, self._key_pem, f"atoll worker {name}")
        return api.Authority(root_pem=self.root_pem.decode(), cert_pem=cert.decode(), key_pem=key.decode())

    def server_cert(self, names: list[str], ips: list[str]) -> tuple[bytes, bytes]:
        """A leaf for the ingress router (its names and addresses), chain included."""
        cert, key = pki.issue_server(self.root_pem, self._key_pem, names, days=365, ip_addresses=ips)
        return cert, key

    def sign_worker(self, csr_pem: bytes, name: str, url: str) -> bytes:
        """The certificate of worker `name` served at `url` (its host in the SAN), over the key of
        its CSR; a ValueError when the CSR is not usable."""
        host = urllib.parse.urlsplit(url).hostname
        if not host:
            raise ValueError(f"url {url!r} names no host")
        return pki.issue_worker(self.root_pem, self._key_pem, csr_pem, name, host)

    def worker_client_context(self) -> ssl.SSLContext:
        """What the server calls a worker over https with: trusts this installation's root alone
        and checks the host name (the worker's name is checked after the handshake)."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=self.root_pem.decode())
        return ctx

    def api_cert_files(self, home: str, names: list[str]) -> tuple[str, str]:
        """A certificate for the API at `names` (DNS names and IP addresses), made at each start
        and written under `$ATOLL_HOME/ca/` (`api.crt` with the root after it, `api.key` 0600):
        (cert_file, key_file), as uvicorn loads them."""
        dns, ips = [], []
        for n in names:
            try:
                ipaddress.ip_address(n)
                ips.append(n)
            except ValueError:
                dns.append(n)
        cert, key = pki.issue_server(self.root_pem, self._key_pem, dns, days=365, ip_addresses=ips)
        d = os.path.join(home, "ca")
        crt_path, key_path = os.path.join(d, "api.crt"), os.path.join(d, "api.key")
        for p in (crt_path, key_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        _write_private(key_path, key)
        _write_private(crt_path, cert + self.root_pem)
        return crt_path, key_path
