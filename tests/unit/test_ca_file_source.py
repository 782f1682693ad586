"""A CA file that cannot be used is named with where it came from: `--ca-file` (the CLI, for the
commands that talk to a server and for `atoll worker`), `ca_file=` (the SDK's caller) or
`$ATOLL_CA_FILE`, so that the fix goes to the right place."""

from __future__ import annotations

import pytest

import atoll
from atoll import errors
from atoll.cli import main as cli

from .test_cli import run

URL = "https://127.0.0.1:1"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in ("ATOLL_CA_FILE", "ATOLL_URL", "ATOLL_API_KEY", "ATOLL_SERVER_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ATOLL_HOME", str(tmp_path / "home"))
    return tmp_path


def test_the_sdk_names_ca_file_or_the_variable(clean_env, monkeypatch):
    missing = str(clean_env / "missing.crt")
    with pytest.raises(errors.BadCAFile) as e:
        atoll.Client(URL, "k", ca_file=missing)
    assert f"the CA file {missing!r} (from ca_file=) cannot be read" in e.value.message
    monkeypatch.setenv("ATOLL_CA_FILE", missing)
    with pytest.raises(errors.BadCAFile) as e:
        atoll.Client(URL, "k")
    assert f"the CA file {missing!r} (from $ATOLL_CA_FILE) cannot be read" in e.value.message


def test_the_cli_client_names_the_flag(clean_env, monkeypatch):
    missing = str(clean_env / "missing.crt")
    with pytest.raises(errors.BadCAFile) as e:
        cli.make_client(URL, "k", missing)
    assert "(from --ca-file)" in e.value.message and "ca_file=" not in e.value.message
    monkeypatch.setenv("ATOLL_CA_FILE", missing)
    with pytest.raises(errors.BadCAFile) as e:
        cli.make_client(URL, "k", None)
    assert "(from $ATOLL_CA_FILE)" in e.value.message


@pytest.mark.parametrize(
    "args",
    [
        ("sandbox", "--url", URL, "--api-key", "k", "--ca-file", "{ca}", "list"),
        ("--ca-file", "{ca}", "workers", "--url", URL, "--api-key", "k"),
    ],
)
def test_a_command_says_the_bad_file_came_from_the_flag(clean_env, args):
    bad = clean_env / "bad.crt"
    bad.write_text("not a certificate\n")
    result = run(*(a.format(ca=bad) for a in args))
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: bad_ca_file: the CA file {str(bad)!r} (from --ca-file) ")
    assert "Traceback" not in result.output


def test_a_command_says_the_bad_file_came_from_the_variable(clean_env):
    missing = str(clean_env / "missing.crt")
    result = run("sandbox", "--url", URL, "--api-key", "k", "list", env={"ATOLL_CA_FILE": missing})
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: bad_ca_file: the CA file {missing!r} (from $ATOLL_CA_FILE) ")


def test_atoll_worker_says_where_its_bad_ca_file_came_from(clean_env):
    missing = str(clean_env / "missing.crt")
    server = ("--server", "https://10.0.0.5:7080")
    result = run("worker", *server, "--ca-file", missing)
    assert result.exit_code == 2, result.output
    assert f"invalid setting: the CA file {missing!r} (from --ca-file) cannot be read" in result.stderr
    result = run("worker", *server, env={"ATOLL_CA_FILE": missing})
    assert result.exit_code == 2, result.output
    assert f"the CA file {missing!r} (from $ATOLL_CA_FILE) cannot be read" in result.stderr
    bad = clean_env / "bad.crt"
    bad.write_text("-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n")
    result = run("--ca-file", str(bad), "worker", *server)
    assert result.exit_code == 2, result.output
    assert f"the CA file {str(bad)!r} (from --ca-file):" in result.stderr
    assert "or leave out --ca-file" in result.stderr
    # a plain-HTTP server: the file's source is named too
    result = run("worker", "--server", "http://127.0.0.1:7080", "--ca-file", str(bad))
    assert result.exit_code == 2 and "a CA file is given (--ca-file)" in result.stderr, result.output
