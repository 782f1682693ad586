"""Run inside a venv holding the unmodified `e2b` SDK (tests/e2b_venv.py) by
tests/integration/test_e2b_sdk.py: drives atoll's E2B API (E2B_API_URL / E2B_SANDBOX_URL /
E2B_API_KEY from the environment) through the SDK's control calls and prints one JSON object of
what it saw. argv[1] is the scenario; every sandbox it creates it kills.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import time

import e2b
from e2b import Sandbox

RELEASE = tuple(int(x) for x in importlib.metadata.version("e2b").split(".")[:2])


def lifecycle() -> dict:
    out: dict = {}
    tag = f"t{os.getpid()}{int(time.time())}"
    sbx = Sandbox.create(metadata={"suite": tag, "odd": "a&b=c%"}, envs={"X": "1"}, timeout=120)
    other = Sandbox.create(metadata={"suite": tag, "odd": "other"}, timeout=120)
    try:
        out["id"] = sbx.sandbox_id
        out["envd_version"] = str(sbx._envd_version)
        info = sbx.get_info()
        out["info"] = {
            "sandbox_id": info.sandbox_id,
            "template_id": info.template_id,
            "metadata": info.metadata,
            "state": str(info.state.value if hasattr(info.state, "value") else info.state),
            "end_minus_start_s": (info.end_at - info.started_at).total_seconds(),
            "cpu_count": info.cpu_count,
            "memory_mb": info.memory_mb,
        }
        found = Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": tag, "odd": "a&b=c%"})).next_items()
        out["listed"] = sorted(s.sandbox_id for s in found)
        pages = Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": tag}), limit=1)
        seen = []
        first_has_next = None
        while pages.has_next:
            items = pages.next_items()
            seen.append([s.sandbox_id for s in items])
            if first_has_next is None:
                first_has_next = pages.has_next
        out["pages"] = seen
        out["first_page_has_next"] = first_has_next
        sbx.set_timeout(600)
        out["end_after_set_timeout_s"] = (sbx.get_info().end_at - sbx.get_info().started_at).total_seconds()
        out["pause"] = sbx.pause()
        out["state_after_pause"] = str(sbx.get_info().state.value)
        out["paused_listed"] = [
            s.sandbox_id
            for s in Sandbox.list(
                query=e2b.SandboxQuery(metadata={"suite": tag}, state=[e2b.SandboxState.PAUSED])
            ).next_items()
        ]
        out["pause_again"] = sbx.pause()
        out["is_running_paused"] = sbx.is_running()
        back = Sandbox.connect(sbx.sandbox_id, timeout=300)
        out["connected"] = back.sandbox_id
        out["state_after_connect"] = str(back.get_info().state.value)
        out["is_running_resumed"] = back.is_running()
        metrics = back.get_metrics()
        out["metrics"] = [
            {"cpu_count": m.cpu_count, "mem_total": m.mem_total, "disk_total": m.disk_total} for m in metrics
        ]
        out["kill"] = back.kill()
        out["kill_again"] = Sandbox.kill(sbx.sandbox_id)
    finally:
        Sandbox.kill(sbx.sandbox_id)
        Sandbox.kill(other.sandbox_id)
    return out


def errors() -> dict:
    out: dict = {}
    try:
        Sandbox.create(api_key="e2b_" + "00" * 8 if RELEASE and RELEASE < (2, 40) else "wrong-key")
        out["wrong_key"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["wrong_key"] = type(e).__name__
    try:
        Sandbox.connect("sb-0000000000000000")
        out["unknown_connect"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["unknown_connect"] = type(e).__name__
    try:
        Sandbox.get_info("sb-0000000000000000")
        out["unknown_info"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["unknown_info"] = type(e).__name__
    out["unknown_kill"] = Sandbox.kill("sb-0000000000000000")
    try:
        Sandbox.create(template="no-such-template")
        out["unknown_template"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["unknown_template"] = f"{type(e).__name__}: {e}"
    return out


def _name(e: BaseException) -> str:
    return type(e).__name__


def envd() -> dict:
    """Commands and files through envd's Connect services and /files."""
    out: dict = {}
    sbx = Sandbox.create(envs={"X": "from-create"}, timeout=120)
    try:
        r = sbx.commands.run("echo $X; echo e >&2")
        out["run"] = {"stdout": r.stdout, "stderr": r.stderr, "exit_code": r.exit_code}
        try:
            sbx.commands.run("echo partial; exit 3")
            out["exit3"] = "no error"
        except Exception as e:  # noqa: BLE001  (CommandExitException)
            out["exit3"] = {
                "type": _name(e),
                "exit_code": getattr(e, "exit_code", None),
                "stdout": getattr(e, "stdout", None),
            }
        r = sbx.commands.run("pwd; echo $Y", cwd="/tmp", envs={"Y": "why"})
        out["cwd_env"] = r.stdout
        seen: list[str] = []
        sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=lambda line: seen.append(line))
        out["on_stdout"] = "".join(seen)
        h = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(h.pid, "to cat\n")
        time.sleep(1)  # cat echoes it before the kill
        out["listed_pid"] = h.pid in [p.pid for p in sbx.commands.list()]
        out["kill"] = sbx.commands.kill(h.pid)
        try:
            h.wait()
            out["killed_wait"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["killed_wait"] = {
                "type": _name(e),
                "exit_code": getattr(e, "exit_code", None),
                "stdout": getattr(e, "stdout", None),
            }
        try:
            sbx.commands.run("sleep 5", timeout=1)
            out["timeout"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["timeout"] = _name(e)
            out["timeout_message"] = str(e)[:300]
        sbx.files.write("/tmp/a.txt", "hello")
        out["read"] = sbx.files.read("/tmp/a.txt")
        blob = bytes(range(256))
        sbx.files.write("/tmp/b.bin", blob)
        out["bytes_exact"] = bytes(sbx.files.read("/tmp/b.bin", format="bytes")) == blob
        out["exists"] = [sbx.files.exists("/tmp/a.txt"), sbx.files.exists("/tmp/none")]
        out["make_dir"] = [sbx.files.make_dir("/tmp/d"), sbx.files.make_dir("/tmp/d")]
        sbx.files.rename("/tmp/a.txt", "/tmp/d/a.txt")
        out["listed"] = sorted(e.name for e in sbx.files.list("/tmp/d"))
        out["info_size"] = sbx.files.get_info("/tmp/b.bin").size
        sbx.files.remove("/tmp/d/a.txt")
        out["after_remove"] = sorted(e.name for e in sbx.files.list("/tmp/d"))
        try:
            sbx.files.read("/tmp/missing")
            out["missing"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["missing"] = _name(e)
        out["seen_by_exec"] = sbx.commands.run("cat /tmp/b.bin | wc -c").stdout.strip()
    finally:
        Sandbox.kill(sbx.sandbox_id)
    return out


def _try(f) -> str:
    try:
        f()
    except Exception as e:  # noqa: BLE001
        return _name(e)
    return "no error"


def _state(sid: str) -> str:
    try:
        return str(Sandbox.get_info(sid).state.value)
    except Exception as e:  # noqa: BLE001 - a killed sandbox
        return _name(e)


def paused() -> dict:
    """E2B's lifecycle kept per sandbox: envd calls to a paused sandbox fail as "not running"
    unless it was created with auto-resume (then they resume it); the lifetime's end kills or
    pauses as `on_timeout` says."""
    out: dict = {}
    plain = Sandbox.create(timeout=120)
    auto = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    ends_kill = Sandbox.create(timeout=120)
    ends_pause = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause"})
    try:
        plain.files.write("/tmp/x", "plain")
        auto.files.write("/tmp/x", "auto")
        plain.pause()
        auto.pause()
        out["plain_is_running"] = plain.is_running()
        out["plain_read"] = _try(lambda: plain.files.read("/tmp/x"))
        out["plain_run"] = _try(lambda: plain.commands.run("true"))
        out["plain_state"] = _state(plain.sandbox_id)
        back = Sandbox.connect(plain.sandbox_id, timeout=120)
        out["plain_read_after_connect"] = back.files.read("/tmp/x")
        out["auto_is_running"] = auto.is_running()
        out["auto_read"] = auto.files.read("/tmp/x")  # resumes it
        out["auto_run"] = auto.commands.run("echo ran").stdout
        out["auto_state"] = _state(auto.sandbox_id)
        ends_kill.set_timeout(2)
        ends_pause.set_timeout(2)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            out["ends_kill"], out["ends_pause"] = _state(ends_kill.sandbox_id), _state(ends_pause.sandbox_id)
            if out["ends_kill"] != "running" and out["ends_pause"] != "running":
                break
            time.sleep(1)
        out["ends_pause_resumed"] = (
            Sandbox.connect(ends_pause.sandbox_id, timeout=60).commands.run("echo up").stdout
        )
    finally:
        for s in (plain, auto, ends_kill, ends_pause):
            Sandbox.kill(s.sandbox_id)
    return out


if __name__ == "__main__":
    scenarios = {"lifecycle": lifecycle, "errors": errors, "envd": envd, "paused": paused}
    print(json.dumps(scenarios[sys.argv[1]]()))
