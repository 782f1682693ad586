"""Certificates for the egress gateway's interception of secret-bearing HTTPS: a per-installation
root CA, an intermediate under it, and short-lived server (leaf) certificates for the names the
gateway intercepts. EC P-256 keys, SHA-256 signatures, PEM bytes in and out.

Also the check of an operator's PEM file of certificates (`check_certificates`: every block must
be one whole certificate) and the block pattern that picks certificates out of such a file.

And a worker's own identity on the server ↔ worker link: the worker makes its key and a CSR
(`new_worker_request`; the key never leaves it), the control plane's CA signs it
(`issue_worker`: the worker's host in the SAN, and its name as the URI `urn:atoll:worker:<name>`),
and the control plane checks, on every connection to a worker, that the certificate names the
worker it meant to reach (`check_worker_certificate`; the chain itself is checked by the TLS
handshake against the installation CA).

Pure: no file I/O (callers store the PEM). Called by gateway.intercept (leaves, per name), by
whoever sets an installation up (the root and the intermediate), by the worker's settings and
worker.host.trust (operators' CA files), and by controlplane.authority, controlplane.remote_worker
and worker.registration (worker certificates).
"""

from __future__ import annotations

import datetime
import ipaddress
import re
import warnings
from collections.abc import Iterable

from cryptography import utils as crypto_utils
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SKEW = datetime.timedelta(hours=1)
"""Certificates start this long before they are made: a peer whose clock is behind accepts them."""


