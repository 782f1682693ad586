"""The guest agent's request-target parser (guest/agent/connection.split_target) against what it
replaced, urllib.parse's urlsplit + parse_qsl(keep_blank_values=True, errors="surrogateescape"):
the same path and parameters for random targets made of the characters that matter."""

from __future__ import annotations

import random
from urllib.parse import parse_qsl, urlsplit

from atoll.guest.agent.connection import split_target


def _urllib(target: str) -> tuple[str, dict[str, str]]:
    split = urlsplit(target)
    return split.path, dict(parse_qsl(split.query, keep_blank_values=True, errors="surrogateescape"))


def test_split_target_decodes_as_urllib_did():
    rng = random.Random(18)
    alphabet = "ab%+=&?#/2Fc3é\udcff0zZ ;"
    for _ in range(20000):
        target = "/" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        assert split_target(target) == _urllib(target), target


def test_split_target_everyday_targets():
    assert split_target("/files?path=%2Ftmp%2Fa%20b&mode=0644") == (
        "/files",
        {"path": "/tmp/a b", "mode": "0644"},
    )
    assert split_target("/processes/12/output?offset=0&follow") == (
        "/processes/12/output",
        {"offset": "0", "follow": ""},
    )
    assert split_target("/files?path=/x%FF") == ("/files", {"path": "/x\udcff"})
