"""Settings precedence and API helpers (hermetic)."""

from __future__ import annotations

import pytest

from atoll import settings
from atoll.controlplane import api, schemas
from atoll.core import errors


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
    assert s.template_dir == str(tmp_path / "flag" / "templates")


def test_bad_settings_say_which_variable(monkeypatch):
    monkeypatch.setenv("ATOLL_PORT", "seventy")
    with pytest.raises(settings.SettingsError, match="ATOLL_PORT"):
        settings.load()
    monkeypatch.setenv("ATOLL_PORT", "70000")
    with pytest.raises(settings.SettingsError, match="out of range"):
        settings.load()


def test_api_key_is_redacted(monkeypatch):
    monkeypatch.setenv("ATOLL_API_KEY", "s3cret")
    assert "s3cret" not in str(settings.load().redacted())


@pytest.mark.parametrize("bad", ["rel/x", "/a/../b", "", "/a\x00b", "/" + "x" * 5000])
def test_path_checks(bad):
    with pytest.raises(errors.InvalidPath):
        api._check_path(bad)


def test_path_ok():
    assert api._check_path("/a/b..c/./d") == "/a/b..c/./d"


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
