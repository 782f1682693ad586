"""Log redaction (atoll.shared.logconfig): lines logged through the handler `configure` installs, in text
and JSON, lose every credential and keep the rest of the line — uvicorn's line for a refused
WebSocket handshake with a key in its query string first of all."""

from __future__ import annotations

import io
import json
import logging

import pytest

from atoll.core import preview
from atoll.shared import logconfig

SECRET = "s3cr3t-VALUE-0123456789"


@pytest.fixture
def configured(request):
    """`configure` as an entry point calls it, its handler's stream swapped for a buffer (the
    formatter and filters are the ones it installed); the root logger's handlers and level are put
    back afterwards. Returns a reader of what was written so far."""
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    levels = {n: logging.getLogger(n).level for n in ("httpx", "httpcore", "uvicorn.access")}
    logconfig.configure(request.param, "INFO")
    [handler] = root.handlers
    buffer = io.StringIO()
    handler.setStream(buffer)  # type: ignore[attr-defined]

    def output() -> str:
        text = buffer.getvalue()
        buffer.seek(0)
        buffer.truncate()
        return text

    yield output
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


both = pytest.mark.parametrize("configured", ["text", "json"], indirect=True)


def _text(out: str) -> str:
    """The output with each JSON line replaced by its message (text lines are kept as they are)."""
    lines = []
    for ln in out.splitlines():
        try:
            lines.append(json.loads(ln)["msg"])
        except ValueError:
            lines.append(ln)
    return "\n".join(lines)


@both
def test_uvicorn_refused_websocket_line_keeps_all_but_the_key(configured):
    path = f"/v1/sandboxes/sb-0123456789abcdef/pty/pty_0123456789ab/ws?cols=80&key={SECRET}&rows=24"
    logging.getLogger("uvicorn.error").info('%s - "WebSocket %s" 403', "127.0.0.1:51234", path)
    out = configured()
    assert SECRET not in out
    out = _text(out)  # JSON lines: their messages
    assert (
        '127.0.0.1:51234 - "WebSocket /v1/sandboxes/sb-0123456789abcdef/pty/pty_0123456789ab/ws'
        '?cols=80&key=[redacted]&rows=24" 403'
    ) in out


@both
def test_query_parameters_named_like_credentials(configured):
    log = logging.getLogger("atoll.test")
    for name in ("key", "token", "access_token", "signature", "api_key", "X-Amz-Signature"):
        log.info("GET http://127.0.0.1:8080/x?a=1&%s=%s#frag done", name, SECRET)
    signed = preview.signed_query(b"k", "sb-0123456789abcdef", 8000, 1893456000)
    log.warning("preview https://8000-sb-0123456789abcdef.atoll.localhost/?%s&x=2 refused", signed)
    out = configured()
    assert SECRET not in out
    out = _text(out)  # JSON lines: their messages
    assert preview.signature(b"k", "sb-0123456789abcdef", 8000, 1893456000) not in out
    assert out.count("&a=1") == 0 and out.count("?a=1&") == 6 and out.count("#frag done") == 6
    assert f"{preview.SIGNATURE_PARAM}=[redacted]" in out
    assert f"{preview.EXPIRES_PARAM}=1893456000" in out and "&x=2 refused" in out
    # names that merely contain a credential's word keep their values
    logging.getLogger("atoll.test").info("GET /files?path=/monkey&keys=3&tokens_used=9&mode=0644")
    assert "?path=/monkey&keys=3&tokens_used=9&mode=0644" in _text(configured())


@both
def test_authorization_and_cookie_headers_in_their_printed_forms(configured):
    log = logging.getLogger("atoll.test")
    log.info("request headers: Authorization: Bearer %s (from 127.0.0.1)", SECRET)
    log.info("scope headers %s", [(b"host", b"x"), (b"authorization", b"Bearer " + SECRET.encode())])
    log.info("headers %s", {"Authorization": f"Basic {SECRET}", "Accept": "text/plain"})
    log.info("preview header Atoll-Access-Token: %s for port 8000", SECRET)
    log.info("Cookie: theme=dark; %s=%s; lang=en", preview.COOKIE, SECRET)
    log.info("sent with bearer %s to the worker", SECRET)
    out = configured()
    assert SECRET not in out
    out = _text(out)  # JSON lines: their messages
    assert "request headers: Authorization: Bearer [redacted] (from 127.0.0.1)" in out
    assert "(b'host', b'x')" in out and "(b'authorization', b'[redacted]')" in out
    assert "'Authorization': '[redacted]', 'Accept': 'text/plain'" in out
    assert "Atoll-Access-Token: [redacted] for port 8000" in out
    assert f"Cookie: theme=dark; {preview.COOKIE}=[redacted]; lang=en" in out
    assert "sent with bearer [redacted] to the worker" in out


@pytest.mark.parametrize("configured", ["text"], indirect=True)
def test_extras_urls_and_tracebacks(configured):
    log = logging.getLogger("atoll.test")
    log.info(
        "starting",
        extra={
            "settings": {"database_url": f"postgresql://atoll:{SECRET}@db:5432/atoll", "port": 8000},
            "token": SECRET,
            "secret": "github",  # a secret's name, not its value
            "url": f"http://10.0.0.1:9/v1?token={SECRET}",
        },
    )
    try:
        raise RuntimeError(f"GET http://127.0.0.1/x?access_token={SECRET} failed")
    except RuntimeError:
        log.exception("call failed")
    out = configured()
    assert SECRET not in out
    assert "postgresql://atoll:[redacted]@db:5432/atoll" in out and "'port': 8000" in out
    assert "token=[redacted]" in out and "secret=github" in out
    assert "url=http://10.0.0.1:9/v1?token=[redacted]" in out
    assert "RuntimeError: GET http://127.0.0.1/x?access_token=[redacted] failed" in out
    assert "Traceback (most recent call last)" in out


@pytest.mark.parametrize("configured", ["json"], indirect=True)
def test_json_extras_and_exception(configured):
    log = logging.getLogger("atoll.test")
    try:
        raise ValueError(f"Authorization: Bearer {SECRET}")
    except ValueError:
        log.exception("failed", extra={"path": f"/x?signature={SECRET}", "sandbox_id": "sb-1"})
    out = configured()
    assert SECRET not in out
    record = json.loads(out.strip())
    assert record["path"] == "/x?signature=[redacted]" and record["sandbox_id"] == "sb-1"
    assert "ValueError: Authorization: Bearer [redacted]" in record["exc"]


def test_redact_leaves_ordinary_lines_alone():
    for line in (
        "sandbox.pause.complete sandbox_id=sb-0123456789abcdef tier=memory duration_ms=3",
        "the Atoll-Access-Token sent is not sandbox sb-1's token; GET /v1/sandboxes/sb-1/preview",
        "failed authorization, retrying in 1.0s",
        "secrets.GH names the secret 'github', which does not exist",
        "layer key oci-0123 made; keys=3",
    ):
        assert logconfig.redact(line) == line
