"""Templates users build, warm pools and fork, through a real `atoll up` with real gVisor sandboxes.

What users do: build a template from a JSON spec (files, run, env, workdir, a start command and a
ready check) or a Dockerfile build context, install pip and apt packages, rebuild and see cached
steps, get clear refusals for what is not supported, create sandboxes from a template (with their
own env), keep a warm pool, fork a running sandbox, and do the same from the CLI.

Builds never reach the internet: one test host (atoll.testing.testnet.TestHost, a network
namespace of this module's own) serves a PEP 503 index with a hand-made wheel and a flat apt
repository with a hand-made .deb (tests/integration/templates_support.py); the worker is started
with ATOLL_BUILD_ALLOW_OUT, ATOLL_PIP_INDEX_URL and ATOLL_APT_SOURCES pointing at it. Layers are
cached in the shared test template cache, so every spec whose steps must really run carries this
run's NONCE (a step's key covers its environment).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time

import httpx
import pytest

import atoll
from atoll.testing import LocalAtoll
from atoll.testing.testnet import TestHost
from tests.conftest import TEMPLATE_CACHE, _skip_unless_root
from tests.integration import templates_support as repo

pytestmark = pytest.mark.integration

NONCE = secrets.token_hex(4)
BUILD_TIMEOUT = 300
ATOLL_CLI = os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", ".venv", "bin", "atoll")


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pkghost():
    """The test host serving the pip index and the apt repository on {a}:8080."""
    _skip_unless_root()
    th = TestHost(repo.SERVER, ["{a}", "{dir}"])
    try:
        repo.write_repositories(th.dir)
        with th:
            yield th
    finally:
        shutil.rmtree(th.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def la(pkghost, tmp_path_factory):
    base = f"http://{pkghost.a}:{repo.PORT}"
    atoll_ = LocalAtoll(
        home=tmp_path_factory.mktemp("atoll-templates") / "home",
        env={
            "ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE,
            "ATOLL_BUILD_ALLOW_OUT": pkghost.a,
            "ATOLL_PIP_INDEX_URL": f"{base}/simple/",
            "ATOLL_APT_SOURCES": f"deb [trusted=yes] {base}/apt ./",
        },
    )
    atoll_.start(timeout=600)
    try:
        yield atoll_
    finally:
        # Pooled sandboxes are not in GET /v1/sandboxes (what stop(reap=True) deletes): empty the
        # pools first, then reap the rest.
        try:
            with httpx.Client(base_url=atoll_.url, headers=atoll_.headers(), timeout=60) as c:
                for t in c.get("/v1/templates").json().get("items", []):
                    if t["name"] != "base":
                        c.put(f"/v1/templates/{t['name']}/pool", json={"min": 0, "max": 0})
        except httpx.HTTPError:
            pass
        atoll_.stop(reap=True)


@pytest.fixture(scope="module")
def client(la):
    with atoll.Client(base_url=la.url, api_key=la.api_key, request_timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def api(la):
    with httpx.Client(base_url=la.url, headers=la.headers(), timeout=300) as c:
        yield c


@pytest.fixture
def made(client):
    """Sandboxes a test made (creates and forks), deleted afterwards."""
    sandboxes: list = []
    yield sandboxes
    for sb in sandboxes:
        try:
            client.sandboxes.delete(sb.id)
        except atoll.errors.SandboxNotFound:
            pass


@pytest.fixture
def make(client, made):
    def _make(template="base", **kw):
        sb = client.sandboxes.create(template=template, idle_timeout_s=0, **kw)
        made.append(sb)
        return sb

    return _make


def build(client, name, **spec):
    """templates.build, collecting the log lines; (template, lines)."""
    lines: list[str] = []
    try:
        t = client.templates.build(name, on_log=lines.append, timeout=BUILD_TIMEOUT, **spec)
    except atoll.BuildFailed as e:
        log = "\n".join(lines)
        raise AssertionError(f"the build of {name} failed: {e.message}\n--- its log:\n{log}") from None
    return t, lines


def build_fails(client, api, name, **spec):
    """A build that must fail: the BuildFailed, the template and the build's whole log."""
    with pytest.raises(atoll.BuildFailed) as ei:
        client.templates.build(name, timeout=BUILD_TIMEOUT, **spec)
    e = ei.value
    t = client.templates.get(name)
    r = api.get(f"/v1/templates/{name}/builds/{e.build_id}/logs")
    assert r.status_code == 200, r.text
    return e, t, r.text


def out(sb, cmd, **kw) -> str:
    r = sb.exec(cmd, timeout_s=60, **kw)
    assert r.exit_code == 0, f"{cmd!r} in {sb.id}: exit {r.exit_code}\n{r.stdout}\n{r.stderr}"
    return r.stdout.strip()


def identity(sb) -> dict:
    return json.loads(sb.files.read("/run/atoll/identity.json"))


def wait_answers(sb, program: str, timeout: float = 15) -> str:
    """Run a python3 client `program` inside the sandbox until it exits 0; its stdout."""
    deadline = time.monotonic() + timeout
    while True:
        r = sb.exec(["python3", "-c", program], timeout_s=10)
        if r.exit_code == 0:
            return r.stdout
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing answered in {sb.id} within {timeout}s: {r.stdout}{r.stderr}")
        time.sleep(0.3)


def http_get(port: int, path: str = "/") -> str:
    return (
        "import urllib.request; "
        f"print(urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=3).read().decode())"
    )


