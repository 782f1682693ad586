"""Where archived sandboxes live: one small `ObjectStore` interface, a local directory or S3.

`LocalStore` keeps objects as files under a directory (`$ATOLL_HOME/archive`, or
`ATOLL_ARCHIVE_DIR`): the embedded default, so that the archive tier needs nothing more. `S3Store`
talks to any S3-compatible server through boto3 with only core calls (put/get/head/delete/list,
create bucket), path-style addressing, multipart parts of at least 5 MiB and botocore's retries;
its blocking calls run in a thread (`asyncio.to_thread`).

`put_file` is atomic: an object is either absent or whole. LocalStore writes a temporary file in the
same directory, fsyncs it and renames it; S3 makes an object visible only when its (multipart)
upload completes, and the size is checked with a HEAD afterwards. A server that cannot be reached
raises `StoreUnavailable` (a retry later may work); a missing key raises `ObjectNotFound`.
Called by worker.host.archive (and worker.service.node, which picks the store from the settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import typing
import uuid
from dataclasses import dataclass

MIN_PART = 5 * 1024 * 1024  # S3's smallest multipart part (but the last)
PART_SIZE = 16 * 1024 * 1024


class StoreError(Exception):
    """The object store failed; `retryable` says whether trying again later makes sense."""

    retryable = False


class StoreUnavailable(StoreError):
    """The object store cannot be reached (down, refusing, timing out): nothing was changed."""

    retryable = True


class ObjectNotFound(StoreError):
    """No object under that key."""


class ObjectStore(typing.Protocol):
    """A flat key space of immutable objects. Keys use '/' as separators and never start with one."""

    name: str
    """Where the store is, for messages (`local:/path`, `s3://endpoint/bucket`)."""

    async def put_file(self, key: str, path: str) -> int:
        """Store the file at `path` under `key` atomically; returns the stored size."""
        ...

    async def get_file(self, key: str, path: str, *, durable: bool = True) -> int:
        """Write the object to `path` (a regular file; written whole or not at all); its size.
        `durable=False`: not fsync'd (a file read once and deleted, e.g. an archive to unpack)."""
        ...

    async def size(self, key: str) -> int:
        """The object's size (ObjectNotFound when absent)."""
        ...

    async def delete(self, key: str) -> None:
        """Remove the object (no error when absent)."""
        ...

    async def list(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""
        ...


async def put_checked(store: ObjectStore, key: str, path: str, size: int) -> None:
    """Upload `path` (`size` bytes) as `key` and check the store holds all of it: StoreUnavailable
    when it does not (the manifest naming an object is written only after this)."""
    stored = await store.put_file(key, path)
    if stored != size or await store.size(key) != size:
        raise StoreUnavailable(f"{store.name} holds {stored} bytes of {key}, {size} were uploaded")


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"object key {key!r} is not valid: use non-empty '/'-separated names, no '..'")
    return key


def _write_atomically(src: str, dest: str, durable: bool = True) -> int:
    """Copy `src` to `dest` through a temporary file beside it (fsync'd unless not `durable`,
    then renamed)."""
    os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 4 * 1024 * 1024)
            fout.flush()
            if durable:
                os.fsync(fout.fileno())
            size = fout.tell()
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return size


