"""`atoll edge` over `atoll server` + `atoll worker` with real gVisor sandboxes: exec, streamed exec,
background processes and files through the edge answer as through the API; an exec stream, a
followed process output and a terminal (the SDK with edge_url) through the edge keep flowing while
the server is SIGKILLed, and new calls work once it is back (the worker registered again: old
grants are refused and the edge asks anew); grants open one sandbox's data verbs only; a wrong key
is the server's 401; a sandbox in standby is resumed by the grant; the edge's calls keep the idle
timer from firing."""

from __future__ import annotations

import json
import time
import typing

import httpx
import pytest

import atoll
from atoll.core import worker_api as api
from atoll.testing import LocalCluster, LocalEdge
from tests.conftest import TEMPLATE_CACHE

pytestmark = pytest.mark.integration

ENV = {"ATOLL_TEMPLATE_DIR": TEMPLATE_CACHE, "ATOLL_WORKER_LOST_S": "6", "ATOLL_HEARTBEAT_S": "1"}
COUNT = "for i in $(seq 1 30); do echo $i; sleep 0.1; done"


def _start(root) -> tuple[LocalCluster, LocalEdge]:
    cl = LocalCluster(root / "cluster", workers=1, env=ENV)
    cl.start(timeout=600)
    try:
        edge = LocalEdge(root / "edge", cl.url).start()
    except BaseException:
        cl.stop(reap=True)
        raise
    return cl, edge


def _stop(cl: LocalCluster, edge: LocalEdge) -> None:
    edge.terminate()
    if cl.server.proc is None:
        cl.server.start()
    try:
        cl.wait_healthy(120, lambda: None)
    except RuntimeError:
        pass
    cl.stop(reap=True)


@pytest.fixture(scope="module")
def _shared(tmp_path_factory):
    cl, edge = _start(tmp_path_factory.mktemp("edge-shared"))
    yield cl, edge
    _stop(cl, edge)


@pytest.fixture
def shared(_shared):
    cl, edge = _shared
    yield cl, edge
    cl.delete_all()


@pytest.fixture
def own(tmp_path):
    cl, edge = _start(tmp_path)
    yield cl, edge
    _stop(cl, edge)


def _api(cl) -> httpx.Client:
    return httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=300)


def _edge(cl, edge, key: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key or cl.api_key}"}
    return httpx.Client(base_url=edge.url, headers=headers, timeout=300)


def _sandbox(c) -> str:
    r = c.post("/v1/sandboxes", json={"idle_timeout_s": 0})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _lines(r: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines() if line]