def tcp_read(port: int) -> str:
    return (
        "import socket; "
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=3); "
        "print(s.recv(100).decode().strip())"
    )


def step_lines(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith(("STEP [", "CACHED ["))]


WEB_SPEC = {
    "files": {"/srv/web/index.html": f"hello web {NONCE}\n"},
    "run": ["echo built-$WEB_MODE > /srv/web/built.txt"],
    "env": {"WEB_MODE": "web-mode", "NONCE": NONCE},
    "workdir": "/srv/web",
    "start": "python3 -m http.server 8000",
    "ready": {"port": 8000},
}


@pytest.fixture(scope="module")
def web(client):
    """The spec template of test 1: (template, its build's log lines)."""
    return build(client, "web", **WEB_SPEC)


# ---- 1. a spec build, and sandboxes made from it -----------------------------------------------


def test_spec_build_boots_once_and_sandboxes_start_from_its_snapshot(client, web, make):
    t, lines = web
    assert t.status == "ready", t.to_dict()
    assert t["start_mode"] == "snapshot", t.to_dict()
    assert any(ln.startswith("DONE") for ln in lines), lines
    assert any(ln.startswith("START") for ln in lines) and any(ln.startswith("READY") for ln in lines), lines
    assert len(step_lines(lines)) == 2, lines
    names = [x.name for x in client.templates.list()]
    assert names[0] == "base" and "web" in names, names
    assert t["workdir"] == "/srv/web" and t["env"]["WEB_MODE"] == "web-mode", t.to_dict()

    sb = make("web", env={"CALLER_VAR": "from-caller"}, metadata={"test": "web"})
    assert sb.state == "running" and sb.template == "web"
    assert sb["build_id"] == t.build_id, sb.to_dict()
    assert out(sb, "pwd") == "/srv/web"
    assert out(sb, "echo $WEB_MODE $CALLER_VAR") == "web-mode from-caller"
    assert out(sb, "cat built.txt") == "built-web-mode"  # the run step ran with the template's env
    # The start command kept running in the snapshot: the server answers at once.
    page = wait_answers(sb, http_get(8000, "/index.html"), timeout=5)
    assert page.strip() == f"hello web {NONCE}"
    # A relative file path is resolved in the workdir.
    assert sb.files.read("index.html") == f"hello web {NONCE}\n".encode()
    # Its own identity, not the snapshot's.
    assert out(sb, "hostname") == sb.id
    assert identity(sb)["sandbox_id"] == sb.id


def test_the_caller_env_wins_over_the_template_env(web, make):
    sb = make("web", env={"WEB_MODE": "caller-mode"})
    assert out(sb, "echo $WEB_MODE $NONCE") == f"caller-mode {NONCE}"


def test_a_create_with_another_memory_size_still_gets_the_started_template(web, make):
    # No snapshot of this size yet: the create boots the template cold, which must still give the
    # workdir, the env and the running start command.
    sb = make("web", memory_mb=768, env={"CALLER_VAR": "cold"})
    assert sb.memory_mb == 768
    assert out(sb, "pwd") == "/srv/web"
    assert out(sb, "echo $WEB_MODE $CALLER_VAR") == "web-mode cold"
    assert wait_answers(sb, http_get(8000, "/index.html"), timeout=15).strip() == f"hello web {NONCE}"
    assert out(sb, "hostname") == sb.id and identity(sb)["sandbox_id"] == sb.id


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_template_sandbox_survives_standby(web, make, tier):
    sb = make("web")
    sb.files.write("note.txt", "kept")
    sb.pause(tier=tier)
    assert sb.state == "standby" and sb.standby_tier == tier
    assert wait_answers(sb, http_get(8000, "/note.txt"), timeout=10).strip() == "kept"
    assert out(sb, "pwd") == "/srv/web" and out(sb, "echo $WEB_MODE") == "web-mode"


def test_a_template_from_another_template_inherits_env_workdir_and_start(client, api, web, make):
    t, lines = build(client, "web-child", from_="web", env={"CHILD": "yes"}, run=["echo child > child.txt"])
    assert t.status == "ready", lines
    assert t["from"] == "web" and t["workdir"] == "/srv/web", t.to_dict()
    sb = make("web-child")
    assert out(sb, "pwd") == "/srv/web"
    assert out(sb, "echo $WEB_MODE $CHILD") == "web-mode yes"
    assert out(sb, "cat child.txt built.txt") == "child\nbuilt-web-mode"
    assert wait_answers(sb, http_get(8000, "/child.txt"), timeout=10).strip() == "child"
    r = api.delete("/v1/templates/web")
    assert r.status_code == 409 and r.json()["error"]["code"] == "template_in_use", r.text


def test_a_dockerfile_from_another_template_runs_in_its_workdir(client, web, make):
    lines: list[str] = []
    t = client.templates.build_dockerfile(
        "web-dchild",
        f"FROM web\nENV DCHILD=yes\nRUN echo dchild-{NONCE} > dchild.txt\n",
        on_log=lines.append,
        timeout=BUILD_TIMEOUT,
    )
    assert t.status == "ready" and t["workdir"] == "/srv/web", (t.to_dict(), lines)
    sb = make("web-dchild")
    assert out(sb, "echo $WEB_MODE $DCHILD") == "web-mode yes"
    assert out(sb, "cat /srv/web/dchild.txt") == f"dchild-{NONCE}"  # RUN ran in the inherited WORKDIR


