"""E2B's control API in atoll's terms, both ways, without I/O: what the E2B edge (issue 22) sends
to atoll's REST API for each call of the `e2b` SDKs (2.31 and 2.63) and what it answers them.

- `create_request` — `POST /v2/sandboxes` (2.63) and `POST /sandboxes` (2.31) bodies → the body
  of atoll's `POST /v1/sandboxes`, and the E2B-only flags atoll keeps per sandbox (auto-resume).
- `network_policy` — E2B's `allow_internet_access`, `allowOut` and `denyOut` (allow wins) →
  atoll's egress policy (deny wins).
- `sandbox`, `listed_sandbox`, `sandbox_detail` — atoll's sandbox object → E2B's `Sandbox`,
  `ListedSandbox` and `SandboxDetail`.
- `list_query` — `GET /v2/sandboxes` query → atoll's `GET /v1/sandboxes` query.
- `metrics` — atoll's metrics object → `[SandboxMetric]`.
- `error` — an atoll error (status, code, message, retryable) → E2B's error body and headers
  (2.63 retries a POST on 5xx unless told `Should-Retry: false`).
- `access_token` — the per-sandbox `envdAccessToken`: HMAC of the sandbox id under a key the
  installation derives (core.grants, where the server's grant route makes and checks it), so no
  edge needs the key and none stores it.

The field names, defaults and required keys are those the SDKs' generated models read
(docs/e2b-compat.md §2, from the SDK wheels). Anything E2B offers that atoll cannot honour and
that changes what leaves the sandbox (`rules`, `egressProxy`, `maskRequestHost`) is refused with
`E2BError(400)`, never dropped silently.
"""

from __future__ import annotations

import contextvars
import datetime as dt
import ipaddress
import math
import typing
import urllib.parse

from atoll.core import grants

ENVD_VERSION = "0.5.6"
"""The envd version atoll's E2B edge advertises: it gates SDK features (docs/e2b-compat.md §3);
0.6.1 once octet-stream uploads are served."""
CLIENT_ID = "atoll"
DEFAULT_TIMEOUT_S = 300
"""The SDKs' own default lifetime (2.63 omits `timeout` when not given; 2.31 always sends it)."""
MAX_TIMEOUT_S = 30 * 86400
"""atoll's longest lifetime (controlplane.schemas.MAX_LIFETIME_S)."""
TEMPLATE_ALIASES = {"code-interpreter": "code-interpreter-v1"}
NO_END = dt.timedelta(days=365 * 100)
"""`endAt` of a sandbox without a lifetime: E2B requires one."""

_REFUSED_NETWORK = {
    "rules": "per-domain header rules",
    "egressProxy": "an egress proxy",
    "maskRequestHost": "masking the request host",
}
_IGNORED_NETWORK = {"dnsServers", "httpsPorts", "allowPublicTraffic"}
_REFUSED_CREATE = {"mcp": "the MCP gateway", "iam": "cloud IAM credentials"}


class E2BError(Exception):
    """A call E2B's API would refuse: `status` and a message naming the field, the value and the fix
    (answered as `{"code": status, "message": message}` with `headers`, e.g. Should-Retry)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class CreatePlan(typing.NamedTuple):
    body: dict[str, typing.Any]
    """atoll's `POST /v1/sandboxes` body."""
    auto_resume: bool
    """E2B's `autoResume.enabled`: envd calls to a paused sandbox resume it (without: 502)."""


def _obj(v: object, what: str) -> dict:
    if not isinstance(v, dict):
        raise E2BError(400, f"{what} must be a JSON object, not {type(v).__name__}")
    return v


def _str_map(v: object, what: str) -> dict[str, str]:
    if v is None:
        return {}
    m = _obj(v, what)
    for k, x in m.items():
        if not isinstance(x, str):
            raise E2BError(400, f"{what}[{k!r}] must be a string, not {type(x).__name__}")
    return dict(m)


def _bool(v: object, what: str, default: bool) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise E2BError(400, f"{what} must be true or false, not {v!r}")
    return v