def test_exec_and_processes_through_the_edge_answer_as_through_the_api(shared):
    cl, edge = shared
    with _api(cl) as a, _edge(cl, edge) as e:
        sid = _sandbox(a)
        body = {"cmd": "echo out; echo err >&2; exit 3"}
        via_api = a.post(f"/v1/sandboxes/{sid}/exec", json=body).json()
        via_edge = e.post(f"/v1/sandboxes/{sid}/exec", json=body)
        assert via_edge.status_code == 200, via_edge.text
        got = via_edge.json()
        assert {k: v for k, v in got.items() if k != "duration_ms"} == {
            k: v for k, v in via_api.items() if k != "duration_ms"
        }
        assert got["stdout"] == "out\n" and got["stderr"] == "err\n" and got["exit_code"] == 3
        nd = {"Accept": "application/x-ndjson"}
        streamed_api = _lines(a.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "seq 1 3"}, headers=nd))
        streamed_edge = _lines(e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "seq 1 3"}, headers=nd))
        strip = lambda ls: [{k: v for k, v in x.items() if k != "duration_ms"} for x in ls]  # noqa: E731
        assert strip(streamed_edge) == strip(streamed_api)
        assert "".join(x.get("stdout", "") for x in streamed_edge) == "1\n2\n3\n"
        assert streamed_edge[-1]["exit_code"] == 0
        # a background process: started, followed and waited for through the edge
        started = e.post(
            f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo a; sleep 0.3; echo b", "background": True}
        )
        assert started.status_code == 200, started.text
        pid = started.json()["pid"]
        out = _lines(e.get(f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"follow": "1"}))
        assert "".join(x.get("stdout", "") for x in out) == "a\nb\n" and out[-1]["exit_code"] == 0
        again = {"follow": "1"}
        assert _lines(e.get(f"/v1/sandboxes/{sid}/processes/{pid}/output", params=again)) == _lines(
            a.get(f"/v1/sandboxes/{sid}/processes/{pid}/output", params=again)
        )
        assert e.post(f"/v1/sandboxes/{sid}/processes/{pid}/wait", json={}).json()["exit_code"] == 0
        assert (
            e.get(f"/v1/sandboxes/{sid}/processes/{pid}").json()
            == a.get(f"/v1/sandboxes/{sid}/processes/{pid}").json()
        )
        # stdin and a signal to a process that reads
        cat = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat", "background": True}).json()["pid"]
        w = e.post(f"/v1/sandboxes/{sid}/processes/{cat}/stdin", params={"eof": "1"}, content=b"hello\n")
        assert w.json() == {"written": 6, "eof": True}, w.text
        assert (
            e.post(f"/v1/sandboxes/{sid}/processes/{cat}/wait", json={"timeout_s": 30}).json()["exit_code"]
            == 0
        )
        sl = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 600", "background": True}).json()["pid"]
        killed = e.post(f"/v1/sandboxes/{sid}/processes/{sl}/signal", json={"signal": "TERM"})
        assert killed.status_code == 200, killed.text
        # files: written through the edge, read through both, listed, stat'ed, deleted
        f = f"/v1/sandboxes/{sid}/files"
        blob = bytes(range(256)) * 4096  # 1 MiB
        assert e.put(f, params={"path": "/tmp/blob"}, content=blob).status_code == 204
        assert a.get(f, params={"path": "/tmp/blob"}).content == blob
        assert e.get(f, params={"path": "/tmp/blob"}).content == blob
        assert (
            e.get(f + "/stat", params={"path": "/tmp/blob"}).json()
            == a.get(f + "/stat", params={"path": "/tmp/blob"}).json()
        )
        assert "blob" in [x["name"] for x in e.get(f + "/list", params={"path": "/tmp"}).json()["items"]]
        assert e.delete(f, params={"path": "/tmp/blob"}).status_code == 204
        assert a.get(f, params={"path": "/tmp/blob"}).status_code == 404
        # control calls are not the edge's
        r = e.post(f"/v1/sandboxes/{sid}/pause")
        assert r.status_code == 404 and cl.url in r.json()["error"]["message"], r.text


