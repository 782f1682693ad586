"""Settings precedence and API helpers (hermetic)."""

from __future__ import annotations

import os
import re

import pytest

from atoll.controlplane import http, schemas, settings
from atoll.core import config, errors
from atoll.worker.service import settings as worker_settings


def test_flag_beats_env_beats_default(monkeypatch, tmp_path):
    monkeypatch.delenv("ATOLL_PORT", raising=False)
    monkeypatch.setenv("ATOLL_HOME", str(tmp_path / "h"))
    assert settings.load().port == 7080
    monkeypatch.setenv("ATOLL_PORT", "7111")
    assert settings.load().port == 7111
    assert settings.load(port=7222).port == 7222
    s = settings.load(home=str(tmp_path / "flag"))
    assert s.home == str(tmp_path / "flag")
    assert s.database_url.endswith("flag/atoll.db")
    w = worker_settings.load(home=str(tmp_path / "flag"))
    assert w.templates == str(tmp_path / "flag" / "templates")
    assert w.listen == ("127.0.0.1", 0) and w.name == "local"
    assert worker_settings.load(listen=":7400", name="w-1").listen == ("127.0.0.1", 7400)


def test_bad_settings_say_which_variable(monkeypatch):
    monkeypatch.setenv("ATOLL_PORT", "seventy")
    with pytest.raises(config.SettingsError, match="ATOLL_PORT"):
        settings.load()
    monkeypatch.setenv("ATOLL_PORT", "70000")
    with pytest.raises(config.SettingsError, match="out of range"):
        settings.load()
    monkeypatch.delenv("ATOLL_PORT")
    monkeypatch.setenv("ATOLL_WORKER_LOST_S", "60")
    with pytest.raises(config.SettingsError, match="ATOLL_WORKER_LOST_S"):
        settings.load()
    for bad in ({"name": "no spaces"}, {"server": "ftp://x"}, {"listen": "host:port"}, {"advertise": "x:1"}):
        with pytest.raises(config.SettingsError):
            worker_settings.load(env={}, **bad)


def test_build_time_limits(tmp_path):
    home = {"ATOLL_HOME": str(tmp_path)}
    w = worker_settings.load(env=home)
    assert (w.build_step_timeout_s, w.build_timeout_s) == (1800.0, 3600.0)
    w = worker_settings.load(env={**home, "ATOLL_BUILD_STEP_TIMEOUT_S": "3", "ATOLL_BUILD_TIMEOUT_S": "90.5"})
    assert (w.build_step_timeout_s, w.build_timeout_s) == (3.0, 90.5)
    for env, needle in (
        ({"ATOLL_BUILD_STEP_TIMEOUT_S": "soon"}, "ATOLL_BUILD_STEP_TIMEOUT_S='soon' is not a number"),
        ({"ATOLL_BUILD_STEP_TIMEOUT_S": "0"}, "ATOLL_BUILD_STEP_TIMEOUT_S=0.0 is out of range"),
        ({"ATOLL_BUILD_TIMEOUT_S": "-5"}, "ATOLL_BUILD_TIMEOUT_S=-5.0 is out of range"),
        ({"ATOLL_BUILD_TIMEOUT_S": "nan"}, "ATOLL_BUILD_TIMEOUT_S='nan' is not a finite number"),
        ({"ATOLL_BUILD_TIMEOUT_S": "inf"}, "ATOLL_BUILD_TIMEOUT_S='inf' is not a finite number"),
        ({"ATOLL_BUILD_TIMEOUT_S": "1h"}, "set it to a number in 1-604800, or unset it for the default 3600"),
        (
            {"ATOLL_BUILD_STEP_TIMEOUT_S": "600", "ATOLL_BUILD_TIMEOUT_S": "300"},
            "ATOLL_BUILD_STEP_TIMEOUT_S=600 is longer than ATOLL_BUILD_TIMEOUT_S=300",
        ),
    ):
        with pytest.raises(config.SettingsError) as ei:
            worker_settings.load(env={**home, **env})
        assert needle in str(ei.value), (env, str(ei.value))


