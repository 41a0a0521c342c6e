"""preprocess as a library: how files become documents, streaming with bounded read-ahead, EOD ids."""

from __future__ import annotations

import io
import json

import pytest

from engine.data.indexed_dataset import IndexedDataset
from engine.data.preprocess import DocumentReader, batches, encode_batches, preprocess
from engine.data.tokenizer import ByteTokenizer
from tests.engine.data_helpers import CORPUS


def docs_of(ds: IndexedDataset, eod: int = 256) -> list[str]:
    out = []
    for i in range(len(ds)):
        ids = ds[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        out.append(bytes(ids[:-1]).decode())
    return out


def test_plain_text_is_one_document_per_paragraph(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("first line\nsame paragraph\n\n\n  \nsecond\n\nthird, no newline at the end")
    assert list(DocumentReader([f])) == [
        "first line\nsame paragraph",
        "second",
        "third, no newline at the end",
    ]
    assert list(DocumentReader([f], text_mode="file")) == [f.read_text()]


def test_jsonl_takes_the_named_field_and_skips_blank_lines(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(
        json.dumps({"text": "one\n\ntwo", "id": 1}) + "\n\n" + json.dumps({"text": "", "body": "b"}) + "\n"
    )
    reader = DocumentReader([f])
    assert list(reader) == ["one\n\ntwo"] and reader.skipped_empty == 1
    with pytest.raises(ValueError, match=r"a\.jsonl:1: no string field 'body'.*--json-key"):
        list(DocumentReader([f], json_key="body"))
    f.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: not a JSON line"):
        list(DocumentReader([f]))


def test_output_is_the_documents_each_followed_by_eod(tmp_path):
    stats = preprocess([CORPUS], "byte", tmp_path / "out", progress=None)
    ds = IndexedDataset(tmp_path / "out")
    expected = list(DocumentReader([CORPUS]))
    assert docs_of(ds) == expected
    assert stats.documents == len(ds) == len(expected) > 1000
    assert stats.tokens == ds.num_tokens == sum(len(d.encode()) + 1 for d in expected)
    assert stats.bytes == CORPUS.stat().st_size and stats.tokens_per_s > 0


def test_streaming_in_batches_far_smaller_than_the_input_gives_the_same_bytes(tmp_path):
    preprocess([CORPUS], "byte", tmp_path / "whole", batch_bytes=1 << 30, progress=None)
    preprocess([CORPUS], "byte", tmp_path / "small", batch_bytes=256, progress=None)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"small.{ext}").read_bytes() == (tmp_path / f"whole.{ext}").read_bytes()


@pytest.mark.parametrize("workers", [1, 2])
def test_read_ahead_is_bounded(workers):
    """The input is pulled only as fast as results are written: a corpus larger than memory streams."""
    pulled = 0

    def texts():
        nonlocal pulled
        for i in range(40):
            pulled += 1
            yield [f"batch {i}"]

    max_pending = 3
    for written, (tokens, lengths) in enumerate(encode_batches(texts(), "byte", workers, max_pending), 1):
        assert tokens.tolist() == list(f"batch {written - 1}".encode()) + [256]
        assert lengths.tolist() == [len(tokens)]
        assert pulled <= written + max_pending
    assert written == 40


def test_batches_group_consecutive_documents():
    assert list(batches(["aa", "b", "cccc", "d"], 3)) == [["aa", "b"], ["cccc"], ["d"]]


def test_progress_reports_throughput(tmp_path):
    out = io.StringIO()
    preprocess([CORPUS], "byte", tmp_path / "out", progress=out)
    line = out.getvalue().strip().splitlines()[-1]
    assert line.startswith("[###") and "100%" in line and "tokens/s" in line and "MB/s" in line


def test_several_inputs_are_concatenated_in_order(tmp_path):
    (tmp_path / "a.txt").write_text("alpha\n\nbeta\n")
    (tmp_path / "b.jsonl").write_text('{"text": "gamma"}\n')
    preprocess([tmp_path / "a.txt", tmp_path / "b.jsonl"], "byte", tmp_path / "out", progress=None)
    assert docs_of(IndexedDataset(tmp_path / "out"), ByteTokenizer.eod) == ["alpha", "beta", "gamma"]
