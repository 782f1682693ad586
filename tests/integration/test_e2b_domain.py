"""E2B_DOMAIN mode through atoll's ingress router, against a real `atoll up`: the unmodified SDKs
(each in its own venv, tests/e2b_venv.py) reach the sandbox hosts `https://{port}-{id}.{domain}`
that the create answer's `domain` (ATOLL_E2B_DOMAIN: the preview domain and the router's port)
names, over TLS verified with SSL_CERT_FILE = the installation's CA. Names under the preview
domain resolve to loopback inside the SDK's process only (tests/integration/loopback_names for
Python's lookups; e2b 2.63's pyqwest resolves `*.localhost` itself): no resolver is asked.

- e2b-code-interpreter 2.8.1 (the OpenAI Agents SDK's pin, whose run_code ignores
  E2B_SANDBOX_URL), in the default mode (E2B_API_URL = E2B_SANDBOX_URL = E2B's port):
  `run_code("x = 1")` then `run_code("x + 1")` → 2 through `49999-{id}.{domain}`.
- e2b 2.63 in pure E2B_DOMAIN mode (only E2B_DOMAIN set): control calls through `api.{domain}`,
  envd through `49983-{id}.{domain}`, and `get_host(8000)` reaching a web server in the sandbox
  (a private preview: the sandbox's token opens it).
- The router's E2B hosts with forged headers and another tenant's sandbox.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from tests import e2b_venv
from tests.integration.e2b_support import code_interpreter_ready

DRIVER = Path(__file__).with_name("e2b_domain_driver.py")
LOOPBACK_NAMES = Path(__file__).with_name("loopback_names")
DOMAIN = "atoll.localhost"


def drive(release: str, atoll_up, scenario: str, **extra_env: str) -> dict:
    python = e2b_venv.python(release)
    key = atoll_up.api_key
    if release != "2.63":  # 2.31 refuses any key but e2b_<hex> client-side (docs/e2b-compat.md §1.11)
        key = "e2b_" + key.encode().hex()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "SSL_CERT_"))},
        "E2B_API_KEY": key,
        "SSL_CERT_FILE": os.path.join(atoll_up.home, "ca", "root.crt"),
        "PYTHONPATH": str(LOOPBACK_NAMES),
        "ATOLL_TEST_LOOPBACK_DOMAIN": DOMAIN,
        "ATOLL_NATIVE_URL": atoll_up.url,
        "ATOLL_NATIVE_KEY": atoll_up.api_key,
        **extra_env,
    }
    proc = subprocess.run(
        [str(python), str(DRIVER), scenario], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"driver {scenario} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.ecosystem
@pytest.mark.timeout(1800)  # the code interpreter's template is built at first start (~10 min)
def test_run_code_of_code_interpreter_2_8_1_through_the_ingress(atoll_up):
    code_interpreter_ready(atoll_up)
    out = drive(
        "agents", atoll_up, "run_code", E2B_API_URL=atoll_up.e2b_url, E2B_SANDBOX_URL=atoll_up.e2b_url
    )
    domain = f"{DOMAIN}:{atoll_up.ingress_port}"
    assert out["domain"] == domain and out["jupyter_url"].startswith("https://49999-sb-"), out
    assert out["jupyter_url"].endswith(f".{domain}"), out
    assert out["assign"] is None and out["x_plus_1"] == "2" and out["error"] is False, out
    assert out["echo"] == "through-envd\n", out  # envd still through E2B_SANDBOX_URL


@pytest.mark.ecosystem
def test_e2b_2_63_in_e2b_domain_mode_and_get_host(atoll_up):
    domain = f"{DOMAIN}:{atoll_up.ingress_port}"
    out = drive("2.63", atoll_up, "get_host", E2B_DOMAIN=domain)
    assert out["domain"] == domain, out
    assert out["envd_url"].startswith("https://49983-sb-") and out["envd_url"].endswith(f".{domain}"), out
    assert out["read"] == "hello from the sandbox", out
    assert out["host"].startswith("8000-sb-") and out["host"].endswith(f".{domain}"), out
    assert out["without_token"] == 401, out  # previews stay private, E2B-created or not
    assert out["with_token"] == [200, "hello from the sandbox"], out
    assert out["is_running"] is True, out


def _via_router(atoll_up, method: str, host: str, path: str, headers: dict, **kw) -> httpx.Response:
    """One request to the ingress router with `host` as Host and SNI, sent to 127.0.0.1 (no name
    is resolved), TLS verified with the installation's CA."""
    ctx = ssl.create_default_context(cafile=os.path.join(atoll_up.home, "ca", "root.crt"))
    with httpx.Client(transport=httpx.HTTPTransport(verify=ctx), timeout=60) as c:
        return c.request(
            method,
            f"https://127.0.0.1:{atoll_up.ingress_port}{path}",
            headers={**headers, "Host": host},
            extensions={"sni_hostname": host.rsplit(":", 1)[0]},
            **kw,
        )


