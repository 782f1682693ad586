"""The checkpoint gate (GET /gate): what would make a gVisor checkpoint of this sandbox fail right now.

Blockers: non-loopback TCP connections in /proc/net/tcp{,6} that are not LISTEN and not the worker's
own connections to the agent port (a TIME_WAIT on the agent port still counts: the worker cannot abort
it); with `final_peer` (POST /gate/final, the worker's last call before a checkpoint, on its only
remaining connection), also any other connection to the agent port in a state this runsc cannot
save (the worker reset them just before: the gVisor stack has not processed those RSTs yet); processes holding an epoll fd and a TCP socket (a socket whose inode is in no /proc/net table
counts as TCP: conservative); more than MAX_PROCESSES processes; or why /proc could not be read. Pure apart from reading `proc_root`, so
tests run `gate_report` against a fake /proc tree. Called by `handlers_status`.
"""

from __future__ import annotations

import os
import socket
import sys

from .common import read_small

_TCP_STATES = {
    0x01: "ESTABLISHED",
    0x02: "SYN_SENT",
    0x03: "SYN_RECV",
    0x04: "FIN_WAIT1",
    0x05: "FIN_WAIT2",
    0x06: "TIME_WAIT",
    0x07: "CLOSE",
    0x08: "CLOSE_WAIT",
    0x09: "LAST_ACK",
    0x0A: "LISTEN",
    0x0B: "CLOSING",
}
_TCP_LISTEN = 0x0A
_TCP_TIME_WAIT = 0x06
# What gVisor's netstack refuses to save (tcp endpoint beforeSave: connected() or handshake()); its
# /proc/net/tcp prints its own states past 0x0B (12 initial, 13 bound, 14 connecting, 15 error).
_UNSAVABLE = {0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x08, 0x09, 0x0B, 0x0E}


# Measured: a checkpoint of a sandbox with ~512 processes (default memory) was killed by the host's
# OOM killer half-way, and a failed checkpoint kills the sandbox.
MAX_PROCESSES = 256


def _decode_addr(field: str) -> tuple[bytes, int]:
    addr_hex, _, port_hex = field.partition(":")
    raw = bytes.fromhex(addr_hex)
    if len(raw) not in (4, 16):
        raise ValueError(f"bad address {field!r}")
    if sys.byteorder == "little":  # the kernel prints each 32-bit word in host byte order
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return raw, int(port_hex, 16)


def _is_loopback(packed: bytes) -> bool:
    if len(packed) == 4:
        return packed[0] == 127
    if packed == b"\0" * 15 + b"\1":
        return True
    return packed[:12] == b"\0" * 10 + b"\xff\xff" and packed[12] == 127


def _fmt_endpoint(packed: bytes, port: int) -> str:
    if len(packed) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, packed)}:{port}"
    return f"[{socket.inet_ntop(socket.AF_INET6, packed)}]:{port}"


def _read_tcp_table(path: str) -> list[tuple[bytes, int, bytes, int, int, int]]:
    """(local, lport, remote, rport, state, inode) rows of /proc/net/tcp or tcp6; bad rows skipped."""
    with open(path, encoding="ascii", errors="replace") as f:
        lines = f.read().splitlines()
    rows = []
    for line in lines[1:]:
        fields = line.split()
        try:
            local, lport = _decode_addr(fields[1])
            remote, rport = _decode_addr(fields[2])
            state = int(fields[3], 16)
            inode = int(fields[9]) if len(fields) > 9 else 0
        except (ValueError, IndexError):
            continue
        rows.append((local, lport, remote, rport, state, inode))
    return rows


