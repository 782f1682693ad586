"""Logging set-up of atoll's processes (`atoll up`, `atoll server`, `atoll worker`): stderr, as text
with `key=value` extras or as one JSON object per line (ATOLL_LOG_FORMAT=json), with credentials
redacted from every line.

Library modules only get loggers named after themselves; the entry points call `configure` once
(CONVENTIONS 7). Called by atoll.up, controlplane.main and worker.main.

Redaction (`RedactingFilter`, installed on the handler, so it sees every record of every logger,
uvicorn's included): a credential can reach a log line inside text atoll does not write — uvicorn
logs the path and full query string of each WebSocket handshake, refused ones included, and an
exception's text may hold a URL. So the filter rewrites the message, the extras and the formatted
traceback of each record with `redact`: values of query parameters and JSON/dict keys named like a
credential (`key`, `token`, `access_token`, `signature`, …, the preview signature of core.preview),
the credentials of `Authorization`, `Proxy-Authorization`, `Atoll-Access-Token`, `Cookie` and
`Set-Cookie` headers in any of the forms they are printed in (`Name: value`, `'name': 'value'`,
`(b'name', b'value')`), `Bearer <token>`, and a password in a URL's userinfo. The rest of the line
is kept.
"""

from __future__ import annotations

import json
import logging
import re
import sys

from atoll.core import preview

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
REDACTED = "[redacted]"

_SECRET_NAMES = {preview.SIGNATURE_PARAM, preview.COOKIE, "sig", "apikey", "passwd", "pwd"}
# `secret` alone is not one: atoll logs a secret's name under it, never its value
_SECRET_SUFFIX = re.compile(r"(?:^|[_.-])(?:key|token|signature|password|credential)$|.[_.-]secret$")


def secret_name(name: str) -> bool:
    """Whether a query parameter, field, cookie or extra called `name` holds a credential: `key`,
    `api_key`, `token`, `access_token`, `signature`, `X-Amz-Signature`, `atoll_signature`, …"""
    low = name.lower()
    return low in _SECRET_NAMES or bool(_SECRET_SUFFIX.search(low))


_HEADER_NAMES = r"(?:proxy-)?authorization|atoll-access-token|x-api-key|set-cookie|cookie"
_HEADER_FIELD = re.compile(rf"^(?:{_HEADER_NAMES})$", re.I)
# name=value in a query string, a cookie header or free text; the value ends at &, ;, #,
# whitespace or a quote
_PARAM = re.compile(
    r"(?P<lead>(?:^|[?&;\s(,]|\bcookie:)\s*)(?P<name>[\w.~-]+)=(?P<value>[^&;#\s\"'<>]*)", re.I
)
# "name": "value" / 'name': 'value' / (b'name', b'value') (JSON, dict and tuple reprs)
_FIELD = re.compile(
    r"(?P<lead>(?P<q>[\"'])(?P<name>[\w.-]+)(?P=q)\s*[:=,]\s*b?(?P<vq>[\"']))(?P<value>(?:\\.|(?!(?P=vq)).)*)"
)
# Authorization: <scheme> <credential> (a header as text, or name=value); the scheme is kept
_AUTH = re.compile(
    r"(?P<lead>\b(?:(?:proxy-)?authorization|atoll-access-token|x-api-key)\s*[:=]\s*)"
    r"(?P<scheme>(?:bearer|basic|digest|token)\s+)?(?P<value>[^\s\"',)]+)",
    re.I,
)
_BEARER = re.compile(r"(?P<lead>\bbearer\s+)(?P<value>[A-Za-z0-9._~+/=-]{8,})", re.I)
_USERINFO = re.compile(r"(?P<lead>\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)(?P<value>[^/\s@]+)(?=@)", re.I)


def redact(text: str) -> str:
    """`text` with the credentials it carries replaced by REDACTED (see the module docstring)."""
    if not text:
        return text
    text = _FIELD.sub(
        lambda m: (
            m["lead"] + REDACTED
            if m["value"] and (secret_name(m["name"]) or _HEADER_FIELD.match(m["name"]))
            else m.group(0)
        ),
        text,
    )
    text = _AUTH.sub(lambda m: m["lead"] + (m["scheme"] or "") + REDACTED, text)
    text = _PARAM.sub(
        lambda m: (
            f"{m['lead']}{m['name']}={REDACTED}" if m["value"] and secret_name(m["name"]) else m.group(0)
        ),
        text,
    )
    text = _BEARER.sub(lambda m: m["lead"] + REDACTED, text)
    return _USERINFO.sub(lambda m: m["lead"] + REDACTED, text)


def _scrub(value: object, depth: int = 0) -> object:
    """A log record's extra with credentials redacted (strings, and containers a few levels deep)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, bytes):
        return redact(value.decode("utf-8", "replace"))
    if depth >= 4:
        return value
    if isinstance(value, dict):
        return {
            k: REDACTED
            if isinstance(k, str) and (secret_name(k) or _HEADER_FIELD.match(k)) and v
            else _scrub(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_scrub(v, depth + 1) for v in value)
    return value


class RedactingFilter(logging.Filter):
    """Rewrites each record it sees so that no credential reaches the output (never drops one)."""

    _traceback = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: the handler reports it as usual
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, ()
        for name, value in list(record.__dict__.items()):
            if name in _STD_ATTRS:
                continue
            if secret_name(name) and value:
                setattr(record, name, REDACTED)
            elif isinstance(value, (str, bytes, dict, list, tuple)):
                setattr(record, name, _scrub(value))
        if record.exc_info and not record.exc_text:
            record.exc_text = self._traceback.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS}
        if extras:
            base += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return base


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _STD_ATTRS})
        if record.exc_info or record.exc_text:
            # the filter's redacted text when it ran
            out["exc"] = record.exc_text or self.formatException(record.exc_info)  # type: ignore[arg-type]
        return json.dumps(out, default=str)


def configure(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RedactingFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
