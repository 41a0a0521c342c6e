"""Nothing read from a checkpoint is executed (issue 61, "No pickle from storage").

Each crafted checkpoint is committed with our own commit routine, so its manifest and CRC-32s are
valid (whoever writes a folder writes its manifest too), and carries a pickle payload that creates
a marker file when unpickled:
- `metadata`: `.metadata` itself is the payload (DCP pickles its Metadata there);
- `bytes-<encoding>`: a clean `.metadata` declaring the tensor `model/w` a non-tensor (BYTE_IO)
  item whose bytes are the payload (DCP's planner torch.load's those with weights_only=False);
  `ours` encodes the metadata the way the writer does, `pickled` as DCP's pickle.
Every load path refuses each of them and no marker appears: the raw reader, a resume on one
rank, a resume on two ranks of another layout (the resharding load), the exporter (library and
`elastron export`), and the in-memory snapshot parser. A genuine checkpoint of the old pickled
format is refused with an error naming `elastron checkpoint convert`, which converts it (and only
it: a payload is refused there too), non-tensor items included. Crafted JSON metadata cannot make
the exporter allocate what the files do not hold, nor put a JSON value where a tensor belongs.
"""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from typer.testing import CliRunner

from engine.checkpointing import raw_io
from engine.checkpointing.checkpointer import Checkpointer
from engine.checkpointing.commit import (
    FileEntry,
    commit_checkpoint,
    crc32_hex,
    iteration_key,
    open_checkpoint,
    read_manifest,
)
from engine.checkpointing.local_storage import LocalStorage
from engine.cli import app
from engine.jobspec.checkpoint import CheckpointSpec
from engine.launcher import RankFailure, spawn
from engine.rerun.event_log import EventLog

JOB = "victim"
CONVERT = "elastron checkpoint convert"
WEIGHTS = torch.arange(6.0).reshape(2, 3)
CRAFTS = ("metadata", "bytes-ours", "bytes-pickled")


class _Payload:
    """Unpickling this creates the marker file: any code could run in its place."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    return ctx


def _genuine(root: Path) -> LocalStorage:
    """A checkpoint of one tensor part 'model' (key w) at iteration 1, as a job writes it."""
    storage = LocalStorage(root)
    writer = raw_io.RawStorageWriter(storage, iteration_key(JOB, 1))
    ctx = _quiet()
    dcp.save({"model/w": WEIGHTS.clone()}, storage_writer=writer)
    ctx.__exit__(None, None, None)
    meta = {"shard_format": raw_io.FORMAT, "layout": "saved-layout", "iteration": 1}
    commit_checkpoint(storage, JOB, 1, writer.entries, meta)
    return storage


def _recommit(storage: LocalStorage, files: dict[str, bytes], **meta) -> None:
    """Replace/add `files` in iteration 1 and commit it again, checksums and all."""
    folder = iteration_key(JOB, 1)
    manifest = read_manifest(storage, JOB, 1)
    entries = {
        e["name"]: FileEntry(e["name"], e["size"], tuple(tuple(c) for c in e["chunks"])) for e in manifest["files"]
    }
    for name, data in files.items():
        storage.put_bytes(f"{folder}/{name}", data)
        entries[name] = FileEntry(name, len(data), ((0, len(data), crc32_hex(data)),))
    commit_checkpoint(storage, JOB, 1, list(entries.values()), {**manifest["meta"], **meta})


def _metadata(storage: LocalStorage):
    opened = open_checkpoint(storage, JOB, 1, Path("/nonexistent-cache"), check_now=[raw_io.METADATA])
    return raw_io.RawStorageReader(opened).read_metadata()


def _encode_ours(metadata) -> bytes:
    """The writer's own encoding of DCP metadata (a pickle before issue 61)."""
    encoder = getattr(raw_io, "metadata_json", None)
    return encoder.encode(metadata) if encoder is not None else pickle.dumps(metadata)