def _seconds(v: object, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise E2BError(400, f"{what} must be a whole number of seconds, not {v!r}")
    if v <= 0 or v > MAX_TIMEOUT_S:
        raise E2BError(400, f"{what} {v!r} is out of range: 1 to {MAX_TIMEOUT_S} seconds (30 days)")
    return int(v)


def timeout_seconds(v: object, what: str = "timeout") -> int:
    """A lifetime in whole seconds (1 to 30 days) from an E2B body; E2BError(400) naming `what`."""
    return _seconds(v, what)


def template_name(raw: object) -> str:
    """The atoll template an E2B `templateID` names (`base` when none)."""
    if raw is None or raw == "":
        return "base"
    if not isinstance(raw, str):
        raise E2BError(400, f"templateID must be a string, not {type(raw).__name__}")
    return TEMPLATE_ALIASES.get(raw, raw)


def create_request(body: object, *, internet: bool = True) -> CreatePlan:
    """atoll's create body for an E2B create body (either SDK generation). `internet` is the
    installation's default for `allow_internet_access` when the SDK leaves it out (E2B's is
    true; `ATOLL_E2B_INTERNET=deny` makes it false)."""
    b = _obj(body if body is not None else {}, "the request body")
    for key, what in _REFUSED_CREATE.items():
        if b.get(key) is not None:
            raise E2BError(
                400, f"{key}: {what} is not supported by atoll; create the sandbox without {key!r}"
            )
    timeout = DEFAULT_TIMEOUT_S if b.get("timeout") is None else _seconds(b["timeout"], "timeout")
    auto_pause = _bool(b.get("autoPause"), "autoPause", False)
    auto_resume = _bool(
        _obj(b.get("autoResume") or {}, "autoResume").get("enabled"), "autoResume.enabled", False
    )
    out: dict[str, typing.Any] = {
        "template": template_name(b.get("templateID")),
        "metadata": _str_map(b.get("metadata"), "metadata"),
        "env": _str_map(b.get("envVars"), "envVars"),
        "timeout_s": timeout,
        # E2B has no idle standby: to its SDKs a sandbox in standby is a paused one (is_running()
        # False, envd 502 without auto-resume), so atoll's idle policy is off for these sandboxes
        "idle_timeout_s": 0,
        "on_timeout": "pause" if auto_pause else "delete",
        # kept as the sandbox's `compat` (atoll's create field `e2b`, docs/e2b-compat.md §6.4)
        "e2b": {"auto_resume": auto_resume, "on_timeout": "pause" if auto_pause else "kill"},
        "network": network_policy(
            b.get("network"), _bool(b.get("allow_internet_access"), "allow_internet_access", internet)
        ),
    }
    mounts = b.get("volumeMounts")
    if mounts:
        if not isinstance(mounts, list):
            raise E2BError(400, f"volumeMounts must be a list of {{name, path}}, not {type(mounts).__name__}")
        out["drives"] = []
        for i, m in enumerate(mounts):
            m = _obj(m, f"volumeMounts[{i}]")
            if not isinstance(m.get("name"), str) or not isinstance(m.get("path"), str):
                raise E2BError(400, f"volumeMounts[{i}] needs a string name and path, got {m!r}")
            out["drives"].append({"name": m["name"], "path": m["path"]})
    return CreatePlan(out, auto_resume)


def _covers_everything(entry: str) -> bool:
    try:
        net = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    return net.prefixlen == 0


def _atoll_entry(entry: str) -> str:
    return "*" if _covers_everything(entry) else entry


def _inside(entry: str, allowed: list[str]) -> bool:
    """Whether the network `entry` (an address or CIDR) contains one of the `allowed` addresses."""
    try:
        net = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    for a in allowed:
        try:
            if ipaddress.ip_network(a, strict=False).subnet_of(net):  # type: ignore[arg-type]
                return True
        except (ValueError, TypeError):
            continue
    return False


def network_policy(network: object, internet: bool) -> dict[str, list[str]]:
    """atoll's egress policy for E2B's network settings. E2B lets `allowOut` win over `denyOut`;
    atoll lets deny win. When `denyOut` covers everything, only `allowOut` is allowed; otherwise
    everything (with internet access) or nothing, plus `allowOut`, minus the `denyOut` entries
    that contain no allowed address."""
    n = _obj(network if network is not None else {}, "network")
    for key, what in _REFUSED_NETWORK.items():
        if n.get(key):
            raise E2BError(400, f"network.{key}: {what} is not supported by atoll; leave it out")
    unknown = set(n) - {"allowOut", "denyOut", *_REFUSED_NETWORK, *_IGNORED_NETWORK}
    if unknown:
        raise E2BError(400, f"network has unknown fields {sorted(unknown)}; known: allowOut, denyOut")
    lists = {}
    for key in ("allowOut", "denyOut"):
        v = n.get(key) or []
        if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
            raise E2BError(400, f"network.{key} must be a list of addresses, networks or domains, got {v!r}")
        lists[key] = v
    allow, deny = lists["allowOut"], lists["denyOut"]
    for d in deny:
        try:
            ipaddress.ip_network(d, strict=False)
        except ValueError:
            raise E2BError(400, f"network.denyOut entry {d!r} is not an IP address or CIDR network") from None
    if any(_covers_everything(d) for d in deny):
        return {"allow_out": [_atoll_entry(a) for a in allow], "deny_out": []}
    base = ["*"] if internet else []
    allow_out = list(dict.fromkeys(base + [_atoll_entry(a) for a in allow]))
    return {"allow_out": allow_out, "deny_out": [d for d in deny if not _inside(d, allow)]}


def _state(sb: dict) -> str:
    """E2B knows `running` and `paused` only (atoll's creating is running; standby is paused)."""
    return "paused" if sb.get("state") == "standby" else "running"


def _end(sb: dict) -> str:
    if sb.get("expires_at"):
        return sb["expires_at"]
    started = _parse(sb.get("created_at")) or dt.datetime.now(dt.UTC)
    return _iso(started + NO_END)


def _parse(raw: object) -> dt.datetime | None:
    if not isinstance(raw, str):
        return None
    try:
        t = dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.UTC)


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