def test_worker_slots(tmp_path):
    """--slots over ATOLL_WORKER_SLOTS over the default 0 (no limit); whole numbers 0-100000."""
    home = {"ATOLL_HOME": str(tmp_path)}
    assert worker_settings.load(env=home).slots == 0
    assert worker_settings.load(env={**home, "ATOLL_WORKER_SLOTS": "12"}).slots == 12
    assert worker_settings.load(env={**home, "ATOLL_WORKER_SLOTS": "12"}, slots=3).slots == 3
    for env, flag, needle in (
        ({"ATOLL_WORKER_SLOTS": "-1"}, None, "ATOLL_WORKER_SLOTS=-1 is out of range 0-100000"),
        ({"ATOLL_WORKER_SLOTS": "2.5"}, None, "ATOLL_WORKER_SLOTS='2.5' is not an integer"),
        ({}, 100_001, "is out of range 0-100000 (--slots: 0 means no limit)"),
    ):
        with pytest.raises(config.SettingsError) as ei:
            worker_settings.load(env={**home, **env}, slots=flag)
        assert needle in str(ei.value), (env, str(ei.value))


def test_network_settings(tmp_path):
    env = {"ATOLL_HOME": str(tmp_path), "ATOLL_NETWORK_ALLOW_OUT": "pypi.org, *.pythonhosted.org:443,,"}
    assert settings.load(env).default_network == {
        "allow_out": ["pypi.org", "*.pythonhosted.org:443"],
        "deny_out": [],
    }
    assert settings.load({"ATOLL_HOME": str(tmp_path)}).default_network == {"allow_out": [], "deny_out": []}
    with pytest.raises(config.SettingsError, match="'bad entry'"):
        settings.load({**env, "ATOLL_NETWORK_DENY_OUT": "bad entry"})
    hosts = tmp_path / "hosts"
    hosts.write_text("10.1.2.3 a.test\n")
    w = worker_settings.load(
        env={"ATOLL_EXTRA_HOSTS": str(hosts), "ATOLL_EGRESS_SOURCE": "10.0.0.9"}, home=str(tmp_path)
    )
    assert w.hosts_files == ["/etc/hosts", str(hosts)] and w.egress_source == "10.0.0.9"
    for bad in ({"ATOLL_EXTRA_HOSTS": str(tmp_path / "missing")}, {"ATOLL_EGRESS_SOURCE": "eth0"}):
        with pytest.raises(config.SettingsError, match=next(iter(bad))):
            worker_settings.load(env=bad, home=str(tmp_path))


def test_api_key_is_redacted(monkeypatch):
    monkeypatch.setenv("ATOLL_API_KEY", "s3cret")
    assert "s3cret" not in str(settings.load().redacted())
    assert "s3cret" not in str(worker_settings.load().redacted())


@pytest.mark.parametrize("bad", ["rel/../../x", "/a/../b", "", "/a\x00b", "/" + "x" * 5000])
def test_path_checks(bad):
    with pytest.raises(errors.InvalidPath):
        http.check_path(bad)


def test_path_ok():
    assert http.check_path("/a/b..c/./d") == "/a/b..c/./d"
    # relative: from the working directory (the template's workdir, else /)
    assert http.check_path("rel/x") == "/rel/x"
    assert http.check_path("rel/x", workdir="/app/") == "/app/rel/x"


def test_exec_request_validation():
    assert schemas.ExecRequest.model_validate({"cmd": ["ls", "-l"]}).cmd == ["ls", "-l"]
    for bad in (
        {"cmd": ""},
        {"cmd": []},
        {"cmd": "x", "cwd": "tmp"},
        {"cmd": "x", "env": {"A-B": "1"}},
        {"cmd": "x", "extra": 1},
    ):
        with pytest.raises(ValueError):
            schemas.ExecRequest.model_validate(bad)


