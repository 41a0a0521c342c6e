"""The checkpoint storage interface (`storage.py`) on S3 or an S3-compatible store (MinIO, Ceph,
...), through boto3: keys under `s3://bucket/prefix/`, listed, read, written and deleted.

The client comes from boto3's standard chain (env, config files, instance roles;
`AWS_ENDPOINT_URL` for S3-compatible stores) with explicit overrides; botocore retries
throttling and 5xx with backoff (adaptive mode by default: it also rate-limits the client when
many ranks hit one prefix). A PUT (single or multipart) only becomes visible when complete,
which is the all-or-nothing write the commit protocol needs. Objects of at least one part go up
as streamed multipart uploads (`s3_multipart.py`), their parts sent from this storage's transfer
pool; reads of more than one part are parallel ranged GETs from the same pool, straight into the
caller's buffers. One storage keeps at most `max_workers` part uploads and `max_workers` GETs in
flight, however many files are being moved, as boto3's transfer manager does per transfer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import IO, Any

from engine.checkpointing.local_storage import atomic_target
from engine.checkpointing.s3_multipart import S3_MIN_PART, MultipartWriteStream, PartBuffers, part_size_for
from engine.checkpointing.storage import Buffer, MiB, Storage, WriteStream, byte_views, byte_window, check_key

logger = logging.getLogger(__name__)


class _Filler:
    """Copies a stream of chunks into consecutive buffers."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views, self._i, self._pos = views, 0, 0
        self.filled = 0

    def put(self, chunk: bytes) -> None:
        data = memoryview(chunk)
        while len(data):
            if self._i == len(self._views):
                raise OSError("the server sent more bytes than the range asked for")
            view = self._views[self._i]
            n = min(len(data), len(view) - self._pos)
            view[self._pos : self._pos + n] = data[:n]
            self._pos += n
            self.filled += n
            data = data[n:]
            if self._pos == len(view):
                self._i, self._pos = self._i + 1, 0


