"""Template images: a checkpoint of a freshly booted sandbox of a template, restored by every create
instead of booting the sentry and starting Python (~200 ms less).

One image per template, memory size, agent and runsc version, under
`$ATOLL_HOME/template-images/<template>-<memory_mb>m-<key>/`. The size is part of the key because
the sentry keeps the memory size it booted with (`MemTotal` inside a restored sandbox is that of
the image's sandbox). The default size's image is made at start-up (`prepare`); another size's the
first time a sandbox of that size is created, in the background, for at most MAX_IMAGE_SIZES sizes
per template (further sizes boot cold). Making one boots a temporary sandbox (its runtime is
recorded like any other, so a crash leaves nothing unowned), gates and checkpoints it, and moves
the committed snapshot into place. Called by worker.node.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import shutil
import time
import typing

from atoll.core import errors, ids
from atoll.worker.host import agent_pack, bundle, netns, runsc, storage
from atoll.worker.images import templates
from atoll.worker.runtimes.guest import Guest
from atoll.worker.runtimes.runtime import RuntimeStore
from atoll.worker.runtimes.sandboxes import Sandboxes
from atoll.worker.runtimes.tiers import Tiers

log = logging.getLogger(__name__)

MAX_IMAGE_SIZES = 8
IMAGE_DISK_MB = 64


class TemplateImages:
    def __init__(
        self,
        home: str,
        store: templates.TemplateStore,
        runtimes: RuntimeStore,
        sandboxes: Sandboxes,
        tiers: Tiers,
        guest: Guest,
        delete: typing.Callable[[str], typing.Awaitable[typing.Any]],
        spawn: typing.Callable[[typing.Awaitable], None],
    ):
        self.root = os.path.join(home, "template-images")
        self.store = store
        self.runtimes = runtimes
        self.sandboxes = sandboxes
        self.tiers = tiers
        self.guest = guest
        self._delete = delete
        self._spawn = spawn
        self._locks: dict[str, asyncio.Lock] = {}
        self._failed: set[str] = set()
        self._digests: dict[str, str] = {}
        self._builds: dict[str, asyncio.Task] = {}
        self.temporary: set[str] = set()  # ids of the sandboxes images are being made from

    # ---- keys -----------------------------------------------------------------------------------
    def key(self, template: str, memory_mb: int) -> str:
        return f"{template}-{memory_mb}m-{self._digest(template)}"

    def _digest(self, template: str) -> str:
        """What an image depends on, computed once per template and process (the agent's files are
        rewritten only at start-up): the layer, the agent, the runsc binary, the agent's address."""
        digest = self._digests.get(template)
        if digest is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(self.store.recipe(template).content_hash().encode())
            for name in (agent_pack.COMPILED, agent_pack.SOURCE):  # whichever the template runs
                with open(os.path.join(self.sandboxes.agent_dir, name), "rb") as f:
                    h.update(f.read())
            st = os.stat(shutil.which(runsc.RUNSC) or runsc.RUNSC)
            # images before the agent bound SANDBOX_IP:AGENT_PORT (not the wildcard) are not reused
            h.update(
                f"{st.st_size}-{st.st_mtime_ns}-{bundle.AGENT_PORT}-{netns.SANDBOX_IP}-bound-gw".encode()
            )
            digest = self._digests[template] = h.hexdigest()
        return digest

    def _dest(self, key: str) -> str:
        return os.path.join(self.root, key)

    def dirs(self, template: str, current: bool = True) -> list[str]:
        """This template's image directories: those of the current key, or with current=False the
        stale ones other versions left."""
        digest = self._digest(template)
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        # <template>-<hex16> (before images were kept per size) or <template>-<N>m-<hex16>
        ours = re.compile(rf"{re.escape(template)}-(?:\d+m-)?([0-9a-f]{{16}})")
        out = []
        for d in names:
            m = ours.fullmatch(d)
            if m and (m.group(1) == digest and "m-" in d) == current:
                out.append(os.path.join(self.root, d))
        return out

    # ---- lookup and builds ----------------------------------------------------------------------
    def find(self, template: str, memory_mb: int) -> str | None:
        """The image for a create, or None (that create boots cold; an image of this size is then
        made in the background, within MAX_IMAGE_SIZES)."""
        key = self.key(template, memory_mb)
        dest = self._dest(key)
        if os.path.exists(os.path.join(dest, "manifest.json")):
            return dest
        if key not in self._failed and key not in self._builds:
            if len(self.dirs(template)) + len(self._builds) < MAX_IMAGE_SIZES:
                self._builds[key] = asyncio.ensure_future(self._build_later(template, memory_mb, key))
        return None

    async def _build_later(self, template: str, memory_mb: int, key: str) -> None:
        try:
            await self.ensure(template, memory_mb)
        finally:
            self._builds.pop(key, None)

    async def prepare(self, template: str, memory_mb: int) -> None:
        """The layer and the default size's image, ahead of the first create (start-up); images of
        this template that older versions made are removed."""
        await self.store.ensure(template)
        for stale in self.dirs(template, current=False):
            log.info("template %s: removing a stale template image %s", template, stale)
            await asyncio.to_thread(shutil.rmtree, stale, True)
        await self.ensure(template, memory_mb)

    async def ensure(self, template: str, memory_mb: int) -> str | None:
        key = self.key(template, memory_mb)
        dest = self._dest(key)
        async with self._locks.setdefault(key, asyncio.Lock()):
            if os.path.exists(os.path.join(dest, "manifest.json")):
                return dest
            if key in self._failed:
                return None
            try:
                await self._make(template, memory_mb, dest)
            except Exception as e:  # noqa: BLE001 - any failure means: boot cold, and say why
                self._failed.add(key)
                log.warning("template %s: no template image (%s); sandboxes boot cold", template, e)
                return None
        return dest

    async def _make(self, template: str, memory_mb: int, dest: str) -> None:
        t0 = time.perf_counter()
        lower = await self.store.ensure(template)
        sid = ids.new_sandbox_id()
        self.temporary.add(sid)
        try:  # the temporary sandbox is deleted even when this is cancelled half-way (shutdown)
            rt = self.runtimes.new(
                sid,
                template=template,
                memory_mb=memory_mb,
                cpus=1,
                env={},
                disk_mb=IMAGE_DISK_MB,
                temporary=True,
            )
            await self.sandboxes.start(rt, lower, image=None)
            gate = await self.guest.gate(sid)
            if not gate.ok:
                raise errors.RuntimeFailure("; ".join(gate.blockers))
            await self.tiers.checkpoint(rt)
            storage.private_dir(self.root)
            tmp = dest + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            os.replace(self.runtimes.path(sid, "snapshot"), tmp)
            os.replace(tmp, dest)
        finally:
            # shielded and tracked: a cancel (shutdown) must not stop the deletion half-way
            deletion = asyncio.ensure_future(self._delete(sid))
            self._spawn(deletion)
            await asyncio.shield(deletion)
            self.temporary.discard(sid)
        log.info("template %s: image made in %.0f ms (%s)", template, (time.perf_counter() - t0) * 1000, dest)

    async def aclose(self) -> None:
        """Abandon images still being made (their sandboxes are deleted)."""
        builds = list(self._builds.values())
        for t in builds:
            t.cancel()
        if builds:
            await asyncio.wait(builds, timeout=10)