def test_sandbox_ca_file_is_a_pem_file_or_host_and_only_certificates_reach_sandboxes(tmp_path):
    from atoll.core import pki
    from atoll.worker.host import trust

    home = {"ATOLL_HOME": str(tmp_path)}
    assert worker_settings.load(env=home).sandbox_ca_file is None  # default: nothing added
    if os.path.exists(worker_settings.SYSTEM_CA):
        assert (
            worker_settings.load(env={**home, "ATOLL_SANDBOX_CA_FILE": "host"}).sandbox_ca_file
            == worker_settings.SYSTEM_CA
        )
    ca, key = pki.new_root_ca("test CA")
    pem = tmp_path / "ca+key.pem"
    pem.write_bytes(b"# our CA\n" + ca + key)
    s = worker_settings.load(env={**home, "ATOLL_SANDBOX_CA_FILE": str(pem)})
    assert s.sandbox_ca_file == str(pem)
    only = trust.certificates(pem.read_text())
    assert only == ca.decode() and "PRIVATE KEY" not in only and "# our CA" not in only
    assert trust.combine("A\n", only) == "A\n" + only and trust.combine("", "") == ""
    for bad, words in ((str(tmp_path / "missing.pem"), "cannot be read"), (str(tmp_path), "cannot be read")):
        with pytest.raises(config.SettingsError, match=f"ATOLL_SANDBOX_CA_FILE=.*{words}"):
            worker_settings.load(env={**home, "ATOLL_SANDBOX_CA_FILE": bad})
    key_only = tmp_path / "key.pem"
    key_only.write_bytes(key)
    with pytest.raises(config.SettingsError, match="holds no PEM certificate"):
        worker_settings.load(env={**home, "ATOLL_SANDBOX_CA_FILE": str(key_only)})


CA_VARIABLES = ("ATOLL_SANDBOX_CA_FILE", "ATOLL_BUILD_CA_FILE", "ATOLL_UPSTREAM_CA_FILE")


@pytest.mark.parametrize("var", CA_VARIABLES)
def test_a_ca_file_whose_certificates_do_not_parse_stops_the_start_naming_the_block(var, tmp_path, capsys):
    """A block that only looks like a certificate (the tester's `AAAA`) would reach every sandbox's
    bundle and break Python's HTTPS there: every certificate block is parsed at start-up."""
    from atoll.core import pki
    from atoll.shared import entry

    home = {"ATOLL_HOME": str(tmp_path / "home")}
    ca = pki.new_root_ca("test CA")[0].decode()
    cut = ca.splitlines()
    bad_files = {
        "fake.pem": (
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "certificate 1 (line 1)",
        ),
        "cut.pem": (ca + "\n".join(cut[:4] + cut[-1:]) + "\n", f"certificate 2 (line {len(cut) + 1})"),
        "no-end.pem": (ca + "-----BEGIN CERTIFICATE-----\n" + "\n".join(cut[1:-1]) + "\n", "certificate 2"),
        "header.pem": (
            "# ours\n" + ca.replace("\n", "\nProc-Type: 4,ENCRYPTED\n", 1),
            "certificate 1 (line 2)",
        ),
    }
    for name, (text, where) in bad_files.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            entry.settings_or_exit("atoll", lambda p=path: worker_settings.load(env={**home, var: str(p)}))
        assert e.value.code == 2, name
        message = capsys.readouterr().err
        assert message.startswith(f"atoll: invalid setting: {var}={str(path)!r}: {where}"), message
        assert f"unset {var}" in message, message
    assert "not a valid X.509 certificate" in message or "not a PEM block" in message

    # what passes: several certificates, CRLF line ends, comments and a key beside them
    good = tmp_path / "good.pem"
    key = pki.new_root_ca("key")[1].decode()
    good.write_bytes(
        ("# two CAs\n" + ca + pki.new_root_ca("other")[0].decode() + key).replace("\n", "\r\n").encode()
    )
    assert getattr(worker_settings.load(env={**home, var: str(good)}), var[6:].lower()) == str(good)
    assert pki.check_certificates(good.read_text()) == 2