def _craft(root: Path, kind: str, marker: Path) -> LocalStorage:
    storage = _genuine(root)
    payload = pickle.dumps(_Payload(marker))
    if kind == "metadata":
        _recommit(storage, {raw_io.METADATA: payload})
        return storage
    md = _metadata(storage)
    md.state_dict_metadata["model/w"] = BytesStorageMetadata()
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != "model/w"}
    md.storage_data[MetadataIndex("model/w")] = _StorageInfo("__0_9.distcp", 0, len(payload))
    encoded = _encode_ours(md) if kind == "bytes-ours" else pickle.dumps(md)
    _recommit(storage, {raw_io.METADATA: encoded, "__0_9.distcp": payload})
    return storage


def _old_format(root: Path) -> LocalStorage:
    """A genuine checkpoint as elastron wrote it before issue 61: pickled `.metadata`, raw-v1."""
    storage = _genuine(root)
    _recommit(storage, {raw_io.METADATA: pickle.dumps(_metadata(storage))}, shard_format="raw-v1")
    return storage


def _raw_load(storage: LocalStorage) -> str:
    target = {"model/w": torch.zeros(2, 3)}
    ctx = _quiet()
    try:
        opened = open_checkpoint(storage, JOB, 1, Path("/nonexistent-cache"), check_now=[raw_io.METADATA])
        raw_io.load(target, opened)
    except BaseException as err:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        return f"{type(err).__name__}: {err}"
    finally:
        ctx.__exit__(None, None, None)
    return "loaded"


# ------------------------------------------------------------------- resume (spawned ranks)
class _Part:
    def __init__(self) -> None:
        self.w, self.iteration = torch.zeros(2, 3), 0

    def state_dict(self):
        return {"w": self.w, "iteration": self.iteration}

    def load_state_dict(self, state_dict) -> None:
        self.w.copy_(state_dict["w"])
        self.iteration = state_dict["iteration"]


def _resume_rank(roots: list[str], layout: str) -> list[str]:
    """Resume every checkpoint root with a Checkpointer of `layout`; what each resume said."""
    out = []
    for root in roots:
        part = _Part()
        checkpointer = Checkpointer(
            {"model": part},
            CheckpointSpec.model_validate({"path": root}),
            job_name=JOB,
            events=EventLog(None, JOB),
            layout=layout,
        )
        try:
            checkpointer.maybe_resume()
            out.append(f"loaded {part.w.tolist()}")
        except BaseException as err:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
            out.append(f"{type(err).__name__}: {err}")
    return out


@pytest.fixture
def crafted(tmp_path):
    """{kind: (storage, marker)} for each crafted checkpoint, plus 'old' (a genuine raw-v1 one)."""
    out = {}
    for kind in CRAFTS:
        marker = tmp_path / f"marker-{kind}"
        out[kind] = (_craft(tmp_path / kind, kind, marker), marker)
    out["old"] = (_old_format(tmp_path / "old"), tmp_path / "marker-old")
    return out


def _assert_refused(outcomes: dict[str, str], crafted) -> None:
    for kind, (_storage, marker) in crafted.items():
        assert not marker.exists(), f"{kind}: the payload ran ({outcomes[kind]})"
        assert not outcomes[kind].startswith("loaded"), f"{kind}: loaded"
    assert CONVERT in outcomes["old"], outcomes["old"]
    assert CONVERT in outcomes["metadata"] and CONVERT in outcomes["bytes-pickled"], outcomes


def test_raw_reader_refuses_every_crafted_checkpoint(crafted):
    outcomes = {kind: _raw_load(storage) for kind, (storage, _m) in crafted.items()}
    _assert_refused(outcomes, crafted)
    assert "model/w" in outcomes["bytes-ours"], outcomes["bytes-ours"]


@pytest.mark.parametrize("ranks,layout", [(1, "saved-layout"), (2, "another-layout")], ids=["resume", "reshard"])
def test_resume_refuses_every_crafted_checkpoint(crafted, ranks, layout):
    kinds = list(crafted)
    roots = [str(crafted[k][0].root) for k in kinds]
    try:
        per_rank = spawn(_resume_rank, ranks, args=(roots, layout), timeout_s=120)
    except RankFailure as err:  # a rank died: first say whether a payload ran
        ran = [kind for kind, (_s, marker) in crafted.items() if marker.exists()]
        assert not ran, f"the payload of {ran} ran on resume; then {err}"
        raise
    for rank_outcomes in per_rank:  # every rank stops, with the same reason
        _assert_refused(dict(zip(kinds, rank_outcomes, strict=True)), crafted)
    assert per_rank[0] == per_rank[-1]


