"""Compatibility suite: the everyday commands an agent runs, in one real sandbox of the base template.

Each check asserts real output, so a runtime or template change that breaks a common tool (as this
runsc's rejection of statx(AT_NO_AUTOMOUNT) broke `ls` and `stat`) fails here. One sandbox serves the
whole module; every test works in its own directory.
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile

import pytest

from tests.integration.conftest import run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sid(api):
    r = api.post("/v1/sandboxes", json={"idle_timeout_s": 0, "metadata": {"test": "compat"}})
    assert r.status_code == 201, r.text
    sandbox_id = r.json()["id"]
    yield sandbox_id
    api.delete(f"/v1/sandboxes/{sandbox_id}")


def sh(api, sid, script: str, **kw) -> str:
    """Run a bash script, assert it succeeded, return its stdout."""
    out = run(api, sid, ["bash", "-euo", "pipefail", "-c", script], timeout_s=120, **kw)
    assert out["exit_code"] == 0, out
    return out["stdout"]


def test_ls(api, sid):
    root = sh(api, sid, "ls /").split()
    assert {"bin", "etc", "tmp", "usr", "root"} <= set(root)
    lines = sh(api, sid, "ls -la /tmp").splitlines()
    assert lines[0].startswith("total ")
    assert any(line.startswith("drwx") and line.endswith(" .") for line in lines), lines
    out = sh(
        api,
        sid,
        "mkdir -p /root/lsdir/a/b && echo hi > /root/lsdir/a/b/f.txt && chmod 640 /root/lsdir/a/b/f.txt && "
        "ls -R /root/lsdir && ls -l /root/lsdir/a/b",
    )
    assert "/root/lsdir/a/b:\nf.txt\n" in out
    assert out.splitlines()[-1].startswith("-rw-r----- 1 root root 3 ")
    assert out.splitlines()[-1].endswith(" f.txt")
    assert sh(api, sid, "ls -d /etc /usr/bin") == "/etc\n/usr/bin\n"


def test_ls_without_environment(api, sid):
    # The fix must not depend on the environment: a cleared LD_PRELOAD or an empty env still works.
    assert sh(api, sid, "env -u LD_PRELOAD ls -d /etc && env -i /bin/ls -d /usr") == "/etc\n/usr\n"


def test_stat(api, sid):
    out = sh(
        api,
        sid,
        "printf 'hello!' > /root/st.txt && chmod 604 /root/st.txt && stat -c '%s %a %F %U' /root/st.txt",
    )
    assert out == "6 604 regular file root\n"
    assert sh(api, sid, "stat -c '%F' /etc /tmp") == "directory\ndirectory\n"
    assert "File: /etc/passwd" in sh(api, sid, "stat /etc/passwd")
    assert sh(api, sid, "ln -sf /etc/passwd /root/st.lnk && stat -c %F /root/st.lnk") == "symbolic link\n"


def test_stat_flags_through_every_entry_point(api, sid):
    # statx() and fstatat() from libc and statx through syscall() (libuv, Rust), all with
    # AT_NO_AUTOMOUNT (0x800) as Linux accepts it.
    script = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(512)
nr = {"x86_64": 332, "aarch64": 291}[os.uname().machine]
AT_FDCWD, NOAUTO = -100, 0x800
results = [
    libc.statx(AT_FDCWD, b"/etc/passwd", NOAUTO, 0xFFF, buf),
    libc.syscall(ctypes.c_long(nr), AT_FDCWD, b"/etc/passwd", NOAUTO, 0xFFF, buf),
    libc.fstatat(AT_FDCWD, b"/etc/passwd", buf, NOAUTO),
    libc.fstatat(AT_FDCWD, b"/etc/passwd", buf, NOAUTO | 0x100),
]
missing = libc.statx(AT_FDCWD, b"/nonexistent", NOAUTO, 0xFFF, buf), ctypes.get_errno()
print(results, missing, libc.syscall(ctypes.c_long(39)) == os.getpid())
"""
    out = sh(api, sid, f"python3 -c '{script}'")
    assert out == "[0, 0, 0, 0] (-1, 2) True\n"


def test_find(api, sid):
    out = sh(
        api,
        sid,
        "mkdir -p /root/fd/x/y && touch /root/fd/x/a.py /root/fd/x/y/b.py /root/fd/c.txt && "
        "find /root/fd -name '*.py' | sort && find /root/fd -type d | sort",
    )
    assert out == "/root/fd/x/a.py\n/root/fd/x/y/b.py\n/root/fd\n/root/fd/x\n/root/fd/x/y\n"


def test_cp_mv_chmod(api, sid):
    out = sh(
        api,
        sid,
        "mkdir -p /root/cp/src/sub && echo data > /root/cp/src/sub/f && chmod 751 /root/cp/src/sub/f && "
        "touch -d '2020-01-02 03:04:05' /root/cp/src/sub/f && ln -s sub/f /root/cp/src/link && "
        "cp -a /root/cp/src /root/cp/dst && "
        "stat -c '%a %Y' /root/cp/dst/sub/f && readlink /root/cp/dst/link && cat /root/cp/dst/link && "
        "mv /root/cp/dst /root/cp/moved && test ! -e /root/cp/dst && cat /root/cp/moved/sub/f && "
        "chmod 600 /root/cp/moved/sub/f && chmod u+x,g+r /root/cp/moved/sub/f && stat -c %a /root/cp/moved/sub/f",
    )
    assert out == "751 1577934245\nsub/f\ndata\ndata\n740\n"


