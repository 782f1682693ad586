"""`atoll mcp`: an MCP server (the official `mcp` SDK's `MCPServer`) whose tools drive atoll through
atoll's own SDK: create, list, exec, read and write files, preview URLs, pause, fork and delete.

Started by `atoll mcp` (atoll.cli.main), over stdio by default or streamable HTTP (`--http`); tests
build it in process with `build_server(client)`. It is one more client of atoll's REST API: it holds
the key it runs with (`ATOLL_API_KEY`, with `ATOLL_URL` and `ATOLL_CA_FILE`, or the CLI's
`--api-key`, `--url`, `--ca-file`) and nothing else, so it sees and changes exactly what that key may.

What a caller gets:
- every tool answers one text block: JSON (`read_file`: the file's text, or its base64);
- an atoll error becomes a tool error (`isError: true`) whose text is `<code>: <message>`, the SDK's
  own code and message (`sandbox_not_found: ...`); arguments that do not fit a tool's input schema
  become `invalid_request: <tool>: <argument>: <why> (got <value>)`; nothing else ever surfaces a
  Python traceback (an unexpected failure is `internal_error: ...`, its traceback logged);
- `exec` streams its output as `notifications/progress` when the call carries a progress token
  (progress = bytes so far, message = `[stdout] <chunk>` or `[stderr] <chunk>`, the first
  STREAM_BYTES of output), and answers the whole result at the end either way.

Logs go to stderr (atoll.shared.logconfig); over stdio the `mcp` SDK's transport moves file
descriptor 1 to stderr while it serves, so stdout carries JSON-RPC only, whatever a library prints.
No `from __future__ import annotations` here: `MCPServer` reads each tool's signature for its input
schema, and annotations that are real objects are what it expects.
"""

import base64
import binascii
import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import sys
from collections.abc import AsyncGenerator, Awaitable
from typing import Annotated, Any, Literal, cast

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, ToolAnnotations
from pydantic import BeforeValidator, Field, ValidationError

import atoll
from atoll import errors
from atoll.core import ids

logger = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 7090
MAX_FORKS = 10
"""The most copies one `fork_sandbox` call makes (the API allows 50; an assistant rarely needs more
than a few, and each copy holds memory until it is deleted)."""
MAX_READ_BYTES = 8 * 1024 * 1024
"""The largest file `read_file` answers: its content goes into one JSON-RPC message."""
MAX_OUTPUT_BYTES = 1024 * 1024
"""Of each stream of a streamed exec, the bytes kept in the result (the first and the last half),
as the server keeps of a plain one by default (ATOLL_MAX_EXEC_OUTPUT_KB)."""
STREAM_BYTES = 1024 * 1024
"""Output sent as progress notifications per exec; past it only the result carries output."""
MAX_EXEC_TIMEOUT_S = 86400
MAX_LIFETIME_S = 30 * 86400

INSTRUCTIONS = """\
Tools for atoll sandboxes (isolated Linux machines, gVisor). create_sandbox gives a sandbox id; exec \
runs a command in it (a string through the shell, bash -l -c; a list as an argv) and answers \
{exit_code, stdout, stderr}; read_file / write_file move text (or base64) by absolute path; \
preview_url gives the HTTPS URL of a port a program in the sandbox listens on; pause_sandbox puts it \
in standby (any later call resumes it); fork_sandbox copies a running one; delete_sandbox removes \
it. Delete the sandboxes you no longer need."""


# ---------------------------------------------------------------- arguments


def _command(value: Any) -> Any:
    """cmd: a non-empty string, or a non-empty list of strings; anything else is refused here with
    one message rather than one per member of the union."""
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(a, str) for a in value) and value[0]:
        return value
    raise ValueError(
        'cmd must be a non-empty string (run by the shell, e.g. "ls -l /tmp | head") or a non-empty '
        'list of strings (an argv, e.g. ["ls", "-l", "/tmp"])'
    )