def test_resume_of_a_genuine_checkpoint_still_loads(tmp_path):
    storage = _genuine(tmp_path / "ok")
    ((outcome,),) = spawn(_resume_rank, 1, args=([str(storage.root)], "another-layout"), timeout_s=120)
    assert outcome == f"loaded {WEIGHTS.tolist()}"


def test_export_refuses_crafted_and_old_checkpoints(crafted, tmp_path):
    from engine.hf.exporter import read_model_tensors

    for kind, (storage, marker) in crafted.items():
        try:
            read_model_tensors(str(storage.root / JOB))
            error: BaseException | None = None
        except BaseException as err:  # noqa: BLE001 - checked below, after the marker
            error = err
        result = CliRunner().invoke(app, ["export", str(storage.root / JOB), "--output", str(tmp_path / "out")])
        assert not marker.exists(), f"{kind}: the payload ran on export ({error!r})"
        assert isinstance(error, ValueError), repr(error)
        assert result.exit_code == 2, result.output
        if kind in ("metadata", "old"):
            assert CONVERT in str(error) and CONVERT in result.output


def test_in_memory_snapshot_header_is_never_unpickled(tmp_path):
    from engine.checkpointing import memory

    marker = tmp_path / "marker"
    header, payload = pickle.dumps(_Payload(marker)), b"\0" * 16
    blob = (
        memory.MAGIC + memory._FRAME.pack(len(header), memory._checksum(header, payload)) + header + payload
    )
    with pytest.raises(memory.SnapshotError):
        memory.parse(blob, job=JOB, rank=0, world_size=1, layout="l")
    assert not marker.exists()


# ----------------------------------------------------------------------- the admin command
def test_convert_rewrites_an_old_checkpoint_as_data(tmp_path):
    storage = _old_format(tmp_path / "old")
    assert CONVERT in _raw_load(storage)

    result = CliRunner().invoke(app, ["checkpoint", "convert", str(storage.root / JOB)])
    assert result.exit_code == 0, result.output
    assert "converted 1 checkpoint(s)" in result.output
    folder = storage.root / iteration_key(JOB, 1)
    json.loads((folder / raw_io.METADATA).read_bytes())  # data now
    assert read_manifest(storage, JOB, 1)["meta"]["shard_format"] == raw_io.FORMAT

    target = {"model/w": torch.zeros(2, 3)}
    opened = open_checkpoint(storage, JOB, 1, tmp_path / "cache", check_now=[raw_io.METADATA])
    ctx = _quiet()
    raw_io.load(target, opened)
    ctx.__exit__(None, None, None)
    assert torch.equal(target["model/w"], WEIGHTS)

    again = CliRunner().invoke(app, ["checkpoint", "convert", str(folder)])  # an iter_ folder; idempotent
    assert again.exit_code == 0 and "1 already raw-v2" in again.output, again.output


@pytest.mark.parametrize("kind", ["metadata", "bytes-pickled"])
def test_convert_refuses_a_payload_without_running_it(tmp_path, kind):
    marker = tmp_path / "marker"
    storage = _craft(tmp_path / kind, kind, marker)
    _recommit(storage, {}, shard_format="raw-v1")
    metadata = storage.get_bytes(f"{iteration_key(JOB, 1)}/{raw_io.METADATA}")

    result = CliRunner().invoke(app, ["checkpoint", "convert", str(storage.root / JOB)])
    assert result.exit_code == 2, result.output
    assert "not converted" in result.output
    assert not marker.exists()
    assert storage.get_bytes(f"{iteration_key(JOB, 1)}/{raw_io.METADATA}") == metadata
    assert read_manifest(storage, JOB, 1)["meta"]["shard_format"] == "raw-v1"


