"""The agent's entry point: parse `--host` / `--port`, set up signals as PID 1, listen, and hand every
accepted connection to the thread pool.

Run in a sandbox as `python3 -I -S -u /opt/atoll/agent.pyc --port 49999` (the bundle's importer
imports this module and calls `main()`; see atoll.worker.host.agent_pack), or from a checkout as
`python -m atoll.guest.agent --host 127.0.0.1 --port N`. Every module of the package is imported
before `main()` runs, so a running agent never reads its file again (a restored sandbox may see
one rewritten by a newer worker).
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
import time

from . import zygote  # noqa: F401 - every module is imported before main() (see above)
from .common import log
from .connection import Conn
from .routing import Agent
from .threads import pool

DEFAULT_PORT = 49999


def _parse_args(argv: list[str]) -> tuple[str, int]:
    host, port = "0.0.0.0", DEFAULT_PORT
    usage = "usage: agent.py [--host ADDR] [--port PORT]"
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print(usage)
            sys.exit(0)
        name, eq, value = arg.partition("=")
        if name not in ("--host", "--port"):
            sys.exit(f"{usage}\nunknown argument {arg!r}")
        if not eq:
            if not args:
                sys.exit(f"{usage}\n{name} needs a value")
            value = args.pop(0)
        if name == "--host":
            host = value
        else:
            try:
                port = int(value)
            except ValueError:
                sys.exit(f"{usage}\n--port must be an integer, got {value!r}")
    return host, port


def _isolate(mode: str) -> bool:
    """Run commands under atoll-init in a child PID namespace? Yes as PID 1 (in a sandbox), where a
    user's `kill -9 1` would otherwise end the sandbox; a checkout run on the host spawns directly
    unless ATOLL_AGENT_ISOLATE=1 (tests run it so inside `unshare --pid --mount`)."""
    if mode in ("0", "1"):
        return mode == "1"
    return os.getpid() == 1


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    host, port = _parse_args(args)
    agent = Agent(host, port)
    if _isolate(os.environ.get("ATOLL_AGENT_ISOLATE", "")):
        try:
            agent.procs.start_init()
        except OSError as e:
            log(f"cannot start atoll-init ({e}); commands run beside the agent, which they can signal")

    def on_term(signum, frame):
        if agent.procs.init is not None:
            agent.procs.init.kill_all()
        else:
            agent.kill_all()
        os._exit(0)

    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # SIG_IGN inherited from a parent would auto-reap
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # No SO_REUSEADDR / SO_REUSEPORT: with them a program in the sandbox could bind the agent's
    # port beside it and answer the worker's calls (the agent starts once per sandbox, so there is
    # no TIME_WAIT of an earlier listener to rebind over).
    try:
        listener.bind((host, port))
    except OSError as e:
        sys.exit(f"atoll-agent: cannot listen on {host}:{port}: {e}")
    listener.listen(128)
    agent.procs.start_reaper()
    log(f"pid {agent.pid} listening on {host}:{port}")
    while True:
        try:
            sock, _ = listener.accept()
        except OSError as e:
            log(f"accept failed: {e}")
            time.sleep(0.05)
            continue
        try:
            pool.submit(Conn(agent, sock).run)
        except Exception as e:
            log(f"cannot serve a connection: {e!r}")
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()
            except OSError:
                pass


if __name__ == "__main__":
    main()
