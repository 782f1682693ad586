"""The unmodified `e2b` SDK (2.63.0 and 2.31.0, each in its own venv: tests/e2b_venv.py) against
a real `atoll up` (gVisor sandboxes) through atoll's E2B API, served by the edge child process on
ATOLL_E2B_PORT (controlplane.edge_host, e2b.app): create with metadata/envs/timeout, get_info,
list by metadata and paged, set_timeout, pause twice, is_running, connect (resume), metrics, kill
twice; and the SDK's exceptions for a wrong key and unknown ids. The driver runs in the venv
(tests/integration/e2b_sdk_driver.py) and prints what it saw."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atoll.testing import LocalAtoll, LocalServer, free_port
from tests import e2b_venv
from tests.conftest import TEMPLATE_CACHE
from tests.integration.e2b_support import code_interpreter_ready

DRIVER = Path(__file__).with_name("e2b_sdk_driver.py")
RELEASES = pytest.mark.parametrize("release", ["2.63", "2.31"])


def drive(release: str, atoll_up, scenario: str, **extra_env: str) -> dict:
    python = e2b_venv.python(release)
    key = atoll_up.api_key
    if release == "2.31":  # it refuses any key but e2b_<hex> client-side (docs/e2b-compat.md §1.11)
        key = "e2b_" + key.encode().hex()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
        "E2B_API_URL": atoll_up.e2b_url,
        "E2B_SANDBOX_URL": atoll_up.e2b_url,
        "E2B_API_KEY": key,
        **extra_env,
    }
    proc = subprocess.run(
        [str(python), str(DRIVER), scenario], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"driver {scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def drive_agents(atoll_up, *args: str) -> dict:
    """Run tests/integration/agents_e2b_driver.py (with `args`) in the Agents SDK's venv (e2b 2.31)
    against the E2B port; its last line of output, as JSON."""
    python = e2b_venv.python("agents")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("E2B_")},
        "E2B_API_URL": atoll_up.e2b_url,
        "E2B_SANDBOX_URL": atoll_up.e2b_url,
        "E2B_API_KEY": "e2b_" + atoll_up.api_key.encode().hex(),  # 2.31 checks the key's spelling
    }
    proc = subprocess.run(
        [str(python), str(DRIVER.with_name("agents_e2b_driver.py")), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"driver failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.ecosystem
@RELEASES
def test_control_api_lifecycle(release, atoll_up):
    out = drive(release, atoll_up, "lifecycle")
    sid = out["id"]
    assert out["envd_version"] == "0.5.6"
    assert out["info"]["sandbox_id"] == sid and out["info"]["template_id"] == "base"
    assert out["info"]["metadata"]["odd"] == "a&b=c%" and out["info"]["state"] == "running"
    assert 100 <= out["info"]["end_minus_start_s"] <= 140  # timeout=120 from creation
    assert out["info"]["cpu_count"] >= 1 and out["info"]["memory_mb"] > 0
    assert out["listed"] == [sid]
    assert [len(p) for p in out["pages"]] == [1, 1] and out["first_page_has_next"] is True
    assert 590 <= out["end_after_set_timeout_s"] <= 700
    assert out["pause"] is True and out["state_after_pause"] == "paused"
    assert out["paused_listed"] == [sid]
    assert out["pause_again"] is False  # 409: already paused
    assert out["is_running_paused"] is False  # envd /health 502 while paused
    assert out["connected"] == sid and out["state_after_connect"] == "running"
    assert out["is_running_resumed"] is True
    assert len(out["metrics"]) == 1 and out["metrics"][0]["mem_total"] > 0
    assert out["kill"] is True and out["kill_again"] is False
    r = httpx.get(f"{atoll_up.url}/v1/sandboxes/{sid}", headers=atoll_up.headers())
    assert r.status_code == 404 or r.json()["state"] == "deleted"


@pytest.mark.ecosystem
@RELEASES
def test_errors_arrive_as_the_sdk_exceptions(release, atoll_up):
    out = drive(release, atoll_up, "errors")
    assert out["wrong_key"] == "AuthenticationException"
    assert out["unknown_connect"] in ("NotFoundException", "SandboxNotFoundException")
    assert out["unknown_info"] in ("NotFoundException", "SandboxNotFoundException")
    assert out["unknown_kill"] is False
    assert (
        out["unknown_template"].startswith("SandboxException")
        and "no-such-template" in out["unknown_template"]
    )


@pytest.mark.ecosystem
@RELEASES
def test_commands_and_files_through_envd(release, atoll_up):
    out = drive(release, atoll_up, "envd")
    assert out["run"] == {"stdout": "from-create\n", "stderr": "e\n", "exit_code": 0}, out
    assert out["exit3"] == {"type": "CommandExitException", "exit_code": 3, "stdout": "partial\n"}, out
    assert out["cwd_env"] == "/tmp\nwhy\n", out
    assert out["on_stdout"].split() == ["1", "2", "3"], out
    assert out["listed_pid"] is True and out["kill"] is True, out
    assert out["killed_wait"]["exit_code"] == -1 and out["killed_wait"]["stdout"] == "to cat\n", out
    assert out["timeout"] == "TimeoutException", out.get("timeout_message")
    assert out["read"] == "hello" and out["bytes_exact"] is True, out
    assert out["exists"] == [True, False] and out["make_dir"] == [True, False], out
    assert out["listed"] == ["a.txt"] and out["after_remove"] == [], out
    assert out["info_size"] == 256 and out["seen_by_exec"] == "256", out
    assert out["missing"] in ("NotFoundException", "FileNotFoundException"), out


@pytest.mark.ecosystem
def test_volumes_are_drives_with_their_content_api(atoll_up):
    """2.63's Volume API (2.31 has none of the content calls) over drives and drive tokens."""
    out = drive("2.63", atoll_up, "volumes", E2B_VOLUME_API_URL=atoll_up.e2b_url)
    assert out["created"] == ["sdkvol", "sdkvol", True], out
    assert out["read"] == "from the sdk" and out["bytes_exact"] and out["streamed"], out
    assert out["made"] == ["directory", "/x/y"] and out["exists"] == [True, False], out
    assert out["info"] == {"size": 256 * 64, "mode": 0o600, "type": "file", "utc": True}, out
    assert out["owner"] == [1000, 1000], out
    assert out["listed"] == ["/b.bin", "/docs", "/docs/a.txt", "/x", "/x/y"], out
    assert out["connect_token_same"] and out["get_info"] == "sdkvol" and out["in_list"], out
    assert out["after_remove"] is False and out["missing"] == "VolumePathNotFoundException", out
    assert out["seen_in_sandbox"] == "from the sdk" and out["written_back"] == "from-sandbox\n", out
    assert out["destroy"] is True and out["destroy_again"] is False, out


