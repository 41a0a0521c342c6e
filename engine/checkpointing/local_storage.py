"""A checkpoint storage on a file system: a local disk, or a shared one (NFS, Lustre).

Every write is all-or-nothing as seen by a reader: a temp file in the destination directory,
fsync, `os.replace`, fsync of the directory. Temp files carry a prefix that listings skip, so a
crashed write's debris never looks like a shard.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from engine.checkpointing.storage import Buffer, Storage, WriteStream, byte_views, byte_window, check_key

_TMP_PREFIX = ".elastron-tmp-"
_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)


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
def atomic_target(dest: Path) -> Iterator[Path]:
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


class _LocalWriteStream(WriteStream):
    """A temp file next to the destination; commit = fsync + rename, as for every local write."""

    def __init__(self, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._dest = dest
        self._tmp = dest.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        self._file = open(self._tmp, "xb")  # noqa: SIM115 - closed by commit / abort
        self.size = 0

    def write(self, data: Buffer) -> None:
        view = memoryview(data)
        self._file.write(view)
        self.size += view.nbytes

    def commit(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._dest)
        except BaseException:
            self.abort()
            raise
        _fsync_dir(self._dest.parent)

    def abort(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


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
        with atomic_target(dest) as tmp:
            shutil.copyfile(src, tmp)

    def get_file(self, key: str, local_path: Path) -> None:
        src, dest = self._path(key), Path(local_path)
        if not src.is_file():
            raise FileNotFoundError(f"{key!r} not found in {self.uri}")
        if _same_file(src, dest):
            return
        with atomic_target(dest) as tmp:
            shutil.copyfile(src, tmp)

    def put_bytes(self, key: str, data: bytes) -> None:
        with atomic_target(self._path(key)) as tmp:
            tmp.write_bytes(data)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise FileNotFoundError(f"{key!r} not found in {self.uri}") from None

    def open_write(self, key: str) -> WriteStream:
        return _LocalWriteStream(self._path(key))

    def read_into(self, key: str, offset: int, buffers: Sequence[Buffer]) -> None:
        views = byte_views(buffers)
        total = sum(len(v) for v in views)
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"{key!r} not found in {self.uri}") from None
        try:
            done = 0
            while done < total:  # one syscall per run of buffers, straight into them
                got = os.preadv(fd, byte_window(views, done, total - done)[:_IOV_MAX], offset + done)
                if got == 0:
                    raise EOFError(
                        f"{key!r} in {self.uri} ends at byte {offset + done}, before byte {offset + total}"
                    )
                done += got
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _walk(self, prefix: str) -> Iterator[tuple[str, str]]:
        """(key, path) of every file under the folder `prefix`, writes in progress left out."""
        base = self._path(prefix, allow_empty=True)
        if not base.is_dir():
            return
        for dirpath, _dirnames, filenames in os.walk(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith(_TMP_PREFIX):  # a write in progress (or a crashed one's debris)
                    continue
                yield (name if rel == "." else f"{rel}/{name}"), os.path.join(dirpath, name)

    def list(self, prefix: str) -> list[str]:
        return sorted(key for key, _path in self._walk(prefix))

    def sizes(self, prefix: str) -> dict[str, int]:
        out = {}
        for key, path in self._walk(prefix):
            with contextlib.suppress(FileNotFoundError):  # deleted since the walk saw it
                out[key] = os.stat(path).st_size
        return out

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