def test_two_sandboxes_of_one_template_are_separate(client, web, make):
    a, b = make("web"), make("web")
    assert a.id != b.id
    a.files.write("/srv/web/mine.txt", "a")
    assert b.exec("test -e /srv/web/mine.txt").exit_code == 1
    assert out(b, "hostname") == b.id and identity(b)["sandbox_id"] == b.id


# ---- 2. the layer cache ------------------------------------------------------------------------


def test_rebuild_reuses_every_cached_step_and_a_changed_last_step_rebuilds_only_it(client, api, make):
    spec = {
        "files": {"/opt/cache/a.txt": f"a {NONCE}\n"},
        "run": [f"echo one-{NONCE} > /opt/cache/one.txt", f"echo two-{NONCE} > /opt/cache/last.txt"],
        "env": {"NONCE": NONCE},
    }
    t1, lines1 = build(client, "cache-demo", **spec)
    assert [ln.split()[0] for ln in step_lines(lines1)] == ["STEP", "STEP", "STEP"], lines1
    old = make("cache-demo")

    t2, lines2 = build(client, "cache-demo", **spec)
    assert t2.build_id != t1.build_id and t2.status == "ready"
    assert [ln.split()[0] for ln in step_lines(lines2)] == ["CACHED"] * 3, lines2
    got = api.get("/v1/templates/cache-demo").json()
    assert got["steps"] == 3 and got["cached_steps"] == 3, got
    assert got["current_build_id"] == t2.build_id and t1.build_id in got["builds"], got

    changed = {**spec, "run": [spec["run"][0], f"echo three-{NONCE} > /opt/cache/last.txt"]}
    t3, lines3 = build(client, "cache-demo", **changed)
    assert [ln.split()[0] for ln in step_lines(lines3)] == ["CACHED", "CACHED", "STEP"], lines3
    got = api.get("/v1/templates/cache-demo").json()
    assert got["cached_steps"] == 2 and got["current_build_id"] == t3.build_id, got
    sb = make("cache-demo")
    assert sb["build_id"] == t3.build_id
    assert out(sb, "cat /opt/cache/one.txt /opt/cache/last.txt") == f"one-{NONCE}\nthree-{NONCE}"
    # A new build does not touch the sandboxes of an older one.
    assert old.refresh().state == "running" and old["build_id"] == t1.build_id
    assert out(old, "cat /opt/cache/last.txt") == f"two-{NONCE}"


# ---- 3. Dockerfiles ----------------------------------------------------------------------------

APP = r"""
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (os.environ["GREETING"] + " " + open("static/msg.txt").read().strip()).encode()
        self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
"""


def test_dockerfile_build_context(client, make, tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "static" / "img").mkdir(parents=True)
    (ctx / "app.py").write_text(APP)
    (ctx / "static" / "msg.txt").write_text(f"static {NONCE}\n")
    (ctx / "static" / "img" / "logo.txt").write_text("logo\n")
    (ctx / "Dockerfile").write_text(
        "FROM base\n"
        "ENV GREETING=hello-docker\n"
        "WORKDIR /srv/app\n"
        "COPY app.py .\n"
        "COPY static/ ./static/\n"
        f"RUN echo built-{NONCE}-$GREETING > built.txt\n"
        'CMD ["python3", "app.py"]\n'
    )
    lines: list[str] = []
    t = client.templates.build_dockerfile("docker-demo", str(ctx), on_log=lines.append, timeout=BUILD_TIMEOUT)
    assert t.status == "ready", (t.to_dict(), lines)
    assert t["start"] and "app.py" in t["start"], t.to_dict()

    sb = make("docker-demo")
    assert out(sb, "pwd") == "/srv/app"
    assert out(sb, "echo $GREETING") == "hello-docker"
    assert out(sb, "cat app.py") == APP.strip()
    assert out(sb, "cat static/msg.txt static/img/logo.txt") == f"static {NONCE}\nlogo"
    assert out(sb, "cat built.txt") == f"built-{NONCE}-hello-docker"
    assert "python3 app.py" in out(sb, "ps -eo args"), out(sb, "ps -eo args")
    assert wait_answers(sb, http_get(8000), timeout=10).strip() == f"hello-docker static {NONCE}"


def test_dockerfile_build_context_keeps_symlinks_and_never_follows_them_on_the_host(client, make, tmp_path):
    """Links in the context used to be dropped: now each is a link in the template, resolved in
    the sandbox; one aimed at a host file (absolute, or `..` out of the context) shows the
    sandbox's own file system, never the host's."""
    host_secret = tmp_path / "host-secret.txt"
    host_secret.write_text(f"host only {NONCE}\n")
    ctx = tmp_path / "ctx"
    (ctx / "conf").mkdir(parents=True)
    (ctx / "data.txt").write_text(f"data {NONCE}\n")
    os.symlink("data.txt", ctx / "rel")
    os.symlink("/etc/os-release", ctx / "abs")
    os.symlink(str(host_secret), ctx / "host")
    os.symlink("../../" + "../" * 8 + str(host_secret).lstrip("/"), ctx / "conf" / "out")
    os.symlink("conf", ctx / "confdir")
    (ctx / "Dockerfile").write_text("FROM base\nCOPY . /srv/links/\n")
    lines: list[str] = []
    t = client.templates.build_dockerfile("links-demo", str(ctx), on_log=lines.append, timeout=BUILD_TIMEOUT)
    assert t.status == "ready", (t.to_dict(), lines)
    sb = make("links-demo")
    targets = out(sb, "cd /srv/links && for l in rel abs host conf/out confdir; do readlink $l; done")
    assert targets.splitlines() == [
        "data.txt",
        "/etc/os-release",
        str(host_secret),
        "../../" + "../" * 8 + str(host_secret).lstrip("/"),
        "conf",
    ], targets
    assert out(sb, "cat /srv/links/rel") == f"data {NONCE}"
    assert out(sb, "cat /srv/links/abs") == out(sb, "cat /etc/os-release")
    assert out(sb, "ls /srv/links/confdir/") == "out"
    for link in ("host", "conf/out"):  # the host's file is not what the sandbox sees
        r = sb.exec(f"cat /srv/links/{link}", timeout_s=60)
        assert r.exit_code != 0 and NONCE not in r.stdout, (link, r.stdout, r.stderr)
        assert "No such file" in r.stderr, r.stderr


