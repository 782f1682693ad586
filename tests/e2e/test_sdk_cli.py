"""The SDK (sync and async) and the CLI against a real `atoll up` — the public contract end to end."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

import atoll

pytestmark = pytest.mark.integration


@pytest.fixture
def client(atoll_server):
    with atoll.Client(base_url=atoll_server.url, api_key=atoll_server.api_key) as c:
        yield c


@pytest.mark.seam
def test_sdk_sync_flow(client):
    sb = client.sandboxes.create(
        template="base", env={"A": "1"}, metadata={"suite": "e2e"}, idle_timeout_s=0, memory_mb=512, cpus=1
    )
    try:
        assert sb.state == "running" and sb.standby_tier is None
        r = sb.exec("echo $A; echo err >&2; exit 2")
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (2, "1\n", "err\n", False)
        chunks = []
        r = sb.exec(["sh", "-c", "for i in 1 2 3; do echo $i; sleep 0.1; done"], on_stdout=chunks.append)
        assert r.exit_code == 0 and "".join(chunks) == "1\n2\n3\n"
        assert sb.exec("sleep 5", timeout_s=0.5).timed_out is True
        p = sb.exec("sleep 600", background=True)
        assert p.pid > 0
        assert any(x.pid == p.pid and x.running for x in sb.processes())
        p.kill()
        sb.files.write("/data/x.bin", b"\x00\x01binary\xff")
        assert sb.files.read("/data/x.bin") == b"\x00\x01binary\xff"
        assert [e.name for e in sb.files.list("/data")] == ["x.bin"]
        sb.files.remove("/data/x.bin")
        with pytest.raises(atoll.errors.FileNotFound) as ei:
            sb.files.read("/data/x.bin")
        assert ei.value.code == "file_not_found"
        assert [s.id for s in client.sandboxes.list(state="running", metadata={"suite": "e2e"})] == [sb.id]
        sb.pause(tier="memory")
        assert (sb.state, sb.standby_tier) == ("standby", "memory")
        sb.pause(tier="disk")
        assert sb.standby_tier == "disk"
        assert sb.exec("echo back").stdout == "back\n"
        sb.refresh()
        assert sb.state == "running"
        sb.pause()
        sb.resume()
        assert sb.state == "running"
        assert client.sandboxes.get(sb.id).id == sb.id
    finally:
        sb.delete()
    with pytest.raises(atoll.errors.SandboxNotFound):
        client.sandboxes.get(sb.id)
    with pytest.raises(atoll.errors.TemplateNotFound):
        client.sandboxes.create(template="no-such-template")


@pytest.mark.seam
async def test_sdk_async_flow(atoll_server):
    async with atoll.AsyncClient(base_url=atoll_server.url, api_key=atoll_server.api_key) as c:
        sb = await c.sandboxes.create(idle_timeout_s=0)
        try:
            got = []

            async def on_out(chunk):
                got.append(chunk)

            r = await sb.exec("echo async", on_stdout=on_out)
            assert r.exit_code == 0 and "".join(got) == "async\n"
            await sb.pause(tier="memory")
            assert sb.standby_tier == "memory"
            await sb.resume()
            assert sb.state == "running"
        finally:
            await sb.delete()


@pytest.mark.slow
def test_sdk_100mb_file_streams(client, tmp_path):
    src = tmp_path / "big.bin"
    block = os.urandom(1024 * 1024)
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for i in range(100):
            chunk = block[i:] + block[:i]
            f.write(chunk)
            h.update(chunk)
    sb = client.sandboxes.create(idle_timeout_s=0, disk_mb=1024)
    try:
        with open(src, "rb") as f:
            sb.files.write("/data/big.bin", f)
        assert sb.exec("sha256sum /data/big.bin").stdout.split()[0] == h.hexdigest()
        out = tmp_path / "back.bin"
        with open(out, "wb") as f:
            n = sb.files.read_to("/data/big.bin", f)
        assert n == 100 * 1024 * 1024
        h2 = hashlib.sha256()
        with open(out, "rb") as f:
            while b := f.read(1 << 20):
                h2.update(b)
        assert h2.hexdigest() == h.hexdigest()
    finally:
        sb.delete()


def _cli(atoll_server, *args, check=True):
    env = {**os.environ, "ATOLL_URL": atoll_server.url, "ATOLL_API_KEY": atoll_server.api_key}
    p = subprocess.run(
        [sys.executable, "-m", "atoll", *args], env=env, capture_output=True, text=True, timeout=300
    )
    if check:
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


def test_cli(atoll_server):
    sid = _cli(
        atoll_server, "sandbox", "create", "--metadata", "via=cli", "--idle-timeout", "0"
    ).stdout.strip()
    try:
        assert sid.startswith("sb-")
        p = _cli(
            atoll_server,
            "sandbox",
            "exec",
            sid,
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 7",
            check=False,
        )
        assert (p.returncode, p.stdout, p.stderr) == (7, "out\n", "err\n")
        assert (
            _cli(atoll_server, "sandbox", "exec", sid, "--", "python3", "-c", "print(6*7)").stdout == "42\n"
        )
        listed = _cli(atoll_server, "sandbox", "list", "--metadata", "via=cli", "--json").stdout
        assert sid in [s["id"] for s in json.loads(listed)]
        _cli(atoll_server, "sandbox", "pause", sid, "--tier", "disk")
        assert json.loads(_cli(atoll_server, "sandbox", "get", sid).stdout)["standby_tier"] == "disk"
        _cli(atoll_server, "sandbox", "resume", sid)
        assert json.loads(_cli(atoll_server, "sandbox", "get", sid).stdout)["state"] == "running"
        # the archive tier (the local archive directory of atoll up's home), and back on a call
        assert _cli(atoll_server, "sandbox", "pause", sid, "--tier", "archive").stdout.endswith("(archive)\n")
        assert _cli(atoll_server, "sandbox", "exec", sid, "--", "echo", "back").stdout == "back\n"
        p = _cli(atoll_server, "sandbox", "get", "sb-0000000000000000", check=False)
        assert p.returncode == 1 and "sandbox_not_found" in p.stderr and "Traceback" not in p.stderr
    finally:
        _cli(atoll_server, "sandbox", "rm", sid)