SandboxId = Annotated[
    str,
    Field(
        min_length=1,
        description="The sandbox's id, as create_sandbox or list_sandboxes answered it (sb-…).",
    ),
]
FilePath = Annotated[
    str,
    Field(
        min_length=1,
        description="Path of the file inside the sandbox, e.g. /tmp/notes.txt (a relative one is under "
        "the sandbox's working directory).",
    ),
]
Command = Annotated[
    str | list[str],
    BeforeValidator(_command),
    Field(
        description="The command: a string runs through the shell (bash -l -c, else sh -c), like "
        '`atoll sandbox exec ID -- "..."`; a list of strings runs as an argv, without a shell.'
    ),
]
ExecTimeout = Annotated[
    float | None,
    Field(
        gt=0,
        le=MAX_EXEC_TIMEOUT_S,
        description="Kill the command after this many seconds (at most a day); it then answers "
        "timed_out: true. Without it, a command still running after 10 minutes is killed when the "
        "call gives up (a timeout tool error): give more for longer work.",
    ),
]
Lifetime = Annotated[
    float | None,
    Field(
        gt=0,
        le=MAX_LIFETIME_S,
        description="The sandbox's lifetime in seconds (default: none); at its end the sandbox is "
        "paused to disk (the API's on_timeout default).",
    ),
]
Labels = Annotated[
    dict[str, str] | None,
    Field(description='Labels (string keys and values), e.g. {"task": "fix-tests"}.'),
]
Encoding = Annotated[
    Literal["utf-8", "base64"],
    Field(description="utf-8: the content is text; base64: the content is bytes, base64-encoded."),
]


# ---------------------------------------------------------------- answers


def _text(text: str, *, error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=error)


def _json(data: Any) -> CallToolResult:
    return _text(json.dumps(data, ensure_ascii=False))


class Refused(Exception):
    """A tool's own refusal (before or instead of an API call), answered `<code>: <message>`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def error_text(exc: errors.AtollError, client: "atoll.AsyncClient") -> str:
    """`<code>: <message>` of an SDK error, with where the key and the URL come from when the
    server refused the key or could not be reached."""
    text = f"{exc.code}: {exc.message}"
    if isinstance(exc, errors.Unauthorized) and exc.code == "unauthorized":
        text += (
            " (atoll mcp sends the API key from its environment, ATOLL_API_KEY: give a valid key in "
            "the env of this server's entry in the MCP client's configuration)"
        )
    elif (
        isinstance(exc, errors.APIConnectionError)
        and not isinstance(exc, errors.BadCAFile)
        and "ATOLL_URL" not in exc.message
    ):
        text += f" (atoll mcp calls the atoll server at {client.base_url}: ATOLL_URL)"
    return text


async def _answer(tool: str, client: "atoll.AsyncClient", work: Awaitable[CallToolResult]) -> CallToolResult:
    """Run one tool's work; every failure becomes a tool error, never a traceback to the caller."""
    try:
        return await work
    except errors.AtollError as exc:
        logger.info("tool %s: %s", tool, exc.code)
        return _text(error_text(exc, client), error=True)
    except Refused as exc:
        return _text(f"{exc.code}: {exc.message}", error=True)
    except Exception as exc:  # a bug of atoll mcp's: the caller gets its kind, the log its traceback
        logger.exception("tool %s failed", tool)
        return _text(f"internal_error: atoll mcp's {tool} failed: {type(exc).__name__}: {exc}", error=True)