def _e2b_create(atoll_up, key: str) -> dict:
    r = httpx.post(
        f"{atoll_up.e2b_url}/v2/sandboxes",
        headers={"X-API-KEY": key},
        json={"templateID": "base"},
        timeout=300,
    )
    assert r.status_code == 201, r.text
    return r.json()


@pytest.mark.ecosystem
def test_the_routers_e2b_hosts_take_the_sandbox_from_the_host_and_keep_tenants_apart(atoll_up):
    admin = httpx.Client(base_url=atoll_up.url, headers=atoll_up.headers(), timeout=60)
    keys = []
    for name in ("mine", "theirs"):  # two tenants (an admin key would see every sandbox)
        tenant = admin.post("/v1/tenants", json={"name": f"e2bdomain-{name}-{os.getpid()}"}).json()
        keys.append(admin.post(f"/v1/tenants/{tenant['id']}/keys", json={}).json()["key"])
    my_key, other_key = keys
    mine, theirs = _e2b_create(atoll_up, my_key), _e2b_create(atoll_up, other_key)
    a, b = mine["sandboxID"], theirs["sandboxID"]
    port = atoll_up.ingress_port
    try:
        # control calls through api.{domain}: another tenant's sandbox is not found
        r = _via_router(atoll_up, "GET", f"api.{DOMAIN}:{port}", f"/sandboxes/{b}", {"X-API-KEY": my_key})
        assert r.status_code == 404 and r.json()["code"] == 404, r.text
        r = _via_router(atoll_up, "GET", f"api.{DOMAIN}:{port}", f"/sandboxes/{a}", {"X-API-KEY": my_key})
        assert r.status_code == 200 and r.json()["domain"] == f"{DOMAIN}:{port}", r.text
        # envd on my sandbox's host, with headers naming theirs: the host wins (my file, my token)
        forged = {
            "X-Access-Token": mine["envdAccessToken"],
            "E2b-Sandbox-Id": b,
            "E2b-Sandbox-Port": "49983",
            "Atoll-Sandbox-Id": b,
            "Atoll-Sandbox-Port": "8080",
        }
        wrote = _via_router(
            atoll_up,
            "POST",
            f"49983-{a}.{DOMAIN}:{port}",
            "/files?path=/tmp/who",
            forged,
            files={"file": ("who", b"mine\n")},
        )
        assert wrote.status_code == 200, wrote.text
        got = httpx.get(
            f"{atoll_up.url}/v1/sandboxes/{a}/files", params={"path": "/tmp/who"}, headers=atoll_up.headers()
        )
        assert got.status_code == 200 and got.content == b"mine\n", got.text
        # their sandbox's host with my token: envd refuses (its token is per sandbox), nothing read
        r = _via_router(
            atoll_up,
            "GET",
            f"49983-{b}.{DOMAIN}:{port}",
            "/files?path=/etc/hostname",
            {"X-Access-Token": mine["envdAccessToken"], "E2b-Sandbox-Id": a},
        )
        assert r.status_code == 401 and r.json()["code"] == 401 and "X-Access-Token" in r.json()["message"], (
            r.text
        )
        # an unknown port of the same sandbox stays a preview (private: the router's own 401)
        r = _via_router(atoll_up, "GET", f"8080-{a}.{DOMAIN}:{port}", "/", {})
        assert r.status_code == 401 and r.headers.get("x-atoll-ingress") == "refused", r.text
        assert "text/plain" in r.headers["content-type"]
    finally:
        for sid, key in ((a, my_key), (b, other_key)):
            httpx.delete(f"{atoll_up.e2b_url}/sandboxes/{sid}", headers={"X-API-KEY": key}, timeout=60)
        admin.close()
