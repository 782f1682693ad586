"""Request parameters of the public API's data routes, checked one way wherever they are served:
a pid in a path, a 1/0 flag in a query, a JSON object body. A wrong value is `400
invalid_request` (a body too large `413 payload_too_large`) whose message names the value and the
right form. Pure; used by controlplane.routes_procs and controlplane.http (the API) and by
edge.service (the edge), so both answer alike.
"""

from __future__ import annotations

import json
import typing

from atoll.core import errors

MAX_JSON_BYTES = 1024 * 1024
"""The most a JSON request body may carry."""


def pid(text: str) -> int:
    """A process id from a path: a positive integer up to 2**31."""
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= 1 << 31:
        raise errors.InvalidRequest(
            f"pid {text!r} is not a positive integer; list processes with GET …/processes"
        )
    return int(text)


def flag(value: str | None, name: str) -> bool:
    """A query flag: 1/true/yes or 0/false/no (absent or empty: false)."""
    if value is None or value.lower() in ("0", "false", "no", ""):
        return False
    if value.lower() in ("1", "true", "yes"):
        return True
    raise errors.InvalidRequest(f"{name} must be 1 or 0 (true or false), got {value!r}")


def check_json_size(size: int, declared: bool = False) -> None:
    """Refuse a JSON body of `size` bytes over MAX_JSON_BYTES: as its Content-Length says
    (`declared`, before reading it), or as read so far."""
    if size <= MAX_JSON_BYTES:
        return
    if declared:
        raise errors.PayloadTooLarge(
            f"request body is {size} bytes; JSON bodies are limited to {MAX_JSON_BYTES} bytes"
        )
    raise errors.PayloadTooLarge(f"request body exceeds {MAX_JSON_BYTES} bytes, the limit for JSON bodies")


def json_kind(value: typing.Any) -> str:
    """What a decoded JSON value is, in JSON's words ("null", "an array", …) for error messages
    (Python's type names — NoneType, list — mean nothing to a caller)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def json_object(raw: bytes | bytearray, expected: str = "a JSON object") -> dict[str, typing.Any] | None:
    """The JSON object of a request body; None for an empty body (the caller says whether that is
    allowed). `expected` names what was wanted in the messages (e.g. the model's name)."""
    if not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.InvalidRequest(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise errors.InvalidRequest(
            f"request body is nested too deeply to parse; send {expected} without deeply nested "
            "arrays or objects"
        ) from None
    if not isinstance(data, dict):
        raise errors.InvalidRequest(f"request body must be a JSON object, got {json_kind(data)}")
    return data
