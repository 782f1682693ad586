"""The worker's verbs on volumes and drives (issue 19): a mixin of worker.service.node.Node.

The stores themselves are worker.host.stores (ext4 images, loop-mounted); file calls from the API
go through worker.host.treeio (never following a link a sandbox planted), tar streams through a
chrooted child (worker.host.treetar). What a running sandbox mounts is in its runtime record
(`Runtime.mounts`): a volume's tar import is refused while a sandbox has it (it would write under
a running program's feet), export and clone flush first and copy what was written back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import typing
from collections.abc import AsyncIterator, Sequence

from atoll.core import errors
from atoll.core import worker_api as api
from atoll.core.lifecycle import Phase
from atoll.worker.host import stores, treeio
from atoll.worker.runtimes.runtime import RuntimeStore

READ_CHUNK = 256 * 1024


class StoreVerbs:
    stores: stores.Stores
    runtimes: RuntimeStore

    def store_users(self, kind: str, name: str) -> list[str]:
        """The sandboxes on this worker that mount the store (any phase but deleting or failed)."""
        return [
            rt.sandbox_id
            for rt in self.runtimes.cached()
            if rt.phase not in (Phase.DELETING, Phase.FAILED)  # a failed one's runtime is stopped
            and any(m.get("kind") == kind and m.get("name") == name for m in rt.mounts)
        ]

    async def create_store(self, kind: str, name: str, size_mb: int) -> api.StoreInfo:
        return await self.stores.create(kind, name, size_mb)

    async def get_store(self, kind: str, name: str) -> api.StoreInfo:
        return await asyncio.to_thread(self.stores.info, kind, name)

    async def delete_store(self, kind: str, name: str) -> None:
        users = self.store_users(kind, name)
        if users:
            raise errors.Conflict(
                f"{kind} {name!r} is mounted by sandbox(es) {', '.join(users)} on this worker; delete them first",
                code=f"{kind}_in_use",
            )
        await self.stores.delete(kind, name)

    async def clone_store(self, kind: str, name: str, new_name: str) -> api.StoreInfo:
        return await self.stores.clone(kind, name, new_name)

    async def list_store_files(
        self, kind: str, name: str, path: api.FilePath, depth: int
    ) -> Sequence[api.StoreEntry]:
        return await asyncio.to_thread(treeio.list_tree, self.stores.fs(kind, name), path, depth)

    async def stat_store_file(self, kind: str, name: str, path: api.FilePath) -> api.StoreEntry:
        return await asyncio.to_thread(treeio.stat_entry, self.stores.fs(kind, name), path)

    async def make_store_dir(
        self,
        kind: str,
        name: str,
        path: api.FilePath,
        parents: bool,
        mode: int | None,
        uid: int | None,
        gid: int | None,
    ) -> api.StoreEntry:
        root = self.stores.fs(kind, name)
        return await asyncio.to_thread(treeio.make_dir, root, path, parents, mode, uid, gid)

    async def set_store_file_attrs(
        self, kind: str, name: str, path: api.FilePath, mode: int | None, uid: int | None, gid: int | None
    ) -> api.StoreEntry:
        return await asyncio.to_thread(treeio.set_attrs, self.stores.fs(kind, name), path, mode, uid, gid)

    async def delete_store_file(self, kind: str, name: str, path: api.FilePath) -> None:
        await asyncio.to_thread(treeio.remove, self.stores.fs(kind, name), path)

    @contextlib.asynccontextmanager
    async def read_store_file(
        self, kind: str, name: str, path: api.FilePath
    ) -> AsyncIterator[api.FileDownload]:
        fd, size = await asyncio.to_thread(treeio.open_read, self.stores.fs(kind, name), path)
        f = os.fdopen(fd, "rb", buffering=0)

        async def chunks() -> AsyncIterator[bytes]:
            while chunk := await asyncio.to_thread(f.read, READ_CHUNK):
                yield chunk

        try:
            yield api.FileDownload(size, chunks())
        finally:
            f.close()

    async def write_store_file(
        self, kind: str, name: str, path: api.FilePath, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.FileStat:
        root = self.stores.fs(kind, name)
        w = await asyncio.to_thread(treeio.Writer, root, path)
        try:
            async for chunk in chunks:
                await asyncio.to_thread(w.write, chunk)
            await asyncio.to_thread(w.commit)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(w.abort))
            raise
        return await asyncio.to_thread(treeio.stat_path, root, path)

    @contextlib.asynccontextmanager
    async def read_store_tar(self, kind: str, name: str) -> AsyncIterator[api.FileDownload]:
        root = self.stores.fs(kind, name)
        await self.stores.flush(kind, name)
        stream = stores.export_tar(root)
        try:
            yield api.FileDownload(None, stream)
        finally:
            await typing.cast(typing.Any, stream).aclose()

    async def write_store_tar(
        self, kind: str, name: str, chunks: AsyncIterator[bytes], size: int | None
    ) -> api.TarWritten:
        root = self.stores.fs(kind, name)
        users = self.store_users(kind, name) if kind == "volume" else []
        if users:
            raise errors.Conflict(
                f"volume {name!r} is mounted by sandbox {users[0]}: a tar is imported only into a volume "
                "no sandbox has (delete the sandbox first, or write the files from inside it)",
                code="volume_in_use",
            )
        counts = await stores.import_tar(root, chunks)
        return api.TarWritten(path="/", **counts)