def test_the_host_s_system_bundle_passes_the_check_without_a_warning(tmp_path):
    """Debian's bundle holds certificates cryptography reads only with a deprecation warning (a
    serial number that is not positive); OpenSSL loads them, so ATOLL_SANDBOX_CA_FILE=host passes
    (a cryptography upgrade that refuses them fails here, not at an operator's start)."""
    import warnings

    from atoll.core import pki

    if not os.path.exists(worker_settings.SYSTEM_CA):
        pytest.skip("no system CA bundle on this host")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = worker_settings.load(env={"ATOLL_HOME": str(tmp_path), "ATOLL_SANDBOX_CA_FILE": "host"})
        with open(worker_settings.SYSTEM_CA) as f:
            assert pki.check_certificates(f.read()) > 0
    assert s.sandbox_ca_file == worker_settings.SYSTEM_CA


@pytest.mark.parametrize("chunks", [[b"a", b"b", b"c"], [b"only"], []])
async def test_a_download_releases_its_sandbox_before_its_last_chunk(chunks):
    """http.relayed: a client holding the whole answer (Content-Length) may call again at once on
    another connection; the sandbox must be released by then, so before the last chunk goes out."""
    seen: list = []

    async def source():
        for c in chunks:
            yield c

    async def close(failure):
        seen.append(("released", failure))

    async for chunk in http.relayed("sb-x", source(), close, "file"):
        seen.append(chunk)
    want = [*chunks[:-1], ("released", None), *chunks[-1:]]
    assert seen == want


def test_e2b_port_default_off_and_clashes(tmp_path):
    base = {"ATOLL_HOME": str(tmp_path), "ATOLL_PORT": "7100"}
    assert settings.load(env=base).e2b_port == 7102
    assert settings.load(env={**base, "ATOLL_E2B_PORT": "off"}).e2b_port == 0
    assert settings.load(env={**base, "ATOLL_E2B_PORT": "0"}).e2b_port == 0
    s = settings.load(env={**base, "ATOLL_E2B_PORT": "7300", "ATOLL_E2B_INTERNET": "deny"})
    assert (s.e2b_port, s.e2b_internet, s.e2b_pause_tier) == (7300, False, "memory")
    for bad, words in (
        ({"ATOLL_E2B_PORT": "7100"}, "the API's port"),
        ({"ATOLL_E2B_PORT": "7101"}, "ATOLL_INGRESS_PORT"),
        ({"ATOLL_INGRESS_PORT": "7102"}, "the API port + 2"),
        ({"ATOLL_E2B_PORT": "x"}, "0 / off"),
        ({"ATOLL_E2B_PORT": "70000"}, "ATOLL_E2B_PORT"),
        ({"ATOLL_E2B_INTERNET": "maybe"}, "ATOLL_E2B_INTERNET"),
        ({"ATOLL_E2B_PAUSE_TIER": "cold"}, "ATOLL_E2B_PAUSE_TIER"),
    ):
        with pytest.raises(config.SettingsError, match=re.escape(words)):
            settings.load(env={**base, **bad})


def test_e2b_domain_defaults_to_the_preview_domain_and_the_routers_port(tmp_path):
    base = {"ATOLL_HOME": str(tmp_path), "ATOLL_PORT": "7100"}
    assert settings.load(env=base).e2b_domain == "atoll.localhost:7101"
    s = settings.load(env={**base, "ATOLL_INGRESS_PORT": "443", "ATOLL_PREVIEW_DOMAIN": "Sb.Example.com"})
    assert s.e2b_domain == "sb.example.com"  # no port for 443: the SDKs' https default
    assert settings.load(env={**base, "ATOLL_E2B_DOMAIN": "off"}).e2b_domain is None
    assert (
        settings.load(env={**base, "ATOLL_E2B_DOMAIN": "sb.example.com:443"}).e2b_domain
        == "sb.example.com:443"
    )
    for bad in ("https://sb.example.com", "sb.example.com:x", "sb.example.com:0", "nodots"):
        with pytest.raises(config.SettingsError, match="ATOLL_E2B_DOMAIN"):
            settings.load(env={**base, "ATOLL_E2B_DOMAIN": bad})
