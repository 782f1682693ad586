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


def volumes() -> dict:
    """E2B volumes (atoll drives): create/connect/list, the content API, a sandbox that mounts one."""
    from e2b import Volume

    out: dict = {}
    vol = Volume.create("sdkvol")
    try:
        out["created"] = [vol.volume_id, vol.name, bool(vol.token)]
        vol.write_file("/docs/a.txt", "from the sdk")
        out["read"] = vol.read_file("/docs/a.txt")
        blob = bytes(range(256)) * 64
        vol.write_file("/b.bin", blob, mode=0o600)
        out["bytes_exact"] = vol.read_file("/b.bin", format="bytes") == blob
        out["streamed"] = b"".join(vol.read_file("/b.bin", format="stream")) == blob
        d = vol.make_dir("/x/y", force=True)
        out["made"] = [d.type, d.path]
        out["exists"] = [vol.exists("/docs/a.txt"), vol.exists("/none")]
        info = vol.get_info("/b.bin")
        out["info"] = {
            "size": info.size,
            "mode": info.mode,
            "type": info.type,
            "utc": info.mtime.utcoffset() is not None,
        }
        up = vol.update_metadata("/docs/a.txt", uid=1000, gid=1000)
        out["owner"] = [up.uid, up.gid]
        out["listed"] = sorted(e.path for e in vol.list("/", depth=2))
        again = Volume.connect(vol.volume_id)
        out["connect_token_same"] = again.token == vol.token
        out["get_info"] = Volume.get_info(vol.volume_id).name
        out["in_list"] = vol.volume_id in [v.volume_id for v in Volume.list()]
        vol.remove("/x")
        out["after_remove"] = vol.exists("/x/y")
        try:
            vol.read_file("/missing")
            out["missing"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["missing"] = _name(e)
        sbx = Sandbox.create(timeout=120, volume_mounts={"/mnt/vol": vol})
        try:
            out["seen_in_sandbox"] = sbx.commands.run("cat /mnt/vol/docs/a.txt").stdout
            sbx.commands.run("echo from-sandbox > /mnt/vol/back.txt")
            out["written_back"] = vol.read_file("/back.txt")
        finally:
            Sandbox.kill(sbx.sandbox_id)
    finally:
        out["destroy"] = Volume.destroy(vol.volume_id)
        out["destroy_again"] = Volume.destroy(vol.volume_id)
    return out


def interpreter() -> dict:
    """e2b_code_interpreter's run_code and contexts against a code-interpreter-v1 sandbox."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    out: dict = {}
    t0 = time.monotonic()
    sbx = CodeSandbox.create(timeout=300)
    try:
        out["template"] = sbx.get_info().template_id
        ex = sbx.run_code("x = 1")
        out["first_run_s"] = time.monotonic() - t0
        out["assign"] = {"text": ex.text, "error": ex.error is not None, "results": len(ex.results)}
        ex = sbx.run_code("x + 1")
        out["x_plus_1"] = ex.text
        ex = sbx.run_code("print('hello'); import sys; print('oops', file=sys.stderr)")
        out["stdout"], out["stderr"] = ex.logs.stdout, ex.logs.stderr
        ex = sbx.run_code("1/0")
        out["error"] = {
            "name": ex.error.name if ex.error else None,
            "value": ex.error.value if ex.error else None,
            "traceback_has_line": bool(ex.error and "1/0" in ex.error.traceback),
        }
        ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
        pngs = [r.png for r in ex.results if r.png]
        out["png_prefix"] = pngs[0][:12] if pngs else None
        ex = sbx.run_code("import os; os.environ.get('ATOLL_T')", envs={"ATOLL_T": "set"})
        out["env_during"] = ex.text
        out["env_after"] = sbx.run_code("import os; repr(os.environ.get('ATOLL_T'))").text
        t = time.monotonic()
        try:  # run_code's timeout ends the request: the cell is interrupted, the state kept
            sbx.run_code("import time\ntime.sleep(60)\nx = 'slept'", timeout=2)
            out["timeout"] = "no exception"
        except Exception as e:  # noqa: BLE001
            out["timeout"] = _name(e)
        out["x_after_timeout"] = sbx.run_code("x").text
        out["after_timeout_s"] = time.monotonic() - t
        ctx = sbx.create_code_context()
        out["ctx"] = {"language": ctx.language, "cwd": ctx.cwd}
        out["ctx_isolated"] = sbx.run_code("'x' in globals()", context=ctx).text
        out["ctx_listed"] = ctx.id in [c.id for c in sbx.list_code_contexts()]
        sbx.run_code("y = 5", context=ctx)
        sbx.restart_code_context(ctx)
        out["ctx_after_restart"] = sbx.run_code("'y' in globals()", context=ctx).text
        sbx.remove_code_context(ctx)
        out["ctx_removed"] = ctx.id not in [c.id for c in sbx.list_code_contexts()]
        times = []
        for _ in range(20):
            t = time.monotonic()
            sbx.run_code("1+1")
            times.append(time.monotonic() - t)
        out["p50_1plus1_ms"] = sorted(times)[len(times) // 2] * 1000
        out["pause"] = sbx.pause()
        CodeSandbox.connect(sbx.sandbox_id)
        out["x_after_resume"] = sbx.run_code("x + 1").text
        native = os.environ.get("ATOLL_NATIVE_URL")
        if native:  # atoll's own disk tier (a checkpoint), through its REST API
            import urllib.request

            req = urllib.request.Request(
                f"{native}/v1/sandboxes/{sbx.sandbox_id}/pause",
                data=json.dumps({"tier": "disk"}).encode(),
                headers={
                    "Authorization": f"Bearer {os.environ['ATOLL_NATIVE_KEY']}",
                    "Content-Type": "application/json",
                },
                method="POST",
            )
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    got = json.loads(r.read())
                    out["disk_pause"] = [got.get("standby_tier"), got.get("standby_reason")]
            except urllib.error.HTTPError as e:
                out["disk_pause"] = f"{e.code} {e.read()[:500]!r}"
            CodeSandbox.connect(sbx.sandbox_id)
            out["x_after_disk"] = sbx.run_code("x + 1").text
    finally:
        CodeSandbox.kill(sbx.sandbox_id)
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


def _exit(e: BaseException) -> object:
    if hasattr(e, "exit_code"):  # CommandExitException
        return [e.exit_code, getattr(e, "error", None)]
    return _name(e)


def pause_streams() -> dict:
    """Pause with a process stream open: the stream ends (TimeoutException), the sandbox is not
    running, and after Sandbox.connect the process runs on (in commands.list, new output through
    commands.connect) and the files are intact. And a process `kill -9`ed by another command ends
    as envd's signal-killed one."""
    out: dict = {}
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/tmp/kept", "kept")
        victim = sbx.commands.run("sleep 600", background=True)
        sbx.commands.run(f"kill -9 {victim.pid}")
        try:
            victim.wait()
            out["victim"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["victim"] = _exit(e)
        h = sbx.commands.run("i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.3; done", background=True)
        out["pid"] = h.pid
        time.sleep(1)
        out["pause"] = sbx.pause()
        try:
            h.wait()
            out["open_stream"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["open_stream"] = _name(e)
        out["is_running"] = sbx.is_running()
        out["state"] = _state(sbx.sandbox_id)
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        out["is_running_after"] = back.is_running()
        out["listed"] = [p.pid for p in back.commands.list()]
        out["kept"] = back.files.read("/tmp/kept")
        again = back.commands.connect(h.pid)
        time.sleep(1.5)
        back.commands.kill(h.pid)
        try:
            again.wait()
            out["after_connect"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["after_connect"] = _exit(e)
            out["after_connect_stdout"] = getattr(e, "stdout", "")
    finally:
        Sandbox.kill(sbx.sandbox_id)
    return out


def snapshots() -> dict:
    """2.63's named snapshots: create_snapshot of a sandbox with a file on disk, one in /tmp and a
    running sleep; list by sandbox and by name; two sandboxes from it by id and name; a
    files-only one (mode="filesystem"); delete_snapshot True then False."""
    out: dict = {}
    tag = f"s{os.getpid()}{int(time.time())}"
    sbx = Sandbox.create(timeout=300)
    made = [sbx]
    try:
        sbx.commands.run(f"echo disk-{tag} > /root/disk.txt; echo tmp-{tag} > /tmp/mem.txt")
        sbx.commands.run("sleep 4321", background=True)
        snap = sbx.create_snapshot(name=tag)
        out["snapshot"] = {"id": snap.snapshot_id, "names": snap.names}
        files_only = sbx.create_snapshot(mode="filesystem")
        out["files_only_id"] = files_only.snapshot_id
        out["by_sandbox"] = sorted(
            s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()
        )
        out["by_name"] = [s.snapshot_id for s in Sandbox.list_snapshots(name=tag).next_items()]
        out["own_list"] = sorted(s.snapshot_id for s in sbx.list_snapshots().next_items())
        copies = []
        for ref in (snap.snapshot_id, tag):
            c = Sandbox.create(ref, timeout=300)
            made.append(c)
            copies.append(
                {
                    "id": c.sandbox_id,
                    "disk": c.commands.run("cat /root/disk.txt").stdout.strip(),
                    "tmp": c.commands.run("cat /tmp/mem.txt").stdout.strip(),
                    "sleep": "sleep 4321" in c.commands.run("ps -eo args").stdout,
                    "hostname": c.commands.run("hostname").stdout.strip(),
                }
            )
        out["copies"] = copies
        cold = Sandbox.create(files_only.snapshot_id, timeout=300)
        made.append(cold)
        out["cold"] = {
            "disk": cold.commands.run("cat /root/disk.txt").stdout.strip(),
            "tmp_exit": cold.commands.run("cat /tmp/mem.txt || echo missing").stdout.strip(),
            "sleep": "sleep 4321" in cold.commands.run("ps -eo args").stdout,
        }
        out["source"] = sbx.sandbox_id
        out["delete"] = Sandbox.delete_snapshot(snap.snapshot_id)
        out["delete_again"] = Sandbox.delete_snapshot(snap.snapshot_id)
        out["delete_files_only"] = Sandbox.delete_snapshot(files_only.snapshot_id)
        out["after"] = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
    finally:
        for m in made:
            Sandbox.kill(m.sandbox_id)
    out["tag"] = tag
    return out


SCENARIOS = {
    "snapshots": snapshots,
    "pause_streams": pause_streams,
    "lifecycle": lifecycle,
    "errors": errors,
    "envd": envd,
    "volumes": volumes,
    "interpreter": interpreter,
    "paused": paused,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()))
