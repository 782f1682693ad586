"""A fake worker with the façade of atoll.worker.service.Worker, for component tests of the control plane.

It keeps sandbox "processes" as Python state, so the lifecycle (state machine, locks, shared resumes,
idle policy, gate results, failures) is exercised without runsc. Steps can be slowed down or made to
fail to provoke races and error paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from atoll.core import errors
from atoll.worker import agent_channel, service
from atoll.worker.templates import RECIPES


class FakeTemplates:
    def recipe(self, name):
        if name not in RECIPES:
            raise errors.TemplateNotFound(f"template {name!r} does not exist")
        return RECIPES[name]

    def status(self):
        return [{"name": "base", "status": "ready"}]

    async def ensure(self, name):
        self.recipe(name)
        return "/nonexistent"


class FakeWorker:
    def __init__(self):
        self.s = service.WorkerSettings(home="/nonexistent")
        self.templates = FakeTemplates()
        self.phase: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.delay: dict[str, float] = {}
        self.fail: set[str] = set()
        self.gate_blockers: list[str] = []
        self.dead: set[str] = set()
        self.freeze_stuck = False
        self.gate_stalled: set[str] = set()  # sandboxes whose agent never answers the gate
        self.pressure: dict[str, float] = {}  # share of the host task limit in use, per sandbox

    async def _step(self, verb, sid):
        self.calls.append((verb, sid))
        await asyncio.sleep(self.delay.get(verb, 0))
        if verb in self.fail:
            raise errors.RuntimeFailure(
                f"fake {verb} failure", detail=f"runsc log: /var/lib/atoll/sandboxes/{sid}/runsc.log said no"
            )

    async def start(self):
        pass

    async def prepare_template(self, name, memory_mb):
        pass

    async def sweep(self, live):
        self.swept_with = set(live)
        return []

    def remove_empty_cgroups(self):
        return []

    async def create(self, sid, **kw):
        await self._step("create", sid)
        self.phase[sid] = "running"

    async def freeze(self, sid):
        await self._step("freeze", sid)
        if self.freeze_stuck:  # as the real worker: thawed again, still running
            self.phase[sid] = "running"
            raise errors.FreezeTimeout(f"fake: sandbox {sid} stayed FREEZING")
        self.phase[sid] = "frozen"

    async def thaw(self, sid):
        await self._step("thaw", sid)
        self.phase[sid] = "running"

    async def thaw_and_ping(self, sid, timeout, while_waiting=None):
        await self.thaw(sid)
        if while_waiting is not None:
            while_waiting()
        return {"ok": True}

    async def wait_agent(self, sid, timeout):
        return {"ok": True}

    async def gate(self, sid):
        self.calls.append(("gate", sid))
        if sid in self.gate_stalled:
            await asyncio.sleep(3600)
        return service.GateResult(not self.gate_blockers, list(self.gate_blockers))

    async def checkpoint(self, sid):
        await self._step("checkpoint", sid)
        self.phase[sid] = "checkpointed"

    async def restore(self, sid):
        await self._step("restore", sid)
        self.phase[sid] = "running"
        self.pressure.pop(sid, None)  # a fresh sentry

    async def reattach(self, sid):
        return service.Observed(self.phase.get(sid, "missing"))

    async def delete(self, sid):
        await self._step("delete", sid)
        self.phase.pop(sid, None)

    def task_pressure(self, sid):
        return self.pressure.get(sid, 0.0) if self.phase.get(sid) == "running" else 0.0

    async def kill_user_processes(self, sid):
        self.calls.append(("kill_user_processes", sid))
        self.pressure[sid] = 0.5  # processes gone, the runtime's leftover host tasks stay

    def alive(self, sid):
        return sid not in self.dead

    def death_cause(self, sid):
        return f"fake death of {sid}"

    async def agent_request(self, sid, method, url, **kw):
        assert self.phase[sid] == "running", f"agent called while {self.phase[sid]}"
        if sid in self.dead:
            raise errors.SandboxDied(self.death_cause(sid))
        await self._step(f"agent {method} {url}", sid)
        body = {"exit_code": 0, "stdout": "", "stderr": "", "duration_ms": 1, "timed_out": False}
        r = agent_channel.Response(200, {"content-type": "application/json"})
        r.content = json.dumps(body).encode()
        return r

    @contextlib.asynccontextmanager
    async def agent_stream(self, sid, method, url, **kw):
        yield await self.agent_request(sid, method, url, **kw)

    async def aclose(self):
        pass
