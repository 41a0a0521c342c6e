"""`elastron preprocess` as a user runs it: a real subprocess, real tokenizer files, exit codes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.data.indexed_dataset import IndexedDataset
from engine.data.preprocess import DocumentReader
from engine.data.tokenizer import build_tokenizer
from tests.engine.data_helpers import CORPUS, train_hf_bpe, train_sentencepiece

ELASTRON = [sys.executable, "-m", "elastron.cli", "preprocess"]
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ELASTRON, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("sp"))


def test_shipped_corpus_with_the_byte_tokenizer(tmp_path):
    out = tmp_path / "corpus"
    proc = run("--input", str(CORPUS), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    paragraphs = list(DocumentReader([CORPUS]))
    ds = IndexedDataset(out)
    assert len(ds) == len(paragraphs) and ds.dtype.name == "uint16"
    assert all(ds[i][-1] == 256 and 256 not in ds[i][:-1] for i in range(len(ds)))
    assert bytes(ds[0][:-1].tolist()).decode() == paragraphs[0]
    assert f"{len(paragraphs):,} documents" in proc.stdout and "tokens/s" in proc.stdout
    assert "100%" in proc.stderr and "tokens/s" in proc.stderr  # the progress bar's last state


def test_jsonl_with_a_trained_hf_tokenizer_decodes_back(tmp_path):
    tok_path = train_hf_bpe(tmp_path / "tok")
    texts = ["def f(x):\n    return x", "Résumé of the año 🐍", "third document"]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"content": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    proc = run(
        "--input",
        str(data),
        "--tokenizer",
        f"hf:{tok_path}",
        "--json-key",
        "content",
        "--output",
        str(tmp_path / "out"),
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # --quiet: no progress bar
    tok = build_tokenizer(f"hf:{tok_path}")
    ds = IndexedDataset(tmp_path / "out")
    assert len(ds) == 3
    for i, text in enumerate(texts):
        assert ds[i][-1] == tok.eod
        assert tok.decode(ds[i][:-1].tolist()) == text


def test_two_workers_write_the_same_bytes_as_one(tmp_path, sp_model):
    # Several input files (a glob) and many small batches, so both workers get work.
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text(CORPUS.read_text()[i * 60_000 : (i + 1) * 60_000])
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        proc = run(
            "--input",
            str(tmp_path / "part*.txt"),
            "--tokenizer",
            f"sentencepiece:{sp_model}",
            "--workers",
            str(workers),
            "--batch-bytes",
            "4096",
            "--output",
            str(out),
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(out)
    for ext in ("bin", "idx"):
        assert Path(f"{outs[0]}.{ext}").read_bytes() == Path(f"{outs[1]}.{ext}").read_bytes()
    ds = IndexedDataset(outs[0])
    assert len(ds) > 100 and all(ds[i][-1] == 2 for i in range(len(ds)))  # SentencePiece's </s>


@pytest.mark.parametrize(
    "args, message",
    [
        (["--input", "missing.txt"], r"error: --input: no such file missing\.txt"),
        (["--input", "nothing/*.jsonl"], r"error: --input: no file matches nothing/\*\.jsonl"),
        (
            ["--tokenizer", "gpt2"],
            r"error: --tokenizer \(data\.tokenizer\) 'gpt2' is not supported: use 'byte'",
        ),
        (
            ["--tokenizer", "hf:/no/such/tokenizer.json"],
            r"data\.tokenizer\).*no such file /no/such/tokenizer\.json",
        ),
        (["--tokenizer", "sentencepiece:/no/m.model"], r"data\.tokenizer\).*no such file /no/m\.model"),
        (["--json-key", "body"], r"error: .*docs\.jsonl:1: no string field 'body'.*--json-key"),
        (["--workers", "0"], r"error: --workers must be at least 1"),
    ],
)
def test_bad_input_exits_2_with_the_field_named_and_no_traceback(tmp_path, args, message):
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "hello"}\n')
    base = {"--input": str(data), "--output": str(tmp_path / "out")}
    for flag in ("--input", "--tokenizer", "--json-key", "--workers"):
        if flag in args:
            base.pop(flag, None)
    proc = run(*[x for kv in base.items() for x in kv], *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert not list(tmp_path.glob("out*")), "a failed run leaves no output"
