"""Checkpoint storage backends (local directory, S3 on a real moto server), the commit protocol,
and the shard writer/reader that move DCP's bytes through them.

Every test that is not about one backend runs on both: the commit protocol must behave the same
whether the job checkpoints to a laptop's disk or to a bucket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from engine.checkpointing import commit as ckpt
from engine.checkpointing import raw_io
from engine.checkpointing.backends import open_storage
from engine.checkpointing.commit import (
    CheckpointCorruptError,
    FileEntry,
    ShardCorruptError,
    apply_retention,
    checksum_file,
    commit_checkpoint,
    committed_iterations,
    corrupt_error,
    fetch_checkpoint,
    iteration_key,
    latest_checkpoint,
    open_checkpoint,
    read_manifest,
    resolve_checkpoint,
    sha256_file,
)
from engine.checkpointing.local_storage import LocalStorage
from engine.checkpointing.s3_storage import S3Storage
from engine.checkpointing.storage import MiB, Storage

JOB = "myjob"

# DCP warns when it saves or loads without a process group, as these tests do on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return LocalStorage(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    # A prefix inside the bucket, and small parts, so multipart and ranged GETs run on small files.
    return S3Storage(bucket, "ckpt/root", part_size=5 * MiB, max_workers=4)


def _make_files(directory: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)


def _save(
    storage: Storage,
    tmp_path: Path,
    iteration: int,
    *,
    job_root: str = JOB,
    commit: bool = True,
    keep: int | None = None,
    files: dict[str, bytes] | None = None,
) -> list[FileEntry]:
    """What a caller does: DCP writes locally, each file is uploaded, then one rank commits."""
    files = files or {
        "__0_0.distcp": f"rank0 shard of {iteration}".encode() * 50,
        "__1_0.distcp": f"rank1 shard of {iteration}".encode() * 70,
        ".metadata": f"metadata {iteration}".encode(),
    }
    local = tmp_path / "dcp" / f"{job_root or 'root'}-{iteration}"
    _make_files(local, files)
    entries = []
    for name in files:
        storage.put_file(local / name, f"{iteration_key(job_root, iteration)}/{name}")
        entries.append(checksum_file(local / name, name, chunk_size=MiB))  # several chunks per big file
    if commit:
        commit_checkpoint(storage, job_root, iteration, entries, {"step": iteration}, keep=keep)
    return entries


# ------------------------------------------------------------------------------------------------
# Storage
# ------------------------------------------------------------------------------------------------


def test_bytes_roundtrip_exists_and_missing_keys(storage: Storage, tmp_path: Path):
    storage.put_bytes("a/b/c.bin", b"\x00hello\xff")
    assert storage.get_bytes("a/b/c.bin") == b"\x00hello\xff"
    assert storage.exists("a/b/c.bin")
    assert not storage.exists("a/b/nope")
    assert not storage.exists("a/b")  # a folder is not an object
    storage.put_bytes("a/b/c.bin", b"new")  # overwrite
    assert storage.get_bytes("a/b/c.bin") == b"new"
    with pytest.raises(FileNotFoundError, match="nope"):
        storage.get_bytes("a/nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        storage.get_file("a/nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_file_roundtrip_creates_parent_folders(storage: Storage, tmp_path: Path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1000))
    storage.put_file(src, "x/y/z.bin")
    dest = tmp_path / "deep" / "down" / "z.bin"
    storage.get_file("x/y/z.bin", dest)
    assert dest.read_bytes() == src.read_bytes()
    src.write_bytes(b"second version")
    storage.put_file(src, "x/y/z.bin")
    storage.get_file("x/y/z.bin", dest)
    assert dest.read_bytes() == b"second version"


def test_large_file_roundtrip(storage: Storage, tmp_path: Path):
    """~12 MiB with 5 MiB parts: three multipart parts up, three ranged GETs down on S3."""
    src = tmp_path / "big.bin"
    data = os.urandom(12 * MiB + 12345)
    src.write_bytes(data)
    storage.put_file(src, "big/shard.distcp")
    dest = tmp_path / "back.bin"
    storage.get_file("big/shard.distcp", dest)
    assert dest.stat().st_size == len(data)
    assert dest.read_bytes() == data


def test_s3_large_files_use_multipart_and_ranged_gets(s3_bucket: str, tmp_path: Path):
    storage = S3Storage(s3_bucket, "p", part_size=5 * MiB, max_workers=3)
    ranges: list[str] = []
    parts: list[int] = []
    events = storage.client.meta.events
    events.register(
        "provide-client-params.s3.GetObject", lambda params, **_: ranges.append(params.get("Range"))
    )
    events.register(
        "provide-client-params.s3.UploadPart", lambda params, **_: parts.append(params["PartNumber"])
    )
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 * MiB + 1))
    storage.put_file(src, "big.bin")
    assert sorted(parts) == [1, 2, 3]
    etag = storage.client.head_object(Bucket=s3_bucket, Key="p/big.bin")["ETag"]
    assert etag.strip('"').endswith("-3"), etag  # S3's multipart ETag form
    storage.get_file("big.bin", tmp_path / "back.bin")
    assert sorted(ranges) == [
        f"bytes=0-{5 * MiB - 1}",
        f"bytes={10 * MiB}-{12 * MiB}",
        f"bytes={5 * MiB}-{10 * MiB - 1}",
    ]
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()

    # below the threshold: one PUT, one plain GET
    parts.clear()
    ranges.clear()
    small = tmp_path / "small.bin"
    small.write_bytes(b"s" * 1000)
    storage.put_file(small, "small.bin")
    storage.get_file("small.bin", tmp_path / "small.back")
    assert parts == [] and ranges == [None]
    assert (tmp_path / "small.back").read_bytes() == b"s" * 1000


def test_list_and_delete_prefix_treat_the_prefix_as_a_folder(storage: Storage):
    for key in ("a/x", "a/b/y", "ab/z", "c"):
        storage.put_bytes(key, key.encode())
    assert storage.list("") == ["a/b/y", "a/x", "ab/z", "c"]
    assert storage.list("a") == ["a/b/y", "a/x"]
    assert storage.list("a/") == ["a/b/y", "a/x"]
    assert storage.list("a/b") == ["a/b/y"]
    assert storage.list("missing") == []
    storage.delete_prefix("a")
    assert storage.list("") == ["ab/z", "c"]  # "ab" is not under "a"
    storage.delete("c")
    storage.delete("c")  # absent: no error
    assert storage.list("") == ["ab/z"]
    storage.delete_prefix("")
    assert storage.list("") == []


def test_s3_list_pages_and_delete_prefix_batches(s3_bucket: str):
    storage = S3Storage(s3_bucket, "")
    storage.list_page_size, storage.delete_batch = 3, 4  # as with >1000 keys, on 10
    lists: list[int] = []
    deletes: list[int] = []
    events = storage.client.meta.events
    events.register("provide-client-params.s3.ListObjectsV2", lambda params, **_: lists.append(1))
    events.register(
        "provide-client-params.s3.DeleteObjects",
        lambda params, **_: deletes.append(len(params["Delete"]["Objects"])),
    )
    keys = [f"many/{i:02d}" for i in range(10)]
    for key in keys:
        storage.put_bytes(key, b"")
    storage.put_bytes("other/keep", b"")
    assert storage.list("many") == keys
    assert len(lists) == 4  # 3 + 3 + 3 + 1
    storage.delete_prefix("many")
    assert deletes == [4, 4, 2]
    assert storage.list("") == ["other/keep"]


def test_keys_cannot_escape_the_root(storage: Storage):
    for bad in ("../x", "a/../../x", "a//b", "", "./a"):
        with pytest.raises(ValueError):
            storage.put_bytes(bad, b"x")


def test_local_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    storage = LocalStorage(tmp_path / "store")
    storage.put_bytes("d/k", b"old")
    src = tmp_path / "src"
    src.write_bytes(b"new")

    def crash(*_args, **_kwargs):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr("engine.checkpointing.local_storage.os.replace", crash)
    with pytest.raises(OSError, match="simulated"):
        storage.put_bytes("d/k", b"new")
    with pytest.raises(OSError, match="simulated"):
        storage.put_file(src, "d/k")
    with pytest.raises(OSError, match="simulated"), storage.open_write("d/k") as out:
        out.write(b"new")
    monkeypatch.undo()
    assert storage.get_bytes("d/k") == b"old"
    assert os.listdir(tmp_path / "store" / "d") == ["k"]  # no temp file left behind

    # a temp file of a write in progress (or of a crash) is never listed as a key
    (tmp_path / "store" / "d" / ".elastron-tmp-deadbeef").write_bytes(b"partial")
    assert storage.list("d") == ["d/k"]


def test_local_put_of_a_file_already_in_place_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    storage = LocalStorage(tmp_path / "store")
    target = storage.local_path("job/iter_0000001/__0_0.distcp")
    assert target == tmp_path / "store" / "job" / "iter_0000001" / "__0_0.distcp"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"written by DCP in place")
    inode = target.stat().st_ino

    def no_copy(*_args, **_kwargs):
        raise AssertionError("copied a file onto itself")

    monkeypatch.setattr("engine.checkpointing.local_storage.shutil.copyfile", no_copy)
    storage.put_file(target, "job/iter_0000001/__0_0.distcp")
    storage.get_file("job/iter_0000001/__0_0.distcp", target)
    assert target.stat().st_ino == inode
    assert target.read_bytes() == b"written by DCP in place"


def test_s3_storage_pickles(s3_bucket: str):
    storage = S3Storage(s3_bucket, "pre")
    storage.put_bytes("k", b"v")
    clone = pickle.loads(pickle.dumps(storage))
    assert clone.get_bytes("k") == b"v"
    assert clone.uri == f"s3://{s3_bucket}/pre"
    assert storage.local_path("k") is None


def test_open_storage_parses_uris(tmp_path: Path, s3_env: str, monkeypatch: pytest.MonkeyPatch):
    local = open_storage(str(tmp_path / "ck"))
    assert isinstance(local, LocalStorage) and local.root == tmp_path / "ck"
    assert open_storage(f"file://{tmp_path}/ck").root == tmp_path / "ck"
    assert open_storage(local.uri).root == tmp_path / "ck"  # uri round-trips
    monkeypatch.chdir(tmp_path)
    assert open_storage("rel/dir").root == tmp_path / "rel" / "dir"
    assert open_storage("file://rel/dir").root == tmp_path / "rel" / "dir"

    s3 = open_storage("s3://my-bucket/some/prefix/", region="eu-west-1", endpoint_url=s3_env)
    assert isinstance(s3, S3Storage)
    assert (s3.bucket, s3.prefix, s3.uri) == ("my-bucket", "some/prefix", "s3://my-bucket/some/prefix")
    assert s3.client.meta.region_name == "eu-west-1"
    assert s3.client.meta.endpoint_url == s3_env
    bare = open_storage("s3://my-bucket")
    assert (bare.bucket, bare.prefix, bare.uri) == ("my-bucket", "", "s3://my-bucket")
    assert bare.client.meta.endpoint_url == s3_env  # AWS_ENDPOINT_URL from the standard chain
    assert open_storage(s3.uri).prefix == "some/prefix"


@pytest.mark.parametrize("uri", ["gs://bucket/x", "http://host/x", "s3://", "s3:///x", "", "  "])
def test_open_storage_rejects_other_uris(uri: str):
    with pytest.raises(ValueError) as err:
        open_storage(uri)
    message = str(err.value)
    assert repr(uri) in message
    assert "s3://bucket" in message and "file://" in message


def test_open_storage_never_echoes_credentials():
    with pytest.raises(ValueError) as err:
        open_storage("s3://AKIAXXX:topsecret@bucket/x")
    assert "topsecret" not in str(err.value) and "AKIAXXX" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# Commit protocol
# ------------------------------------------------------------------------------------------------


def test_iteration_key():
    assert iteration_key("myjob", 10) == "myjob/iter_0000010"
    assert iteration_key("", 5) == "iter_0000005"
    assert iteration_key("a/b", 12345678) == "a/b/iter_12345678"
    with pytest.raises(ValueError):
        iteration_key("myjob", -1)


def test_sha256_file_streams(tmp_path: Path):
    p = tmp_path / "f"
    data = os.urandom(3 * 1024 * 1024 + 7)
    p.write_bytes(data)
    assert sha256_file(p) == hashlib.sha256(data).hexdigest()
    assert ckpt.sha256_file(p, chunk_size=4096) == hashlib.sha256(data).hexdigest()


def test_commit_writes_manifest_then_latest(storage: Storage, tmp_path: Path):
    entries = _save(storage, tmp_path, 10)
    manifest = read_manifest(storage, JOB, 10)
    assert manifest["iteration"] == 10
    assert manifest["format_version"] == ckpt.FORMAT_VERSION
    assert manifest["meta"] == {"step": 10}
    assert manifest["files"] == [e.to_json() for e in entries]
    assert all(f["algorithm"] == "crc32" for f in manifest["files"])
    assert storage.get_bytes(f"{JOB}/latest").decode().strip() == "10"
    assert committed_iterations(storage, JOB) == [10]
    assert latest_checkpoint(storage, JOB) == 10
    _save(storage, tmp_path, 20)
    assert committed_iterations(storage, JOB) == [10, 20]
    assert latest_checkpoint(storage, JOB) == 20


class _Recorder(Storage):
    """Wraps a storage; records writes and, at each manifest write, whether the files were there."""

    def __init__(self, inner: Storage, files: list[str]) -> None:
        self.inner, self.files, self.uri = inner, files, inner.uri
        self.writes: list[str] = []
        self.files_present_at_manifest: list[bool] = []

    def put_bytes(self, key, data):
        if key.endswith("manifest.json"):
            self.files_present_at_manifest = [self.inner.exists(f) for f in self.files]
        self.writes.append(key)
        self.inner.put_bytes(key, data)

    def put_file(self, local_path, key):
        self.writes.append(key)
        self.inner.put_file(local_path, key)

    def get_file(self, key, local_path):
        self.inner.get_file(key, local_path)

    def get_bytes(self, key):
        return self.inner.get_bytes(key)

    def exists(self, key):
        return self.inner.exists(key)

    def list(self, prefix):
        return self.inner.list(prefix)

    def delete(self, key):
        self.writes.append(f"delete {key}")
        self.inner.delete(key)

    def delete_prefix(self, prefix):
        self.writes.append(f"delete_prefix {prefix}")
        self.inner.delete_prefix(prefix)

    def local_path(self, key):
        return self.inner.local_path(key)

    def open_write(self, key):
        self.writes.append(key)
        return self.inner.open_write(key)

    def read_into(self, key, offset, buffers):
        self.inner.read_into(key, offset, buffers)

    def sizes(self, prefix):
        return self.inner.sizes(prefix)


def test_manifest_is_written_after_the_files_and_before_latest(storage: Storage, tmp_path: Path):
    entries = _save(storage, tmp_path, 7, commit=False)
    folder = iteration_key(JOB, 7)
    rec = _Recorder(storage, [f"{folder}/{e.name}" for e in entries])
    commit_checkpoint(rec, JOB, 7, entries, {})
    assert rec.writes == [f"{folder}/manifest.json", f"{JOB}/latest"]
    assert rec.files_present_at_manifest == [True, True, True]


def test_commit_with_a_missing_file_publishes_nothing(storage: Storage, tmp_path: Path):
    _save(storage, tmp_path, 5)
    entries = _save(storage, tmp_path, 10, commit=False)
    storage.delete(f"{iteration_key(JOB, 10)}/__1_0.distcp")  # that rank's upload never finished
    with pytest.raises(FileNotFoundError, match="__1_0.distcp"):
        commit_checkpoint(storage, JOB, 10, entries, {})
    assert not storage.exists(f"{iteration_key(JOB, 10)}/manifest.json")
    assert storage.get_bytes(f"{JOB}/latest").decode().strip() == "5"
    assert committed_iterations(storage, JOB) == [5]
    assert latest_checkpoint(storage, JOB) == 5


def test_commit_refuses_bad_file_lists(storage: Storage, tmp_path: Path):
    entries = _save(storage, tmp_path, 3, commit=False)
    with pytest.raises(ValueError, match="duplicate"):
        commit_checkpoint(storage, JOB, 3, entries + entries[:1], {})
    with pytest.raises(ValueError, match="no files"):
        commit_checkpoint(storage, JOB, 3, [], {})
    with pytest.raises(TypeError):
        commit_checkpoint(storage, JOB, 3, entries, {"not json": object()})
    holey = FileEntry(entries[0].name, entries[0].size, entries[0].chunks[:-1])  # a writer bug
    with pytest.raises(ValueError, match="chunks"):
        commit_checkpoint(storage, JOB, 3, [holey, *entries[1:]], {})
    assert committed_iterations(storage, JOB) == []


def test_folders_without_manifest_do_not_count(storage: Storage, tmp_path: Path):
    assert committed_iterations(storage, JOB) == []
    assert latest_checkpoint(storage, JOB) is None
    _save(storage, tmp_path, 10)
    _save(storage, tmp_path, 20, commit=False)  # crashed mid-save
    storage.put_bytes(f"{JOB}/iter_0000030/manifest.json.partial", b"{}")  # a name that only looks close
    storage.put_bytes(f"{JOB}/not_an_iter/manifest.json", b"{}")
    assert committed_iterations(storage, JOB) == [10]
    assert latest_checkpoint(storage, JOB) == 10
    # `latest` naming an uncommitted folder, or holding junk: fall back to the newest committed
    storage.put_bytes(f"{JOB}/latest", b"20\n")
    assert latest_checkpoint(storage, JOB) == 10
    storage.put_bytes(f"{JOB}/latest", b"garbage")
    assert latest_checkpoint(storage, JOB) == 10
    storage.delete(f"{JOB}/latest")
    assert latest_checkpoint(storage, JOB) == 10


def test_jobs_under_one_storage_do_not_see_each_other(storage: Storage, tmp_path: Path):
    _save(storage, tmp_path, 10, job_root="runs/a")
    _save(storage, tmp_path, 20, job_root="runs/ab")
    assert committed_iterations(storage, "runs/a") == [10]
    assert committed_iterations(storage, "runs/ab") == [20]
    assert committed_iterations(storage, "runs") == []  # iter_ folders only directly under the root
    apply_retention(storage, "runs/a", 1)
    assert committed_iterations(storage, "runs/ab") == [20]


def test_retention_keeps_the_newest_k(storage: Storage, tmp_path: Path):
    for it in (10, 20, 30, 40):
        _save(storage, tmp_path, it, keep=2)
    assert committed_iterations(storage, JOB) == [30, 40]
    assert storage.list(iteration_key(JOB, 10)) == [] and storage.list(iteration_key(JOB, 20)) == []
    assert len(storage.list(iteration_key(JOB, 40))) == 4  # 3 files + manifest


def test_retention_never_deletes_the_latest(storage: Storage, tmp_path: Path):
    for it in (10, 20, 30):
        _save(storage, tmp_path, it)
    _save(storage, tmp_path, 5, keep=2)  # e.g. a rerun from an early checkpoint saved again
    assert latest_checkpoint(storage, JOB) == 5
    assert committed_iterations(storage, JOB) == [5, 20, 30]
    apply_retention(storage, JOB, 1)
    assert committed_iterations(storage, JOB) == [5, 30]
    with pytest.raises(ValueError):
        apply_retention(storage, JOB, 0)


def test_retention_deletes_old_debris_but_not_newer_folders(storage: Storage, tmp_path: Path):
    _save(storage, tmp_path, 5, commit=False)  # nothing committed yet: may be in flight
    apply_retention(storage, JOB, 1)
    assert len(storage.list(iteration_key(JOB, 5))) == 3
    _save(storage, tmp_path, 10)
    _save(storage, tmp_path, 15, commit=False)  # crashed save
    _save(storage, tmp_path, 20)
    _save(storage, tmp_path, 30, commit=False)  # an async save in flight
    apply_retention(storage, JOB, 5)
    assert committed_iterations(storage, JOB) == [10, 20]
    assert storage.list(iteration_key(JOB, 5)) == []
    assert storage.list(iteration_key(JOB, 15)) == []
    assert len(storage.list(iteration_key(JOB, 30))) == 3


def test_fetch_returns_verified_files(storage: Storage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    big = os.urandom(6 * MiB)  # above the S3 part size: a multipart upload and ranged GETs
    _save(storage, tmp_path, 10, files={"__0_0.distcp": big, "sub/__1_0.distcp": b"one", ".metadata": b"m"})
    cache = tmp_path / "cache"
    got = fetch_checkpoint(storage, JOB, 10, cache)
    assert (got / "__0_0.distcp").read_bytes() == big
    assert (got / "sub" / "__1_0.distcp").read_bytes() == b"one"
    assert (got / ".metadata").read_bytes() == b"m"
    if isinstance(storage, LocalStorage):
        assert got == storage.local_path(iteration_key(JOB, 10))  # in place, no copy
        assert not cache.exists()
    else:
        assert got == cache / JOB / "iter_0000010"

        def no_download(*_args, **_kwargs):
            raise AssertionError("downloaded a file already in the cache")

        monkeypatch.setattr(storage, "get_file", no_download)
        assert fetch_checkpoint(storage, JOB, 10, cache) == got  # verified cache hit


def _corrupt(storage: Storage, key: str) -> None:
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    path = storage.local_path(key)
    if path is not None:
        with open(path, "r+b") as f:  # in place, as disk rot would
            f.write(bytes(data))
    else:
        storage.put_bytes(key, bytes(data))


def test_fetch_names_a_flipped_shard_and_the_previous_checkpoint(storage: Storage, tmp_path: Path):
    _save(storage, tmp_path, 10)
    _save(storage, tmp_path, 20)
    _corrupt(storage, f"{iteration_key(JOB, 20)}/__1_0.distcp")
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointCorruptError) as err:
        fetch_checkpoint(storage, JOB, 20, cache)
    message = str(err.value)
    assert "__1_0.distcp" in message and "__0_0.distcp" not in message
    assert "iteration 20" in message and "crc32" in message
    assert "previous committed checkpoint" in message and "iteration 10" in message
    assert isinstance(err.value, RuntimeError)
    assert (err.value.iteration, err.value.files, err.value.previous) == (20, ["__1_0.distcp"], 10)
    if not isinstance(storage, LocalStorage):
        assert not (cache / iteration_key(JOB, 20) / "__1_0.distcp").exists()  # bad copy not cached
    assert fetch_checkpoint(storage, JOB, 10, cache).is_dir()  # the fallback is fine


def test_fetch_names_a_missing_shard(storage: Storage, tmp_path: Path):
    _save(storage, tmp_path, 10)
    storage.delete(f"{iteration_key(JOB, 10)}/__0_0.distcp")
    with pytest.raises(CheckpointCorruptError) as err:
        fetch_checkpoint(storage, JOB, 10, tmp_path / "cache")
    message = str(err.value)
    assert "__0_0.distcp" in message and "missing" in message and "iteration 10" in message
    assert "no previous committed checkpoint" in message
    assert err.value.previous is None


def test_fetch_of_an_uncommitted_iteration_fails(storage: Storage, tmp_path: Path):
    _save(storage, tmp_path, 10, commit=False)
    with pytest.raises(FileNotFoundError, match="not committed"):
        fetch_checkpoint(storage, JOB, 10, tmp_path / "cache")


def test_resolve_checkpoint(storage: Storage, tmp_path: Path):
    assert resolve_checkpoint(storage, JOB) is None
    _save(storage, tmp_path, 10)
    _save(storage, tmp_path, 20)
    _save(storage, tmp_path, 30, commit=False)
    assert resolve_checkpoint(storage, JOB) == (JOB, 20)
    assert resolve_checkpoint(storage, f"{JOB}/") == (JOB, 20)
    assert resolve_checkpoint(storage, f"{JOB}/iter_0000010") == (JOB, 10)
    with pytest.raises(ValueError, match="iter_0000030"):
        resolve_checkpoint(storage, f"{JOB}/iter_0000030")
    # a job root that is the storage root itself
    _save(storage, tmp_path, 7, job_root="")
    assert resolve_checkpoint(storage, "") == ("", 7)
    assert resolve_checkpoint(storage, "iter_0000007") == ("", 7)
    assert resolve_checkpoint(storage, "other-job") is None


# ------------------------------------------------------------------------------------------------
# Streamed writes, ranged reads, sizes
# ------------------------------------------------------------------------------------------------


def _record(storage: Storage, operation: str, param: str) -> list:
    """The `param` of every `operation` request an S3 storage sends (nothing on local storage)."""
    seen: list = []
    if isinstance(storage, S3Storage):
        storage.client.meta.events.register(
            f"provide-client-params.s3.{operation}", lambda params, **_: seen.append(params.get(param))
        )
    return seen


def test_streamed_write_in_uneven_pieces(storage: Storage):
    """12 MiB + 3 bytes written in pieces that straddle part boundaries: on S3 three parts go up."""
    parts = _record(storage, "UploadPart", "PartNumber")
    data = os.urandom(12 * MiB + 3)
    with storage.open_write("s/big") as out:
        for start in range(0, len(data), 3 * MiB + 7):
            out.write(memoryview(data)[start : start + 3 * MiB + 7])
        assert out.size == len(data)
        assert not storage.exists("s/big")  # nothing visible before the commit
    assert storage.get_bytes("s/big") == data
    if isinstance(storage, S3Storage):
        assert sorted(parts) == [1, 2, 3]

    parts.clear()
    with storage.open_write("s/small") as out:  # below one part: a single PUT
        out.write(b"tiny")
    with storage.open_write("s/empty"):
        pass
    assert storage.get_bytes("s/small") == b"tiny" and storage.get_bytes("s/empty") == b""
    assert parts == []


def test_streamed_write_that_fails_leaves_nothing(storage: Storage):
    with pytest.raises(RuntimeError, match="boom"), storage.open_write("s/k") as out:
        out.write(os.urandom(11 * MiB))  # on S3, two parts already on their way
        raise RuntimeError("boom")
    assert not storage.exists("s/k")
    assert storage.list("") == []  # no temp file left behind
    if isinstance(storage, S3Storage):
        uploads = storage.client.list_multipart_uploads(Bucket=storage.bucket).get("Uploads", [])
        assert uploads == []  # the multipart upload was aborted, not left to linger


def test_streamed_uploads_hold_a_bounded_number_of_part_buffers(s3_bucket: str, monkeypatch):
    storage = S3Storage(s3_bucket, "p", part_size=5 * MiB, max_workers=1)
    buffers = storage._buffers
    out_now, most, lock = [0], [0], threading.Lock()
    take, give = buffers.take, buffers.give

    def counting_take(size):
        buf = take(size)
        with lock:
            out_now[0] += 1
            most[0] = max(most[0], out_now[0])
        return buf

    def counting_give(buf):
        with lock:
            out_now[0] -= 1
        give(buf)

    monkeypatch.setattr(buffers, "take", counting_take)
    monkeypatch.setattr(buffers, "give", counting_give)
    data = os.urandom(31 * MiB)
    with storage.open_write("many") as out:
        out.write(data)  # 7 parts through one sender: the writer must wait for buffers
    assert storage.get_bytes("many") == data
    assert 1 <= most[0] <= storage.max_workers + 2
    assert out_now[0] == 0 and buffers._free == []  # all given back, and let go once idle


def test_read_into_fills_buffers_from_an_offset(storage: Storage):
    """On S3, a read of more than one part is parallel ranged GETs, each straight into its buffers."""
    data = os.urandom(12 * MiB)
    storage.put_bytes("r/obj", data)
    ranges = _record(storage, "GetObject", "Range")
    start = MiB + 5
    bufs = [bytearray(3 * MiB), bytearray(1), torch.empty(6 * MiB, dtype=torch.uint8)]
    storage.read_into("r/obj", start, [bufs[0], bufs[1], memoryview(bufs[2].numpy())])
    got = bytes(bufs[0]) + bytes(bufs[1]) + bufs[2].numpy().tobytes()
    assert got == data[start : start + 9 * MiB + 1]
    if isinstance(storage, S3Storage):
        end = start + 9 * MiB
        assert sorted(ranges) == sorted(
            [f"bytes={start}-{start + 5 * MiB - 1}", f"bytes={start + 5 * MiB}-{end}"]
        )
    with pytest.raises(FileNotFoundError, match="nope"):
        storage.read_into("r/nope", 0, [bytearray(10)])
    with pytest.raises(FileNotFoundError, match="nope"):
        storage.read_into("r/nope", 0, [])
    with pytest.raises(EOFError):
        storage.read_into("r/obj", len(data) - 10, [bytearray(11)])
    with pytest.raises(EOFError):
        storage.read_into("r/obj", len(data) + 5, [bytearray(1)])


def test_s3_gets_in_flight_stay_within_max_workers(s3_bucket: str, monkeypatch):
    """Ranged GETs come from the callers' threads (a read of one part) and from the transfer pool
    (a read of several); together they stay within max_workers (a GET is in flight until its
    body has been read)."""
    from concurrent.futures import ThreadPoolExecutor

    storage = S3Storage(s3_bucket, "p", part_size=5 * MiB, max_workers=2)
    data = os.urandom(21 * MiB)
    storage.put_bytes("obj", data)
    get_object = storage.client.get_object
    in_flight, most, lock = [0], [0], threading.Lock()

    class CountedBody:
        def __init__(self, body):
            self.body = body

        def iter_chunks(self, size):
            yield from self.body.iter_chunks(size)
            with lock:
                in_flight[0] -= 1

    def counted_get_object(**kwargs):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        resp = get_object(**kwargs)
        return {**resp, "Body": CountedBody(resp["Body"])}

    monkeypatch.setattr(storage.client, "get_object", counted_get_object)

    def whole() -> bytes:  # five GETs, from the pool
        out = bytearray(len(data))
        storage.read_into("obj", 0, [out])
        return bytes(out)

    def pieces() -> bytes:  # one GET at a time, from the caller's thread
        outs = [bytearray(3 * MiB) for _ in range(7)]
        for i, out in enumerate(outs):
            storage.read_into("obj", i * 3 * MiB, [out])
        return b"".join(outs)

    with ThreadPoolExecutor(6) as callers:
        got = [callers.submit(f) for f in (whole, pieces, whole, pieces, whole, pieces)]
    assert all(f.result() == data for f in got)
    assert most[0] <= 2 and in_flight[0] == 0


def test_sizes_lists_a_folder_with_sizes(storage: Storage):
    storage.put_bytes("z/a", b"12345")
    storage.put_bytes("z/sub/b", b"")
    storage.put_bytes("zz/c", b"x")
    assert storage.sizes("z") == {"z/a": 5, "z/sub/b": 0}
    assert storage.sizes("missing") == {}


# ------------------------------------------------------------------------------------------------
# Shards: DCP through raw_io's writer and reader, checked as they are read
# ------------------------------------------------------------------------------------------------


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(1536, 1024, generator=g),  # 6 MiB: more than one 5 MiB part on S3
        "half": torch.randn(300, 7, generator=g).to(torch.bfloat16),
        "ints": torch.arange(10, dtype=torch.int64) * seed,
        "nested": {"vec": torch.randn(33, generator=g), "scalar": torch.tensor(float(seed))},
        "step": seed,  # not a tensor: DCP stores it as pickled bytes
    }


def _zeros_like(state: dict) -> dict:
    return {
        k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if torch.is_tensor(v) else 0
        for k, v in state.items()
    }


def _assert_same(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_same(got[key], value)
        elif torch.is_tensor(value):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _save_shards(storage: Storage, iteration: int, state: dict) -> list[FileEntry]:
    writer = raw_io.RawStorageWriter(storage, iteration_key(JOB, iteration), thread_count=2)
    dcp.save(state, storage_writer=writer)
    commit_checkpoint(storage, JOB, iteration, writer.entries, {"step": iteration})
    return writer.entries


def _open(storage: Storage, iteration: int, tmp_path: Path):
    return open_checkpoint(storage, JOB, iteration, tmp_path / "cache", check_now=[raw_io.METADATA])


def _biggest_shard(entries: list[FileEntry]) -> str:
    return max((e for e in entries if e.name.endswith(".distcp")), key=lambda e: e.size).name


def test_shards_round_trip_read_straight_from_storage(storage: Storage, tmp_path: Path, monkeypatch):
    state = _state(1)
    entries = _save_shards(storage, 10, state)
    assert sorted(e.name for e in entries) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    manifest = read_manifest(storage, JOB, 10)
    assert manifest["format_version"] == 2
    # one checksummed chunk per stored item: the reader checks exactly what it reads
    items = sum(len(e.chunks) for e in entries if e.name.endswith(".distcp"))
    assert items == 6

    opened = _open(storage, 10, tmp_path)
    assert opened.verify_on_read and opened.storage is storage
    # all-gathered to every rank without the (per-tensor) checksums, which a receiver re-reads
    clone = pickle.loads(pickle.dumps(opened))
    assert clone._files is None and clone.files == opened.files and clone.meta == {"step": 10}

    def no_download(*_args, **_kwargs):
        raise AssertionError("a format 2 checkpoint is read in place, never downloaded to a file")

    monkeypatch.setattr(storage, "get_file", no_download)
    ranges = _record(storage, "GetObject", "Range")
    opened = _open(storage, 10, tmp_path)
    target = _zeros_like(state)
    raw_io.load(target, opened)
    _assert_same(target, state)
    assert not (tmp_path / "cache").exists()
    if isinstance(storage, S3Storage):
        shard_reads = [r for r in ranges if r is not None]
        assert len(shard_reads) >= 3  # "big" alone is two ranged GETs of at most one part
        assert all(int(r.split("-")[1]) - int(r[6:].split("-")[0]) < 5 * MiB for r in shard_reads)


@pytest.mark.parametrize("where", ["middle of a big tensor", "last byte"])
def test_a_flipped_shard_byte_fails_the_load_naming_the_shard(storage: Storage, tmp_path: Path, where: str):
    _save_shards(storage, 10, _state(1))
    entries = _save_shards(storage, 20, _state(2))
    name = _biggest_shard(entries)
    key = f"{iteration_key(JOB, 20)}/{name}"
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2 if where.startswith("middle") else -1] ^= 0x04
    path = storage.local_path(key)
    if path is not None:
        with open(path, "r+b") as f:  # in place, as disk rot would
            f.write(bytes(data))
    else:
        storage.put_bytes(key, bytes(data))

    opened = _open(storage, 20, tmp_path)  # sizes match: only reading can tell
    with pytest.raises(ShardCorruptError) as err:
        raw_io.load(_zeros_like(_state(2)), opened)
    assert [n for n, _why in err.value.problems] == [name]
    assert "crc32" in str(err.value)
    # what the checkpointer raises from it: the shard, the iteration, the way out
    error = corrupt_error(storage, JOB, 20, err.value.problems)
    assert isinstance(error, CheckpointCorruptError)
    assert (error.iteration, error.files, error.previous) == (20, [name], 10)
    assert name in str(error) and "iteration 10" in str(error)
    # the previous checkpoint loads, over the target the failed load left behind
    target = _zeros_like(_state(1))
    raw_io.load(target, _open(storage, 10, tmp_path))
    _assert_same(target, _state(1))


def test_a_corrupt_metadata_file_is_caught_before_it_is_unpickled(storage: Storage, tmp_path: Path):
    _save_shards(storage, 10, _state(1))
    opened = _open(storage, 10, tmp_path)
    _corrupt(storage, f"{iteration_key(JOB, 10)}/{raw_io.METADATA}")
    with pytest.raises(CheckpointCorruptError, match=r"'\.metadata'.*crc32"):
        _open(storage, 10, tmp_path)
    with pytest.raises(ShardCorruptError, match=r"\.metadata"):  # and the reader checks it again
        raw_io.RawStorageReader(opened).read_metadata()


def test_a_missing_or_truncated_shard_is_named(storage: Storage, tmp_path: Path):
    entries = _save_shards(storage, 10, _state(1))
    name = _biggest_shard(entries)
    key = f"{iteration_key(JOB, 10)}/{name}"
    data = storage.get_bytes(key)
    opened = _open(storage, 10, tmp_path)
    storage.delete(key)  # gone after the open: the read reports it
    with pytest.raises(ShardCorruptError, match="missing") as err:
        raw_io.load(_zeros_like(_state(1)), opened)
    assert err.value.problems[0][0] == name
    with pytest.raises(CheckpointCorruptError, match="missing") as err:  # gone before: the open does
        _open(storage, 10, tmp_path)
    assert err.value.files == [name]
    storage.put_bytes(key, data[:-100])
    with pytest.raises(CheckpointCorruptError, match="size"):
        _open(storage, 10, tmp_path)


def test_format_1_manifests_still_load(storage: Storage, tmp_path: Path):
    """A checkpoint committed before chunk checksums (sha256 of whole files) is verified whole,
    fetched into the cache first when remote, and loads."""
    state = _state(3)
    entries = _save_shards(storage, 10, state)
    folder = iteration_key(JOB, 10)
    manifest = read_manifest(storage, JOB, 10)
    manifest["format_version"] = 1
    manifest["files"] = [
        {
            "name": e.name,
            "size": e.size,
            "sha256": hashlib.sha256(storage.get_bytes(f"{folder}/{e.name}")).hexdigest(),
        }
        for e in entries
    ]
    storage.put_bytes(f"{folder}/manifest.json", json.dumps(manifest).encode())

    opened = _open(storage, 10, tmp_path)
    assert not opened.verify_on_read
    if isinstance(storage, S3Storage):
        assert isinstance(opened.storage, LocalStorage)
        assert (tmp_path / "cache" / folder / ".metadata").is_file()
    target = _zeros_like(state)
    raw_io.load(target, opened)
    _assert_same(target, state)

    _corrupt(storage, f"{folder}/{_biggest_shard(entries)}")
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        _open(storage, 10, tmp_path / "elsewhere")  # not the cache that holds a good copy


def test_shard_corrupt_error_pickles():
    err = pickle.loads(pickle.dumps(ShardCorruptError([("__1_0.distcp", "crc32 of bytes 0-9 is x")])))
    assert isinstance(err, ShardCorruptError)
    assert err.problems == [("__1_0.distcp", "crc32 of bytes 0-9 is x")]
    assert "__1_0.distcp" in str(err)


def test_a_reader_without_checks_trusts_files_verified_whole(tmp_path: Path):
    """verify_on_read=False (format 1, verified at open): a flipped byte is not looked for again.
    The control for the corruption tests above: the reader's checks are what fail them."""
    storage = LocalStorage(tmp_path / "store")
    entries = _save_shards(storage, 10, _state(1))
    opened = _open(storage, 10, tmp_path)
    _corrupt(storage, f"{iteration_key(JOB, 10)}/{_biggest_shard(entries)}")
    unchecked = dataclasses.replace(opened, verify_on_read=False)
    target = _zeros_like(_state(1))
    raw_io.load(target, unchecked)
    assert not torch.equal(target["big"], _state(1)["big"])