def test_files_under_the_merged_usr_links_land_in_usr_and_bin_sh_stays(client, api, make, tmp_path):
    """Debian's /bin, /sbin, /lib and /lib64 are links into /usr. A file written under one (JSON
    `files`, a Dockerfile COPY) used to make a real /bin in its layer holding only that file: the
    template's /bin/sh was gone and every string exec failed with exit 127. Now the path resolves
    through the link, as Docker's COPY does, and a file that would replace the link is refused."""
    _t, lines = build(
        client, "spec-bin", files={"/bin/tool2": f"#!/bin/sh\necho t2 {NONCE}\n", "/tmp/note": "n\n"}
    )
    assert any("/bin/tool2 is /usr/bin/tool2" in ln for ln in lines), lines
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "tool").write_text(f"#!/bin/sh\necho tool {NONCE}\n")
    os.chmod(ctx / "tool", 0o755)
    (ctx / "Dockerfile").write_text("FROM spec-bin\nCOPY tool /bin/tool\nCOPY tool /sbin/\n")
    lines = []
    t = client.templates.build_dockerfile("docker-bin", str(ctx), on_log=lines.append, timeout=BUILD_TIMEOUT)
    assert t.status == "ready", (t.to_dict(), lines)

    sb = make("docker-bin")
    assert out(sb, "true") == ""  # a string exec: through /bin/sh
    r = sb.exec(["sh", "-c", "true"], timeout_s=60)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert out(sb, "readlink /bin /sbin") == "usr/bin\nusr/sbin"
    assert {"sh", "ls", "tool", "tool2"} <= set(out(sb, "ls /bin/").split())
    assert out(sb, "sh /bin/tool2") == f"t2 {NONCE}"
    assert out(sb, "/bin/tool") == out(sb, "/usr/sbin/tool") == f"tool {NONCE}"
    assert out(sb, "stat -c %a /tmp") == "1777"  # the directory the files step made keeps its mode

    _e, failed, _log = build_fails(client, api, "spec-bin-dir", files={"/bin": "x"})
    assert "/bin is a symbolic link to the directory /usr/bin" in (failed.error or ""), failed.error


