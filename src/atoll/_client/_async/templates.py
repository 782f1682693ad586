"""`client.templates`: templates you build (specs, Dockerfiles), their builds, logs and pools.

Part of the hand-written async SDK; `scripts/unasync_sdk.py` generates its sync twin in `_sync/`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from atoll import errors

from .. import _base
from .._models import (
    Template,
)
from ._parents import ClientLike


class AsyncTemplates:
    """`client.templates`: build, inspect and delete templates, and size their warm pools."""

    def __init__(self, client: ClientLike) -> None:
        self._client = client

    async def list(self) -> list[Template]:
        return [Template(item) for item in await self._client._items("/v1/templates")]

    async def get(self, name: str) -> Template:
        response = await self._client._request("GET", _base.template_path(name))
        return Template(_base.json_body(response))

    async def delete(self, name: str) -> None:
        """Delete a template (its builds and pool); `Conflict` (template_in_use) while sandboxes use it."""
        await self._client._request("DELETE", _base.template_path(name))

    async def build(
        self,
        name: str,
        from_: str = "base",
        apt: Sequence[str] | None = None,
        pip: Sequence[str] | None = None,
        run: Sequence[str] | None = None,
        files: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
        start: str | None = None,
        ready: Mapping[str, Any] | None = None,
        on_log: _base.TextCallback | None = None,
        *,
        wait: bool = True,
        timeout: float | None = None,  # noqa: ASYNC109 - how long to wait for the build
    ) -> Template:
        """Build a template: `from_` ("base", another template, or "oci-archive:/path/on/the/worker"),
        then `apt` packages, `pip` packages, `files` ({path: text}), `run` commands, in that
        order; `env`, `workdir`, `user` for its sandboxes; `start` a long-running command kept
        running in its snapshot, `ready` ({"port": N} or {"cmd": "..."}) when it is ready. With
        `wait` (default) this returns once the build ends, calling `on_log` with each log line,
        and raises `BuildFailed` if it failed."""
        body = _base.without_none(
            name=name,
            **{"from": from_},
            apt=list(apt) if apt is not None else None,
            pip=list(pip) if pip is not None else None,
            run=list(run) if run is not None else None,
            files=dict(files) if files is not None else None,
            env=dict(env) if env is not None else None,
            workdir=workdir,
            user=user,
            start=start,
            ready=dict(ready) if ready is not None else None,
        )
        response = await self._client._request("POST", "/v1/templates", json=body)
        started = _base.json_body(response)
        if not wait:
            return await self.get(name)
        return await self.wait(name, started["build_id"], on_log=on_log, timeout=timeout)

    async def build_dockerfile(
        self,
        name: str,
        path_or_text: str,
        on_log: _base.TextCallback | None = None,
        *,
        wait: bool = True,
        timeout: float | None = None,  # noqa: ASYNC109 - how long to wait for the build
    ) -> Template:
        """Build a template from a Dockerfile: a path to a Dockerfile (its directory is the build
        context for COPY/ADD), a path to a context directory holding one, or the text itself."""
        content, kind = _base.dockerfile_body(path_or_text)
        response = await self._client._request(
            "POST", "/v1/templates", params={"name": name}, content=content, headers={"Content-Type": kind}
        )
        started = _base.json_body(response)
        if not wait:
            return await self.get(name)
        return await self.wait(name, started["build_id"], on_log=on_log, timeout=timeout)

    async def wait(
        self,
        name: str,
        build_id: str,
        on_log: _base.TextCallback | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - how long to wait for the build
    ) -> Template:
        """Follow a build's log until it ends; the template, or `BuildFailed` with its error."""
        async with self._client._stream(
            "GET", _base.template_path(name, "builds", build_id, "logs"), timeout=timeout or 3600.0
        ) as response:
            async for line in response.aiter_lines():
                if on_log is not None:
                    await _base.acall_callback(on_log, line)
        for _ in range(100):  # the record follows the worker's event within moments
            template = await self.get(name)
            if template.build_id != build_id or template.status != "building":
                break
            await _base.asleep(0.1)
        if template.status == "failed":
            raise errors.BuildFailed(
                f"build {build_id} of template {name!r} failed: {template.error}", build_id=build_id
            )
        return template

    async def set_pool(
        self,
        name: str,
        min: int = 0,  # noqa: A002 - the API's own name
        max: int | None = None,  # noqa: A002
        schedule: Sequence[Mapping[str, Any]] | None = None,
        memory_mb: int | None = None,
    ) -> dict[str, Any]:
        """Keep `min`–`max` sandboxes of the template ready (frozen until a create claims one);
        `schedule` raises the floor in UTC windows: [{"from": "08:00", "to": "20:00", "min": 5}]."""
        body = _base.without_none(
            min=min,
            max=max,
            schedule=[dict(w) for w in schedule] if schedule is not None else None,
            memory_mb=memory_mb,
        )
        response = await self._client._request("PUT", _base.template_path(name, "pool"), json=body)
        return _base.json_body(response)

    async def get_pool(self, name: str) -> dict[str, Any]:
        response = await self._client._request("GET", _base.template_path(name, "pool"))
        return _base.json_body(response)