@pytest.mark.ecosystem
@pytest.mark.timeout(1800)  # the code interpreter's template is built at first start (~10 min cold)
def test_run_code_through_the_code_interpreter(atoll_up):
    """e2b_code_interpreter 2.11.5 (in the 2.63 venv) against a `code-interpreter-v1` sandbox: state
    between calls, stdout/stderr, an error with its traceback, a matplotlib figure as PNG, env vars
    for one call, run_code's timeout interrupting the cell, contexts (create, isolated, list,
    restart, remove), and state across a pause."""
    code_interpreter_ready(atoll_up)
    out = drive(
        "2.63", atoll_up, "interpreter", ATOLL_NATIVE_URL=atoll_up.url, ATOLL_NATIVE_KEY=atoll_up.api_key
    )
    print(
        "interpreter:",
        json.dumps({k: out[k] for k in ("first_run_s", "p50_1plus1_ms", "disk_pause", "x_after_disk")}),
    )
    assert out["template"] == "code-interpreter-v1"
    assert out["assign"] == {"text": None, "error": False, "results": 0}, out
    assert out["x_plus_1"] == "2", out
    assert out["stdout"] == ["hello\n"] and out["stderr"] == ["oops\n"], out
    assert out["error"] == {
        "name": "ZeroDivisionError",
        "value": "division by zero",
        "traceback_has_line": True,
    }, out
    assert out["png_prefix"] == "iVBORw0KGgoA", out  # base64 of the PNG signature
    assert out["env_during"] == "'set'" and out["env_after"] == "'None'", out
    # interrupted, not waited for: the 60 s cell never assigned x
    assert out["timeout"] == "TimeoutException" and out["x_after_timeout"] == "1", out
    assert out["after_timeout_s"] < 40, out
    assert out["ctx"] == {"language": "python", "cwd": "/home/user"}, out
    assert out["ctx_isolated"] == "False" and out["ctx_listed"] is True, out
    assert out["ctx_after_restart"] == "False" and out["ctx_removed"] is True, out
    assert out["pause"] is True and out["x_after_resume"] == "2", out
    # the disk tier (a checkpoint) keeps the kernel: ipc sockets, no TCP endpoint in epoll
    assert out["disk_pause"][0] == "disk" and out["x_after_disk"] == "2", out


