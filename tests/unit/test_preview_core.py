"""core.preview (routing and proof of a preview request), core.secretbox and the secret store's
checks: pure, no sandbox."""

from __future__ import annotations

import os
import stat
import time

import pytest

from atoll.controlplane import secrets as secrets_mod
from atoll.core import config, errors, preview, secretbox

KEY = b"k" * 32


@pytest.mark.parametrize(
    "host, want",
    [
        ("8080-sb-abc123.atoll.localhost", preview.Target("sb-abc123", 8080)),
        ("8080-sb-abc123.atoll.localhost:7081", preview.Target("sb-abc123", 8080)),
        ("8080-SB-ABC123.Atoll.Localhost.", preview.Target("sb-abc123", 8080)),
        ("example.com", None),
        ("[::1]:7081", None),
    ],
)
def test_host_names_route_to_a_sandbox_and_port(host, want):
    assert preview.host_target(host, "atoll.localhost") == want


@pytest.mark.parametrize(
    "host",
    [
        "sb-abc.atoll.localhost",
        "x-sb-abc.atoll.localhost",
        "99999-sb-abc.atoll.localhost",
        "80-notasb.atoll.localhost",
        "a.80-sb-abc.atoll.localhost",
        "٨٠-sb-abc.atoll.localhost",
    ],
)
def test_malformed_preview_hosts_are_refused_with_a_reason(host):
    with pytest.raises(preview.BadTarget):
        preview.host_target(host, "atoll.localhost")


def test_headers_route_and_must_come_together():
    assert preview.header_target("sb-abc", "80") == preview.Target("sb-abc", 80)
    assert preview.header_target(None, None) is None
    for sid, port in (("sb-abc", None), (None, "80"), ("sb-abc", "0"), ("sb-abc", "http"), ("../x", "80")):
        with pytest.raises(preview.BadTarget):
            preview.header_target(sid, port)


def test_tokens_and_signed_urls():
    t = preview.token(KEY, "sb-a")
    assert preview.token_ok(KEY, "sb-a", t) and not preview.token_ok(KEY, "sb-b", t)
    assert not preview.token_ok(b"x" * 32, "sb-a", t)
    target = preview.Target("sb-a", 80)
    exp = int(time.time()) + 60
    sig = preview.signature(KEY, "sb-a", 80, exp)
    assert preview.signature_ok(KEY, target, str(exp), sig, time.time()) is None
    assert "expired" in preview.signature_ok(KEY, target, str(exp), sig, exp + 1)
    assert "not valid" in preview.signature_ok(KEY, preview.Target("sb-a", 81), str(exp), sig, time.time())
    assert "not valid" in preview.signature_ok(KEY, target, str(exp + 1), sig, time.time())
    assert "unix time" in preview.signature_ok(KEY, target, "soon", sig, time.time())
    path, e, s = preview.split_signed(f"/a/b?x=1&atoll_expires={exp}&atoll_signature={sig}&y=2")
    assert (path, e, s) == ("/a/b?x=1&y=2", str(exp), sig)
    assert preview.split_signed("/plain?x=1") == ("/plain?x=1", None, None)


def test_sealed_values_open_only_with_their_key_and_name():
    text = secretbox.seal(KEY, "v@lue", "default/n")
    assert "v@lue" not in text and secretbox.unseal(KEY, text, "default/n") == "v@lue"
    for key, aad, t in (
        (b"j" * 32, "default/n", text),
        (KEY, "default/m", text),
        (KEY, "default/n", text[:-2] + "AA"),
    ):
        with pytest.raises(secretbox.BadSeal):
            secretbox.unseal(key, t, aad)


def test_the_secrets_key_file_is_made_private_and_checked(tmp_path):
    key = secrets_mod.load_key(str(tmp_path), None)
    p = tmp_path / "secrets.key"
    assert len(key) == 32 and stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert secrets_mod.load_key(str(tmp_path), None) == key  # the same key at the next start
    op = tmp_path / "op.key"
    op.write_text(os.urandom(32).hex())
    os.chmod(op, 0o644)
    with pytest.raises(config.SettingsError, match="chmod 600"):
        secrets_mod.load_key(str(tmp_path), str(op))
    os.chmod(op, 0o600)
    assert len(secrets_mod.load_key(str(tmp_path), str(op))) == 32
    op.write_text("short")
    with pytest.raises(config.SettingsError, match="32-byte"):
        secrets_mod.load_key(str(tmp_path), str(op))


@pytest.mark.parametrize(
    "hosts, ok",
    [
        (["api.example.com"], ["api.example.com"]),
        (["*.Example.com", "*.example.com"], ["*.example.com"]),
        (["1.2.3.4"], None),
        (["a.example:443"], None),
        ([], None),
        ("a.example", None),
        ([""], None),
    ],
)
def test_secret_hosts_are_names_or_wildcards(hosts, ok):
    if ok is None:
        with pytest.raises(errors.InvalidRequest):
            secrets_mod.check_hosts(hosts)
    else:
        assert secrets_mod.check_hosts(hosts) == ok
