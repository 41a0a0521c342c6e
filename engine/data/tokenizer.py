"""Byte-level tokenizer: the embedded default that needs no files (vocabulary: 256 bytes + EOD)."""

from __future__ import annotations


class ByteTokenizer:
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_tokenizer(name: str) -> ByteTokenizer:
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"data.tokenizer {name!r} is not supported: use 'byte'")