def _other_socket_inodes(proc_root: str) -> set[int]:
    """Inodes of non-TCP sockets (udp, raw, unix, netlink, packet), so they are not taken for TCP."""
    inodes: set[int] = set()
    for name in ("udp", "udp6", "raw", "raw6", "unix", "netlink", "packet"):
        try:
            with open(f"{proc_root}/net/{name}", encoding="ascii", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        if name.startswith(("udp", "raw")):
            column = 9
        else:
            header = [h.lower() for h in lines[0].split()]
            if "inode" not in header:
                continue
            column = header.index("inode")
        for line in lines[1:]:
            fields = line.split()
            try:
                inodes.add(int(fields[column]))
            except (ValueError, IndexError):
                continue
    return inodes


def gate_report(
    proc_root: str = "/proc",
    *,
    own_pid: int | None = None,
    own_port: int | None = None,
    final_peer: int | None = None,
) -> dict:
    """What would make a gVisor checkpoint of this sandbox fail right now (see this module's docstring).
    `final_peer`: the worker's port of the connection asking, the only one of its own that may be
    open (see `still_open`)."""
    blockers: list[str] = []
    external = 0
    own_open = 0
    epoll_pids: list[int] = []
    tcp_inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        path = f"{proc_root}/net/{name}"
        try:
            rows = _read_tcp_table(path)
        except FileNotFoundError:
            if name == "tcp6":
                continue  # IPv6 disabled
            blockers.append(f"the checkpoint gate could not be evaluated: {path} does not exist")
            continue
        except (OSError, UnicodeError) as e:
            blockers.append(f"the checkpoint gate could not be evaluated: reading {path} failed: {e}")
            continue
        for local, lport, remote, rport, state, inode in rows:
            if inode:
                tcp_inodes.add(inode)
            if state == _TCP_LISTEN or (rport == 0 and not any(remote)):
                continue  # listening or not connected
            if _is_loopback(local) and _is_loopback(remote):
                continue
            if own_port is not None and lport == own_port and state != _TCP_TIME_WAIT:
                if final_peer is not None and rport != final_peer and state in _UNSAVABLE:
                    own_open += 1
                continue  # the worker's own channel; it aborts these before checkpointing
            external += 1
            blockers.append(
                f"TCP connection {_fmt_endpoint(local, lport)} -> {_fmt_endpoint(remote, rport)} "
                f"({_TCP_STATES.get(state, f'state {state:#04x}')}) on the sandbox's external interface "
                "cannot be checkpointed"
            )

    other_inodes = _other_socket_inodes(proc_root)
    try:
        names = os.listdir(proc_root)
    except OSError as e:
        blockers.append(f"the checkpoint gate could not be evaluated: listing {proc_root} failed: {e}")
        names = []
    pids = [n for n in names if n.isdigit()]
    if len(pids) > MAX_PROCESSES:
        blockers.append(
            f"{len(pids)} processes are running; this runsc's checkpoint of more than {MAX_PROCESSES} "
            "can exceed the sandbox's memory limit, which kills it (end some to allow the disk tier)"
        )
    for name in sorted(pids, key=int):
        pid = int(name)
        if pid == own_pid:
            continue
        fd_dir = f"{proc_root}/{name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue  # exited, or not ours to read
        has_epoll = has_tcp = False
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if "eventpoll" in target:
                has_epoll = True
            elif target.startswith("socket:["):
                try:
                    inode = int(target[8:-1])
                except ValueError:
                    inode = -1
                if inode in tcp_inodes or inode not in other_inodes:
                    has_tcp = True  # unknown sockets count as TCP: a false positive only keeps it in memory
            if has_epoll and has_tcp:
                break
        if not (has_epoll and has_tcp):
            continue
        try:
            comm = read_small(f"{proc_root}/{name}/comm", 256).decode("utf-8", "replace").strip()
        except OSError:
            comm = "?"
        epoll_pids.append(pid)
        blockers.append(
            f"process {pid} ({comm}) watches TCP sockets with epoll (e.g. asyncio/uvicorn/node); "
            "gVisor cannot checkpoint it — the sandbox stays in the memory tier"
        )
    report = {"blockers": blockers, "external_connections": external, "epoll_tcp_pids": epoll_pids}
    if final_peer is not None:
        report["own_connections_open"] = own_open
    return report