@pytest.mark.parametrize(
    "dockerfile, needle",
    [
        ("FROM base\nRUN echo hi\nEXPOSE 80\n", "line 3"),
        ("FROM base\nRUN echo hi\nFROM base\n", "line 3"),
        ("FROM python:3.12\nRUN echo hi\n", "registry"),
        ("FROM base\nCOPY app.py /app.py\n", "COPY"),
    ],
    ids=["expose", "second-from", "registry-image", "copy-without-context"],
)
def test_dockerfile_refusals_are_immediate_400s(api, dockerfile, needle):
    t0 = time.monotonic()
    r = api.post(
        "/v1/templates",
        params={"name": "docker-bad"},
        content=dockerfile.encode(),
        headers={"Content-Type": "text/x-dockerfile"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and needle in err["message"], err
    assert time.monotonic() - t0 < 5
    assert api.get("/v1/templates/docker-bad").status_code == 404  # nothing was recorded


# ---- 4. pip --------------------------------------------------------------------------------------


def test_pip_from_the_index_and_a_failed_rebuild_keeps_the_previous_build(client, api, make, pkghost):
    t, lines = build(client, "pip-demo", pip=[repo.PIP_PACKAGE], env={"NONCE": NONCE})
    assert t.status == "ready", lines
    assert any(f"/simple/{repo.PIP_PACKAGE}/" in ln for ln in repo.requests_seen(pkghost.dir)), (
        "pip did not ask the test index",
        repo.requests_seen(pkghost.dir),
    )
    sb = make("pip-demo")
    assert out(sb, "python3 -c 'import atolltestpkg; print(atolltestpkg.VALUE)'") == repo.PIP_VALUE

    e, after, log = build_fails(client, api, "pip-demo", pip=["atoll-no-such-package"], env={"NONCE": NONCE})
    assert "No matching distribution found for atoll-no-such-package" in log, log
    assert any("/simple/atoll-no-such-package/" in ln for ln in repo.requests_seen(pkghost.dir))
    assert after.status == "failed" and after.build_id == e.build_id, after.to_dict()
    assert after["current_build_id"] == t.build_id, after.to_dict()
    sb2 = make("pip-demo")  # the previous build keeps serving
    assert sb2["build_id"] == t.build_id
    assert out(sb2, "python3 -c 'import atolltestpkg; print(atolltestpkg.VALUE)'") == repo.PIP_VALUE


# ---- 5. apt --------------------------------------------------------------------------------------


def apt_asked(pkghost) -> list[str]:
    return [ln for ln in repo.requests_seen(pkghost.dir) if " /apt/" in ln]


def test_apt_from_the_flat_repository(client, make, pkghost):
    t, lines = build(client, "apt-demo", apt=[repo.APT_PACKAGE], env={"NONCE": NONCE})
    assert t.status == "ready", lines
    assert any(repo.APT_PACKAGE in ln for ln in apt_asked(pkghost)), repo.requests_seen(pkghost.dir)
    sb = make("apt-demo")
    assert out(sb, repo.APT_PACKAGE) == repo.APT_LINE
    assert "deb.debian.org" not in "\n".join(lines), lines  # only the configured sources


def test_an_apt_package_that_does_not_exist_fails_the_build_with_apt_s_message(client, api, pkghost):
    before = len(apt_asked(pkghost))
    e, t, log = build_fails(client, api, "apt-missing", apt=["atoll-no-such-package"], env={"NONCE": NONCE})
    assert "Unable to locate package atoll-no-such-package" in log, log
    assert "atoll-no-such-package" in e.message and t.status == "failed"
    # apt looked in the configured repository (not only failed to reach the image's own sources).
    assert len(apt_asked(pkghost)) > before, repo.requests_seen(pkghost.dir)


# ---- 6. ready checks ---------------------------------------------------------------------------


def test_a_ready_command_that_never_passes_fails_the_build(client, api):
    t0 = time.monotonic()
    e, t, log = build_fails(
        client, api, "ready-cmd", start="sleep 1000", ready={"cmd": "false", "timeout_s": 3}
    )
    assert "ready" in e.message and "did not pass" in e.message, e.message
    assert t.status == "failed" and "did not pass" in (t.error or ""), t.to_dict()
    assert log.rstrip().splitlines()[-1].startswith("ERROR"), log
    assert time.monotonic() - t0 < 60


def test_a_ready_port_nothing_listens_on_fails_the_build(client, api):
    e, t, log = build_fails(client, api, "ready-port", start="sleep 1000", ready={"port": 9, "timeout_s": 3})
    assert "port 9" in e.message, e.message
    assert t.status == "failed"
    with pytest.raises(atoll.errors.AtollError) as ei:
        client.sandboxes.create(template="ready-port")
    assert ei.value.status_code == 409, ei.value  # no ready build to create from


def test_a_template_path_that_finds_no_python_boots_and_is_its_commands_path(client, make):
    """A tester's `{"env": {"PATH": "/nonexistent"}}` failed its build with "runsc run failed
    (exit 128)": the guest agent was started as `python3` through the template's PATH. It starts by
    its absolute path now, and atoll's own commands of the boot (mkdir of the workdir, the listen
    probe) do not use that PATH either; the sandbox's commands do."""
    t, lines = build(
        client,
        "path-nowhere",
        env={"PATH": "/nonexistent", "NONCE": NONCE},
        workdir="/srv/path-nowhere",
        start="exec /usr/bin/python3 -m http.server 8001",
        ready={"port": 8001},
    )
    assert t.status == "ready", (t.to_dict(), lines)
    assert t["env"]["PATH"] == "/nonexistent", t.to_dict()
    sb = make("path-nowhere")
    assert out(sb, ["/bin/sh", "-c", 'echo "$PATH $PWD"']) == "/nonexistent /srv/path-nowhere"
    r = sb.exec("ls", timeout_s=60)  # found through the template's PATH: not there
    assert r.exit_code == 127 and "not found" in r.stderr, (r.exit_code, r.stdout, r.stderr)
    assert "http.server" in out(sb, ["/bin/ps", "-eo", "args"])


# ---- 7. bad input ------------------------------------------------------------------------------


def test_bad_specs_are_refused_at_once(api, web):
    def post(body):
        r = api.post("/v1/templates", json=body)
        assert r.status_code == 400, (body, r.text)
        return r.json()["error"]["message"]

    assert "no-such-template" in post({"name": "bad-from", "from": "no-such-template"})
    assert "absolute" in post({"name": "bad-oci", "from": "oci-archive:nonexistent.tar"})
    assert "base" in post({"name": "base", "run": ["true"]})
    assert "name" in post({"name": "Not_A_Name"})
    assert "unknown" in post({"name": "typo", "rnu": ["true"]})
    r = api.put("/v1/templates/web/pool", json={"min": 3, "max": 2})
    assert r.status_code == 400, r.text
    assert api.get("/v1/templates/web/pool").json()["min"] == 0  # nothing changed


def test_a_corrupt_oci_archive_fails_the_build_naming_it(client, api):
    with tempfile.TemporaryDirectory(prefix="atoll-oci-") as d:
        path = os.path.join(d, "corrupt.tar")
        with open(path, "wb") as f:
            f.write(os.urandom(8192))
        e, t, log = build_fails(client, api, "bad-archive", **{"from_": f"oci-archive:{path}"})
    assert path in e.message or "corrupt.tar" in e.message, e.message
    assert t.status == "failed"


def test_fork_count_out_of_range_is_400(api, make):
    sb = make()
    for count in (0, 51):
        r = api.post(f"/v1/sandboxes/{sb.id}/fork", json={"count": count})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_request"
    assert [
        s["id"] for s in api.get("/v1/sandboxes").json()["items"] if s["metadata"].get("atoll.forked_from")
    ] == []


# ---- 8. users ------------------------------------------------------------------------------------


def test_the_template_user_is_the_default_user_of_exec(client, make):
    t, lines = build(client, "user-demo", run=["useradd -m dev"], user="dev", env={"NONCE": NONCE})
    assert t.status == "ready", lines
    sb = make("user-demo")
    assert out(sb, "whoami") == "dev"
    assert out(sb, "whoami", user="root") == "root"


def test_a_dockerfile_user_made_by_an_earlier_run(client, make):
    lines: list[str] = []
    t = client.templates.build_dockerfile(
        "user-docker",
        f"FROM base\nRUN useradd -m dev2 && echo {NONCE}\nUSER dev2\nRUN whoami > /home/dev2/who-built\n",
        on_log=lines.append,
        timeout=BUILD_TIMEOUT,
    )
    assert t.status == "ready" and t["user"] == "dev2", (t.to_dict(), lines)
    sb = make("user-docker")
    assert out(sb, "cat /home/dev2/who-built") == "dev2"  # RUN after USER ran as dev2
    assert out(sb, "whoami") == "dev2"
    assert sb.user == "dev2", sb.to_dict()  # the sandbox object says who exec runs as
    assert out(sb, "echo $HOME") == "/home/dev2"


def test_a_template_user_that_does_not_exist_fails_the_build(client, api):
    e, t, log = build_fails(client, api, "user-missing", user="nobodyhere")
    assert "nobodyhere" in e.message, e.message
    assert t.status == "failed"


# ---- 9. delete -----------------------------------------------------------------------------------


def test_delete_is_refused_while_in_use_then_removes_the_template(client, api, make, la):
    t, _ = build(client, "del-demo", env={"DEL": "1"})
    assert t.status == "ready"
    before = unlisted_on_host(la, api, timeout=5)
    client.templates.set_pool("del-demo", min=1, max=1)
    wait_pool(client, "del-demo", lambda p: p["ready"] >= 1)
    pooled = host_sandbox_dirs(la) - {s["id"] for s in api.get("/v1/sandboxes").json()["items"]}
    assert pooled, "the pooled sandbox should be on the host"
    sb = make("del-demo", memory_mb=768)  # another memory size: not claimed from the pool
    assert api.get("/v1/templates/del-demo").json()["in_use"] == 1  # the pooled one does not count
    r = api.delete("/v1/templates/del-demo")
    assert r.status_code == 409 and r.json()["error"]["code"] == "template_in_use", r.text
    assert api.get("/v1/templates/del-demo").status_code == 200
    sb.delete()
    r = api.delete("/v1/templates/del-demo")
    assert r.status_code == 204, r.text
    r = api.get("/v1/templates/del-demo")
    assert r.status_code == 404 and r.json()["error"]["code"] == "template_not_found", r.text
    assert "del-demo" not in [x.name for x in client.templates.list()]
    r = api.post("/v1/sandboxes", json={"template": "del-demo"})
    assert r.status_code == 404, r.text
    # Its pool went with it: nothing of it is left on the host (no refill raced the delete).
    assert unlisted_on_host(la, api, ignore=before) == set(), "the deleted template's pool left sandboxes"
    assert not os.path.exists(os.path.join(la.home, "builds", t.build_id)), "its build is still on the host"


# ---- 10. warm pools ------------------------------------------------------------------------------


def wait_pool(client, name, pred, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        p = client.templates.get_pool(name)
        if pred(p):
            return p
        if time.monotonic() > deadline:
            raise AssertionError(f"pool of {name} did not get there within {timeout}s: {p}")
        time.sleep(0.5)


def host_sandbox_dirs(la) -> set[str]:
    d = os.path.join(la.home, "sandboxes")
    return set(os.listdir(d)) if os.path.isdir(d) else set()


def unlisted_on_host(la, api, ignore: set[str] = frozenset(), timeout: float = 30) -> set[str]:
    """Sandboxes on the host that GET /v1/sandboxes does not list (deletion finishes in the
    background: waits up to `timeout` for them to go)."""
    deadline = time.monotonic() + timeout
    while True:
        live = {s["id"] for s in api.get("/v1/sandboxes").json()["items"]}
        left = host_sandbox_dirs(la) - live - ignore
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.3)


def test_warm_pool_claim_refill_and_drain(client, api, make, la, pkghost):
    t, _ = build(client, "pool-demo", run=[f"echo pooled-{NONCE} > /pooled.txt"], env={"POOL_T": "t"})
    assert t.status == "ready"
    before = unlisted_on_host(la, api, timeout=5)
    try:
        pool = client.templates.set_pool("pool-demo", min=2, max=3)
        assert pool["min"] == 2 and pool["max"] == 3, pool
        p = wait_pool(client, "pool-demo", lambda p: p["ready"] >= 2)
        claimed = p["claimed"]
        listed = [s for s in api.get("/v1/sandboxes").json()["items"] if s["template"] == "pool-demo"]
        assert listed == [], listed
        on_host = host_sandbox_dirs(la) - {s["id"] for s in api.get("/v1/sandboxes").json()["items"]}
        assert len(on_host) >= 2, on_host  # the pooled sandboxes are real, just not listed

        sb = make("pool-demo", env={"CALLER": "claimer"}, metadata={"who": "pool-test"})
        assert client.templates.get_pool("pool-demo")["claimed"] == claimed + 1
        assert out(sb, "echo $CALLER $POOL_T") == "claimer t"
        assert out(sb, "cat /pooled.txt") == f"pooled-{NONCE}"
        assert out(sb, "hostname") == sb.id and identity(sb)["sandbox_id"] == sb.id
        assert sb.metadata == {"who": "pool-test"}
        assert client.sandboxes.get(sb.id).metadata == {"who": "pool-test"}
        listed = [s["id"] for s in api.get("/v1/sandboxes").json()["items"] if s["template"] == "pool-demo"]
        assert listed == [sb.id]
        p = wait_pool(client, "pool-demo", lambda p: p["ready"] >= 2)  # refilled
        assert p["desired"] == 2 and p["build_id"] == t.build_id, p

        # A pooled sandbox was started before anyone chose its egress policy: a claim gets the
        # caller's, and one without a policy gets no way out.
        page = f"http://{pkghost.a}:{repo.PORT}/simple/"
        fetch = f"import urllib.request; print(urllib.request.urlopen({page!r}, timeout=5).status)"
        claims = client.templates.get_pool("pool-demo")["claimed"]
        open_ = make("pool-demo", network={"allow_out": [f"{pkghost.a}:{repo.PORT}"]})
        closed = make("pool-demo")
        assert client.templates.get_pool("pool-demo")["claimed"] == claims + 2
        assert open_.network["allow_out"] == [f"{pkghost.a}:{repo.PORT}"]
        assert out(open_, ["python3", "-c", fetch]) == "200"
        assert closed.exec(["python3", "-c", fetch], timeout_s=30).exit_code != 0
    finally:
        client.templates.set_pool("pool-demo", min=0, max=0)
    wait_pool(client, "pool-demo", lambda p: p["ready"] == 0 and p["starting"] == 0)
    assert unlisted_on_host(la, api, ignore=before) == set(), "pooled sandboxes are still on the host"


# ---- 11. fork ------------------------------------------------------------------------------------


def test_fork_makes_independent_copies_with_their_own_identity(client, make, made):
    parent = make(metadata={"role": "parent"})
    parent.files.write("/root/state.txt", f"state {NONCE}\n")
    parent.exec("sleep 1000", background=True)
    copies = parent.fork(3)
    made.extend(copies)
    assert len(copies) == 3
    ids_ = {c.id for c in copies}
    assert len(ids_) == 3 and parent.id not in ids_
    for c in copies:
        assert c.state == "running" and c.metadata.get("atoll.forked_from") == parent.id, c.to_dict()
        assert out(c, "hostname") == c.id
        ident = identity(c)
        assert ident["sandbox_id"] == c.id and ident["hostname"] == c.id and ident["generation"] == 0, ident
        assert out(c, "cat /root/state.txt") == f"state {NONCE}"
        assert "sleep 1000" in out(c, "ps -eo args"), out(c, "ps -eo args")
    # The parent runs on with its own state and processes.
    assert client.sandboxes.get(parent.id).state == "running"
    assert out(parent, "cat /root/state.txt") == f"state {NONCE}"
    assert "sleep 1000" in out(parent, "ps -eo args")
    assert out(parent, "hostname") == parent.id and identity(parent)["sandbox_id"] == parent.id
    out(copies[0], "echo changed > /root/state.txt")
    assert out(parent, "cat /root/state.txt") == f"state {NONCE}"
    assert out(copies[1], "cat /root/state.txt") == f"state {NONCE}"
    rand = {out(c, "head -c16 /dev/urandom | od -An -tx1") for c in copies}
    assert len(rand) == 3, rand


def test_fork_of_a_template_sandbox_in_standby(client, web, make, made):
    parent = make("web")
    parent.files.write("mine.txt", "parent's")
    parent.pause(tier="memory")
    (copy,) = parent.fork(1)
    made.append(copy)
    assert copy.template == "web" and copy["build_id"] == parent["build_id"], copy.to_dict()
    assert wait_answers(copy, http_get(8000, "/mine.txt"), timeout=10).strip() == "parent's"
    assert out(copy, "pwd") == "/srv/web" and out(copy, "hostname") == copy.id
    assert client.sandboxes.get(parent.id).state in ("running", "standby")
    assert wait_answers(parent, http_get(8000, "/mine.txt"), timeout=10).strip() == "parent's"


ASYNC_SERVER = r"""
import asyncio, os, sys
port = int(sys.argv[1])
async def handle(r, w):
    w.write(f"async-hello {os.environ.get('WHO', '-')}\n".encode()); await w.drain(); w.close()
async def main():
    s = await asyncio.start_server(handle, "127.0.0.1", port)
    async with s:
        await s.serve_forever()
asyncio.run(main())
"""


def test_fork_of_an_asyncio_server_is_refused_and_the_sandbox_runs_on(client, api, make):
    sb = make()
    sb.files.write("/root/aserver.py", ASYNC_SERVER)
    sb.exec("python3 /root/aserver.py 9000", background=True)
    assert wait_answers(sb, tcp_read(9000)).strip() == "async-hello -"
    r = api.post(f"/v1/sandboxes/{sb.id}/fork", json={"count": 1})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "checkpoint_refused", r.text
    assert out(sb, "echo still-here") == "still-here"
    assert wait_answers(sb, tcp_read(9000)).strip() == "async-hello -"
    assert client.sandboxes.get(sb.id).state == "running"
    with pytest.raises(atoll.errors.Conflict):
        sb.fork(1)
    assert [
        s for s in api.get("/v1/sandboxes").json()["items"] if s["metadata"].get("atoll.forked_from")
    ] == []


# ---- 12. an epoll server as the start command -------------------------------------------------


def test_an_asyncio_start_command_runs_after_each_restore(client, make):
    t, lines = build(
        client,
        "async-demo",
        files={"/opt/aserver.py": ASYNC_SERVER},
        start="python3 /opt/aserver.py 9001",
        ready={"port": 9001},
        env={"NONCE": NONCE},
    )
    assert t.status == "ready", lines
    assert t["start_mode"] == "after_restore" and t["start_reason"], t.to_dict()
    sb = make("async-demo")
    assert wait_answers(sb, tcp_read(9001), timeout=10).strip() == "async-hello -"
    assert "aserver.py" in out(sb, "ps -eo args")
    assert out(sb, "hostname") == sb.id


def test_a_start_command_run_after_restore_gets_the_caller_env(client, make):
    # It starts after the create, so (unlike one kept running in the snapshot) it can see the
    # environment the caller gave: a web app reading DATABASE_URL, say.
    t, lines = build(
        client,
        "async-env",
        files={"/opt/aserver.py": ASYNC_SERVER},
        start="python3 /opt/aserver.py 9002",
        ready={"port": 9002},
        env={"NONCE": NONCE, "WHO": "template"},
    )
    assert t["start_mode"] == "after_restore", t.to_dict()
    assert wait_answers(make("async-env"), tcp_read(9002), timeout=10).strip() == "async-hello template"
    sb = make("async-env", env={"WHO": "caller"})
    assert wait_answers(sb, tcp_read(9002), timeout=10).strip() == "async-hello caller"


# ---- 13. the build log, streamed -----------------------------------------------------------------


def test_build_log_streams_while_building_and_ends_with_done(api):
    r = api.post(
        "/v1/templates",
        json={"name": "log-demo", "run": [f"echo marker-{NONCE}; sleep 1; echo after-{NONCE}"]},
    )
    assert r.status_code == 202, r.text
    started = r.json()
    assert started["status"] == "building" and started["build_id"]
    again = api.post("/v1/templates", json={"name": "log-demo", "run": ["true"]})
    assert again.status_code == 409 and again.json()["error"]["code"] == "template_exists", again.text
    with api.stream(
        "GET", f"/v1/templates/log-demo/builds/{started['build_id']}/logs", timeout=BUILD_TIMEOUT
    ) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/plain")
        text = "".join(s.iter_text())
    lines = text.splitlines()
    assert lines[-1].startswith("DONE"), text
    assert f"  marker-{NONCE}" in lines and f"  after-{NONCE}" in lines, text
    assert any(ln.startswith("STEP [1/1]") for ln in lines), text
    deadline = time.monotonic() + 10
    while api.get("/v1/templates/log-demo").json()["status"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.get("/v1/templates/log-demo").json()["status"] == "ready"
    assert api.get("/v1/templates/log-demo/builds/bld-nosuchbuild000/logs").status_code == 404


# ---- 14. the CLI ---------------------------------------------------------------------------------


def test_cli_template_build_list_pool_rm(la, api, tmp_path):
    env = {**os.environ, "ATOLL_URL": la.url, "ATOLL_API_KEY": la.api_key}

    def cli(*args, ok=True):
        p = subprocess.run([ATOLL_CLI, *args], env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if ok:
            assert p.returncode == 0, (args, p.returncode, p.stdout, p.stderr)
        return p

    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: cli-demo\nfrom: base\nrun:\n  - echo cli-{NONCE} > /cli.txt\n")
    p = cli("template", "build", "-f", str(spec))
    assert "cli-demo ready" in p.stdout, p.stdout
    assert "DONE" in p.stderr, p.stderr  # the log streamed
    p = cli("template", "list")
    row = [ln for ln in p.stdout.splitlines() if ln.split()[:1] == ["cli-demo"]]
    assert row and "ready" in row[0], p.stdout
    p = cli("pool", "set", "cli-demo", "--min", "0", "--max", "1")
    assert json.loads(p.stdout)["max"] == 1, p.stdout
    assert api.get("/v1/templates/cli-demo/pool").json()["max"] == 1
    cli("template", "rm", "cli-demo")
    assert api.get("/v1/templates/cli-demo").status_code == 404
    p = cli("template", "rm", "cli-demo", ok=False)
    assert p.returncode == 1 and "template_not_found" in p.stderr, (p.returncode, p.stderr)


def test_a_build_step_that_points_etc_at_the_host_changes_nothing_there(client, api, tmp_path):
    """A run step (untrusted code) replaces /etc with a symlink to a host directory: the worker,
    root on the host, must not write or delete through it when it takes the step's layer."""
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("hosts", "hostname", "resolv.conf"):
        (victim / name).write_text("the host's own\n")
    e, t, log = build_fails(client, api, "etc-symlink", run=[f"rm -rf /etc && ln -s {victim} /etc"])
    assert t.status == "failed" and "/etc is a symlink" in (t.error or ""), t.error
    assert "ERROR" in log
    assert sorted(os.listdir(victim)) == ["hostname", "hosts", "resolv.conf"]
    assert all((victim / n).read_text() == "the host's own\n" for n in os.listdir(victim))