def test_tar_create_and_extract(api, sid):
    out = sh(
        api,
        sid,
        "mkdir -p /root/tr/in/d && seq 1000 > /root/tr/in/d/n && echo x > /root/tr/in/top && "
        "cd /root/tr && tar -czf a.tgz in && mkdir out && tar -xzf a.tgz -C out && "
        "tar -tzf a.tgz | sort && diff -r in out/in && echo same",
    )
    assert out == "in/\nin/d/\nin/d/n\nin/top\nsame\n"


def test_du_df(api, sid):
    out = sh(
        api,
        sid,
        "mkdir -p /root/du && head -c 102400 /dev/zero > /root/du/f && du -b /root/du/f && du -sk /root/du",
    )
    lines = out.splitlines()
    assert lines[0] == "102400\t/root/du/f"
    size_kb, path = lines[1].split("\t")
    assert path == "/root/du" and int(size_kb) >= 100
    df = sh(api, sid, "df -P / /tmp").splitlines()
    assert df[0].startswith("Filesystem") and len(df) == 3
    assert df[1].split()[-1] == "/" and df[2].split()[-1] == "/tmp"
    assert int(df[1].split()[1]) > 0  # a real size, not an error


def test_ps_top(api, sid):
    out = sh(api, sid, "sleep 30 & ps -eo pid,comm; kill $!")
    assert out.splitlines()[0].split() == ["PID", "COMMAND"]
    assert {"sleep", "ps"} <= {line.split()[1] for line in out.splitlines()[1:]}
    assert "PID" in sh(api, sid, "ps aux").splitlines()[0]
    top = sh(api, sid, "top -b -n1")
    assert top.startswith("top - ") and "Tasks:" in top and "PID USER" in top


def test_git(api, sid):
    out = sh(
        api,
        sid,
        "mkdir -p /root/repo && cd /root/repo && git init -q -b main && "
        "git config user.name 'Compat Test' && git config user.email compat@example.invalid && "
        "echo one > a.txt && mkdir src && echo 'print(1)' > src/m.py && git add -A && "
        "git commit -q -m 'first commit' && echo two >> a.txt && git status --porcelain && "
        "git commit -qam 'second commit' && git status --porcelain && git log --format='%s|%an' && "
        "git ls-files",
    )
    assert out == " M a.txt\nsecond commit|Compat Test\nfirst commit|Compat Test\na.txt\nsrc/m.py\n"


def _tiny_wheel() -> bytes:
    """A minimal pure-Python wheel (PEP 427), built in memory on the host."""
    dist = "atoll_probe-1.0.dist-info"
    files = {
        "atoll_probe/__init__.py": b"def hello():\n    return 'hello from a local wheel'\n",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: atoll-probe\nVersion: 1.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: atoll-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_venv_and_offline_pip_install(api, sid):
    wheel = "/root/wheels/atoll_probe-1.0-py3-none-any.whl"
    r = api.put(f"/v1/sandboxes/{sid}/files", params={"path": wheel}, content=_tiny_wheel())
    assert r.status_code == 204, r.text
    out = sh(
        api,
        sid,
        f"python3 -m venv /root/venv && /root/venv/bin/pip install -q --no-index {wheel} && "
        "/root/venv/bin/python -c 'import atoll_probe, sys; print(atoll_probe.hello(), sys.prefix)' && "
        "/root/venv/bin/pip list --format=freeze | grep -i atoll",
    )
    assert out == "hello from a local wheel /root/venv\natoll-probe==1.0\n"


def test_bash_features(api, sid):
    script = r"""
arr=(alpha "beta gamma" delta)
declare -A m=([k]=v)
[[ ${#arr[@]} -eq 3 && ${arr[1]} == beta* && ${m[k]} == v ]] && echo "arrays ok ${arr[-1]}"
diff <(printf 'a\nb\n') <(printf 'a\nb\n') && echo "procsub ok"
while read -r line; do echo "read:$line"; done < <(printf 'x\ny\n')
cat <<EOF
heredoc $((6 * 7)) ${arr[0]^^}
EOF
cat <<'EOF'
literal $HOME
EOF
echo {1..3} "$(echo nested $(echo sub))"
"""
    out = sh(api, sid, script)
    assert out == (
        "arrays ok delta\nprocsub ok\nread:x\nread:y\nheredoc 42 ALPHA\nliteral $HOME\n1 2 3 nested sub\n"
    )


def test_sort_sha256sum(api, sid):
    assert sh(api, sid, "printf 'b\\nc\\na\\nb\\n' | sort -u") == "a\nb\nc\n"
    assert sh(api, sid, "printf '10\\n9\\n100\\n' | sort -n | tr '\\n' ' '") == "9 10 100 "
    assert sh(api, sid, "printf '2 b\\n1 a\\n3 c\\n' | sort -k2 -r | head -1") == "3 c\n"
    out = sh(
        api, sid, "printf abc > /root/abc && cd /root && sha256sum abc | tee abc.sum && sha256sum -c abc.sum"
    )
    assert out == ("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad  abc\nabc: OK\n")


def test_kill_and_pkill_own_processes(api, sid):
    out = sh(
        api,
        sid,
        "set +e; sleep 300 & pid=$!; sleep 0.2; pkill -x sleep; wait $pid; echo pkill:$?; "
        "sleep 301 & kill %1; wait %1; echo kill-job:$?; "
        "sleep 302 & pid=$!; kill -9 $pid; wait $pid; echo kill-9:$?; "
        "pgrep -x sleep || echo no-sleep-left",
    )
    assert out == "pkill:143\nkill-job:143\nkill-9:137\nno-sleep-left\n"
    # The sandbox and its agent survive the user's own process cleanup.
    assert sh(api, sid, "echo alive") == "alive\n"
