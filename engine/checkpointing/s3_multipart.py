"""Streamed multipart uploads to S3: a checkpoint shard goes up in parts while it is being written.

A shard is written front to back from memory (`Storage.open_write`) and can be many GiB: held whole
before one PUT it would cost its size in memory and send nothing until the end. So the stream is
cut into parts, and each full part goes up (a multipart upload, in the S3 storage's transfer pool)
while the writer fills the next; an object smaller than one part is a single PUT. Either way the
object only becomes visible when the upload completes, the all-or-nothing write the commit protocol
needs, and an upload that fails is aborted so that no parts linger in the bucket.

The part buffers are reused and capped in number per storage (`PartBuffers`): that cap, not the
size of the objects, bounds the memory of the uploads in flight. `S3Storage` (`s3_storage.py`)
owns the client, the pool and the buffers, and opens these streams for `open_write` and for the
`put_file` of a large file.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from engine.checkpointing.storage import Buffer, MiB, WriteStream

S3_MIN_PART = 5 * MiB  # S3 rejects non-final multipart parts below this
S3_MAX_PARTS = 10_000


def part_size_for(size: int, part_size: int) -> int:
    """The part size for an object of `size` bytes: `part_size`, doubled until the object fits in
    S3's 10,000 parts."""
    part = part_size
    while -(-size // part) > S3_MAX_PARTS:
        part *= 2
    return part


class PartBuffers:
    """Part-sized buffers for streamed uploads, shared by one storage's uploads.

    Reused rather than allocated per part (writing into fresh pages costs more than the copy
    itself) and capped in number, which is what bounds the memory of uploads in flight: a writer
    that finds none free waits for a part to finish going up. Dropped when no upload is open.
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._free: list[bytearray] = []
        self._out = 0  # handed out, not yet given back
        self._uploads = 0  # streams open
        self._cond = threading.Condition()

    def opened(self) -> None:
        with self._cond:
            self._uploads += 1

    def closed(self) -> None:
        with self._cond:
            self._uploads -= 1
            if self._uploads == 0:
                self._free.clear()

    def take(self, size: int) -> bytearray:
        with self._cond:
            while self._out >= self._count:
                self._cond.wait()
            self._out += 1
            for i, buf in enumerate(self._free):
                if len(buf) == size:
                    return self._free.pop(i)
            if self._free and self._out + len(self._free) > self._count:
                self._free.pop()  # one of another part size: let it go, stay within the cap
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        with self._cond:
            self._out -= 1
            if self._uploads > 0:
                self._free.append(buf)
            self._cond.notify()


class MultipartWriteStream(WriteStream):
    """Bytes written are cut into parts; each full part goes up (multipart upload, through
    `submit`: the storage's transfer pool) while the writer fills the next. An object smaller than
    a part is one PUT. `where` names the storage in errors (its URI)."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        full: str,
        part_size: int,
        buffers: PartBuffers,
        submit: Callable[..., Future],
        where: str,
    ) -> None:
        self._client, self._bucket, self._full, self._part_size = client, bucket, full, part_size
        self._buffers, self._submit, self._where = buffers, submit, where
        self._buf: bytearray | None = None
        self._fill = 0
        self._upload_id: str | None = None
        self._parts: list[Future] = []
        self._error: BaseException | None = None
        self._closed = False
        self.size = 0
        buffers.opened()

    def write(self, data: Buffer) -> None:
        if self._error is not None:  # a part already failed: stop feeding the upload
            raise self._error
        view = memoryview(data).cast("B")
        while len(view):
            if self._buf is None:
                self._buf, self._fill = self._buffers.take(self._part_size), 0
            n = min(len(view), self._part_size - self._fill)
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill += n
            self.size += n
            view = view[n:]
            if self._fill == self._part_size:
                self._send()

    def _send(self) -> None:
        """Hand the current buffer to the transfer pool as the next part."""
        if self._upload_id is None:
            created = self._client.create_multipart_upload(Bucket=self._bucket, Key=self._full)
            self._upload_id = created["UploadId"]
        number = len(self._parts) + 1
        if number > S3_MAX_PARTS:
            raise ValueError(
                f"{self._where}: {self._full} needs more than {S3_MAX_PARTS} parts of {self._part_size} "
                f"bytes; give the storage a larger part_size"
            )
        buf, n = self._buf, self._fill
        self._buf, self._fill = None, 0
        self._parts.append(self._submit(self._upload_part, number, buf, n))

    def _upload_part(self, number: int, buf: bytearray, n: int) -> dict[str, Any]:
        try:
            body = buf if n == len(buf) else bytes(memoryview(buf)[:n])
            resp = self._client.upload_part(
                Bucket=self._bucket, Key=self._full, UploadId=self._upload_id, PartNumber=number, Body=body
            )
        except BaseException as err:
            self._error = self._error or err
            raise
        finally:
            self._buffers.give(buf)
        entry = {"PartNumber": number, "ETag": resp["ETag"]}
        # botocore adds a CRC checksum to each part by default; CompleteMultipartUpload must
        # then repeat it, as boto3's own transfer manager does.
        entry.update({k: v for k, v in resp.items() if k.startswith("Checksum") and k != "ChecksumType"})
        return entry

    def commit(self) -> None:
        if self._closed:
            raise ValueError(f"upload of {self._full} is already closed")
        try:
            if self._upload_id is None:
                body = b""
                if self._buf is not None:
                    body = bytes(memoryview(self._buf)[: self._fill])
                    self._buffers.give(self._buf)
                    self._buf = None
                self._client.put_object(Bucket=self._bucket, Key=self._full, Body=body)
            else:
                if self._buf is not None:
                    self._send()
                wait(self._parts)
                parts = [f.result() for f in self._parts]
                self._client.complete_multipart_upload(
                    Bucket=self._bucket,
                    Key=self._full,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._buffers.closed()

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._buf is not None:
            self._buffers.give(self._buf)
            self._buf = None
        wait(self._parts)  # no part may still be sending from a buffer once we return
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=self._full, UploadId=self._upload_id
                )
        self._buffers.closed()
