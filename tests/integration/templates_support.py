"""Package repositories for the template tests (tests/integration/test_templates.py): a PEP 503
simple index with one hand-made pure-Python wheel, and a flat apt repository with one hand-made
.deb, written into a directory that a test host (atoll.testing.testnet.TestHost) serves over plain
HTTP from inside its own network namespace. Builds then install from these instead of PyPI or a
Debian mirror, so no test reaches the internet.
"""

from __future__ import annotations

import base64
import email.utils
import gzip
import hashlib
import os
import subprocess
import tempfile
import zipfile

PIP_PACKAGE = "atolltestpkg"
PIP_VALUE = "atolltestpkg works"
APT_PACKAGE = "atoll-test-hello"
APT_LINE = "hello from atoll-test-hello"
PORT = 8080

SERVER = r"""
import functools, http.server, sys
addr, root = sys.argv[1], sys.argv[2]
class H(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *args):  # one line per request: the path asked for
        with open(root + "/requests.log", "a") as f:
            f.write(f"{self.command} {self.path}\n")
s = http.server.ThreadingHTTPServer((addr, 8080), functools.partial(H, directory=root + "/www"))
print("ready", flush=True)
s.serve_forever()
"""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(dest_dir: str) -> str:
    """`atolltestpkg-1.0-py3-none-any.whl` in dest_dir; its path."""
    dist = f"{PIP_PACKAGE}-1.0.dist-info"
    files = {
        f"{PIP_PACKAGE}/__init__.py": f"VALUE = {PIP_VALUE!r}\n".encode(),
        f"{dist}/METADATA": (
            f"Metadata-Version: 2.1\nName: {PIP_PACKAGE}\nVersion: 1.0\n"
            "Summary: a wheel made by atoll's template tests\n"
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: atoll-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    record += f"{dist}/RECORD,,\n"
    path = os.path.join(dest_dir, f"{PIP_PACKAGE}-1.0-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{dist}/RECORD", record)
    return path


def make_deb(dest_dir: str) -> str:
    """`atoll-test-hello_1.0_all.deb` (installs /usr/bin/atoll-test-hello) in dest_dir; its path."""
    with tempfile.TemporaryDirectory(prefix="atoll-deb-") as root:
        pkg = os.path.join(root, "pkg")
        os.makedirs(os.path.join(pkg, "DEBIAN"))
        os.makedirs(os.path.join(pkg, "usr", "bin"))
        with open(os.path.join(pkg, "DEBIAN", "control"), "w") as f:
            f.write(
                f"Package: {APT_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
                "Maintainer: atoll tests <tests@atoll.invalid>\n"
                "Description: a package made by atoll's template tests\n prints one line\n"
            )
        exe = os.path.join(pkg, "usr", "bin", APT_PACKAGE)
        with open(exe, "w") as f:
            f.write(f"#!/bin/sh\necho '{APT_LINE}'\n")
        os.chmod(exe, 0o755)
        path = os.path.join(dest_dir, f"{APT_PACKAGE}_1.0_all.deb")
        subprocess.run(
            ["dpkg-deb", "-Zgzip", "--root-owner-group", "--build", pkg, path],
            check=True,
            capture_output=True,
        )
    return path


def write_repositories(root: str) -> None:
    """`root/www/simple/...` (PEP 503), `root/www/packages/<wheel>` and `root/www/apt/` (flat)."""
    www = os.path.join(root, "www")
    packages = os.path.join(www, "packages")
    simple = os.path.join(www, "simple", PIP_PACKAGE)
    apt = os.path.join(www, "apt")
    for d in (packages, simple, apt):
        os.makedirs(d, exist_ok=True)
    wheel = make_wheel(packages)
    with open(wheel, "rb") as f:
        wheel_hash = _sha256(f.read())
    name = os.path.basename(wheel)
    with open(os.path.join(www, "simple", "index.html"), "w") as f:
        f.write(f'<!DOCTYPE html><html><body><a href="{PIP_PACKAGE}/">{PIP_PACKAGE}</a></body></html>\n')
    with open(os.path.join(simple, "index.html"), "w") as f:
        f.write(
            "<!DOCTYPE html><html><body>"
            f'<a href="../../packages/{name}#sha256={wheel_hash}">{name}</a>'
            "</body></html>\n"
        )
    deb = make_deb(apt)
    with open(deb, "rb") as f:
        deb_data = f.read()
    stanza = (
        f"Package: {APT_PACKAGE}\nVersion: 1.0\nArchitecture: all\n"
        "Maintainer: atoll tests <tests@atoll.invalid>\nInstalled-Size: 1\n"
        f"Filename: ./{os.path.basename(deb)}\nSize: {len(deb_data)}\nSHA256: {_sha256(deb_data)}\n"
        "Description: a package made by atoll's template tests\n prints one line\n\n"
    ).encode()
    packages_gz = gzip.compress(stanza, mtime=0)
    with open(os.path.join(apt, "Packages"), "wb") as f:
        f.write(stanza)
    with open(os.path.join(apt, "Packages.gz"), "wb") as f:
        f.write(packages_gz)
    release = (
        "Origin: atoll-tests\nLabel: atoll-tests\n"
        f"Date: {email.utils.formatdate(usegmt=True)}\nSHA256:\n"
        f" {_sha256(stanza)} {len(stanza)} Packages\n"
        f" {_sha256(packages_gz)} {len(packages_gz)} Packages.gz\n"
    )
    with open(os.path.join(apt, "Release"), "w") as f:
        f.write(release)


def requests_seen(root: str) -> list[str]:
    try:
        with open(os.path.join(root, "requests.log")) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []
