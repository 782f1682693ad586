"""Issue 21 item 6, the settings side: a worker's --server must be https:// unless it is on a
loopback address; --ca-file is checked at start; the server's ATOLL_TLS_* settings; worker URLs the
server accepts; and the worker certificates of core.pki (a worker presenting another worker's
certificate is refused by the server's check)."""

from __future__ import annotations

import pytest

from atoll.controlplane import settings as server_settings
from atoll.controlplane.remote_worker import RemoteWorker
from atoll.core import config, errors, pki
from atoll.worker.service import settings as worker_settings


def _load(tmp_path, **env):
    return worker_settings.load({"ATOLL_HOME": str(tmp_path), **env})


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:7080", "http://localhost:7080", "http://[::1]:7080", "http://127.0.0.2:1"]
)
def test_plain_http_to_loopback_stays_allowed(tmp_path, url):
    assert _load(tmp_path, ATOLL_SERVER_URL=url).server_url == url


@pytest.mark.parametrize("url", ["http://10.0.0.5:7080", "http://atoll.example.com", "http://0.0.0.0:7080"])
def test_plain_http_to_another_address_is_refused_at_start(tmp_path, url):
    with pytest.raises(config.SettingsError) as e:
        _load(tmp_path, ATOLL_SERVER_URL=url)
    msg = str(e.value)
    assert url in msg and "--ca-file" in msg and "https://" in msg and "ATOLL_TLS_NAMES" in msg


def test_several_servers_are_checked_each_and_kept_in_order(tmp_path):
    s = _load(tmp_path, ATOLL_SERVER_URL=" http://127.0.0.1:7080/, http://127.0.0.1:7090 ")
    assert s.server_urls == ("http://127.0.0.1:7080", "http://127.0.0.1:7090")
    assert s.server_url == "http://127.0.0.1:7080"
    for bad, said in (
        ("http://127.0.0.1:1,http://10.0.0.5:1", "http://10.0.0.5:1"),  # each is checked
        ("http://127.0.0.1:1,https://10.0.0.5:1", "mixes http:// and https://"),
        ("http://127.0.0.1:1,http://127.0.0.1:1", "names a server twice"),
    ):
        with pytest.raises(config.SettingsError) as e:
            _load(tmp_path, ATOLL_SERVER_URL=bad)
        assert said in str(e.value), (bad, str(e.value))


def test_https_needs_no_ca_file_and_takes_a_checked_one(tmp_path):
    assert _load(tmp_path, ATOLL_SERVER_URL="https://10.0.0.5:7080").ca_file is None
    root, _ = pki.new_root_ca("test CA")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(root)
    s = worker_settings.load({"ATOLL_HOME": str(tmp_path)}, server="https://10.0.0.5:7080", ca_file=str(ca))
    assert s.ca_file == str(ca)
    bad = tmp_path / "bad.crt"
    bad.write_text("-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
    with pytest.raises(config.SettingsError, match="ATOLL_CA_FILE"):
        _load(tmp_path, ATOLL_SERVER_URL="https://10.0.0.5:7080", ATOLL_CA_FILE=str(bad))
    with pytest.raises(config.SettingsError, match="cannot be read"):
        _load(tmp_path, ATOLL_SERVER_URL="https://10.0.0.5:7080", ATOLL_CA_FILE=str(tmp_path / "none"))
    with pytest.raises(config.SettingsError, match="not https://"):
        _load(tmp_path, ATOLL_SERVER_URL="http://127.0.0.1:7080", ATOLL_CA_FILE=str(ca))
    with pytest.raises(config.SettingsError, match="serves its API over TLS"):
        _load(tmp_path, ATOLL_SERVER_URL="https://10.0.0.5:7080", ATOLL_WORKER_ADVERTISE="http://10.0.0.6:1")


def test_server_tls_settings(tmp_path):
    s = server_settings.load({"ATOLL_HOME": str(tmp_path), "ATOLL_TLS_NAMES": "atoll.example.com, 10.0.0.5"})
    assert s.tls_names == ("atoll.example.com", "10.0.0.5") and s.tls
    assert not server_settings.load({"ATOLL_HOME": str(tmp_path)}).tls
    with pytest.raises(config.SettingsError, match="neither an IP address nor a DNS name"):
        server_settings.load({"ATOLL_HOME": str(tmp_path), "ATOLL_TLS_NAMES": "bad name"})
    with pytest.raises(config.SettingsError, match="ATOLL_TLS_KEY_FILE"):
        server_settings.load({"ATOLL_HOME": str(tmp_path), "ATOLL_TLS_CERT_FILE": str(tmp_path)})


def test_the_server_refuses_a_plain_worker_url_off_loopback():
    assert RemoteWorker.address("http://127.0.0.1:9") == ("127.0.0.1", 9)
    assert RemoteWorker.address("https://10.0.0.5:9") == ("10.0.0.5", 9)
    with pytest.raises(errors.InvalidRequest, match="not loopback"):
        RemoteWorker.address("http://10.0.0.5:9")


def test_a_worker_certificate_names_its_worker_and_no_other():
    root, key = pki.new_root_ca("test CA")
    _, csr_a = pki.new_worker_request("a")
    _, csr_b = pki.new_worker_request("b")
    from cryptography import x509

    def der(pem: bytes) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)

    cert_a = pki.issue_worker(root, key, csr_a, "a", "127.0.0.1")
    cert_b = pki.issue_worker(root, key, csr_b, "b", "worker-b.example")
    assert pki.worker_names(der(cert_a)) == ["a"]
    pki.check_worker_certificate(der(cert_a), "a")
    with pytest.raises(ValueError, match="names 'b', not worker 'a'"):
        pki.check_worker_certificate(der(cert_b), "a")
    with pytest.raises(ValueError, match="no certificate"):
        pki.check_worker_certificate(None, "a")
    server_leaf, _ = pki.issue_server(root, key, ["x.example"])
    with pytest.raises(ValueError, match="names no worker"):
        pki.check_worker_certificate(der(server_leaf), "a")
    with pytest.raises(ValueError, match="not a PEM CSR"):
        pki.issue_worker(root, key, b"junk", "a", "127.0.0.1")