class LocalStore:
    """Objects as files under `root` (a directory on this host; may be a shared mount)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.name = f"local:{self.root}"

    def _p(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def _available(self) -> None:
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(
                f"the archive directory {self.root} cannot be used: {e.strerror}"
            ) from None

    def _failed(self, key: str, e: OSError) -> StoreUnavailable:
        """A store directory broken under `key` (a file where a directory should be, a share gone
        read-only): the store fails, the caller says so (never a bare OSError: a 500)."""
        return StoreUnavailable(f"the archive directory {self.root} failed at {key!r}: {e.strerror}")

    async def put_file(self, key: str, path: str) -> int:
        self._available()
        dest = self._p(key)
        try:
            return await asyncio.to_thread(_write_atomically, path, dest)
        except OSError as e:
            if not os.path.isfile(path):
                raise  # the caller's file is gone, not the store
            raise self._failed(key, e) from None

    async def get_file(self, key: str, path: str, *, durable: bool = True) -> int:
        self._available()
        src = self._p(key)
        if not os.path.isfile(src):
            raise ObjectNotFound(f"no object {key!r} in {self.name}")
        return await asyncio.to_thread(_write_atomically, src, path, durable)

    async def size(self, key: str) -> int:
        try:
            return os.path.getsize(self._p(key))
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.name}") from None
        except OSError as e:
            raise self._failed(key, e) from None

    async def delete(self, key: str) -> None:
        path = self._p(key)
        self._available()  # a shared mount that is gone: the removal is owed, not done
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        # its directories go with their last object (a sandbox's prefix is a directory of its own)
        parent = os.path.dirname(path)
        while parent != self.root and parent.startswith(self.root + os.sep):
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)

    async def list(self, prefix: str) -> list[str]:
        out = []
        # only the directory the prefix is in (an archive holds thousands of sandboxes' objects)
        if ".." in prefix.split("/"):
            raise ValueError(f"object key prefix {prefix!r} is not valid: no '..'")
        self._available()
        start = os.path.join(self.root, *prefix.split("/")[:-1])
        for dirpath, _dirs, files in os.walk(start):
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                if ".tmp-" in f:
                    continue
                key = f if rel == "." else f"{rel.replace(os.sep, '/')}/{f}"
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


@dataclass(frozen=True)
class S3Config:
    """ATOLL_S3_ENDPOINT, ATOLL_S3_BUCKET, ATOLL_S3_ACCESS_KEY, ATOLL_S3_SECRET_KEY, ATOLL_S3_REGION."""

    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def redacted(self) -> dict:
        return {"endpoint": self.endpoint, "bucket": self.bucket, "region": self.region}


class S3Store:
    """Objects in one bucket of an S3-compatible server (boto3; path-style; core calls only)."""

    def __init__(self, cfg: S3Config, *, connect_timeout: float = 5.0, read_timeout: float = 15.0):
        import boto3  # server-side only: the SDK never imports this module
        import boto3.s3.transfer
        import botocore.config

        self.cfg = cfg
        self.name = f"s3:{cfg.endpoint.rstrip('/')}/{cfg.bucket}"
        self._client = boto3.client(
            "s3",
            endpoint_url=cfg.endpoint,
            aws_access_key_id=cfg.access_key,
            aws_secret_access_key=cfg.secret_key,
            region_name=cfg.region,
            config=botocore.config.Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 3, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                # only what every S3 server checks; newer botocore adds CRC32 trailers by default
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self._transfer = boto3.s3.transfer.TransferConfig(
            multipart_threshold=PART_SIZE, multipart_chunksize=max(PART_SIZE, MIN_PART), max_concurrency=4
        )
        self._bucket_ready = False

    def _call(self, fn: typing.Callable[[], typing.Any], key: str = "") -> typing.Any:
        """Run one blocking boto3 call, turning its errors into StoreUnavailable / ObjectNotFound."""
        import boto3.exceptions
        import botocore.exceptions

        try:
            return fn()
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("404", "NoSuchKey", "NotFound") or status == 404:
                raise ObjectNotFound(f"no object {key!r} in {self.name}") from None
            if status is not None and status >= 500:
                raise StoreUnavailable(f"the object store {self.name} answered {status} {code}") from None
            raise StoreError(f"the object store {self.name} refused the request: {code} {e}") from None
        except (botocore.exceptions.BotoCoreError, boto3.exceptions.S3UploadFailedError, OSError) as e:
            if isinstance(e, boto3.exceptions.S3UploadFailedError) and "NoSuchBucket" not in str(e):
                raise StoreUnavailable(f"upload to the object store {self.name} failed: {e}") from None
            raise StoreUnavailable(f"the object store {self.name} cannot be reached: {e}") from None

    def _ensure_bucket(self) -> None:
        if self._bucket_ready:
            return
        import botocore.exceptions

        try:
            self._client.head_bucket(Bucket=self.cfg.bucket)
        except botocore.exceptions.ClientError:
            try:
                self._client.create_bucket(Bucket=self.cfg.bucket)
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") not in (
                    "BucketAlreadyOwnedByYou",
                    "BucketAlreadyExists",
                ):
                    raise
        self._bucket_ready = True

    async def ensure_bucket(self) -> None:
        await asyncio.to_thread(self._call, self._ensure_bucket)

    async def put_file(self, key: str, path: str) -> int:
        check_key(key)
        want = os.path.getsize(path)

        def put() -> int:
            self._ensure_bucket()
            self._client.upload_file(path, self.cfg.bucket, key, Config=self._transfer)
            got = self._client.head_object(Bucket=self.cfg.bucket, Key=key)["ContentLength"]
            if got != want:
                self._client.delete_object(Bucket=self.cfg.bucket, Key=key)
                raise StoreUnavailable(
                    f"the object store {self.name} kept {got} of the {want} bytes uploaded to {key!r}"
                )
            return got

        return await asyncio.to_thread(self._call, put, key)

    async def get_file(self, key: str, path: str, *, durable: bool = True) -> int:
        check_key(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"

        def get() -> int:
            try:
                self._client.download_file(self.cfg.bucket, key, tmp, Config=self._transfer)
                if durable:
                    with open(tmp, "rb+") as f:
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            return os.path.getsize(path)

        return await asyncio.to_thread(self._call, get, key)

    async def size(self, key: str) -> int:
        check_key(key)
        head = await asyncio.to_thread(
            self._call, lambda: self._client.head_object(Bucket=self.cfg.bucket, Key=key), key
        )
        return int(head["ContentLength"])

    async def delete(self, key: str) -> None:
        check_key(key)
        await asyncio.to_thread(
            self._call, lambda: self._client.delete_object(Bucket=self.cfg.bucket, Key=key), key
        )

    async def list(self, prefix: str) -> list[str]:
        def walk() -> list[str]:
            self._ensure_bucket()
            keys: list[str] = []
            for page in self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.cfg.bucket, Prefix=prefix
            ):
                keys += [o["Key"] for o in page.get("Contents", ())]
            return sorted(keys)

        return await asyncio.to_thread(self._call, walk)


def from_settings(home: str, archive_dir: str | None, s3: S3Config | None) -> ObjectStore:
    """The store a worker archives into: S3 when configured, else a local directory."""
    if s3 is not None:
        return S3Store(s3)
    return LocalStore(archive_dir or os.path.join(home, "archive"))