access_token = grants.e2b_access_token
"""The sandbox's envd access token (`X-Access-Token`): core.grants, where the server makes it too."""
check_access_token = grants.check_e2b_access_token


def sandbox(sb: dict, *, token: str, domain: str | None = None) -> dict:
    """E2B's `Sandbox` (the create, connect and fork answer)."""
    return {
        "templateID": sb["template"],
        "sandboxID": sb["id"],
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "domain": domain,
    }


def listed_sandbox(sb: dict) -> dict:
    """E2B's `ListedSandbox` (an item of `GET /v2/sandboxes`)."""
    return {
        "templateID": sb["template"],
        "sandboxID": sb["id"],
        "clientID": CLIENT_ID,
        "startedAt": sb.get("created_at") or _iso(dt.datetime.now(dt.UTC)),
        "endAt": _end(sb),
        "cpuCount": max(1, math.ceil(sb.get("cpus") or 1)),
        "memoryMB": int(sb.get("memory_mb") or 0),
        "diskSizeMB": int(sb.get("disk_mb") or 0),
        "state": _state(sb),
        "envdVersion": ENVD_VERSION,
        "metadata": dict(sb.get("metadata") or {}),
    }


def paused_message(sid: str) -> str:
    """What envd answers (502) for a call to a paused sandbox it does not resume: the SDKs map a
    502 whose message says `was not found` to "not running" (docs/e2b-compat.md §1 finding 9)."""
    return f"The sandbox {sid} was not found: it is paused; Sandbox.connect() resumes it"


_PAUSED_SEEN: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "atoll_e2b_paused_seen", default=None
)


def watch_paused() -> list[bool]:
    """A list that becomes non-empty when a call made from here on (this task, and tasks it
    starts) meets a sandbox paused and not resumed (`mark_paused`): envd's routes answer such a
    call 502 as envd does, when nothing of its answer was sent yet (e2b.envd_routes)."""
    box: list[bool] = []
    _PAUSED_SEEN.set(box)
    return box


def mark_paused() -> None:
    """A call met a paused sandbox it was asked not to resume (edge.seam.SandboxPaused)."""
    box = _PAUSED_SEEN.get()
    if box is not None:
        box.append(True)