# ------------------------------------------------------------------------------------------------
# End to end: a job checkpointing to S3, a flipped byte in a shard object
# ------------------------------------------------------------------------------------------------


def test_job_on_s3_with_a_flipped_shard_fails_resume_from_and_auto_falls_back(s3_bucket: str, s3_env: str):
    from engine.launcher import RankFailure, spawn
    from tests.engine.parallel_harness import job, train_until

    env = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    uri = f"s3://{s3_bucket}/runs"

    def spec(**checkpoint) -> dict:
        return job(
            1,
            name="job",
            model={"num_layers": 2},
            training={"global_batch_size": 4, "micro_batch_size": 2, "train_iters": 6},
            checkpoint={"path": uri, "endpoint_url": s3_env, "interval": 2, **checkpoint},
        )

    spawn(train_until, 1, (spec(), 4), env=env)
    storage = open_storage(uri, endpoint_url=s3_env)
    assert committed_iterations(storage, "job") == [2, 4]
    shard = _biggest_shard(
        [FileEntry(f["name"], f["size"], ()) for f in read_manifest(storage, "job", 4)["files"]]
    )
    _corrupt(storage, f"job/iter_0000004/{shard}")

    explicit = spec(resume_from=f"{uri}/job/iter_0000004")
    explicit["name"] = "other"
    with pytest.raises(RankFailure, match=shard):
        spawn(train_until, 1, (explicit, 6), env=env)
    resumed = spawn(train_until, 1, (spec(), 6), env=env)[0]
    assert resumed["start"] == 2, "auto resume falls back to the previous committed checkpoint"
