"""envd's wire contract as generated (atoll.e2b.proto, scripts/gen_e2b_stubs.py): the field names
and numbers the `e2b` SDKs send and read (docs/e2b-compat.md §4), the proto3 JSON forms they
expect, and connectrpc's ASGI application serving a generated service in the framing the SDKs
speak (Connect streaming with JSON, an end-of-stream frame last)."""

from __future__ import annotations

import json
import struct

import httpx
from protobuf import Oneof, message_from_json_value, message_to_json_value

from atoll.e2b.proto.filesystem import filesystem_pb as fs
from atoll.e2b.proto.process import process_connect
from atoll.e2b.proto.process import process_pb as pr


def _numbers(message) -> dict[str, int]:
    return {f.name: f.number for f in message.desc().fields}


def test_the_fields_the_sdks_use_have_envds_numbers():
    assert _numbers(pr.StartRequest) == {"process": 1, "pty": 2, "tag": 3, "stdin": 4}
    assert _numbers(pr.ProcessConfig) == {"cmd": 1, "args": 2, "envs": 3, "cwd": 4}
    assert _numbers(pr.ProcessEvent) == {"start": 1, "data": 2, "end": 3, "keepalive": 4}
    assert _numbers(pr.ProcessEvent.EndEvent) == {"exit_code": 1, "exited": 2, "status": 3, "error": 4}
    assert _numbers(pr.ProcessInput) == {"stdin": 1, "pty": 2}
    assert _numbers(pr.StreamInputRequest.DataEvent) == {"input": 2}
    assert {v.name: v.number for v in pr.Signal.desc().values} == {
        "SIGNAL_UNSPECIFIED": 0,
        "SIGNAL_SIGTERM": 15,
        "SIGNAL_SIGKILL": 9,
    }
    assert _numbers(fs.EntryInfo) == {
        "name": 1,
        "type": 2,
        "path": 3,
        "size": 4,
        "mode": 5,
        "permissions": 6,
        "owner": 7,
        "group": 8,
        "modified_time": 9,
        "symlink_target": 10,
        "metadata": 11,
        "is_symlink": 12,
    }
    assert _numbers(fs.WatchDirRequest) == {
        "path": 1,
        "recursive": 2,
        "include_entry": 3,
        "allow_network_mounts": 4,
    }
    methods = {m.name: m for m in process_connect.Process.desc().methods}
    assert sorted(methods) == sorted(
        ["List", "Connect", "Start", "Update", "StreamInput", "SendInput", "SendSignal", "CloseStdin"]
    )


def test_the_json_forms_the_sdks_read():
    start = pr.StartResponse(event=pr.ProcessEvent(event=Oneof("start", pr.ProcessEvent.StartEvent(pid=7))))
    assert message_to_json_value(start) == {"event": {"start": {"pid": 7}}}
    data = pr.ProcessEvent.DataEvent(output=Oneof("stderr", b"\xff\x00oops"))
    assert message_to_json_value(pr.ConnectResponse(event=pr.ProcessEvent(event=Oneof("data", data)))) == {
        "event": {"data": {"stderr": "/wBvb3Bz"}}  # bytes as base64: binary output intact
    }
    end = pr.ProcessEvent.EndEvent(
        exit_code=-1, exited=False, status="signal: killed", error="signal: killed"
    )
    assert message_to_json_value(end) == {
        "exitCode": -1,
        "status": "signal: killed",
        "error": "signal: killed",
    }
    entry = fs.EntryInfo(name="a", path="/a", size=2**40, is_symlink=True, type=fs.FileType.FILE)
    assert message_to_json_value(entry) == {
        "name": "a",
        "path": "/a",
        "size": str(2**40),  # int64: a decimal string
        "isSymlink": True,
        "type": "FILE_TYPE_FILE",
    }
    # what `commands.run("echo hi")` sends (either spelling of a field name is read)
    req = message_from_json_value(
        pr.StartRequest,
        {
            "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"], "envs": {"A": "1"}},
            "stdin": False,
        },
    )
    assert (req.process.cmd, list(req.process.args), dict(req.process.envs), req.stdin) == (
        "/bin/bash",
        ["-l", "-c", "echo hi"],
        {"A": "1"},
        False,
    )


def _frames(body: bytes) -> list[tuple[int, dict]]:
    out = []
    while body:
        flags, n = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + n])))
        body = body[5 + n :]
    return out


async def test_a_generated_service_answers_a_stream_as_the_sdks_read_it():
    class Toy(process_connect.Process):
        async def start(self, request, ctx):
            yield pr.StartResponse(
                event=pr.ProcessEvent(event=Oneof("start", pr.ProcessEvent.StartEvent(pid=3)))
            )
            out = pr.ProcessEvent.DataEvent(output=Oneof("stdout", request.process.args[-1].encode()))
            yield pr.StartResponse(event=pr.ProcessEvent(event=Oneof("data", out)))
            end = pr.ProcessEvent.EndEvent(exit_code=0, exited=True, status="exit status 0")
            yield pr.StartResponse(event=pr.ProcessEvent(event=Oneof("end", end)))

    app = process_connect.ProcessASGIApplication(Toy())
    request = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "hi"]}}).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as c:
        r = await c.post(
            "/process.Process/Start",
            content=struct.pack(">BI", 0, len(request)) + request,
            headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"},
        )
        assert r.status_code == 200 and r.headers["content-type"] == "application/connect+json", r.text
        assert _frames(r.content) == [
            (0, {"event": {"start": {"pid": 3}}}),
            (0, {"event": {"data": {"stdout": "aGk="}}}),
            (0, {"event": {"end": {"exited": True, "status": "exit status 0"}}}),
            (2, {}),  # end of stream, no error
        ]
        # an RPC the service does not have: a plain 404, which the SDKs read as not_found
        r = await c.post("/process.Process/Nope", content=b"{}", headers={"Content-Type": "application/json"})
        assert r.status_code == 404
        # a unary RPC the toy does not implement: unimplemented, as a Connect JSON error
        r = await c.post("/process.Process/List", content=b"{}", headers={"Content-Type": "application/json"})
        assert r.status_code == 501 and r.json()["code"] == "unimplemented", r.text
