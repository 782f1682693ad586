"""The worker protocol's verbs in one table: for each plain verb of core.worker_api.WorkerAPI, its
HTTP method and path, where each argument travels, what it answers, how long the server waits and
what a call lost on the way may have done.

Both sides are derived from it: the worker's routes (worker.service.httpapi reads the table when it
builds its app) and the clients' methods (`scripts/gen_seam.py` writes shared/seam_verbs.py from it, the
mixin of the control plane's RemoteWorker and the edge's GrantedWorker; `make lint` checks that the written file is current). Adding
a plain verb touches the Protocol, this table, worker.service.node.Node and testing.FakeWorker
— then the generator is run. Streams and tunnels (exec, file bodies, watches, process output, build
logs, events, terminals, ports) are written by hand on both sides: their shape is not a call and
an answer.
Pure; used by worker.service.httpapi, scripts/gen_seam.py and its tests.
"""

from __future__ import annotations

import dataclasses
import typing

from atoll.core import worker_api as api
from atoll.core.lifecycle import Tier

PREFIX = "/worker/v1"


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of a verb. `where`:
      path    a `{name}` of the path (`int` for pids);
      body    the whole JSON body is this seam type;
      field   one key (`key`, default the name) of a JSON object body;
      query   a query parameter (`bool` as "1"/"0", `int` as digits);
      file    a FilePath in query parameter `key` (default "path"), as `<key>` or `<key>_b64` (bytes);
      raw     the request body itself (bytes).
    `secret`: the value must never appear in an error's text (secret bindings, the CA's key)."""

    name: str
    where: str
    type: typing.Any = str
    key: str = ""
    default: typing.Any = None
    required: bool = True
    """Whether a `field` must be in the body (else `default` stands in)."""
    secret: bool = False

    @property
    def wire_name(self) -> str:
        return self.key or ("path" if self.where == "file" else self.name)


@dataclasses.dataclass(frozen=True)
class Verb:
    """One plain verb: `answer` is the seam type of the JSON answer (None: 204 No Content), or with
    `answer_key` the type of that one key of an answer object. `wait` is how long the control plane
    waits: "call" (a minute), "step" (a lifecycle step: a quarter hour) or "none" (as long as it
    takes: commands). `step`: the worker runs it to its end even if the server hangs up (a
    half-made sandbox helps nobody; the server reconciles later). `cancel_on_hangup`: the worker
    stops it when the server hangs up (a wait, a command). `effect`: what the call may have done if
    the worker was lost after it was sent (None: it only reads)."""

    name: str
    method: str
    path: str
    args: tuple[Arg, ...] = ()
    answer: typing.Any = None
    answer_key: str = ""
    wait: str = "call"
    step: bool = False
    cancel_on_hangup: bool = False
    effect: str | None = None


SID = Arg("sandbox_id", "path")
PID = Arg("pid", "path", int)
FILE = Arg("path", "file", api.FilePath)
_STATE = (
    "the sandbox's state may have changed (the next reconciliation with the worker brings its record in line)"
)
_FILES = "the file change may have been made, in whole or in part"

VERBS: tuple[Verb, ...] = (
    # ---- the worker ----------------------------------------------------------------------------
    Verb("info", "GET", "/info", answer=api.WorkerInfo),
    Verb("inventory", "GET", "/inventory", answer=api.Inventory),
    Verb(
        "reconcile",
        "POST",
        "/reconcile",
        answer=api.ReconcileReport,
        wait="step",
        effect="runtimes no live record owns may have been deleted",
    ),
    Verb(
        "set_authority",
        "PUT",
        "/authority",
        (Arg("authority", "body", api.Authority, secret=True),),
        effect="the CA may have been replaced",
    ),
    # ---- lifecycle ------------------------------------------------------------------------------
    Verb(
        "create",
        "POST",
        "/sandboxes",
        (Arg("spec", "body", api.SandboxSpec),),
        api.CreateOutcome,
        wait="step",
        step=True,
        effect=_STATE,
    ),
    Verb(
        "pause",
        "POST",
        "/sandboxes/{sandbox_id}/pause",
        (
            SID,
            Arg("tier", "field", Tier),
            Arg("only_if_idle", "field", bool, default=False, required=False),
            Arg("end_streams", "field", bool, default=False, required=False),
        ),
        api.PauseOutcome,
        wait="step",
        step=True,
        effect=_STATE,
    ),
    Verb(
        "resume",
        "POST",
        "/sandboxes/{sandbox_id}/resume",
        (SID, Arg("keep_archive", "field", bool, default=False, required=False)),
        api.ResumeOutcome,
        wait="step",
        step=True,
        effect=_STATE,
    ),
    Verb(
        "adopt",
        "POST",
        "/sandboxes/{sandbox_id}/adopt",
        (SID, Arg("mounts", "field", tuple[api.MountSpec, ...], default=(), required=False)),
        api.AdoptOutcome,
        wait="step",
        step=True,
        effect="the sandbox may have been recorded on this worker (archived)",
    ),
    Verb("delete", "DELETE", "/sandboxes/{sandbox_id}", (SID,), wait="step", step=True, effect=_STATE),
    Verb(
        "set_network",
        "PUT",
        "/sandboxes/{sandbox_id}/network",
        (SID, Arg("network", "body", dict[str, list[str]])),
        dict[str, list[str]],
        effect="the egress policy may have been replaced",
    ),
    Verb(
        "set_secrets",
        "PUT",
        "/sandboxes/{sandbox_id}/secrets",
        (SID, Arg("secrets", "field", tuple[api.SecretBinding, ...], secret=True)),
        effect="the secret bindings may have been replaced",
    ),
    # ---- templates, pools, fork -----------------------------------------------------------------
    Verb(
        "build_template",
        "POST",
        "/builds",
        (Arg("build", "body", api.TemplateBuild),),
        api.BuildInfo,
        wait="step",
        effect="the build may have started",
    ),
    Verb(
        "delete_build",
        "DELETE",
        "/builds/{build_id}",
        (Arg("build_id", "path"),),
        wait="step",
        step=True,
        effect="the build may have been deleted",
    ),
    Verb(
        "claim",
        "POST",
        "/sandboxes/{sandbox_id}/claim",
        (SID, Arg("env", "field", dict[str, str]), Arg("cpus", "field", float)),
        api.ResumeOutcome,
        wait="step",
        step=True,
        effect=_STATE,
    ),
    Verb(
        "fork",
        "POST",
        "/sandboxes/{sandbox_id}/fork",
        (SID, Arg("new_ids", "field", list[str], key="sandbox_ids")),
        api.ForkOutcome,
        wait="step",
        step=True,
        effect=_STATE,
    ),
    Verb(
        "snapshot",
        "POST",
        "/sandboxes/{sandbox_id}/snapshots",
        (
            SID,
            Arg("snapshot_id", "field"),
            Arg("memory", "field", bool, default=True, required=False),
            Arg("end_streams", "field", bool, default=False, required=False),
        ),
        api.SnapshotOutcome,
        wait="step",
        step=True,
        effect="the snapshot may have been kept on the worker (the sandbox was checkpointed and restored)",
    ),
    Verb(
        "delete_snapshot",
        "DELETE",
        "/snapshots/{snapshot_id}",
        (Arg("snapshot_id", "path"),),
        wait="step",
        step=True,
        effect="the snapshot may have been removed",
    ),
    Verb(
        "store_snapshot",
        "POST",
        "/snapshots/{snapshot_id}/store",
        (Arg("snapshot_id", "path"),),
        api.StoredSnapshot,
        wait="step",
        step=True,
        effect="the snapshot may have been uploaded to the object store",
    ),
    Verb("stored_snapshots", "GET", "/stored-snapshots", answer=list[api.KeptSnapshot]),
    # ---- processes ------------------------------------------------------------------------------
    Verb(
        "start_process",
        "POST",
        "/sandboxes/{sandbox_id}/processes",
        (SID, Arg("spec", "body", api.ExecSpec)),
        api.ProcessStarted,
        effect="the process may have started",
    ),
    Verb("list_processes", "GET", "/sandboxes/{sandbox_id}/processes", (SID,), list[api.ProcessInfo]),
    Verb(
        "kill_process",
        "DELETE",
        "/sandboxes/{sandbox_id}/processes/{pid}",
        (SID, PID),
        effect="the signal may have been sent",
    ),
    Verb("get_process", "GET", "/sandboxes/{sandbox_id}/processes/{pid}", (SID, PID), api.ProcessInfo),
    Verb(
        "send_stdin",
        "POST",
        "/sandboxes/{sandbox_id}/processes/{pid}/stdin",
        (SID, PID, Arg("data", "raw", bytes), Arg("eof", "query", bool)),
        int,
        answer_key="written",
        wait="none",
        effect="the input may have been written, in whole or in part",
    ),
    Verb(
        "signal_process",
        "POST",
        "/sandboxes/{sandbox_id}/processes/{pid}/signal",
        (SID, PID, Arg("signal", "field", str)),
        effect="the signal may have been sent",
    ),
    Verb(
        "wait_process",
        "POST",
        "/sandboxes/{sandbox_id}/processes/{pid}/wait",
        (SID, PID, Arg("timeout_s", "field", float | None, required=False)),
        api.ProcessInfo,
        wait="none",
        cancel_on_hangup=True,
    ),
    Verb("metrics", "GET", "/sandboxes/{sandbox_id}/metrics", (SID,), api.SandboxMetrics),
    # ---- terminals ------------------------------------------------------------------------------
    Verb(
        "open_pty",
        "POST",
        "/sandboxes/{sandbox_id}/pty",
        (SID, Arg("spec", "body", api.PtySpec)),
        api.PtyStarted,
        effect="the terminal may have started",
    ),
    Verb("list_ptys", "GET", "/sandboxes/{sandbox_id}/pty", (SID,), list[api.PtyInfo]),
    Verb(
        "kill_pty",
        "DELETE",
        "/sandboxes/{sandbox_id}/pty/{pty_id}",
        (SID, Arg("pty_id", "path")),
        effect="the terminal may have been killed",
    ),
    # ---- files ----------------------------------------------------------------------------------
    Verb("list_files", "GET", "/sandboxes/{sandbox_id}/files/list", (SID, FILE), list[api.FileEntry]),
    Verb("delete_file", "DELETE", "/sandboxes/{sandbox_id}/files", (SID, FILE), effect=_FILES),
    Verb("stat_file", "GET", "/sandboxes/{sandbox_id}/files/stat", (SID, FILE), api.FileStat),
    Verb(
        "make_dir",
        "POST",
        "/sandboxes/{sandbox_id}/files/mkdir",
        (SID, FILE),
        bool,
        answer_key="created",
        effect=_FILES,
    ),
    Verb(
        "move_file",
        "POST",
        "/sandboxes/{sandbox_id}/files/move",
        (SID, Arg("src", "file", api.FilePath, key="from"), Arg("dst", "file", api.FilePath, key="to")),
        api.FileStat,
        effect=_FILES,
    ),
    Verb(
        "chmod_file",
        "POST",
        "/sandboxes/{sandbox_id}/files/chmod",
        (SID, FILE, Arg("mode", "query", int)),
        api.FileStat,
        effect=_FILES,
    ),
)

KIND = Arg("kind", "path")
NAME = Arg("name", "path")
_STORE = "the volume or drive may have changed"
VERBS += (
    # ---- volumes and drives (issue 19) ---------------------------------------------------------
    Verb(
        "create_store",
        "POST",
        "/stores/{kind}",
        (KIND, Arg("name", "field"), Arg("size_mb", "field", int)),
        api.StoreInfo,
        wait="step",
        step=True,
        effect="the volume or drive may have been made",
    ),
    Verb("get_store", "GET", "/stores/{kind}/{name}", (KIND, NAME), api.StoreInfo),
    Verb(
        "delete_store",
        "DELETE",
        "/stores/{kind}/{name}",
        (KIND, NAME),
        wait="step",
        step=True,
        effect="the volume or drive may have been deleted",
    ),
    Verb(
        "clone_store",
        "POST",
        "/stores/{kind}/{name}/clone",
        (KIND, NAME, Arg("new_name", "field")),
        api.StoreInfo,
        wait="step",
        step=True,
        effect="the copy may have been made",
    ),
    Verb(
        "list_store_files",
        "GET",
        "/stores/{kind}/{name}/files/list",
        (KIND, NAME, FILE, Arg("depth", "query", int)),
        list[api.StoreEntry],
    ),
    Verb("stat_store_file", "GET", "/stores/{kind}/{name}/files/stat", (KIND, NAME, FILE), api.StoreEntry),
    Verb(
        "make_store_dir",
        "POST",
        "/stores/{kind}/{name}/files/mkdir",
        (
            KIND,
            NAME,
            FILE,
            Arg("parents", "field", bool, default=False, required=False),
            Arg("mode", "field", int | None, required=False),
            Arg("uid", "field", int | None, required=False),
            Arg("gid", "field", int | None, required=False),
        ),
        api.StoreEntry,
        effect=_STORE,
    ),
    Verb(
        "set_store_file_attrs",
        "POST",
        "/stores/{kind}/{name}/files/attrs",
        (
            KIND,
            NAME,
            FILE,
            Arg("mode", "field", int | None, required=False),
            Arg("uid", "field", int | None, required=False),
            Arg("gid", "field", int | None, required=False),
        ),
        api.StoreEntry,
        effect=_STORE,
    ),
    Verb("delete_store_file", "DELETE", "/stores/{kind}/{name}/files", (KIND, NAME, FILE), effect=_STORE),
)

BY_NAME = {v.name: v for v in VERBS}
HAND_WRITTEN = (
    "exec",
    "exec_stream",
    "process_output",
    "run_process",
    "read_file",
    "write_file",
    "watch_files",
    "write_tar",
    "read_tar",
    "read_store_file",
    "write_store_file",
    "read_store_tar",
    "write_store_tar",
    "build_log",
    "events",
    "open_port",
    "attach_pty",
    "aclose",
)
"""The verbs that are streams, tunnels or local: written by hand on both sides."""
