"""Inside a sandbox: who it is now, and a hook that runs when it was restored or forked.

The guest agent rewrites `/run/atoll/identity.json` (`sandbox_id`, `generation`, `hostname`,
`restored_at`) whenever the worker gives the sandbox an identity: at a create from a template's
snapshot or pool, after a disk-tier restore, and in each copy of a fork. A program that holds state
which must differ between copies (a seeded `random`, cached host names, client ids, leases) watches
it. Standard library only: copy this file into a template, or `pip install atoll` in it.

    from atoll.guest import identity

    identity.on_restore(lambda ident: random.seed())   # runs in a daemon thread
"""

from __future__ import annotations

import json
import threading
import time
import typing

PATH = "/run/atoll/identity.json"


def current(path: str = PATH) -> dict[str, typing.Any]:
    """The sandbox's identity now ({} before the agent wrote one)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def on_restore(
    callback: typing.Callable[[dict[str, typing.Any]], typing.Any], *, poll_s: float = 0.5, path: str = PATH
) -> threading.Thread:
    """Call `callback(identity)` each time the sandbox id or generation changes (a restore or a
    fork), from a daemon thread polling every `poll_s` seconds. Returns the thread."""
    seen = current(path)
    last = (seen.get("sandbox_id"), seen.get("generation"), seen.get("restored_at"))

    def watch() -> None:
        nonlocal last
        while True:
            time.sleep(poll_s)
            now = current(path)
            key = (now.get("sandbox_id"), now.get("generation"), now.get("restored_at"))
            if now and key != last:
                last = key
                try:
                    callback(now)
                except Exception:  # noqa: BLE001 - the watcher outlives a failing callback
                    pass

    t = threading.Thread(target=watch, name="atoll-on-restore", daemon=True)
    t.start()
    return t
