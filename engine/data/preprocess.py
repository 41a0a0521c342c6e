"""Turn text files into an indexed dataset (PREFIX.bin/.idx): `elastron preprocess`.

Inputs, decided per file by its name:
- `*.jsonl`, `*.json`, `*.ndjson`: one JSON object per line; the document is its `json_key`
  field (default "text"). Blank lines are skipped; a line that is not an object with that
  string field is an error naming the file and line.
- anything else is UTF-8 plain text. `text_mode="paragraph"` (default): each run of non-blank
  lines is one document (blank-line-separated paragraphs, as the shipped corpus is written);
  `text_mode="file"`: the whole file is one document (that document is held in memory).

Every document is followed by the tokenizer's end-of-document id; empty documents are skipped.

Why the pipeline has this shape: the corpus may be larger than memory, so files are read line by
line, grouped into batches of about `batch_bytes` of text, and at most `2 x workers` batches are in
flight at once (multiprocessing.Pool.imap would read the whole input ahead). Batches are written in
input order, so the output does not depend on the number of workers. Workers are spawned (not
forked): each builds its own tokenizer, and a Rust tokenizer's thread pool does not survive a fork.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from engine.data.indexed_dataset import IndexedDatasetWriter, dtype_for_vocab
from engine.data.tokenizer import Tokenizer, build_tokenizer

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_MODES = ("paragraph", "file")


@dataclass
class PreprocessStats:
    documents: int
    tokens: int
    bytes: int
    seconds: float
    skipped_empty: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


class DocumentReader:
    """Yields document texts from files, streaming; `bytes_read` tracks progress through them."""

    def __init__(self, paths: Sequence[str | Path], json_key: str = "text", text_mode: str = "paragraph"):
        if text_mode not in TEXT_MODES:
            raise ValueError(f"text mode {text_mode!r} is not one of {', '.join(TEXT_MODES)}")
        self.paths = [Path(p) for p in paths]
        self.json_key, self.text_mode = json_key, text_mode
        self.bytes_read = 0
        self.skipped_empty = 0

    def __iter__(self) -> Iterator[str]:
        for path in self.paths:
            if path.name.endswith(JSONL_SUFFIXES):
                docs = self._jsonl(path)
            elif self.text_mode == "file":
                docs = self._whole(path)
            else:
                docs = self._paragraphs(path)
            for doc in docs:
                if doc.strip():
                    yield doc
                else:
                    self.skipped_empty += 1

    def _lines(self, path: Path) -> Iterator[tuple[int, str]]:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                self.bytes_read += len(raw)
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"{path}:{number}: not UTF-8 text ({err.reason})") from None

    def _jsonl(self, path: Path) -> Iterator[str]:
        for number, line in self._lines(path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err.msg})") from None
            text = obj.get(self.json_key) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{number}: no string field {self.json_key!r} in this JSON line "
                    "(name the field with --json-key)"
                )
            yield text

    def _paragraphs(self, path: Path) -> Iterator[str]:
        lines: list[str] = []
        for _, line in self._lines(path):
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\r\n")
                lines = []
        if lines:
            yield "".join(lines).rstrip("\r\n")

    def _whole(self, path: Path) -> Iterator[str]:
        yield "".join(line for _, line in self._lines(path))


def batches(docs: Iterable[str], batch_bytes: int) -> Iterator[list[str]]:
    """Consecutive documents grouped so a batch holds about `batch_bytes` characters (at least one doc)."""
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


_worker_tokenizer = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = build_tokenizer(spec)


def _encode(texts: list[str], tokenizer: Tokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A batch as (concatenated ids with EOD after each document, per-document lengths)."""
    tok = tokenizer or _worker_tokenizer
    dtype = dtype_for_vocab(tok.vocab_size)
    encoded = tok.encode_batch(texts)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    out[ends - 1] = tok.eod
    for ids, end, n in zip(encoded, ends, lengths, strict=True):
        out[end - n : end - 1] = ids
    return out, lengths


def encode_batches(
    texts: Iterable[list[str]],
    tokenizer_spec: str,
    workers: int = 1,
    max_pending: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode batches in order; with workers > 1, at most `max_pending` batches are read ahead.

    With one worker the batches are encoded here, by `tokenizer` when given (else one built from
    the spec); with more, by spawned processes that each build their own from the spec.
    """
    if workers <= 1:
        tok = tokenizer or build_tokenizer(tokenizer_spec)
        for batch in texts:
            yield _encode(batch, tok)
        return
    max_pending = max_pending or 2 * workers
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer_spec,)) as pool:
        pending: deque = deque()
        for batch in texts:
            pending.append(pool.apply_async(_encode, (batch,)))
            if len(pending) >= max_pending:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """A progress bar on a terminal (redrawn in place), a line every few seconds in a log."""

    def __init__(self, total_bytes: int, stream: TextIO | None):
        self.total, self.stream = max(total_bytes, 1), stream
        self.tty = bool(stream) and stream.isatty()
        self.start = self.last = time.perf_counter()

    def line(self, done_bytes: int, docs: int, tokens: int) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        frac = min(done_bytes / self.total, 1.0)
        bar = "#" * int(frac * 30)
        return (
            f"[{bar:<30}] {frac:4.0%}  {docs:,} docs  {tokens:,} tokens  "
            f"{done_bytes / 1e6 / elapsed:.1f} MB/s  {tokens / elapsed:,.0f} tokens/s"
        )

    def update(self, done_bytes: int, docs: int, tokens: int) -> None:
        now = time.perf_counter()
        if self.stream is None or now - self.last < (0.2 if self.tty else 10.0):
            return
        self.last = now
        text = self.line(done_bytes, docs, tokens)
        self.stream.write(f"\r{text}" if self.tty else f"{text}\n")
        self.stream.flush()

    def finish(self, done_bytes: int, docs: int, tokens: int) -> None:
        if self.stream is not None:
            end = "\r" if self.tty else ""
            self.stream.write(f"{end}{self.line(done_bytes, docs, tokens)}\n")
            self.stream.flush()


def preprocess(
    inputs: Sequence[str | Path],
    tokenizer_spec: str,
    output_prefix: str | Path,
    workers: int = 1,
    json_key: str = "text",
    text_mode: str = "paragraph",
    batch_bytes: int = 1 << 20,
    progress: TextIO | bool | None = True,
) -> PreprocessStats:
    """Tokenise `inputs` into output_prefix.bin/.idx; returns counts and the time it took.

    progress: True (stderr), a stream, or False/None for none.
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("--input: give at least one file")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"--input: no such file {p}")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    tokenizer = build_tokenizer(tokenizer_spec)  # fails here, before any output, on a bad spec
    reader = DocumentReader(paths, json_key, text_mode)
    stream = sys.stderr if progress is True else (progress or None)
    bar = Progress(sum(p.stat().st_size for p in paths), stream)
    start = time.perf_counter()
    with IndexedDatasetWriter(output_prefix, tokenizer.vocab_size) as writer:
        for tokens, lengths in encode_batches(
            batches(reader, batch_bytes), tokenizer_spec, workers, tokenizer=tokenizer
        ):
            writer.add_documents(tokens, lengths)
            bar.update(reader.bytes_read, writer.num_docs, writer.num_tokens)
    stats = PreprocessStats(
        writer.num_docs,
        writer.num_tokens,
        reader.bytes_read,
        time.perf_counter() - start,
        reader.skipped_empty,
    )
    bar.finish(stats.bytes, stats.documents, stats.tokens)
    return stats