@pytest.mark.ecosystem
@RELEASES
def test_e2b_lifecycle_is_kept_per_sandbox(release, atoll_up):
    """Without auto-resume a paused sandbox's envd calls fail as "not running" and leave it
    paused; with it they resume it; the lifetime's end kills or pauses as on_timeout says."""
    out = drive(release, atoll_up, "paused")
    assert out["plain_is_running"] is False and out["plain_state"] == "paused", out
    not_running = {"2.63": "SandboxNotRunningException", "2.31": "TimeoutException"}[release]
    assert out["plain_read"] == not_running and out["plain_run"] == not_running, out
    assert out["plain_read_after_connect"] == "plain", out
    assert out["auto_is_running"] is False, out  # /health never resumes
    assert out["auto_read"] == "auto" and out["auto_run"] == "ran\n" and out["auto_state"] == "running", out
    assert out["ends_kill"] in ("NotFoundException", "SandboxNotFoundException"), out
    assert out["ends_pause"] == "paused" and out["ends_pause_resumed"] == "up\n", out


@pytest.mark.ecosystem
@RELEASES
def test_pause_with_a_process_stream_open(release, atoll_up):
    """Issue 22's acceptance: pause → is_running() false → Sandbox.connect → a running process and
    files intact. The open stream ends (Connect canceled: TimeoutException) rather than refusing
    the pause; and a process another command `kill -9`s ends as envd's `-1 signal: killed`."""
    out = drive(release, atoll_up, "pause_streams")
    assert out["victim"] == [-1, "signal: killed"], out
    assert out["pause"] is True and out["open_stream"] == "TimeoutException", out
    assert out["is_running"] is False and out["state"] == "paused", out
    assert out["is_running_after"] is True and out["pid"] in out["listed"], out
    assert out["kept"] == "kept", out
    assert out["after_connect"] == [-1, "signal: killed"], out
    assert "tick" in out["after_connect_stdout"], out  # it ran on: new output after the connect


@pytest.mark.ecosystem
def test_the_openai_agents_sdks_own_e2b_extension(atoll_up):
    """The OpenAI Agents SDK 0.24's E2B extension, unchanged (on e2b 2.31.0), against the E2B port:
    a session from a manifest (its defaults: pause on timeout with auto-resume), exec with the
    session's env, files, a missing file, a terminal, pause on exit and resume from its state."""
    out = drive_agents(atoll_up)
    assert out["echo"] == {"stdout": "hi 1\n", "stderr": "", "exit_code": 0}, out
    assert out["fail"] == {"stdout": "", "stderr": "oops\n", "exit_code": 3}, out
    assert out["manifest_file"] == "from the manifest\n", out
    assert out["cat"]["stdout"] == "written by the agent\n" and out["missing"] == "WorkspaceReadNotFoundError"
    assert out["supports_pty"] is True and "got:abc" in out["pty"]["output"], out
    assert out["running"] is True and out["state_after_exit"] == "paused", out
    assert out["after_resume"] == {"stdout": "written by the agent\n1\n", "stderr": "", "exit_code": 0}, out
    assert out["killed"] is True, out