def _is_not_found(err: Exception) -> bool:
    response = getattr(err, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("404", "NoSuchKey", "NotFound") or status == 404


def _is_bad_range(err: Exception) -> bool:
    response = getattr(err, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code == "InvalidRange" or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416


# Set in the threads of an S3 storage's transfer pool: a task there that waited on the pool could
# deadlock it, so anything it submits runs inline instead.
_transfer_thread = threading.local()


def _mark_transfer_thread() -> None:
    _transfer_thread.active = True


class S3Storage(Storage):
    """Keys are objects under `s3://bucket/prefix/`.

    `part_size`: multipart part size, also the size of one ranged GET. `put_file` uses a single
    PUT below `multipart_threshold` bytes (default: `part_size`); streamed writes (`open_write`)
    switch to multipart once a part is full. At most `max_workers` parts and `max_workers` ranged
    GETs are in flight per storage, and streamed uploads hold at most `max_workers + 2` part
    buffers. `retry_mode` /
    `max_attempts` default to `AWS_RETRY_MODE` / `AWS_MAX_ATTEMPTS` when set, else adaptive / 10.
    """

    delete_batch = 1000  # DeleteObjects takes at most 1000 keys per request
    list_page_size = 1000  # ListObjectsV2 returns at most 1000 keys per page

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int = 64 * MiB,
        multipart_threshold: int | None = None,
        max_workers: int = 8,
        retry_mode: str | None = None,
        max_attempts: int | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("S3Storage needs a bucket name")
        if part_size < S3_MIN_PART:
            raise ValueError(f"part_size {part_size} is below S3's minimum part size of 5 MiB")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.bucket = bucket
        self.prefix = check_key(prefix, allow_empty=True)
        self.endpoint_url = endpoint_url
        self.region = region
        self.part_size = part_size
        self.multipart_threshold = part_size if multipart_threshold is None else multipart_threshold
        self.max_workers = max_workers
        self.concurrency = max_workers
        self.retry_mode = retry_mode or os.environ.get("AWS_RETRY_MODE") or "adaptive"
        self.max_attempts = max_attempts or int(os.environ.get("AWS_MAX_ATTEMPTS") or 10)
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = self._make_client()
        self._init_transfers()

    def _make_client(self) -> Any:
        import boto3  # optional dependency of the engine: only S3 users need it
        from botocore.config import Config

        config = Config(
            retries={"mode": self.retry_mode, "max_attempts": self.max_attempts},
            max_pool_connections=max(10, 4 * self.max_workers),
        )
        session = boto3.session.Session(region_name=self.region)
        client = session.client("s3", endpoint_url=self.endpoint_url, config=config)
        logger.debug("S3 storage %s via %s", self.uri, client.meta.endpoint_url)
        return client

    def _init_transfers(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._buffers = PartBuffers(self.max_workers + 2)
        # Reads come from the caller's threads as well as from the pool: this keeps the GETs in
        # flight at max_workers however the two add up.
        self._gets = threading.BoundedSemaphore(self.max_workers)

    # A boto3 client, threads and locks do not pickle; rebuild them on the other side (Ray
    # actors, spawn workers, the resume fetcher's all-gather).
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_client", "_pool", "_pool_lock", "_buffers", "_gets"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = self._make_client()
        self._init_transfers()

    @property
    def client(self) -> Any:
        """The boto3 S3 client (thread-safe; shared by this storage's worker threads)."""
        return self._client

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` in this storage's transfer pool (inline when already in one)."""
        if getattr(_transfer_thread, "active", False):
            done: Future = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - delivered through the future
                done.set_exception(err)
            return done
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.max_workers, thread_name_prefix="elastron-s3", initializer=_mark_transfer_thread
                )
        return self._pool.submit(fn, *args)

    def _run_all(self, fn: Callable[..., Any], calls: list[tuple]) -> list[Any]:
        """`fn` over `calls` in the transfer pool; the first error is raised once all have ended
        (none may still be writing into a caller's buffer after we return)."""
        if len(calls) == 1:
            return [fn(*calls[0])]
        futures = [self._submit(fn, *call) for call in calls]
        wait(futures)
        return [f.result() for f in futures]

    def _key(self, key: str, *, allow_empty: bool = False) -> str:
        key = check_key(key, allow_empty=allow_empty)
        if self.prefix:
            return f"{self.prefix}/{key}" if key else self.prefix
        return key

    def _folder(self, prefix: str) -> str:
        full = self._key(prefix, allow_empty=True)
        return f"{full}/" if full else ""

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1 :] if self.prefix else full_key

    def local_path(self, key: str) -> Path | None:
        check_key(key)
        return None

    # ---- writes ----------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data))

    def open_write(self, key: str) -> WriteStream:
        return self._upload(self._key(key), self.part_size)

    def _upload(self, full: str, part_size: int) -> MultipartWriteStream:
        """A streamed upload of `full` in parts of `part_size`, through this storage's pool and
        part buffers (s3_multipart.py)."""
        return MultipartWriteStream(
            self._client, self.bucket, full, part_size, self._buffers, self._submit, self.uri
        )

    def put_file(self, local_path: Path, key: str) -> None:
        path = Path(local_path)
        size = path.stat().st_size
        full = self._key(key)
        if size < self.multipart_threshold:
            with open(path, "rb") as f:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=f)
            return
        logger.debug("multipart upload of %s (%d bytes) to %s", path, size, full)
        with open(path, "rb") as f, self._upload(full, part_size_for(size, self.part_size)) as out:
            while chunk := f.read(8 * MiB):
                out.write(chunk)
            if out.size != size:
                raise OSError(f"{path} changed size during upload ({out.size} bytes read, {size} expected)")

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> None:
        batch: list[dict[str, str]] = []

        def flush() -> None:
            if not batch:
                return
            resp = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise OSError(
                    f"S3 refused to delete {len(errors)} object(s) under {self.uri}/{prefix}: "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )
            batch.clear()

        for full, _size in self._iter_objects(self._folder(prefix)):
            batch.append({"Key": full})
            if len(batch) >= self.delete_batch:
                flush()
        flush()

    # ---- reads -----------------------------------------------------------------------------------

    def _iter_objects(self, folder: str) -> Iterator[tuple[str, int]]:
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=folder, PaginationConfig={"PageSize": self.list_page_size}
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"], int(obj["Size"])

    def list(self, prefix: str) -> list[str]:
        return sorted(self._rel(k) for k, _size in self._iter_objects(self._folder(prefix)))

    def sizes(self, prefix: str) -> dict[str, int]:
        return {self._rel(k): size for k, size in self._iter_objects(self._folder(prefix))}

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as err:
            if _is_not_found(err):
                return False
            raise
        return True

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
        except ClientError as err:
            if _is_not_found(err):
                raise FileNotFoundError(f"{key!r} not found in {self.uri}") from None
            raise
        return resp["Body"].read()

    def read_into(self, key: str, offset: int, buffers: Sequence[Buffer]) -> None:
        views = byte_views(buffers)
        total = sum(len(v) for v in views)
        if total == 0:
            if not self.exists(key):
                raise FileNotFoundError(f"{key!r} not found in {self.uri}")
            return
        full, step = self._key(key), self.part_size
        calls = [
            (full, key, offset + start, byte_window(views, start, min(step, total - start)))
            for start in range(0, total, step)
        ]
        self._run_all(self._get_range_into, calls)

    def _get_range_into(self, full: str, key: str, start: int, views: list[memoryview]) -> None:
        """One ranged GET into `views`, retrying a body stream that breaks mid-read (botocore
        retries failed requests, not a response body that dies after the headers came)."""
        from botocore.exceptions import (
            ClientError,
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        length = sum(len(v) for v in views)
        end = start + length - 1
        for attempt in range(3):
            try:
                with self._gets:
                    try:
                        resp = self._client.get_object(
                            Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end}"
                        )
                    except ClientError as err:
                        if _is_not_found(err):
                            raise FileNotFoundError(f"{key!r} not found in {self.uri}") from None
                        if _is_bad_range(err):
                            raise EOFError(f"{key!r} in {self.uri} ends before byte {start}") from None
                        raise
                    filler = _Filler(views)
                    for chunk in resp["Body"].iter_chunks(MiB):
                        filler.put(chunk)
                if filler.filled < length:
                    raise EOFError(
                        f"{key!r} in {self.uri} ends at byte {start + filler.filled}, before byte {end + 1}"
                    )
                return
            except (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError):
                if attempt == 2:
                    raise
                logger.warning("S3 read of %s/%s broke off; retrying", self.uri, key)

    def get_file(self, key: str, local_path: Path) -> None:
        from botocore.exceptions import ClientError

        full = self._key(key)
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=full)
        except ClientError as err:
            if _is_not_found(err):
                raise FileNotFoundError(f"{key!r} not found in {self.uri}") from None
            raise
        size, etag = int(head["ContentLength"]), head["ETag"]
        dest = Path(local_path)
        with atomic_target(dest) as tmp:
            if size < self.multipart_threshold:
                with open(tmp, "wb") as f:
                    self._read_range(full, etag, f, None)
            else:
                self._ranged_download(full, etag, size, tmp)
            got = tmp.stat().st_size
            if got != size:
                raise OSError(f"download of {self.uri}/{key} got {got} bytes, expected {size}")

    def _read_range(self, full: str, etag: str, out: IO[bytes], byte_range: tuple[int, int] | None) -> None:
        """GET (a range of) an object into `out`, retrying a body stream that breaks mid-read.

        IfMatch pins every request to the ETag seen first: a concurrent overwrite fails loudly.
        """
        from botocore.exceptions import (
            ConnectionClosedError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )

        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full, "IfMatch": etag}
        if byte_range is not None:
            kwargs["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
        start = out.tell()
        for attempt in range(3):
            try:
                body = self._client.get_object(**kwargs)["Body"]
                for chunk in body.iter_chunks(MiB):
                    out.write(chunk)
                return
            except (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError):
                if attempt == 2:
                    raise
                logger.warning("S3 read of %s/%s broke off; retrying", self.uri, self._rel(full))
                out.seek(start)
                out.truncate()

    def _ranged_download(self, full: str, etag: str, size: int, tmp: Path) -> None:
        part = self.part_size
        ranges = [(off, min(off + part, size) - 1) for off in range(0, size, part)]
        with open(tmp, "r+b") as f:
            f.truncate(size)

        def fetch(byte_range: tuple[int, int]) -> None:
            with open(tmp, "r+b") as f:
                f.seek(byte_range[0])
                self._read_range(full, etag, f, byte_range)
                if f.tell() != byte_range[1] + 1:
                    raise OSError(f"ranged GET of {full} bytes {byte_range} came back short")

        self._run_all(fetch, [(r,) for r in ranges])