def test_non_tensor_items_round_trip_as_json(tmp_path):
    """A non-tensor value in a DCP state dict is stored as JSON and read back as it was."""
    storage = LocalStorage(tmp_path)
    writer = raw_io.RawStorageWriter(storage, iteration_key(JOB, 1))
    state = {"model/w": WEIGHTS.clone(), "extra": {"steps": [1, 2.5, "x"]}, "count": 3}
    ctx = _quiet()
    dcp.save(state, storage_writer=writer)
    commit_checkpoint(storage, JOB, 1, writer.entries, {"shard_format": raw_io.FORMAT})
    target = {"model/w": torch.zeros(2, 3), "extra": {"steps": None}, "count": 0}
    raw_io.load(target, open_checkpoint(storage, JOB, 1, tmp_path / "cache", check_now=[raw_io.METADATA]))
    ctx.__exit__(None, None, None)
    assert target["extra"] == {"steps": [1, 2.5, "x"]} and target["count"] == 3
    assert torch.equal(target["model/w"], WEIGHTS)
    with pytest.raises(CheckpointException) as err:  # not data: refused at save, never pickled
        dcp.save({"obj": object()}, storage_writer=raw_io.RawStorageWriter(storage, iteration_key(JOB, 2)))
    assert any("is not JSON data" in str(exc) for exc, _trace in err.value.failures.values())


def test_convert_rewrites_old_non_tensor_items_as_json(tmp_path):
    """An old checkpoint's non-tensor item (torch.save bytes) comes back as the same value, as JSON."""
    import io

    storage = LocalStorage(tmp_path / "old")
    writer = raw_io.RawStorageWriter(storage, iteration_key(JOB, 1))
    ctx = _quiet()
    dcp.save({"model/w": WEIGHTS.clone(), "count": 3}, storage_writer=writer)
    ctx.__exit__(None, None, None)
    commit_checkpoint(storage, JOB, 1, writer.entries, {"shard_format": raw_io.FORMAT})
    md = _metadata(storage)
    saved = io.BytesIO()
    torch.save({"steps": [1, 2]}, saved)  # what DCP's planner wrote for a non-tensor value
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != "count"}
    md.storage_data[MetadataIndex("count")] = _StorageInfo("__0_9.distcp", 0, len(saved.getvalue()))
    files = {raw_io.METADATA: pickle.dumps(md), "__0_9.distcp": saved.getvalue()}
    _recommit(storage, files, shard_format="raw-v1")

    result = CliRunner().invoke(app, ["checkpoint", "convert", str(storage.root / JOB)])
    assert result.exit_code == 0, result.output
    target = {"model/w": torch.zeros(2, 3), "count": None}
    ctx = _quiet()
    raw_io.load(target, open_checkpoint(storage, JOB, 1, tmp_path / "cache", check_now=[raw_io.METADATA]))
    ctx.__exit__(None, None, None)
    assert target["count"] == {"steps": [1, 2]} and torch.equal(target["model/w"], WEIGHTS)


def test_export_allocates_nothing_the_checkpoint_does_not_hold(tmp_path):
    """Crafted JSON metadata claiming a 4 TB tensor is refused before anything is allocated."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from engine.checkpointing import metadata_json
    from engine.hf.exporter import ExportError, read_model_tensors

    storage = _genuine(tmp_path / "big")
    md = _metadata(storage)
    huge = torch.Size([10**6, 10**6])
    md.state_dict_metadata["model/w"].size = huge
    md.state_dict_metadata["model/w"].chunks = [ChunkStorageMetadata(torch.Size([0, 0]), huge)]
    _recommit(storage, {raw_io.METADATA: metadata_json.encode(md)})
    with pytest.raises(ExportError, match="more tensor bytes than"):
        read_model_tensors(str(storage.root / JOB))
    md.state_dict_metadata["model/w"].chunks = []  # a tensor the checkpoint holds no part of
    _recommit(storage, {raw_io.METADATA: metadata_json.encode(md)})
    with pytest.raises(ExportError, match="do not make up the whole"):
        read_model_tensors(str(storage.root / JOB))


def test_a_json_value_never_replaces_a_tensor(tmp_path):
    """Metadata declaring a tensor of ours a non-tensor item: even valid JSON is refused."""
    storage = _genuine(tmp_path / "c")
    md = _metadata(storage)
    md.state_dict_metadata["model/w"] = BytesStorageMetadata()
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != "model/w"}
    md.storage_data[MetadataIndex("model/w")] = _StorageInfo("__0_9.distcp", 0, 5)
    _recommit(storage, {raw_io.METADATA: _encode_ours(md), "__0_9.distcp": b"[1,2]"})
    assert "is a tensor here but a non-tensor value" in _raw_load(storage)