def _edge_children(pid: int) -> list[int]:
    """PIDs of `python -m atoll.edge` processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"atoll.edge" in argv:
            out.append(int(entry))
    return out


def _wait_listed(url: str, key: str, timeout: float = 30) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(f"{url}/v2/sandboxes", headers={"X-API-KEY": key}, timeout=5)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "E2B's API did not answer again"
        time.sleep(0.2)


def test_the_edge_child_is_started_again_when_it_dies(atoll_up):
    assert atoll_up.proc is not None
    [pid] = _edge_children(atoll_up.proc.pid)
    os.kill(pid, signal.SIGKILL)  # our own installation's child, by PID
    assert _wait_listed(atoll_up.e2b_url, atoll_up.api_key).json() is not None
    [again] = _edge_children(atoll_up.proc.pid)
    assert again != pid


def test_the_harness_picks_its_ports_again_when_one_was_taken(tmp_path):
    """LocalAtoll chooses free ports apart from their use; one taken in between (by any process on
    the machine) made a whole module's installation fail to start. It now picks again."""
    # the shared layer cache: without it this installation built `base` with mmdebstrap (~35-55 s)
    la = LocalAtoll(home=tmp_path / "home", env={"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE})
    taken = socket.socket()
    taken.bind(("127.0.0.1", la.e2b_port))
    taken.listen(1)
    first = la.e2b_port
    try:
        la.start(timeout=300)
        assert la.e2b_port != first
        assert httpx.get(f"{la.e2b_url}/v2/sandboxes", headers={"X-API-KEY": la.api_key}).status_code == 200
    finally:
        la.stop(reap=False)
        taken.close()


def test_an_e2b_port_in_use_stops_the_start_naming_the_variable(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    la = LocalAtoll(home=tmp_path / "home", env={"ATOLL_E2B_PORT": str(port)})
    try:
        la.spawn()
        assert la.proc is not None
        rc = la.proc.wait(120)
        assert rc == 2, la.tail()
        log = la.tail()
        assert "ATOLL_E2B_PORT" in log and str(port) in log and "Traceback" not in log, log
    finally:
        la.stop(reap=False)
        taken.close()


def test_atoll_edge_serves_e2b_beside_its_native_routes(atoll_up, tmp_path):
    native, e2b = free_port(), free_port()
    log = open(tmp_path / "edge.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "atoll",
            "edge",
            "--server",
            atoll_up.url,
            "--port",
            str(native),
            "--e2b-port",
            str(e2b),
        ],
        env={k: v for k, v in os.environ.items() if k != "ATOLL_E2B_TOKEN_KEY"},
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{e2b}"
        assert isinstance(_wait_listed(url, atoll_up.api_key).json(), list)
        wrong = httpx.get(f"{url}/v2/sandboxes", headers={"X-API-KEY": "wrong"})
        assert wrong.status_code == 401 and wrong.json()["code"] == 401
        # the native routes answer on both ports, in the API's own shape
        for port in (native, e2b):
            r = httpx.get(
                f"http://127.0.0.1:{port}/v1/sandboxes/sb-0000000000000000/files/stat",
                params={"path": "/"},
                headers=atoll_up.headers(),
            )
            assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found", r.text
        # E2B's routes only on the E2B port
        assert (
            httpx.get(f"http://127.0.0.1:{native}/v2/sandboxes", headers={"X-API-KEY": "k"}).status_code
            == 404
        )
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_atoll_server_serves_e2b_over_https_when_the_api_does(tmp_path):
    server = LocalServer(tmp_path / "server", env={"ATOLL_TLS_NAMES": "127.0.0.1"})
    try:
        server.start()
        url = f"https://127.0.0.1:{server.e2b_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(
                    f"{url}/v2/sandboxes", headers={"X-API-KEY": server.api_key}, verify=server.verify
                )
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, server.tail()
                time.sleep(0.2)
        assert r.status_code == 200 and r.json() == [], r.text  # forwarded to the API over https
        with pytest.raises(httpx.HTTPError):
            httpx.get(
                f"http://127.0.0.1:{server.e2b_port}/v2/sandboxes", headers={"X-API-KEY": server.api_key}
            )
    finally:
        server.terminate()


@pytest.mark.ecosystem
def test_named_snapshots_with_the_263_sdk(atoll_up):
    out = drive("2.63", atoll_up, "snapshots")
    snap, tag = out["snapshot"], out["tag"]
    assert snap["id"].startswith("snp-") and snap["names"] == [tag]
    assert out["by_sandbox"] == sorted([snap["id"], out["files_only_id"]]) == out["own_list"]
    assert out["by_name"] == [snap["id"]]
    ids_ = {c["id"] for c in out["copies"]}
    assert len(ids_) == 2 and out["source"] not in ids_
    for c in out["copies"]:
        assert c["disk"] == f"disk-{tag}" and c["tmp"] == f"tmp-{tag}" and c["sleep"] is True, c
        assert c["hostname"] == c["id"]
    assert out["cold"] == {"disk": f"disk-{tag}", "tmp_exit": "missing", "sleep": False}
    assert out["delete"] is True and out["delete_again"] is False and out["delete_files_only"] is True
    assert out["after"] == []


@pytest.mark.ecosystem
def test_the_agents_sdk_e2b_extension_persists_a_workspace_as_a_snapshot(atoll_up):
    """The Agents SDK's own E2B extension (e2b 2.31) with `workspace_persistence="snapshot"`:
    persist_workspace is E2B's native create_snapshot, hydrate_workspace a create from it."""
    out = drive_agents(atoll_up, "snapshot")
    assert out["snapshot_id"] and out["snapshot_id"].startswith("snp-"), out
    assert out["second"] != out["first"], out
    assert out["cat"] == {"stdout": "in the snapshot\n", "stderr": "", "exit_code": 0}, out
    assert out["first_state"] is False, out
    r = httpx.delete(f"{atoll_up.url}/v1/snapshots/{out['snapshot_id']}", headers=atoll_up.headers())
    assert r.status_code == 204, r.text


def _connect_frames(raw: bytes) -> list[tuple[int, dict]]:
    """A Connect server stream's envelopes: (flags, JSON message); flag 2 is the end of stream."""
    out = []
    while raw:
        flags, size = struct.unpack(">BI", raw[:5])
        out.append((flags, json.loads(raw[5 : 5 + size])))
        raw = raw[5 + size :]
    return out


def test_envd_start_through_a_real_sandbox(atoll_up):
    """envd's process.Process/Start without an SDK, through the edge child, the worker's
    run_process and the guest agent (one call each): start{pid} first, stdout and stderr as data,
    then end{exitCode}; Connect-Timeout-Ms kills the command and ends deadline_exceeded."""
    e2b = httpx.Client(base_url=atoll_up.e2b_url, headers={"X-API-KEY": atoll_up.api_key}, timeout=120)
    made = e2b.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
    assert made.status_code == 201, made.text
    sid, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
    headers = {
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
        "E2b-Sandbox-Id": sid,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": token,
    }

    def start(cmd: str, **extra: str) -> list[tuple[int, dict]]:
        body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": False})
        envelope = struct.pack(">BI", 0, len(body)) + body.encode()
        r = e2b.post("/process.Process/Start", content=envelope, headers={**headers, **extra})
        assert r.status_code == 200, r.text
        return _connect_frames(r.content)

    try:
        frames = start("echo out; echo err >&2; exit 3")
        events = [m["event"] for flags, m in frames if not flags & 2]
        assert events[0]["start"]["pid"] > 0, frames
        data = [base64.b64decode(v) for e in events[1:-1] for k, v in e["data"].items()]
        streams = sorted(k for e in events[1:-1] for k in e["data"])
        assert (sorted(data), streams) == ([b"err\n", b"out\n"], ["stderr", "stdout"]), frames
        assert events[-1]["end"]["exitCode"] == 3 and events[-1]["end"]["status"] == "exit status 3"
        assert frames[-1] == (2, {}), frames
        # the deadline: the command is killed and the stream ends deadline_exceeded
        t0 = time.monotonic()
        frames = start("sleep 30", **{"Connect-Timeout-Ms": "1500"})
        assert time.monotonic() - t0 < 20
        assert frames[-1][0] & 2 and frames[-1][1]["error"]["code"] == "deadline_exceeded", frames
        pid = frames[0][1]["event"]["start"]["pid"]
        info = httpx.get(f"{atoll_up.url}/v1/sandboxes/{sid}/processes/{pid}", headers=atoll_up.headers())
        deadline = time.monotonic() + 10
        while info.json().get("running") and time.monotonic() < deadline:
            time.sleep(0.2)
            info = httpx.get(f"{atoll_up.url}/v1/sandboxes/{sid}/processes/{pid}", headers=atoll_up.headers())
        assert info.json()["running"] is False, info.text
    finally:
        e2b.delete(f"/sandboxes/{sid}")
        e2b.close()