def test_a_wrong_key_or_another_tenants_sandbox_is_refused_at_the_edge(shared):
    cl, edge = shared
    with _api(cl) as a:
        sid = _sandbox(a)
    with _edge(cl, edge, key="wrong-key") as e:
        r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
    r = httpx.post(f"{edge.url}/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"], r.text
    with _edge(cl, edge) as e:
        r = e.post("/v1/sandboxes/sb-0000000000000000/exec", json={"cmd": "true"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found", r.text


def test_a_grant_opens_one_sandboxs_data_verbs_and_nothing_else(shared):
    cl, _ = shared
    with _api(cl) as a:
        sa, sb = _sandbox(a), _sandbox(a)
        g = a.post(f"/v1/sandboxes/{sa}/grant")
        assert g.status_code == 200, g.text
        grant = g.json()
        assert grant["sandbox_id"] == sa and grant["grant"].startswith(f"{sa}.")
        assert 50 <= grant["expires_at"] - time.time() <= 61
        url = grant["worker"]["url"]
        hdr = {"Authorization": f"Grant {grant['grant']}", "Atoll-Protocol": str(api.PROTOCOL_VERSION)}
        spec = {"cmd": ["echo", "hi"], "max_output_bytes": 1000}
        ok = httpx.post(f"{url}/worker/v1/sandboxes/{sa}/exec", json=spec, headers=hdr)
        assert ok.status_code == 200 and ok.json()["stdout"] == "hi\n", ok.text

        def refused(method, path, headers=hdr, **kw) -> str:
            r = httpx.request(method, f"{url}/worker/v1{path}", headers=headers, **kw)
            assert r.status_code == 401, (path, r.status_code, r.text)
            return r.json()["error"]["message"]

        assert f"for sandbox {sa}" in refused("POST", f"/sandboxes/{sb}/exec", json=spec)
        # the edge's liveness probe opens with the grant too, for its sandbox only
        alive = httpx.get(f"{url}/worker/v1/sandboxes/{sa}/alive", headers=hdr)
        assert alive.status_code == 204, alive.text
        assert f"for sandbox {sa}" in refused("GET", f"/sandboxes/{sb}/alive")
        assert "data verbs" in refused("POST", f"/sandboxes/{sa}/pause", json={"tier": "memory"})
        assert "data verbs" in refused("DELETE", f"/sandboxes/{sa}")
        assert "data verbs" in refused("GET", "/info")
        sid, exp, scope, mac = grant["grant"].split(".")
        later = {**hdr, "Authorization": f"Grant {sid}.{int(exp) + 3600}.{scope}.{mac}"}
        assert "current token" in refused("POST", f"/sandboxes/{sa}/exec", headers=later, json=spec)
        assert "malformed" in refused(
            "POST", f"/sandboxes/{sa}/exec", headers={**hdr, "Authorization": "Grant x"}
        )
        assert a.get(f"/v1/sandboxes/{sa}").json()["state"] == "running"
        trail = a.get("/v1/audit", params={"action": "sandbox.grant"}).json()["items"]
        assert any(sa in (t["target"] or "") and t["result"]["status"] == 200 for t in trail), trail


def test_a_sandbox_in_standby_is_resumed_by_the_grant(shared):
    cl, edge = shared
    with _api(cl) as a, _edge(cl, edge) as e:
        sid = _sandbox(a)
        assert e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo 1 > /tmp/x"}).status_code == 200
        r = a.post(f"/v1/sandboxes/{sid}/pause", json={"tier": "disk"})
        assert r.status_code == 200 and r.json()["state"] == "standby", r.text
        r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "cat /tmp/x"})
        assert r.status_code == 200 and r.json()["stdout"] == "1\n", r.text
        assert a.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


def _until(term, needle: bytes, timeout: float = 30) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, seen
        seen += term.read(timeout=deadline - time.monotonic())
    return seen


def test_a_stream_through_the_edge_outlives_a_server_sigkill(own):
    cl, edge = own
    with (
        _api(cl) as a,
        _edge(cl, edge) as e,
        atoll.Client(cl.url, cl.api_key, edge_url=edge.url) as sdk,
    ):
        sid = _sandbox(a)
        # a terminal opened and attached through the edge (the SDK with edge_url)
        term = sdk.sandboxes.get(sid).pty(cmd=["/bin/sh"])
        term.send(b"echo one-$((1+1))\n")
        _until(term, b"one-2")
        pid = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": COUNT, "background": True}).json()["pid"]
        got: list[dict] = []
        followed: list[dict] = []
        nd = {"Accept": "application/x-ndjson"}
        with (
            e.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": COUNT}, headers=nd) as r,
            e.stream("GET", f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"follow": "1"}) as o,
        ):
            assert r.status_code == 200 and o.status_code == 200
            lines, out_lines = r.iter_lines(), o.iter_lines()
            for line in lines:
                got.append(json.loads(line))
                if got[-1].get("stdout") == "3\n":
                    break
            followed.append(json.loads(next(out_lines)))
            cl.server.kill()  # mid-stream: the bytes do not pass through it
            term.send(b"echo two-$((2+2))\n")  # the terminal goes on too
            _until(term, b"two-4")
            got += [json.loads(line) for line in lines if line]
            followed += [json.loads(line) for line in out_lines if line]
        want = "".join(f"{i}\n" for i in range(1, 31))
        assert "".join(x.get("stdout", "") for x in got) == want, got
        assert got[-1]["exit_code"] == 0 and "error" not in json.dumps(got)
        assert "".join(x.get("stdout", "") for x in followed) == want, followed
        assert followed[-1]["exit_code"] == 0 and followed[-1]["offset"] == len(want)
        term.send(b"exit 3\n")
        assert term.wait(timeout=30) == 3
        # with the server down, a call with a cached grant may still be served; a new grant cannot be had
        r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code in (200, 503), r.text
        cl.server.start()
        deadline = time.monotonic() + 60
        while a.get("/v1/workers").json()["items"][0]["state"] != "ready":
            assert time.monotonic() < deadline, cl.tail()
            time.sleep(0.2)
        # the worker registered again (new token): the edge's cached grant is refused, it asks anew
        deadline = time.monotonic() + 30
        while True:
            r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo back"})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and r.json()["stdout"] == "back\n", r.text


