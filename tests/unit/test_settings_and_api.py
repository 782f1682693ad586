"""Settings precedence and API helpers (hermetic)."""

from __future__ import annotations

import os

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
