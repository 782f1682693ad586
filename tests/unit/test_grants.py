"""core.grants: a data grant opens one sandbox's data verbs on its worker, for a minute, and only
when it was minted with the worker's current token."""

from __future__ import annotations

import pytest

from atoll.core import errors, grants

SID = "sb-0123456789abcdef"
OTHER = "sb-fedcba9876543210"
TOKEN = "worker-token-1"
NOW = 1_800_000_000.0


def _refused(token, grant, path, now=NOW) -> str:
    with pytest.raises(errors.Unauthorized) as e:
        grants.verify(token, grant, path, now)
    return e.value.message


def test_a_grant_opens_every_data_verb_of_its_sandbox_until_it_expires():
    grant, expires = grants.mint(TOKEN, SID, NOW)
    assert expires == int(NOW) + grants.TTL_S == int(grant.split(".")[1])
    assert grant.startswith(f"{SID}.{expires}.data.")
    for path in (
        "exec",
        "processes",
        "processes/12/output",
        "files",
        "files/tar",
        "files/list",
        "pty",
        "pty/p1",
        "alive",
        "ports/49990",  # the code interpreter's (GRANT_PORTS), through the worker's port tunnel
    ):
        assert grants.verify(TOKEN, grant, f"/sandboxes/{SID}/{path}", NOW + 59) == SID
    assert "expired 1 s ago" in _refused(TOKEN, grant, f"/sandboxes/{SID}/exec", expires + 1)
    assert "expired" in _refused(TOKEN.encode(), grant, f"/sandboxes/{SID}/exec", expires)


def test_a_grant_opens_nothing_else():
    grant, _ = grants.mint(TOKEN, SID, NOW)
    for path in (
        f"/sandboxes/{SID}",
        f"/sandboxes/{SID}/pause",
        f"/sandboxes/{SID}/resume",
        f"/sandboxes/{SID}/network",
        f"/sandboxes/{SID}/secrets",
        f"/sandboxes/{SID}/metrics",
        "/sandboxes",
        "/info",
        "/events",
        "/inventory",
        "/stores/volume/v/files",
        f"/sandboxes/{SID}/execs",
        f"/sandboxes/{SID}/ports/8080",
        f"/sandboxes/{SID}/ports/49999",
        f"/sandboxes/{SID}/ports/49990/x",
        f"/sandboxes/{SID}/ports/499900",
    ):
        assert "only a sandbox's data verbs" in _refused(TOKEN, grant, path)
    assert f"for sandbox {SID}, not for '{OTHER}'" in _refused(TOKEN, grant, f"/sandboxes/{OTHER}/exec")


def test_a_forged_or_stale_or_malformed_grant_is_refused():
    grant, expires = grants.mint(TOKEN, SID, NOW)
    path = f"/sandboxes/{SID}/exec"
    assert "current token" in _refused("worker-token-2", grant, path)  # the worker registered again
    assert "not registered" in _refused(None, grant, path)
    sid, exp, scope, mac = grant.split(".")
    assert "current token" in _refused(TOKEN, f"{sid}.{int(exp) + 3600}.{scope}.{mac}", path)  # later expiry
    assert "current token" in _refused(TOKEN, f"{OTHER}.{exp}.{scope}.{mac}", f"/sandboxes/{OTHER}/exec")
    assert "current token" in _refused(TOKEN, f"{sid}.{exp}.{scope}.{mac[:-1]}A", path)
    assert "unknown scope" in _refused(TOKEN, f"{sid}.{exp}.admin.{mac}", path)
    for bad in (
        "",
        "x",
        f"{sid}.{exp}.{scope}",
        f"{sid}.soon.{scope}.{mac}",
        grant + ".x",
        grant + "A" * 300,
    ):
        assert "malformed grant" in _refused(TOKEN, bad, path)