def test_calls_through_the_edge_count_as_activity_for_the_idle_policy(shared):
    """The server sees none of the edge's calls: the worker keeps a sandbox with a call in flight
    from being paused, and tells the server (SandboxActivity events) while and just after it serves
    one, so the idle timer restarts from the call's end; once calls stop, idle standby follows."""
    cl, edge = shared
    with _api(cl) as a, _edge(cl, edge) as e:
        r = a.post("/v1/sandboxes", json={"idle_timeout_s": 3})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 6; echo done"})
        assert r.status_code == 200 and r.json()["stdout"] == "done\n", r.text
        for _ in range(4):  # 2 s after a 6 s call: an idle timer not told of it would have fired
            time.sleep(0.5)
            assert a.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        deadline = time.monotonic() + 30
        while a.get(f"/v1/sandboxes/{sid}").json()["state"] != "standby":
            assert time.monotonic() < deadline, "idle standby must still happen once the calls stop"
            time.sleep(0.5)


def test_the_edge_over_tls_checks_the_server_and_the_workers(tmp_path):
    """With the API and the workers on https (the installation CA), the edge checks both against
    --ca-file and the worker's certificate name, and serves as before; without the CA it refuses."""
    cl = LocalCluster(tmp_path / "cluster", workers=1, env=ENV, tls=True)
    cl.start(timeout=600)
    edge = bare = None
    try:
        edge = LocalEdge(tmp_path / "edge", cl.url, ca_file=cl.server.ca_file).start()
        with httpx.Client(base_url=cl.url, headers=cl.headers(), timeout=300, verify=cl.verify) as a:
            url = a.get("/v1/workers").json()["items"][0]["url"]
            assert url.startswith("https://"), url
            sid = _sandbox(a)
            with _edge(cl, edge) as e:
                r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "echo over-tls"})
                assert r.status_code == 200 and r.json()["stdout"] == "over-tls\n", r.text
        bare = LocalEdge(tmp_path / "bare", cl.url).start()  # the system's CAs: the server is not trusted
        with _edge(cl, bare) as e:
            r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
            assert r.status_code == 503 and cl.url in r.json()["error"]["message"], r.text
    finally:
        for p in (edge, bare):
            if p is not None:
                p.terminate()
        cl.stop(reap=True)