def describe_invalid(tool: str, exc: ValidationError) -> str:
    """One line naming each argument that does not fit the tool's schema, why, and the value."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "arguments"
        if err["type"] == "missing":
            parts.append(f"{where}: missing (required)")
            continue
        why = str(err["msg"]).removeprefix("Value error, ")
        got = repr(err.get("input"))
        parts.append(f"{where}: {why} (got {got[:120] + '…' if len(got) > 120 else got})")
    return f"invalid_request: {tool}: " + "; ".join(parts) + " (see the tool's input schema)"


class _Server(MCPServer):
    """MCPServer whose argument errors read like atoll's own (`invalid_request: ...`) rather than
    pydantic's multi-line report, and which refuses arguments a tool does not have (as the API
    refuses unknown fields) instead of ignoring them: `timeout` for `timeout_s` must not pass
    silently as "no timeout"."""

    _arguments: dict[str, set[str]] | None = None

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        if self._arguments is None:
            self._arguments = {
                t.name: set(t.input_schema.get("properties", {})) for t in await self.list_tools()
            }
        known = self._arguments.get(name)
        unknown = sorted(set(arguments) - known) if known is not None else []
        if unknown:
            return _text(
                f"invalid_request: {name}: no argument named {', '.join(map(repr, unknown))}; its "
                f"arguments are {', '.join(sorted(known or ()))} (see the tool's input schema)",
                error=True,
            )
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as exc:
            if isinstance(exc.__cause__, ValidationError):
                logger.info("tool %s: invalid arguments", name)
                return _text(describe_invalid(name, exc.__cause__), error=True)
            raise


# ---------------------------------------------------------------- exec output


def progress_token(ctx: Context) -> Any:
    """The caller's progress token for this request, or None (then nothing is streamed)."""
    meta = ctx.request_context.meta or {}
    return meta.get("progress_token", meta.get("progressToken"))


class OutputProgress:
    """An exec's output chunks as progress notifications: progress counts the bytes sent, the
    message is the chunk after `[stdout] ` or `[stderr] `; past `limit` bytes, one notice and no more."""

    def __init__(self, ctx: Context, limit: int = STREAM_BYTES) -> None:
        self._ctx = ctx
        self._limit = limit
        self._sent = 0
        self._stopped = False

    async def stdout(self, text: str) -> None:
        await self._send("stdout", text)

    async def stderr(self, text: str) -> None:
        await self._send("stderr", text)

    async def _send(self, stream: str, text: str) -> None:
        if not text or self._stopped:
            return
        size = len(text.encode())
        if self._sent + size > self._limit:
            self._stopped = True
            self._sent += 1  # progress must grow with every notification
            await self._ctx.report_progress(
                self._sent,
                None,
                f"[atoll] the output passed {self._limit} bytes: the rest is not streamed; the result "
                "holds the first and the last part of each stream",
            )
            return
        self._sent += size
        await self._ctx.report_progress(self._sent, None, f"[{stream}] {text}")


def _cut(text: str, kind: str, limit: int) -> tuple[str, int]:
    """`text` as at most `limit` bytes: its first and last halves around a marker, and the bytes
    left out (0: whole). Cuts fall on character boundaries."""
    data = text.encode()
    if len(data) <= limit:
        return text, 0
    half = limit // 2
    head = data[:half].decode("utf-8", "ignore")
    tail = data[len(data) - half :].decode("utf-8", "ignore")
    dropped = len(data) - len(head.encode()) - len(tail.encode())
    marker = (
        f"\n…[atoll mcp: {dropped} bytes of {kind} truncated here; redirect the output to a file and "
        "read it in parts to get more]…\n"
    )
    return head + marker + tail, dropped


def capped(result: "atoll.ExecResult", limit: int = MAX_OUTPUT_BYTES) -> "atoll.ExecResult":
    """A streamed result (never cut by the server) cut as the server cuts a plain one."""
    stdout, out_dropped = _cut(result.stdout, "stdout", limit)
    stderr, err_dropped = _cut(result.stderr, "stderr", limit)
    return dataclasses.replace(
        result,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated_bytes=result.stdout_truncated_bytes + out_dropped,
        stderr_truncated_bytes=result.stderr_truncated_bytes + err_dropped,
    )


def exec_answer(result: "atoll.ExecResult") -> dict[str, Any]:
    answer: dict[str, Any] = {
        "exit_code": result.exit_code,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "timed_out": result.timed_out,
        "duration_ms": result.duration_ms,
    }
    if result.truncated:
        answer["stdout_truncated_bytes"] = result.stdout_truncated_bytes
        answer["stderr_truncated_bytes"] = result.stderr_truncated_bytes
    return answer


