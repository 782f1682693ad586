"""Global options anywhere on the command line: `atoll sandbox list --url URL`, `atoll --json
sandbox get ID` and `atoll sandbox --url URL list` all mean the same.

click only accepts a group's options right after the group's name, so before typer parses,
`normalize` moves `--url` / `--api-key` / `--ca-file` (with their values) to where the command
that owns them reads them — right after `sandbox` or `workers` (their own options), else right
after `atoll` (the top-level options, which `secret`, `template`, `pool` and `worker` read) — and
`--json` to the end of the leaf command's options. Nothing after `--` (an exec's command) is touched.
Called by atoll.cli.main's entry point (`app()`), nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

VALUED = ("--url", "--api-key", "--ca-file")
FLAGS = ("--json",)
# Top-level commands that declare --url/--api-key/--ca-file themselves (the others read atoll's own;
# `atoll worker` and `atoll edge` fall back on atoll's --ca-file).
OWN_CONNECTION = ("sandbox", "workers")


def normalize(argv: Sequence[str]) -> list[str]:
    args = list(argv)
    end = args.index("--") if "--" in args else len(args)
    head, tail = args[:end], args[end:]
    moved: list[str] = []
    flags: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(head):
        tok = head[i]
        name = tok.split("=", 1)[0]
        if name in VALUED:
            if "=" in tok:
                moved.append(tok)
            elif i + 1 < len(head):
                moved += [tok, head[i + 1]]
                i += 1
            else:
                rest.append(tok)  # no value: let click say so
        elif tok in FLAGS:
            if tok not in flags:
                flags.append(tok)
        else:
            rest.append(tok)
        i += 1
    if not moved and not flags:
        return args
    command = next((t for t in rest if not t.startswith("-")), None)
    at = rest.index(command) + 1 if command in OWN_CONNECTION else 0
    return [*rest[:at], *moved, *rest[at:], *flags, *tail]