def test_a_revoked_key_is_refused_by_the_edge_within_seconds(shared):
    """The edge re-checks a kept grant with the server every REVALIDATE_S (5 s): a key revoked
    while the edge holds a grant for it is refused there within seconds (it used to work until
    the grant expired, ~50 s), and a stream and a terminal open with it are ended too."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    cl, edge = shared
    with _api(cl) as a:
        sid = _sandbox(a)
        made = a.post("/v1/keys", json={"scope": "admin"})
        assert made.status_code == 201, made.text
        kid, key = made.json()["id"], made.json()["key"]
        with _edge(cl, edge, key=key) as e:
            assert e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 200
            pid = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 600", "background": True}).json()[
                "pid"
            ]
            pty_id = e.post(f"/v1/sandboxes/{sid}/pty", json={"cmd": ["/bin/sh"]}).json()["pty_id"]
            ws_url = edge.url.replace("http://", "ws://") + f"/v1/sandboxes/{sid}/pty/{pty_id}/ws"
            term = connect(ws_url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30)
            with e.stream("GET", f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"follow": "1"}) as o:
                assert o.status_code == 200
                assert a.delete(f"/v1/keys/{kid}").status_code == 204
                t0 = time.monotonic()
                while True:
                    r = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
                    if r.status_code != 200:
                        break
                    assert time.monotonic() - t0 < 20, "a revoked key still works through the edge"
                    time.sleep(0.5)
                assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", r.text
                lines = [json.loads(x) for x in o.iter_lines() if x.strip()]  # ended by the watchdog
                assert time.monotonic() - t0 < 30
            assert lines and lines[-1]["error"]["code"] == "unauthorized", lines
            # the terminal open with the key is ended too (an error frame, close code 4401)
            with pytest.raises(ConnectionClosed):
                while True:
                    term.recv(timeout=30)
            assert term.close_code == 4401, term.close_code


def _worker_ready(a, deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while a.get("/v1/workers").json()["items"][0]["state"] != "ready":
        assert time.monotonic() < deadline, "the worker did not come back"
        time.sleep(0.5)


def test_a_frozen_worker_ends_calls_through_the_edge_but_a_quiet_stream_lives(shared):
    """A follow of a process that prints nothing for longer than the watchdog's period is not cut
    while the worker answers its probe; once the worker is frozen (SIGSTOP), a plain exec and a
    follow through the edge end with a retryable 503 worker_unavailable instead of waiting."""
    import os
    import signal
    import threading

    cl, edge = shared
    with _api(cl) as a, _edge(cl, edge) as e:
        sid = _sandbox(a)
        pid = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 12; echo late", "background": True})
        pid = pid.json()["pid"]
        out = _lines(e.get(f"/v1/sandboxes/{sid}/processes/{pid}/output", params={"follow": "1"}))
        assert "".join(x.get("stdout", "") for x in out) == "late\n" and out[-1]["exit_code"] == 0, out
        quiet = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 600", "background": True})
        quiet_pid = quiet.json()["pid"]
        got: dict[str, typing.Any] = {}

        def plain() -> None:
            got["exec"] = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 60; echo no"})

        def follow() -> None:
            got["follow"] = e.get(f"/v1/sandboxes/{sid}/processes/{quiet_pid}/output", params={"follow": "1"})

        threads = [threading.Thread(target=plain), threading.Thread(target=follow)]
        for t in threads:
            t.start()
        time.sleep(2)
        worker = cl.workers[0].proc
        assert worker is not None
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            for t in threads:
                t.join(45)
            assert not any(t.is_alive() for t in threads), "a call through the edge waits on a frozen worker"
            took = time.monotonic() - t0
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        r = got["exec"]
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "worker_unavailable" and err["retryable"] and "liveness" in err["message"], err
        last = _lines(got["follow"])[-1]
        assert last["error"]["code"] == "worker_unavailable" and "liveness" in last["error"]["message"], last
        assert took < 40
        _worker_ready(a)


def test_the_terminal_websocket_of_the_edge_refuses_a_bad_key_before_the_handshake(shared):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    cl, edge = shared
    with _api(cl) as a:
        sid = _sandbox(a)
        pty_id = a.post(f"/v1/sandboxes/{sid}/pty", json={"cmd": ["/bin/sh"]}).json()["pty_id"]
    url = edge.url.replace("http://", "ws://") + f"/v1/sandboxes/{sid}/pty/{pty_id}/ws"
    for headers in ({}, {"Authorization": "Bearer wrong-key"}):
        with pytest.raises(InvalidStatus) as refused:
            connect(url, additional_headers=headers, open_timeout=30).close()
        assert refused.value.response.status_code == 401, headers
        assert b"unauthorized" in refused.value.response.body
    with connect(url, additional_headers=cl.headers(), open_timeout=30) as ws:  # the right key opens it
        ws.send(b"echo ok-$((3+4))\n")
        seen = b""
        deadline = time.monotonic() + 30
        while b"ok-7" not in seen:
            assert time.monotonic() < deadline, seen
            msg = ws.recv(timeout=30)
            seen += msg if isinstance(msg, bytes) else msg.encode()


def test_file_operations_watches_tars_and_lists_through_the_edge_answer_as_through_the_api(shared):
    import io
    import tarfile
    import threading

    cl, edge = shared
    with _api(cl) as a, _edge(cl, edge) as e:
        sid = _sandbox(a)
        f = f"/v1/sandboxes/{sid}/files"
        r = e.post(f + "/mkdir", params={"path": "/tmp/d/e"})
        assert r.status_code == 200 and r.json() == {"path": "/tmp/d/e", "created": True}, r.text
        assert e.post(f + "/mkdir", params={"path": "/tmp/d/e"}).json()["created"] is False
        assert e.put(f, params={"path": "/tmp/d/e/a.txt"}, content=b"abc").status_code == 204
        moved = e.post(f + "/move", json={"from": "/tmp/d/e/a.txt", "to": "/tmp/d/b.txt"})
        assert moved.status_code == 200, moved.text
        assert moved.json() == a.get(f + "/stat", params={"path": "/tmp/d/b.txt"}).json()
        ch = e.post(f + "/chmod", json={"path": "/tmp/d/b.txt", "mode": "600"})
        assert ch.status_code == 200 and ch.json()["mode"] & 0o777 == 0o600, ch.text
        bad = e.post(f + "/chmod", json={"path": "/tmp/d/b.txt", "mode": "9"})
        assert bad.status_code == 400 and "octal" in bad.json()["error"]["message"], bad.text
        bad = e.post(f + "/move", json={"from": "/tmp/../etc/x", "to": "/tmp/y"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_path", bad.text
        # a tar up and down
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            info = tarfile.TarInfo("x/y.txt")
            info.size = 5
            tf.addfile(info, io.BytesIO(b"hello"))
        up = e.put(f + "/tar", params={"path": "/tmp/t"}, content=buf.getvalue())
        assert up.status_code == 200 and up.json()["files"] == 1, up.text
        assert a.get(f, params={"path": "/tmp/t/x/y.txt"}).content == b"hello"
        down = e.get(f + "/tar", params={"path": "/tmp/t"})
        assert down.status_code == 200 and down.headers["content-type"] == "application/x-tar"
        with tarfile.open(fileobj=io.BytesIO(down.content)) as tf:
            assert tf.extractfile("x/y.txt").read() == b"hello"  # type: ignore[union-attr]
        # a watch: ready, then the change made through the API
        events: list[dict] = []

        def watch() -> None:
            with e.stream("GET", f + "/watch", params={"path": "/tmp/d"}) as w:
                assert w.status_code == 200
                for line in w.iter_lines():
                    if line.strip():
                        events.append(json.loads(line))
                    if any(ev.get("path") == "/tmp/d/sub" for ev in events):
                        return

        t = threading.Thread(target=watch)
        t.start()
        deadline = time.monotonic() + 30
        while not events:
            assert time.monotonic() < deadline and t.is_alive(), events
            time.sleep(0.1)
        assert events[0]["type"] == "ready"
        assert a.post(f + "/mkdir", params={"path": "/tmp/d/sub"}).status_code == 200
        t.join(30)
        assert not t.is_alive()
        assert {"type": "create", "path": "/tmp/d/sub", "is_dir": True} in events, events
        # the lists of processes and terminals
        e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "sleep 600", "background": True})
        done = e.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true", "background": True}).json()["pid"]
        # ended before the two lists are taken, so both show the same record
        assert a.post(f"/v1/sandboxes/{sid}/processes/{done}/wait", json={}).status_code == 200
        assert e.post(f"/v1/sandboxes/{sid}/pty", json={"cmd": ["/bin/sh"]}).status_code == 201
        for sub in ("processes", "pty"):
            via_edge = e.get(f"/v1/sandboxes/{sid}/{sub}")
            assert via_edge.status_code == 200, via_edge.text
            assert via_edge.json() == a.get(f"/v1/sandboxes/{sid}/{sub}").json()
        first = e.get(f"/v1/sandboxes/{sid}/processes", params={"limit": 1}).json()
        assert len(first["items"]) == 1 and first["next_cursor"]
        rest = e.get(f"/v1/sandboxes/{sid}/processes", params={"cursor": first["next_cursor"]}).json()
        assert [p["pid"] for p in first["items"] + rest["items"]] == [
            p["pid"] for p in a.get(f"/v1/sandboxes/{sid}/processes").json()["items"]
        ]
        r = e.get(f"/v1/sandboxes/{sid}/processes", params={"cursor": "made.up"})
        assert r.status_code == 400 and "cursor" in r.json()["error"]["message"], r.text