def new_root_ca(common_name: str, days: int = 3650) -> tuple[bytes, bytes]:
    """A self-signed root CA that may sign one level of intermediates: (cert_pem, key_pem)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(common_name)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
        .add_extension(_ca_key_usage(), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def issue_intermediate(
    ca_cert_pem: bytes, ca_key_pem: bytes, common_name: str, days: int = 825
) -> tuple[bytes, bytes]:
    """An intermediate CA under `ca` that signs leaves only (path_length 0): (cert_pem, key_pem)."""
    ca_cert, ca_key = _load(ca_cert_pem, ca_key_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _issued(ca_cert, ca_key, key, _name(common_name), days)
    cert = (
        builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_ca_key_usage(), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


def issue_server(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    names: list[str],
    days: int = 30,
    ip_addresses: Iterable[str] = (),
) -> tuple[bytes, bytes]:
    """A TLS server certificate for `names` (DNS names, `*.example.com` wildcards allowed) and
    `ip_addresses`, signed by `ca`: (cert_pem, key_pem). Raises ValueError when it names nothing."""
    ips = [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans += ips
    if not sans:
        raise ValueError("a server certificate needs at least one DNS name or IP address")
    ca_cert, ca_key = _load(ca_cert_pem, ca_key_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name(names[0] if names else str(ips[0].value))
    builder = _issued(ca_cert, ca_key, key, subject, days)
    cert = (
        builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _cert_pem(cert), _key_pem(key)


WORKER_URI = "urn:atoll:worker:"
"""A worker certificate's SAN URI: this prefix and the worker's name."""


def new_worker_request(name: str) -> tuple[bytes, bytes]:
    """A worker's new private key and its certificate signing request: (key_pem, csr_pem)."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_name(f"atoll worker {name}"))
        .sign(key, hashes.SHA256())
    )
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def issue_worker(
    ca_cert_pem: bytes, ca_key_pem: bytes, csr_pem: bytes, name: str, host: str, days: int = 825
) -> bytes:
    """A certificate for worker `name` reached at `host` (a DNS name or an IP address) over the key
    of `csr_pem`: server and client use, SAN = `host` and `urn:atoll:worker:<name>`. Only the
    CSR's key is taken from it (its subject and extensions are the caller's wish, not ours). A
    ValueError when the CSR is not one or its signature does not verify."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise ValueError(f"the certificate request is not a PEM CSR ({_reason(e)})") from None
    if not csr.is_signature_valid:
        raise ValueError("the certificate request's signature does not verify")
    public = csr.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise ValueError("the certificate request's key must be an EC key")
    try:
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(host))]
    except ValueError:
        sans = [x509.DNSName(host)]
    sans.append(x509.UniformResourceIdentifier(WORKER_URI + name))
    ca_cert, ca_key = _load(ca_cert_pem, ca_key_pem)
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"atoll worker {name}"))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _cert_pem(cert)


def worker_names(cert_der: bytes) -> list[str]:
    """The worker names a certificate (DER) carries as `urn:atoll:worker:` SAN URIs."""
    cert = x509.load_der_x509_certificate(cert_der)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [
        u[len(WORKER_URI) :]
        for u in san.get_values_for_type(x509.UniformResourceIdentifier)
        if u.startswith(WORKER_URI)
    ]


def check_worker_certificate(cert_der: bytes | None, name: str) -> None:
    """The peer certificate (DER, already verified against the installation CA by the handshake)
    must name worker `name`; a ValueError saying whom it names otherwise — another worker's
    certificate (and key) is refused."""
    if not cert_der:
        raise ValueError(f"the peer presented no certificate; worker {name!r} must present its own")
    names = worker_names(cert_der)
    if names != [name]:
        whom = ", ".join(repr(n) for n in names) if names else "no worker"
        raise ValueError(
            f"the peer's certificate names {whom}, not worker {name!r}: a worker must present the "
            "certificate it got at its own registration"
        )


def fingerprint(cert_pem: bytes) -> str:
    """The SHA-256 fingerprint of a certificate, lower-case hex (64 characters)."""
    return x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256()).hex()


CERTIFICATE_BLOCK = re.compile(
    r"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+?-----END CERTIFICATE-----"
)
"""One PEM certificate: its BEGIN line, base64 lines only, its END line."""
_BEGIN = "-----BEGIN CERTIFICATE-----"


def check_certificates(text: str) -> int:
    """How many certificates `text` (a PEM file) holds, each parsed; a ValueError saying which
    block (its number and line) is not one whole certificate, and why. Text outside the blocks
    (comments, a private key) is not looked at. A certificate that cryptography reads only with a
    deprecation warning (a serial number that is not positive, as a few in Debian's system bundle)
    counts as good: OpenSSL, which sandboxes and the gateway load them with, accepts it."""
    blocks = {m.start(): m for m in CERTIFICATE_BLOCK.finditer(text)}
    if not blocks and _BEGIN not in text:
        raise ValueError(f"it holds no PEM certificate ({_BEGIN})")
    n, at = 0, text.find(_BEGIN)
    while at != -1:
        n += 1
        where = f"certificate {n} (line {text.count(chr(10), 0, at) + 1})"
        block = blocks.get(at)
        if block is None:
            raise ValueError(
                f"{where} is not a PEM block: between its {_BEGIN} line and the next "
                "-----END CERTIFICATE----- line there may be base64 lines only (no headers, spaces "
                "or other text), and every block needs its END line"
            )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", crypto_utils.CryptographyDeprecationWarning)
                x509.load_pem_x509_certificate(block.group(0).encode("ascii"))
        except ValueError as e:
            raise ValueError(f"{where} is not a valid X.509 certificate ({_reason(e)})") from None
        at = text.find(_BEGIN, block.end())
    return n


def _reason(e: ValueError) -> str:
    text = str(e)
    if "MalformedFraming" in text or "Unable to load PEM" in text:
        return "its base64 text does not decode"
    if "asn1" in text.lower():
        return "its bytes are not DER: the base64 text is cut short, damaged or not a certificate"
    return text[:200]


# ---- helpers ------------------------------------------------------------------------------------
def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


def _name(common_name: str) -> x509.Name:
    # a CN is at most 64 characters (RFC 5280); a longer name still goes in the SAN
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def _ca_key_usage() -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )


def _issued(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    subject: x509.Name,
    days: int,
) -> x509.CertificateBuilder:
    """A builder for a certificate `ca` issues, valid no longer than `ca` itself."""
    now = _now()
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )


def _load(cert_pem: bytes, key_pem: bytes) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an EC private key")
    return cert, key


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
