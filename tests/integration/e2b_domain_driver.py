"""Run inside a venv holding an unmodified `e2b` SDK by tests/integration/test_e2b_domain.py: the
SDK's sandbox hosts `https://{port}-{id}.{domain}` (the create answer's `domain`, or E2B_DOMAIN)
through atoll's ingress router, over TLS verified with SSL_CERT_FILE (the installation's CA).
Prints one JSON object of what it saw; every sandbox it creates it kills. argv[1] is the scenario.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request


def _native(method: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        os.environ["ATOLL_NATIVE_URL"] + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={
            "Authorization": f"Bearer {os.environ['ATOLL_NATIVE_KEY']}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read() or b"{}")


def run_code() -> dict:
    """e2b-code-interpreter 2.8.1 (the Agents SDK's pin): its Jupyter URL is
    https://{get_host(49999)}, never E2B_SANDBOX_URL."""
    from e2b_code_interpreter import Sandbox

    out: dict = {}
    sbx = Sandbox.create(timeout=300)
    try:
        out["domain"] = sbx.sandbox_domain
        out["jupyter_url"] = sbx._jupyter_url
        out["assign"] = sbx.run_code("x = 1").text
        ex = sbx.run_code("x + 1")
        out["x_plus_1"] = ex.text
        out["error"] = ex.error is not None
        out["echo"] = sbx.commands.run("echo through-envd").stdout
    finally:
        Sandbox.kill(sbx.sandbox_id)
    return out


def get_host() -> dict:
    """e2b 2.63 in E2B_DOMAIN mode (no E2B_API_URL, no E2B_SANDBOX_URL): control calls to
    https://api.{domain}, envd to https://49983-{id}.{domain}, and get_host(8000) to a web server
    in the sandbox, all through the ingress router."""
    import httpx
    from e2b import Sandbox

    out: dict = {}
    sbx = Sandbox.create(timeout=300)
    try:
        out["domain"] = sbx.sandbox_domain
        out["envd_url"] = sbx.envd_api_url
        sbx.files.write("/tmp/www/index.html", "hello from the sandbox")
        out["read"] = sbx.files.read("/tmp/www/index.html")
        sbx.commands.run("cd /tmp/www && exec python3 -m http.server 8000", background=True)
        host = sbx.get_host(8000)
        out["host"] = host
        url = f"https://{host}/index.html"
        with httpx.Client(timeout=30) as c:  # verified with SSL_CERT_FILE
            out["without_token"] = c.get(url).status_code  # previews are private by default
            token = _native("GET", f"/v1/sandboxes/{sbx.sandbox_id}/preview/8000")["token"]
            deadline = time.monotonic() + 30
            while True:  # until the server in the sandbox listens
                r = c.get(url, headers={"Atoll-Access-Token": token})
                if r.status_code != 502 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            out["with_token"] = [r.status_code, r.text]
        out["is_running"] = sbx.is_running()
    finally:
        Sandbox.kill(sbx.sandbox_id)
    return out


SCENARIOS = {"run_code": run_code, "get_host": get_host}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]]()))