def auto_resume(sb: dict) -> bool:
    """Whether atoll's sandbox object (or a grant answer) says E2B's auto-resume is on: its
    `compat` (kept from the E2B create), off for sandboxes made otherwise."""
    return bool((sb.get("compat") or {}).get("auto_resume"))


def sandbox_detail(sb: dict, *, token: str, domain: str | None = None) -> dict:
    """E2B's `SandboxDetail` (`GET /sandboxes/{id}`)."""
    net = sb.get("network") or {}
    return {
        **listed_sandbox(sb),
        "envdAccessToken": token,
        "allowInternetAccess": "*" in (net.get("allow_out") or []),
        "domain": domain,
        "network": {"allowOut": list(net.get("allow_out") or []), "denyOut": list(net.get("deny_out") or [])},
        "lifecycle": {
            "autoResume": auto_resume(sb),
            "onTimeout": "pause" if sb.get("on_timeout") == "pause" else "kill",
        },
    }


_E2B_STATES = {"running": "running,creating", "paused": "standby"}


def snapshot_info(snap: dict) -> dict:
    """E2B's `SnapshotInfo` of an atoll snapshot."""
    return {"snapshotID": snap["id"], "names": list(snap.get("names") or [])}


def list_query(query: typing.Mapping[str, str]) -> dict[str, str]:
    """atoll's `GET /v1/sandboxes` query for E2B's `GET /v2/sandboxes` (and 2.31's `GET
    /sandboxes`): `metadata` is one parameter holding form-encoded, percent-quoted pairs;
    `state` a comma list of running/paused (absent: both); `startedAfter` ISO 8601;
    `nextToken` the cursor atoll handed out as `x-next-token`."""
    out: dict[str, str] = {}
    raw = query.get("metadata")
    if raw:
        for k, v in urllib.parse.parse_qsl(raw, keep_blank_values=True):
            out[f"metadata.{urllib.parse.unquote(k)}"] = urllib.parse.unquote(v)
    states = [s.strip() for s in (query.get("state") or "running,paused").split(",") if s.strip()]
    bad = [s for s in states if s not in _E2B_STATES]
    if bad:
        raise E2BError(400, f"state {bad[0]!r} is not a sandbox state; use running, paused or both (comma)")
    out["state"] = ",".join(_E2B_STATES[s] for s in dict.fromkeys(states))
    order = query.get("order")
    if order:
        if order not in ("asc", "desc"):
            raise E2BError(400, f"order {order!r} is not asc or desc")
        out["order"] = order
    for e2b, atoll in (("startedAfter", "created_after"), ("template", "template"), ("nextToken", "cursor")):
        if query.get(e2b):
            out[atoll] = query[e2b]
    if query.get("limit"):
        out["limit"] = query["limit"]
    return out


def metrics(m: dict, now: dt.datetime | None = None) -> list[dict]:
    """E2B's `[SandboxMetric]` from atoll's metrics object: one sample, now."""
    t = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
    mb = 1 << 20
    return [
        {
            "timestamp": _iso(t),
            "timestampUnix": int(t.timestamp()),
            "cpuCount": max(1, math.ceil(m.get("cpus") or 1)),
            "cpuUsedPct": float(m.get("cpu_percent") or 0.0),
            "memUsed": int((m.get("memory_used_mb") or 0) * mb),
            "memTotal": int((m.get("memory_limit_mb") or 0) * mb),
            "memCache": 0,
            "diskUsed": int((m.get("disk_used_mb") or 0) * mb),
            "diskTotal": int((m.get("disk_limit_mb") or 0) * mb),
        }
    ]


def error(
    status: int, code: str, message: str, *, retryable: bool = False, outcome_unknown: bool = False
) -> tuple[int, dict, dict[str, str]]:
    """E2B's error answer for an atoll error: (status, body, headers). The body is what both SDKs
    parse (`code` an int, `message` a string); on 5xx and 429 `Should-Retry` tells 2.63 whether
    to repeat the call (never when a POST may have taken effect: `outcome_unknown`)."""
    headers = {}
    if status >= 500 or status == 429:
        again = retryable and not outcome_unknown
        headers["Should-Retry"] = "true" if again else "false"
        if again:
            headers["Retry-After"] = "1"
    return status, {"code": status, "message": f"{code}: {message}"}, headers
