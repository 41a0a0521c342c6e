"""Tokenizers behind one small interface, chosen by the job's `data.tokenizer` string.

A spec is `byte` (256 bytes + EOD, needs no files: the embedded default), `hf:PATH` (a Hugging
Face `tokenizers` tokenizer.json, or a folder holding one) or `sentencepiece:PATH` (a
SentencePiece .model file); `hf:s3://bucket/model` (a model folder on S3, the default for
`model.init_from: s3://...`) is copied to a local cache first. Nothing is downloaded from a hub:
a spec whose file is missing raises
FileNotFoundError naming the file and the `data.tokenizer` field, before any work starts.

The end-of-document (EOD) id comes from the tokenizer's own special tokens (`<|endoftext|>`,
`</s>`, `<eos>`, ... or SentencePiece's eos id). A tokenizer with none of them is refused with a
message saying which token to add, rather than given an extra id past its vocabulary: such an id
would decode to nothing and a model trained with it could not be served by that same tokenizer
file. `preprocess` appends EOD after every document; the GPT samples cross documents through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from engine.jobspec.data import parse_tokenizer_spec  # the spec's own rule; re-exported

# Looked up in this order: the first one the tokenizer knows is its end-of-document token.
# "[SEP]" last: a BERT WordPiece tokenizer has no other, and [SEP] is what separates its documents.
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>", "[EOS]", "[SEP]")



@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs: ids in [0, vocab_size), and one id that ends a document."""

    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


class ByteTokenizer:
    """UTF-8 bytes are the ids 0..255; 256 is EOD. Needs no files, so it is the default."""

    vocab_size = 257
    eod = 256
    spec = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _missing_package(package: str, spec: str) -> ImportError:
    return ImportError(f"data.tokenizer {spec!r} needs the Python package {package!r}: pip install {package}")


def _no_eod(spec: str, known: str) -> ValueError:
    return ValueError(
        f"data.tokenizer {spec!r} has no end-of-document token: none of {', '.join(EOD_CANDIDATES)} is in "
        f"its vocabulary{known}. Add one as a special token when training the tokenizer "
        "(e.g. special_tokens=['<|endoftext|>'])"
    )


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a local tokenizer.json (no hub access)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        self.spec = f"hf:{path}"
        if not file.is_file():
            raise FileNotFoundError(
                f"data.tokenizer {self.spec!r}: no such file {file} (hf: needs a tokenizer.json saved by "
                "the `tokenizers` library; nothing is downloaded)"
            )
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise _missing_package("tokenizers", self.spec) from None
        try:
            self._tok = _HF.from_file(str(file))
        except Exception as err:  # the Rust side raises a bare Exception on a bad file
            raise ValueError(f"data.tokenizer {self.spec!r}: {file} is not a tokenizer.json: {err}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        for token in EOD_CANDIDATES:
            found = self._tok.token_to_id(token)
            if found is not None:
                self.eod = found
                break
        else:
            raise _no_eod(self.spec, "")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def token_to_id(self, token: str) -> int | None:
        """A named token's id (BERT's [MASK], T5's <extra_id_0>), None where the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self._tok.id_to_token(index)


class SentencePieceTokenizer:
    """A SentencePiece model file. EOD is the model's eos id (`</s>` unless trained otherwise)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.spec = f"sentencepiece:{path}"
        if not path.is_file():
            raise FileNotFoundError(
                f"data.tokenizer {self.spec!r}: no such file {path} (sentencepiece: needs the .model file "
                "written by SentencePiece's trainer; nothing is downloaded)"
            )
        try:
            import sentencepiece as spm
        except ImportError:
            raise _missing_package("sentencepiece", self.spec) from None
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as err:
            raise ValueError(
                f"data.tokenizer {self.spec!r}: {path} is not a SentencePiece model: {err}"
            ) from None
        self.vocab_size = self._sp.get_piece_size()
        eod = self._sp.eos_id()
        if eod < 0:  # trained with eos_id=-1: fall back on a piece that names itself an EOD
            unk = self._sp.unk_id()
            eod = next(
                (i for t in EOD_CANDIDATES if (i := self._sp.piece_to_id(t)) != unk and i < self.vocab_size),
                -1,
            )
        if eod < 0:
            raise _no_eod(self.spec, " and the model has no eos id (it was trained with eos_id=-1)")
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        """A named piece's id, None where the model lacks it (SentencePiece answers unk)."""
        found = self._sp.piece_to_id(token)
        return None if found == self._sp.unk_id() else found

    def id_to_token(self, index: int) -> str | None:
        return self._sp.id_to_piece(index)


# The files of a Hugging Face tokenizer folder (tokenizer.json, and what chat templates and
# special tokens live in).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def local_tokenizer_path(path: str) -> str:
    """`path` itself, or for an `s3://` folder (a model folder named by model.init_from) a local
    copy of its tokenizer files, fetched once per machine into a cache keyed by the URI."""
    if not path.startswith("s3://"):
        return path
    import hashlib
    import os
    import tempfile

    from engine.checkpointing.backends import open_storage

    local = Path(tempfile.gettempdir()) / "elastron-tokenizers" / hashlib.sha256(path.encode()).hexdigest()[:16]
    if not (local / "tokenizer.json").is_file():
        storage = open_storage(path)
        local.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=local.parent))
        for name in HF_TOKENIZER_FILES:
            if storage.exists(name):
                storage.get_file(name, staging / name)
        if not (staging / "tokenizer.json").is_file():
            raise FileNotFoundError(f"data.tokenizer 'hf:{path}': no tokenizer.json in {path}")
        try:
            os.rename(staging, local)  # atomic: ranks of one machine race to the same folder
        except OSError:
            pass  # another rank got there first; its copy is the same files
    return str(local)


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer | SentencePieceTokenizer:
    """The tokenizer a `data.tokenizer` string names (see the module docstring for the forms)."""
    kind, path = parse_tokenizer_spec(spec)
    if kind == "hf":
        return HFTokenizer(local_tokenizer_path(path))
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path)
    return ByteTokenizer()


def write_corpus_bpe(folder: str | Path, corpus: str | Path, vocab_size: int = 300) -> Path:
    """A small byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json, EOD
    `<|endoftext|>` = id 0) trained on the text file `corpus` (the shipped one:
    engine.data.sources.SHIPPED_CORPUS) into `folder`: an `hf:` tokenizer that transformers and
    lm-eval load too, for tests, benches and a first try without a download."""
    import json

    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder
