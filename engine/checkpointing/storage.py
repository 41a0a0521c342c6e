"""Where checkpoint files live: a local directory or an S3 bucket, behind one small interface.

`torch.distributed.checkpoint` (DCP) writes each rank's shard files into a local directory; this
module publishes those files and fetches them back. DCP's own `FileSystemWriter` only knows POSIX
paths and fsspec's S3 layer would add a dependency without giving us what a training job needs
from object storage, so the few operations the commit protocol (`commit.py`) uses are written here:

- Keys are '/'-separated strings relative to the storage root (`"job/iter_0000010/__0_0.distcp"`).
  `list` and `delete_prefix` treat the prefix as a folder: `"job"` covers `"job/..."` but never
  `"job2/..."`, so deleting one job's checkpoints cannot touch a sibling job's.
- Every write is all-or-nothing as seen by a reader. Locally: write a temp file in the same
  directory, fsync, `os.replace`, fsync the directory. On S3 a PUT (single or multipart) only
  becomes visible when complete. This is what lets `commit.py` publish a manifest last and have
  readers trust that a visible manifest means a complete checkpoint.
- A missing key raises `FileNotFoundError` on both backends.
- S3: the client comes from boto3's standard chain (env, config files, instance roles;
  `AWS_ENDPOINT_URL` for S3-compatible stores) with explicit overrides; botocore retries
  throttling and 5xx with backoff (adaptive mode by default: it also rate-limits the client when
  many ranks hit one prefix). Large files go up as multipart uploads with parts sent in parallel
  and come down as parallel ranged GETs pinned to the object's ETag, so a file replaced mid-read
  fails instead of mixing two versions. Credentials are never logged or put in `repr`/`uri`.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote, urlsplit

logger = logging.getLogger(__name__)

MiB = 1024 * 1024
_TMP_PREFIX = ".elastron-tmp-"
_S3_MIN_PART = 5 * MiB  # S3 rejects non-final multipart parts below this
_S3_MAX_PARTS = 10_000


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Normalise a key ('/'-separated, relative); refuse ones that could escape the root."""
    if not isinstance(key, str):
        raise TypeError(f"storage key must be a str, got {type(key).__name__}")
    stripped = key.strip("/")
    if not stripped:
        if allow_empty:
            return ""
        raise ValueError(f"empty storage key {key!r}")
    parts = stripped.split("/")
    bad = [p for p in parts if p in ("", ".", "..") or "\\" in p or "\0" in p]
    if bad:
        raise ValueError(f"invalid storage key {key!r}: segments must be non-empty and not '.' or '..'")
    return stripped


class Storage(abc.ABC):
    """A flat key space of immutable-once-written blobs, as the checkpoint commit protocol needs it."""

    uri: str

    @abc.abstractmethod
    def put_file(self, local_path: Path, key: str) -> None:
        """Upload a local file to `key`, atomically (readers see the old object or the whole new one)."""

    @abc.abstractmethod
    def get_file(self, key: str, local_path: Path) -> None:
        """Download `key` to `local_path` (parent folders created), atomically."""

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write `data` to `key`, atomically."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Read the whole of `key`; FileNotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored at exactly `key`."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys under the folder `prefix` ("" = everything), recursively, sorted, as full keys."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object at `key`; no error if it is absent."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under the folder `prefix` ("" = everything under this storage's root)."""

    @abc.abstractmethod
    def local_path(self, key: str) -> Path | None:
        """Where `key` lives on this machine's file system, or None for remote storage."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


# --------------------------------------------------------------------------------------------------
# Local directory
# --------------------------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _atomic_target(dest: Path) -> Iterator[Path]:
    """Yield a temp path next to `dest`; on success fsync it and rename it over `dest`.

    The temp file sits in the destination directory so `os.replace` is a same-file-system rename
    (atomic); it is created with mode 0o666 so the umask applies as for any other new file.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(dest.parent)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class LocalStorage(Storage):
    """Keys are files under `root`. Also the right backend for a shared file system (NFS, Lustre)."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = self.root.as_uri()

    def _path(self, key: str, *, allow_empty: bool = False) -> Path:
        key = check_key(key, allow_empty=allow_empty)
        return self.root / key if key else self.root

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def put_file(self, local_path: Path, key: str) -> None:
        src, dest = Path(local_path), self._path(key)
        if not src.is_file():
            raise FileNotFoundError(f"cannot upload {src}: not a file")
        if _same_file(src, dest):  # DCP wrote straight into the storage folder: nothing to do
            return
        with _atomic_target(dest) as tmp:
            shutil.copyfile(src, tmp)

    def get_file(self, key: str, local_path: Path) -> None:
        src, dest = self._path(key), Path(local_path)
        if not src.is_file():
            raise FileNotFoundError(f"{key!r} not found in {self.uri}")
        if _same_file(src, dest):
            return
        with _atomic_target(dest) as tmp:
            shutil.copyfile(src, tmp)

    def put_bytes(self, key: str, data: bytes) -> None:
        with _atomic_target(self._path(key)) as tmp:
            tmp.write_bytes(data)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise FileNotFoundError(f"{key!r} not found in {self.uri}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix, allow_empty=True)
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _dirnames, filenames in os.walk(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(_TMP_PREFIX):  # a write in progress (or a crashed one's debris)
                    continue
                keys.append(name if rel == "." else f"{rel}/{name}")
        return sorted(keys)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def delete_prefix(self, prefix: str) -> None:
        base = self._path(prefix, allow_empty=True)
        if not base.is_dir():
            return
        if base == self.root:  # keep the root folder itself
            for child in base.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(base)


# --------------------------------------------------------------------------------------------------
# S3 (and S3-compatible stores)
# --------------------------------------------------------------------------------------------------


def _is_not_found(err: Exception) -> bool:
    response = getattr(err, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("404", "NoSuchKey", "NotFound") or status == 404


class S3Storage(Storage):
    """Keys are objects under `s3://bucket/prefix/`.

    `part_size`: multipart part size (also the ranged-GET chunk); files of at least
    `multipart_threshold` bytes (default: `part_size`) use multipart upload / parallel ranged GETs,
    with up to `max_workers` requests in flight per file. `retry_mode` / `max_attempts` default to
    `AWS_RETRY_MODE` / `AWS_MAX_ATTEMPTS` when set, else adaptive / 10.
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
        if part_size < _S3_MIN_PART:
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
        self.retry_mode = retry_mode or os.environ.get("AWS_RETRY_MODE") or "adaptive"
        self.max_attempts = max_attempts or int(os.environ.get("AWS_MAX_ATTEMPTS") or 10)
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = self._make_client()

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

    # A boto3 client does not pickle; rebuild it on the other side (Ray actors, spawn workers).
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_client", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client = self._make_client()

    @property
    def client(self) -> Any:
        """The boto3 S3 client (thread-safe; shared by this storage's worker threads)."""
        return self._client

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

    def put_file(self, local_path: Path, key: str) -> None:
        path = Path(local_path)
        size = path.stat().st_size
        full = self._key(key)
        if size < self.multipart_threshold:
            with open(path, "rb") as f:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=f)
            return
        self._multipart_upload(path, size, full)

    def _part_size_for(self, size: int) -> int:
        part = self.part_size
        while -(-size // part) > _S3_MAX_PARTS:  # keep within S3's 10,000-part limit
            part *= 2
        return part

    def _multipart_upload(self, path: Path, size: int, full: str) -> None:
        part = self._part_size_for(size)
        ranges = [(n + 1, off, min(part, size - off)) for n, off in enumerate(range(0, size, part))]
        upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
        logger.debug("multipart upload of %s (%d bytes, %d parts) to %s", path, size, len(ranges), full)

        def upload(number: int, offset: int, length: int) -> dict[str, Any]:
            with open(path, "rb") as f:
                f.seek(offset)
                body = f.read(length)
            if len(body) != length:
                raise OSError(f"{path} changed size during upload")
            resp = self._client.upload_part(
                Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=body
            )
            entry = {"PartNumber": number, "ETag": resp["ETag"]}
            # botocore adds a CRC checksum to each part by default; CompleteMultipartUpload must
            # then repeat it, as boto3's own transfer manager does.
            entry.update({k: v for k, v in resp.items() if k.startswith("Checksum") and k != "ChecksumType"})
            return entry

        try:
            with ThreadPoolExecutor(max_workers=min(self.max_workers, len(ranges))) as pool:
                parts = list(pool.map(lambda r: upload(*r), ranges))
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            raise

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

        for full in self._iter_keys(self._folder(prefix)):
            batch.append({"Key": full})
            if len(batch) >= self.delete_batch:
                flush()
        flush()

    # ---- reads -----------------------------------------------------------------------------------

    def _iter_keys(self, folder: str) -> Iterator[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket, Prefix=folder, PaginationConfig={"PageSize": self.list_page_size}
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield obj["Key"]

    def list(self, prefix: str) -> list[str]:
        return sorted(self._rel(k) for k in self._iter_keys(self._folder(prefix)))

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
        with _atomic_target(dest) as tmp:
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

        botocore retries failed requests, not a response body that dies after the headers came.
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

        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(ranges))) as pool:
            list(pool.map(fetch, ranges))


# --------------------------------------------------------------------------------------------------


def _redact(uri: str) -> str:
    """The URI with any user:password@ part masked, fit for an error message."""
    scheme, sep, rest = uri.partition("://")
    authority, slash, path = rest.partition("/")
    if sep and "@" in authority:
        return f"{scheme}://***@{authority.rsplit('@', 1)[1]}{slash}{path}"
    return uri


def open_storage(uri: str, *, endpoint_url: str | None = None, region: str | None = None) -> Storage:
    """A plain path or file:// URI -> LocalStorage; s3://bucket[/prefix] -> S3Storage.

    S3 credentials come from boto3's chain (env, config files, roles), never from the URI.
    """
    accepted = "accepted forms: a local path, file:///abs/path (or file://rel/path), s3://bucket[/prefix]"
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"checkpoint storage URI {uri!r} is empty; {accepted}")
    if "://" not in uri:
        return LocalStorage(Path(uri))
    shown = _redact(uri)
    scheme = uri.split("://", 1)[0].lower()
    if scheme == "file":
        rest = unquote(uri[len("file://") :])
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest:
            raise ValueError(f"checkpoint storage URI {uri!r} has no path; {accepted}")
        return LocalStorage(Path(rest))
    if scheme == "s3":
        parts = urlsplit(uri)
        if "@" in parts.netloc:
            raise ValueError(
                f"checkpoint storage URI {shown!r} carries credentials; give them through the AWS "
                f"environment or config files instead; {accepted}"
            )
        if not parts.netloc:
            raise ValueError(f"checkpoint storage URI {shown!r} has no bucket; {accepted}")
        if parts.query or parts.fragment:
            raise ValueError(
                f"checkpoint storage URI {shown!r} must not have a query or fragment; {accepted}"
            )
        return S3Storage(parts.netloc, parts.path.strip("/"), endpoint_url=endpoint_url, region=region)
    raise ValueError(f"unsupported checkpoint storage URI {shown!r}; {accepted}")