# ---------------------------------------------------------------- the server


def build_server(client: "atoll.AsyncClient", *, log_level: str = "INFO") -> MCPServer:
    """The MCP server with atoll's tools, each a call through `client` (which the caller closes)."""
    server = _Server(
        name="atoll",
        title="atoll sandboxes",
        version=atoll.__version__,
        instructions=INSTRUCTIONS,
        log_level=log_level,  # type: ignore[arg-type]  # checked by main
    )

    def handle(sandbox_id: str) -> "atoll.AsyncSandbox":
        """A sandbox by id without fetching it: the call that uses it answers sandbox_not_found for
        an id no sandbox of this key has. An id that no sandbox can have (the API's answer would be
        `invalid_request: malformed sandbox id`) is refused as not found here, with its form."""
        if not ids.SANDBOX_ID_RE.fullmatch(sandbox_id):
            raise Refused(
                "sandbox_not_found",
                f"no sandbox has the id {sandbox_id!r}: sandbox ids are 'sb-' and 16 lower-case letters "
                "and digits, as create_sandbox and list_sandboxes answer them",
            )
        return atoll.AsyncSandbox(client, {"id": sandbox_id})

    def tool(
        name: str,
        description: str,
        *,
        read_only_hint: bool,
        destructive_hint: bool | None = None,
        idempotent_hint: bool | None = None,
    ) -> Any:
        hints = ToolAnnotations(
            read_only_hint=read_only_hint, destructive_hint=destructive_hint, idempotent_hint=idempotent_hint
        )
        return server.tool(name=name, description=description, annotations=hints, structured_output=False)

    @tool(
        "create_sandbox",
        "Create a sandbox and wait until it runs; answers the sandbox object as JSON (its id is "
        "what the other tools take). The first sandbox of a template may take a minute.",
        read_only_hint=False,
        destructive_hint=False,
    )
    async def create_sandbox(
        template: Annotated[str, Field(min_length=1, description="Template to start from.")] = "base",
        metadata: Labels = None,
        timeout_s: Lifetime = None,
        env: Annotated[
            dict[str, str] | None, Field(description="Environment variables of its commands.")
        ] = None,
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            sandbox = await client.sandboxes.create(
                template=template, metadata=metadata, env=env, timeout_s=timeout_s
            )
            return _json(sandbox.to_dict())

        return await _answer("create_sandbox", client, work())

    @tool(
        "list_sandboxes",
        "List the sandboxes this key can see, as a JSON array of sandbox objects (id, state, "
        "standby_tier, template, metadata, …).",
        read_only_hint=True,
    )
    async def list_sandboxes(
        state: Annotated[
            Literal["creating", "running", "standby", "failed"] | None,
            Field(description="Only sandboxes in this state."),
        ] = None,
        metadata: Annotated[
            dict[str, str] | None, Field(description="Only sandboxes carrying all these labels.")
        ] = None,
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            sandboxes = await client.sandboxes.list(state=state, metadata=metadata)
            return _json([sb.to_dict() for sb in sandboxes])

        return await _answer("list_sandboxes", client, work())

    @tool(
        "exec",
        "Run a command in a sandbox and wait for it; answers JSON {exit_code, stdout, stderr, "
        "timed_out, duration_ms} (a command that fails is not a tool error: read exit_code). A "
        "sandbox in standby is resumed first. With a progress token, stdout and stderr stream as "
        "progress notifications while it runs.",
        read_only_hint=False,
        destructive_hint=True,
    )
    async def exec_(
        sandbox_id: SandboxId,
        cmd: Command,
        ctx: Context,
        timeout_s: ExecTimeout = None,
        cwd: Annotated[
            str | None, Field(min_length=1, description="Working directory (absolute path).")
        ] = None,
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            sandbox = handle(sandbox_id)
            if progress_token(ctx) is None:
                result = await sandbox.exec(cmd, timeout_s=timeout_s, cwd=cwd)
            else:
                relay = OutputProgress(ctx)
                result = capped(
                    await sandbox.exec(
                        cmd, timeout_s=timeout_s, cwd=cwd, on_stdout=relay.stdout, on_stderr=relay.stderr
                    )
                )
            return _json(exec_answer(result))

        return await _answer("exec", client, work())

    @tool(
        "read_file",
        f"Read a file of a sandbox: answers its content as text (encoding utf-8, the default; a file "
        f"that is not UTF-8 text is refused: read it with encoding base64). Files over "
        f"{MAX_READ_BYTES // (1024 * 1024)} MiB are refused: read parts with exec (head -c, sed -n).",
        read_only_hint=True,
    )
    async def read_file(
        sandbox_id: SandboxId, path: FilePath, encoding: Encoding = "utf-8"
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            data = bytearray()
            stream = cast(AsyncGenerator[bytes, None], handle(sandbox_id).files.stream(path))
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    data += chunk
                    if len(data) > MAX_READ_BYTES:
                        raise Refused(
                            "payload_too_large",
                            f"{path} is larger than {MAX_READ_BYTES} bytes, the most read_file answers; "
                            "read parts of it with exec (head -c N, tail -c N, sed -n 'A,Bp')",
                        )
            if encoding == "base64":
                return _text(base64.b64encode(bytes(data)).decode("ascii"))
            try:
                return _text(bytes(data).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise Refused(
                    "not_text",
                    f"{path} is not UTF-8 text (byte {exc.start} of {len(data)}): read it with "
                    'encoding "base64"',
                ) from None

        return await _answer("read_file", client, work())

    @tool(
        "write_file",
        "Create or replace a file of a sandbox (parent directories are created); answers JSON {path, bytes}.",
        read_only_hint=False,
        destructive_hint=True,
        idempotent_hint=True,
    )
    async def write_file(
        sandbox_id: SandboxId,
        path: FilePath,
        content: Annotated[str, Field(description="The file's new content (text, or base64: see encoding).")],
        encoding: Encoding = "utf-8",
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            if encoding == "base64":
                try:
                    data = base64.b64decode(content, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise Refused(
                        "invalid_request", f"write_file: content is not valid base64 ({exc})"
                    ) from None
            else:
                data = content.encode("utf-8")
            sandbox = handle(sandbox_id)
            await sandbox.files.write(path, data)
            where = path
            if not path.startswith("/"):  # the API put it under the sandbox's working directory
                where = (await sandbox.files.stat(path)).path
            return _json({"path": where, "bytes": len(data)})

        return await _answer("write_file", client, work())

    @tool(
        "preview_url",
        "The HTTPS preview URL of a TCP port a program in the sandbox listens on; answers JSON {url, "
        "signed_url, token, headers, public, port, expires_at}: send token as the "
        "Atoll-Access-Token header to url, or use signed_url (valid until expires_at) as it is. A "
        "request to it resumes a sandbox in standby.",
        read_only_hint=True,
    )
    async def preview_url(
        sandbox_id: SandboxId,
        port: Annotated[int, Field(ge=1, le=65535, description="The port inside the sandbox.")],
        expires_in_s: Annotated[
            float | None,
            Field(gt=0, description="Seconds the signed URL stays valid (default 3600)."),
        ] = None,
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            preview = await handle(sandbox_id).preview(port, expires_in_s=expires_in_s)
            return _json(preview.to_dict())

        return await _answer("preview_url", client, work())

    @tool(
        "pause_sandbox",
        "Put a sandbox in standby with its memory, files and processes kept; the next exec, file "
        "call or preview request resumes it. Answers the sandbox object as JSON (standby_reason says "
        "why it stayed in a warmer tier than asked).",
        read_only_hint=False,
        destructive_hint=False,
        idempotent_hint=True,
    )
    async def pause_sandbox(
        sandbox_id: SandboxId,
        tier: Annotated[
            Literal["memory", "disk", "archive"],
            Field(
                description="memory: fastest resume (the default); disk: frees its memory; archive: "
                "frees the worker's disk too (object store; the slowest resume)."
            ),
        ] = "memory",
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            sandbox = await handle(sandbox_id).pause(tier=tier)
            return _json(sandbox.to_dict())

        return await _answer("pause_sandbox", client, work())

    @tool(
        "fork_sandbox",
        f"Copy a running sandbox (1 to {MAX_FORKS} copies from one checkpoint of its memory, files and "
        "processes); it keeps running. Answers a JSON array of the copies' sandbox objects.",
        read_only_hint=False,
        destructive_hint=False,
    )
    async def fork_sandbox(
        sandbox_id: SandboxId,
        count: Annotated[
            int, Field(ge=1, le=MAX_FORKS, description=f"How many copies (1 to {MAX_FORKS}).")
        ] = 1,
    ) -> CallToolResult:
        async def work() -> CallToolResult:
            copies = await handle(sandbox_id).fork(count=count)
            return _json([sb.to_dict() for sb in copies])

        return await _answer("fork_sandbox", client, work())

    @tool(
        "delete_sandbox",
        "Delete a sandbox and everything in it (its processes, files and snapshots; volumes stay). "
        "Answers JSON {id, deleted: true}.",
        read_only_hint=False,
        destructive_hint=True,
        idempotent_hint=False,
    )
    async def delete_sandbox(sandbox_id: SandboxId) -> CallToolResult:
        async def work() -> CallToolResult:
            await handle(sandbox_id).delete()
            return _json({"id": sandbox_id, "deleted": True})

        return await _answer("delete_sandbox", client, work())

    return server


# ---------------------------------------------------------------- the process


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(
    *,
    url: str | None = None,
    api_key: str | None = None,
    ca_file: str | None = None,
    http: bool = False,
    host: str = "127.0.0.1",
    port: int = DEFAULT_HTTP_PORT,
) -> None:
    """Serve until stdin closes (stdio) or SIGINT/SIGTERM (HTTP). A client that cannot be made
    (a bad ATOLL_CA_FILE) exits 2 with `error: <code>: <message>` on stderr; a missing key is
    logged and every call then answers the server's `unauthorized` with how to fix it."""
    from atoll.shared import logconfig

    level = os.environ.get("ATOLL_LOG_LEVEL", "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        level = "INFO"
    logconfig.configure("json" if os.environ.get("ATOLL_LOG_FORMAT") == "json" else "text", level)
    if level != "DEBUG":  # the SDK logs every request at INFO
        logging.getLogger("mcp").setLevel(logging.WARNING)
    try:
        client = atoll.AsyncClient(base_url=url, api_key=api_key, ca_file=ca_file)
    except errors.AtollError as exc:
        print(f"error: {exc.code}: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
    if not (api_key or os.environ.get("ATOLL_API_KEY")):
        logger.warning(
            "no API key: ATOLL_API_KEY is not set, so every tool call will answer unauthorized; "
            "set it in the env of this server's entry in the MCP client's configuration"
        )
    server = build_server(client, log_level=level)
    if http and not _loopback(host):
        logger.warning(
            "serving MCP on %s without authentication: whoever reaches it acts with this API key", host
        )
    logger.info(
        "atoll mcp: serving %s for %s",
        f"streamable HTTP on http://{host}:{port}/mcp" if http else "stdio",
        client.base_url,
    )

    async def serve() -> None:
        async with client:
            if not http:
                await server.run_stdio_async()
                return
            import uvicorn

            # the app (the SDK's, DNS rebinding protection for a loopback host included) served by
            # uvicorn with no logging config of its own: its access lines go to stderr as ours do,
            # not to stdout as its default config sends them
            app = server.streamable_http_app(host=host)
            config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level=level.lower())
            await uvicorn.Server(config).serve()

    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(serve)


__all__ = ["DEFAULT_HTTP_PORT", "build_server", "main"]
