"""GENERATED FILE - do not edit. The worker protocol's plain verbs as a client calls them.

Written by `scripts/gen_seam.py` from the table in `atoll.core.seam` (edit the table and rerun the
script; `make lint` fails while this file is stale). `RemoteVerbs` is a mixin of the control
plane's controlplane.remote_worker.RemoteWorker (worker token: every verb) and of the edge's
edge.seam.GrantedWorker (a grant: one sandbox's data verbs), which provide `_call` and `name`;
streams and tunnels are written by hand there.
"""

from __future__ import annotations

import base64
import typing
from collections.abc import Sequence

from atoll.core import wire
from atoll.core import worker_api as api

CALL_TIMEOUT_S = 60.0
"""Reads and small changes (inventory, info, listings)."""
STEP_TIMEOUT_S = 900.0
"""Lifecycle steps: create (a first template build), pause, resume, delete, builds, fork."""


def _file(key: str, path: api.FilePath) -> dict[str, str]:
    """A file path as query parameters: `<key>`, or `<key>_b64` for bytes."""
    if isinstance(path, bytes):
        return {f"{key}_b64": base64.b64encode(path).decode("ascii")}
    return {key: path}


class RemoteVerbs:
    name: str

    async def _call(
        self,
        method: str,
        path: str,
        *,
        timeout: float | None,
        effect: str | None,
        **kw: typing.Any,
    ) -> typing.Any:
        raise NotImplementedError

    async def info(self) -> api.WorkerInfo:
        url = "/info"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(api.WorkerInfo, data, "info answer")

    async def inventory(self) -> api.Inventory:
        url = "/inventory"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(api.Inventory, data, "inventory answer")

    async def reconcile(self) -> api.ReconcileReport:
        url = "/reconcile"
        data = await self._call(
            "POST", url, timeout=STEP_TIMEOUT_S, effect="runtimes no live record owns may have been deleted"
        )
        return wire.load(api.ReconcileReport, data, "reconcile answer")

    async def set_authority(self, authority: api.Authority) -> None:
        url = "/authority"
        await self._call(
            "PUT",
            url,
            json=wire.dump(authority, api.Authority),
            timeout=CALL_TIMEOUT_S,
            effect="the CA may have been replaced",
        )

    async def create(self, spec: api.SandboxSpec) -> api.CreateOutcome:
        url = "/sandboxes"
        data = await self._call(
            "POST",
            url,
            json=wire.dump(spec, api.SandboxSpec),
            timeout=STEP_TIMEOUT_S,
            effect="the sandbox's state may have changed (the next reconciliation with the worker brings its record in line)",
        )
        return wire.load(api.CreateOutcome, data, "create answer")

    async def pause(
        self, sandbox_id: str, tier: api.Tier, *, only_if_idle: bool = False, end_streams: bool = False
    ) -> api.PauseOutcome:
        url = f"/sandboxes/{sandbox_id}/pause"
        data = await self._call(
            "POST",
            url,
            json={
                "tier": wire.dump(tier, api.Tier),
                "only_if_idle": wire.dump(only_if_idle, bool),
                "end_streams": wire.dump(end_streams, bool),
            },
            timeout=STEP_TIMEOUT_S,
            effect="the sandbox's state may have changed (the next reconciliation with the worker brings its record in line)",
        )
        return wire.load(api.PauseOutcome, data, "pause answer")

    async def resume(self, sandbox_id: str, keep_archive: bool = False) -> api.ResumeOutcome:
        url = f"/sandboxes/{sandbox_id}/resume"
        data = await self._call(
            "POST",
            url,
            json={"keep_archive": wire.dump(keep_archive, bool)},
            timeout=STEP_TIMEOUT_S,
            effect="the sandbox's state may have changed (the next reconciliation with the worker brings its record in line)",
        )
        return wire.load(api.ResumeOutcome, data, "resume answer")

    async def adopt(self, sandbox_id: str, mounts: Sequence[api.MountSpec]) -> api.AdoptOutcome:
        url = f"/sandboxes/{sandbox_id}/adopt"
        data = await self._call(
            "POST",
            url,
            json={"mounts": wire.dump(mounts, tuple[api.MountSpec, ...])},
            timeout=STEP_TIMEOUT_S,
            effect="the sandbox may have been recorded on this worker (archived)",
        )
        return wire.load(api.AdoptOutcome, data, "adopt answer")

    async def delete(self, sandbox_id: str) -> None:
        url = f"/sandboxes/{sandbox_id}"
        await self._call(
            "DELETE",
            url,
            timeout=STEP_TIMEOUT_S,
            effect="the sandbox's state may have changed (the next reconciliation with the worker brings its record in line)",
        )

    async def set_network(self, sandbox_id: str, network: dict[str, list[str]]) -> dict[str, list[str]]:
        url = f"/sandboxes/{sandbox_id}/network"
        data = await self._call(
            "PUT",
            url,
            json=wire.dump(network, dict[str, list[str]]),
            timeout=CALL_TIMEOUT_S,
            effect="the egress policy may have been replaced",
        )
        return wire.load(dict[str, list[str]], data, "set network answer")

    async def set_secrets(self, sandbox_id: str, secrets: Sequence[api.SecretBinding]) -> None:
        url = f"/sandboxes/{sandbox_id}/secrets"
        await self._call(
            "PUT",
            url,
            json={"secrets": wire.dump(secrets, tuple[api.SecretBinding, ...])},
            timeout=CALL_TIMEOUT_S,
            effect="the secret bindings may have been replaced",
        )

    async def build_template(self, build: api.TemplateBuild) -> api.BuildInfo:
        url = "/builds"
        data = await self._call(
            "POST",
            url,
            json=wire.dump(build, api.TemplateBuild),
            timeout=STEP_TIMEOUT_S,
            effect="the build may have started",
        )
        return wire.load(api.BuildInfo, data, "build template answer")

    async def delete_build(self, build_id: str) -> None:
        url = f"/builds/{build_id}"
        await self._call("DELETE", url, timeout=STEP_TIMEOUT_S, effect="the build may have been deleted")

    async def claim(self, sandbox_id: str, env: dict[str, str], cpus: float) -> api.ResumeOutcome:
        url = f"/sandboxes/{sandbox_id}/claim"
        data = await self._call(
            "POST",
            url,
            json={"env": wire.dump(env, dict[str, str]), "cpus": wire.dump(cpus, float)},
            timeout=STEP_TIMEOUT_S,
            effect="the sandbox's state may have changed (the next reconciliation with the worker brings its record in line)",
        )
        return wire.load(api.ResumeOutcome, data, "claim answer")

    async def fork(self, sandbox_id: str, new_ids: Sequence[str]) -> api.ForkOutcome:
        url = f"/sandboxes/{sandbox_id}/fork"
        data = await self._call(
            "POST",
            url,
            json={"sandbox_ids": wire.dump(new_ids, list[str])},
            timeout=STEP_TIMEOUT_S,
            effect="the sandbox's state may have changed (the next reconciliation with the worker brings its record in line)",
        )
        return wire.load(api.ForkOutcome, data, "fork answer")

    async def snapshot(
        self, sandbox_id: str, snapshot_id: str, memory: bool = True, end_streams: bool = False
    ) -> api.SnapshotOutcome:
        url = f"/sandboxes/{sandbox_id}/snapshots"
        data = await self._call(
            "POST",
            url,
            json={
                "snapshot_id": wire.dump(snapshot_id, str),
                "memory": wire.dump(memory, bool),
                "end_streams": wire.dump(end_streams, bool),
            },
            timeout=STEP_TIMEOUT_S,
            effect="the snapshot may have been kept on the worker (the sandbox was checkpointed and restored)",
        )
        return wire.load(api.SnapshotOutcome, data, "snapshot answer")

    async def delete_snapshot(self, snapshot_id: str) -> None:
        url = f"/snapshots/{snapshot_id}"
        await self._call("DELETE", url, timeout=STEP_TIMEOUT_S, effect="the snapshot may have been removed")

    async def store_snapshot(self, snapshot_id: str) -> api.StoredSnapshot:
        url = f"/snapshots/{snapshot_id}/store"
        data = await self._call(
            "POST",
            url,
            timeout=STEP_TIMEOUT_S,
            effect="the snapshot may have been uploaded to the object store",
        )
        return wire.load(api.StoredSnapshot, data, "store snapshot answer")

    async def stored_snapshots(self) -> list[api.KeptSnapshot]:
        url = "/stored-snapshots"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(list[api.KeptSnapshot], data, "stored snapshots answer")

    async def start_process(self, sandbox_id: str, spec: api.ExecSpec) -> api.ProcessStarted:
        url = f"/sandboxes/{sandbox_id}/processes"
        data = await self._call(
            "POST",
            url,
            json=wire.dump(spec, api.ExecSpec),
            timeout=CALL_TIMEOUT_S,
            effect="the process may have started",
        )
        return wire.load(api.ProcessStarted, data, "start process answer")

    async def list_processes(self, sandbox_id: str) -> Sequence[api.ProcessInfo]:
        url = f"/sandboxes/{sandbox_id}/processes"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(list[api.ProcessInfo], data, "list processes answer")

    async def kill_process(self, sandbox_id: str, pid: int) -> None:
        url = f"/sandboxes/{sandbox_id}/processes/{int(pid)}"
        await self._call("DELETE", url, timeout=CALL_TIMEOUT_S, effect="the signal may have been sent")

    async def get_process(self, sandbox_id: str, pid: int) -> api.ProcessInfo:
        url = f"/sandboxes/{sandbox_id}/processes/{int(pid)}"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(api.ProcessInfo, data, "get process answer")

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool) -> int:
        url = f"/sandboxes/{sandbox_id}/processes/{int(pid)}/stdin"
        params: dict[str, str] = {}
        params["eof"] = "1" if eof else "0"
        data = await self._call(
            "POST",
            url,
            params=params,
            content=data,
            headers={"Content-Type": "application/octet-stream"},
            timeout=None,
            effect="the input may have been written, in whole or in part",
        )
        answer = wire.load(dict[str, int], data, "send stdin answer")
        return answer["written"]

    async def signal_process(self, sandbox_id: str, pid: int, signal: str) -> None:
        url = f"/sandboxes/{sandbox_id}/processes/{int(pid)}/signal"
        await self._call(
            "POST",
            url,
            json={"signal": wire.dump(signal, str)},
            timeout=CALL_TIMEOUT_S,
            effect="the signal may have been sent",
        )

    async def wait_process(self, sandbox_id: str, pid: int, timeout_s: float | None) -> api.ProcessInfo:
        url = f"/sandboxes/{sandbox_id}/processes/{int(pid)}/wait"
        data = await self._call(
            "POST", url, json={"timeout_s": wire.dump(timeout_s, float | None)}, timeout=None, effect=None
        )
        return wire.load(api.ProcessInfo, data, "wait process answer")

    async def metrics(self, sandbox_id: str) -> api.SandboxMetrics:
        url = f"/sandboxes/{sandbox_id}/metrics"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(api.SandboxMetrics, data, "metrics answer")

    async def open_pty(self, sandbox_id: str, spec: api.PtySpec) -> api.PtyStarted:
        url = f"/sandboxes/{sandbox_id}/pty"
        data = await self._call(
            "POST",
            url,
            json=wire.dump(spec, api.PtySpec),
            timeout=CALL_TIMEOUT_S,
            effect="the terminal may have started",
        )
        return wire.load(api.PtyStarted, data, "open pty answer")

    async def list_ptys(self, sandbox_id: str) -> Sequence[api.PtyInfo]:
        url = f"/sandboxes/{sandbox_id}/pty"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(list[api.PtyInfo], data, "list ptys answer")

    async def kill_pty(self, sandbox_id: str, pty_id: str) -> None:
        url = f"/sandboxes/{sandbox_id}/pty/{pty_id}"
        await self._call("DELETE", url, timeout=CALL_TIMEOUT_S, effect="the terminal may have been killed")

    async def list_files(self, sandbox_id: str, path: api.FilePath) -> Sequence[api.FileEntry]:
        url = f"/sandboxes/{sandbox_id}/files/list"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        data = await self._call("GET", url, params=params, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(list[api.FileEntry], data, "list files answer")

    async def delete_file(self, sandbox_id: str, path: api.FilePath) -> None:
        url = f"/sandboxes/{sandbox_id}/files"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        await self._call(
            "DELETE",
            url,
            params=params,
            timeout=CALL_TIMEOUT_S,
            effect="the file change may have been made, in whole or in part",
        )

    async def stat_file(self, sandbox_id: str, path: api.FilePath) -> api.FileStat:
        url = f"/sandboxes/{sandbox_id}/files/stat"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        data = await self._call("GET", url, params=params, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(api.FileStat, data, "stat file answer")

    async def make_dir(self, sandbox_id: str, path: api.FilePath) -> bool:
        url = f"/sandboxes/{sandbox_id}/files/mkdir"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        data = await self._call(
            "POST",
            url,
            params=params,
            timeout=CALL_TIMEOUT_S,
            effect="the file change may have been made, in whole or in part",
        )
        answer = wire.load(dict[str, bool], data, "make dir answer")
        return answer["created"]

    async def move_file(self, sandbox_id: str, src: api.FilePath, dst: api.FilePath) -> api.FileStat:
        url = f"/sandboxes/{sandbox_id}/files/move"
        params: dict[str, str] = {}
        params.update(_file("from", src))
        params.update(_file("to", dst))
        data = await self._call(
            "POST",
            url,
            params=params,
            timeout=CALL_TIMEOUT_S,
            effect="the file change may have been made, in whole or in part",
        )
        return wire.load(api.FileStat, data, "move file answer")

    async def chmod_file(self, sandbox_id: str, path: api.FilePath, mode: int) -> api.FileStat:
        url = f"/sandboxes/{sandbox_id}/files/chmod"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        params["mode"] = str(int(mode))
        data = await self._call(
            "POST",
            url,
            params=params,
            timeout=CALL_TIMEOUT_S,
            effect="the file change may have been made, in whole or in part",
        )
        return wire.load(api.FileStat, data, "chmod file answer")

    async def create_store(self, kind: str, name: str, size_mb: int) -> api.StoreInfo:
        url = f"/stores/{kind}"
        data = await self._call(
            "POST",
            url,
            json={"name": wire.dump(name, str), "size_mb": wire.dump(size_mb, int)},
            timeout=STEP_TIMEOUT_S,
            effect="the volume or drive may have been made",
        )
        return wire.load(api.StoreInfo, data, "create store answer")

    async def get_store(self, kind: str, name: str) -> api.StoreInfo:
        url = f"/stores/{kind}/{name}"
        data = await self._call("GET", url, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(api.StoreInfo, data, "get store answer")

    async def delete_store(self, kind: str, name: str) -> None:
        url = f"/stores/{kind}/{name}"
        await self._call(
            "DELETE", url, timeout=STEP_TIMEOUT_S, effect="the volume or drive may have been deleted"
        )

    async def clone_store(self, kind: str, name: str, new_name: str) -> api.StoreInfo:
        url = f"/stores/{kind}/{name}/clone"
        data = await self._call(
            "POST",
            url,
            json={"new_name": wire.dump(new_name, str)},
            timeout=STEP_TIMEOUT_S,
            effect="the copy may have been made",
        )
        return wire.load(api.StoreInfo, data, "clone store answer")

    async def list_store_files(
        self, kind: str, name: str, path: api.FilePath, depth: int
    ) -> Sequence[api.StoreEntry]:
        url = f"/stores/{kind}/{name}/files/list"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        params["depth"] = str(int(depth))
        data = await self._call("GET", url, params=params, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(list[api.StoreEntry], data, "list store files answer")

    async def stat_store_file(self, kind: str, name: str, path: api.FilePath) -> api.StoreEntry:
        url = f"/stores/{kind}/{name}/files/stat"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        data = await self._call("GET", url, params=params, timeout=CALL_TIMEOUT_S, effect=None)
        return wire.load(api.StoreEntry, data, "stat store file answer")

    async def make_store_dir(
        self,
        kind: str,
        name: str,
        path: api.FilePath,
        parents: bool,
        mode: int | None,
        uid: int | None,
        gid: int | None,
    ) -> api.StoreEntry:
        url = f"/stores/{kind}/{name}/files/mkdir"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        data = await self._call(
            "POST",
            url,
            params=params,
            json={
                "parents": wire.dump(parents, bool),
                "mode": wire.dump(mode, int | None),
                "uid": wire.dump(uid, int | None),
                "gid": wire.dump(gid, int | None),
            },
            timeout=CALL_TIMEOUT_S,
            effect="the volume or drive may have changed",
        )
        return wire.load(api.StoreEntry, data, "make store dir answer")

    async def set_store_file_attrs(
        self, kind: str, name: str, path: api.FilePath, mode: int | None, uid: int | None, gid: int | None
    ) -> api.StoreEntry:
        url = f"/stores/{kind}/{name}/files/attrs"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        data = await self._call(
            "POST",
            url,
            params=params,
            json={
                "mode": wire.dump(mode, int | None),
                "uid": wire.dump(uid, int | None),
                "gid": wire.dump(gid, int | None),
            },
            timeout=CALL_TIMEOUT_S,
            effect="the volume or drive may have changed",
        )
        return wire.load(api.StoreEntry, data, "set store file attrs answer")

    async def delete_store_file(self, kind: str, name: str, path: api.FilePath) -> None:
        url = f"/stores/{kind}/{name}/files"
        params: dict[str, str] = {}
        params.update(_file("path", path))
        await self._call(
            "DELETE",
            url,
            params=params,
            timeout=CALL_TIMEOUT_S,
            effect="the volume or drive may have changed",
        )
