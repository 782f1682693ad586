"""The base template's login profile starts no programs (worker/images/login_profile.py) and a login
shell in a sandbox sees what it saw with Debian's profile: the same PATH, environment and umask,
as root and as another user; and the profile as Debian ships it, sourced beside the edited one in
the same sandbox, leaves the same variables, umask and exit status."""

from __future__ import annotations

import pytest

from atoll.worker.images import login_profile
from tests.integration.conftest import run

# What `bash -l -c` showed with Debian's unedited profile (measured on the template before the
# edit); atoll re-exports the sandbox's environment after the profile, so PATH is atoll's.
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXPECTED_ENV = {
    "ATOLL_GENERATION": "0",
    "CURL_CA_BUNDLE": "/etc/atoll/ca-bundle.crt",
    "LANG": "C.UTF-8",
    "NODE_EXTRA_CA_CERTS": "/etc/atoll/ca.crt",
    "PATH": ROOT_PATH,
    "PWD": "/",
    "REQUESTS_CA_BUNDLE": "/etc/atoll/ca-bundle.crt",
    "SHLVL": "1",
    "SSL_CERT_FILE": "/etc/atoll/ca-bundle.crt",
    "_": "/usr/bin/env",
}
USERS = {"root": {"HOME": "/root"}, "nobody": {"HOME": "/nonexistent"}}


@pytest.mark.parametrize("user", sorted(USERS))
def test_login_shell_sees_the_same_path_env_and_umask(api, sandbox, user):
    r = run(api, sandbox["id"], 'echo "PATH=$PATH"; umask; env | sort', shell="bash", user=user)
    assert r["exit_code"] == 0 and r["stderr"] == "", r
    lines = r["stdout"].splitlines()
    assert lines[0] == f"PATH={ROOT_PATH}"
    assert lines[1] == "0022"
    env = dict(line.split("=", 1) for line in lines[2:])
    assert env.pop("ATOLL_SANDBOX_ID") == sandbox["id"]
    assert env == EXPECTED_ENV | USERS[user] | {"LOGNAME": user, "USER": user}


def test_profile_is_edited_and_acts_as_debians(api, sandbox):
    sid = sandbox["id"]
    for rel in ("etc/profile", "root/.profile"):
        edited = run(api, sid, ["cat", f"/{rel}"])["stdout"]
        assert any(new in edited for path, _, new in login_profile.EDITS if path == rel), rel
        original = login_profile.unpatch(edited, rel)
        assert original != edited
        # Copies of both, readable by every user (/root is not): the same footing for each.
        for top, text in (("/tmp/orig", original), ("/tmp/edited", edited)):
            script = f"mkdir -p {top}/etc {top}/root && cat > {top}/{rel}"
            assert run(api, sid, ["sh", "-c", script], stdin=text)["exit_code"] == 0
    run(api, sid, ["chmod", "-R", "a+rX", "/tmp/orig", "/tmp/edited"])
    for user in sorted(USERS):
        for shell in (["bash", "--noprofile", "--norc", "-c"], ["sh", "-c"]):
            for ps1 in ("", "PS1='$ ' "):
                before = _source(api, sid, "/tmp/orig", user, shell, ps1)
                after = _source(api, sid, "/tmp/edited", user, shell, ps1)
                assert after["exit_code"] == before["exit_code"] == 0, (before, after)
                assert after["stdout"] == before["stdout"], (user, shell, ps1)
                assert after["stderr"] == before["stderr"], (user, shell, ps1)


DUMP = 'echo "rc=$?"; umask; set | grep -E "^(PATH|PS1|i)="; export -p | sort'


def _source(api, sid: str, root: str, user: str, shell: list[str], ps1: str) -> dict:
    """Source the profile files under `root` in a clean environment, then print what they left."""
    script = f"{ps1}. {root}/etc/profile; . {root}/root/.profile; {DUMP}"
    return run(api, sid, ["env", "-i", "HOME=/root", "TERM=dumb", *shell, script], user=user)
