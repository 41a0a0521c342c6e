"""`data`: where samples come from. Shapes are checked here; files are opened on the ranks."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import Field, model_validator

from engine.jobspec.bert import MLMSpec
from engine.jobspec.common import _Section

SPEC_HELP = (
    "use 'byte', 'hf:PATH' (a tokenizer.json, or a folder with one) or "
    "'sentencepiece:PATH' (a SentencePiece .model file)"
)


def parse_tokenizer_spec(spec: str) -> tuple[str, str | None]:
    """('byte', None) | ('hf', path) | ('sentencepiece', path); ValueError naming data.tokenizer.
    Here, not beside the tokenizers, so that validating a job imports nothing else of the engine."""
    if spec == "byte":
        return "byte", None
    kind, sep, path = spec.partition(":")
    if sep and kind in ("hf", "sentencepiece") and path.strip():
        return kind, os.path.expanduser(path)
    raise ValueError(f"data.tokenizer {spec!r} is not supported: {SPEC_HELP}")


class DataSpec(_Section):
    """Where samples come from. Shapes are checked here; files are opened on the ranks, at start."""

    source: Literal["text", "synthetic", "indexed", "blend", "sft", "mlm", "span_corruption", "seq2seq"] = Field(
        "text",
        description="text: a UTF-8 file tokenised at start; indexed: a dataset written by `elastron "
        "preprocess` (data.path = its PREFIX); blend: several of those (data.blend); sft: chat "
        "conversations for fine-tuning, the loss on assistant tokens only (data.path); synthetic: "
        "seeded random tokens (benchmarks); mlm: masked-LM samples for arch bert from a text file or an "
        "indexed dataset (data.mlm). Encoder-decoder (model.arch t5): span_corruption: T5's "
        "pretraining spans over a text file (data.path, default the shipped corpus); seq2seq: input -> "
        "target pairs, JSON lines (data.path).",
    )
    mlm: MLMSpec | None = Field(
        None,
        exclude_if=lambda v: v is None,  # other sources' specs dump as they always did
        description="source=mlm: the masking and BERT's special token ids (default: data.mlm's defaults).",
    )
    path: str | None = Field(
        None,
        description="source=text: a UTF-8 file (default: the corpus shipped with elastron); "
        "source=indexed: the PREFIX of PREFIX.bin/PREFIX.idx; source=sft: a JSON-lines file (local or "
        's3://bucket/key), one conversation per line: {"messages": [{"role", "content"}, ...]} or '
        '{"prompt", "response"}, rendered with the chat_template of the tokenizer_config.json beside an '
        "hf: tokenizer, else a plain <|role|> template.",
    )
    packing: bool = Field(
        False,
        description="source=sft: pack several whole conversations into each seq_length row (exact: "
        "attention stays within a conversation and positions restart); training.global_batch_size "
        "then counts packed rows. Not with parallel.context > 1.",
    )
    tokenizer: str = Field(
        "byte",
        description="byte (no files), hf:PATH (a tokenizer.json or a folder with one) or "
        "sentencepiece:PATH (a .model file); for indexed data, the one it was preprocessed with.",
    )
    blend: list[tuple[float, str]] | None = Field(
        None,
        description="[[weight, prefix], ...]: indexed datasets mixed in exactly these proportions "
        "(weights are relative); implies source=blend.",
    )
    split: str | list[float] | None = Field(
        None,
        description='train/valid/test shares, by documents: "949,50,1" or [98, 1, 1] (missing shares '
        "are 0); default: every document trains. Not for source=synthetic.",
    )
    cache_dir: str | None = Field(
        None, description="Folder for the cached per-epoch sample indexes; default: next to the data."
    )

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("tokenizer"), str):
            parse_tokenizer_spec(data["tokenizer"])
        if data.get("blend") is not None:
            data["blend"] = _check_blend(data["blend"])
        if data.get("split") is not None:
            data["split"] = _check_split(data["split"])
        return data

    @model_validator(mode="after")
    def _sources(self) -> DataSpec:
        if self.blend is not None and "source" not in self.model_fields_set:
            self.source = "blend"
        if self.source == "blend":
            if self.blend is None:
                raise ValueError("data.source blend needs data.blend: [[weight, prefix], ...]")
            if self.path is not None:
                raise ValueError(
                    "data.path is not used with data.source blend: the prefixes go in data.blend"
                )
        elif self.blend is not None:
            raise ValueError(
                f"data.blend is set but data.source is {self.source}: set data.source to blend, or drop data.blend"
            )
        if self.source == "indexed" and not self.path:
            raise ValueError(
                "data.source indexed needs data.path: the PREFIX given to `elastron preprocess --output`"
            )
        if self.source == "sft" and not self.path:
            raise ValueError(
                'data.source sft needs data.path: a JSON-lines file with one {"messages": [...]} or '
                '{"prompt": ..., "response": ...} object per line'
            )
        if self.source == "seq2seq" and not self.path:
            raise ValueError(
                'data.source seq2seq needs data.path: a JSON-lines file with one {"input": ..., "target": ...} '
                '(or {"prompt": ..., "response": ...}, or {"messages": [...]}) object per line'
            )
        if self.packing and self.source != "sft":
            raise ValueError(
                f"data.packing applies to data.source sft only (this job's source is {self.source}): "
                "set data.source: sft or drop data.packing"
            )
        if self.source == "mlm" and self.mlm is None:
            self.mlm = MLMSpec()
        elif self.source != "mlm" and self.mlm is not None:
            raise ValueError(f"data.mlm applies to data.source mlm only (this job's source is {self.source}): drop it")
        if self.source == "synthetic" and self.split is not None:
            raise ValueError(
                "data.split does not apply to data.source synthetic (it has no documents): drop it"
            )
        return self


def _check_blend(blend: Any) -> list[list[Any]]:
    form = "write data.blend as [[weight, prefix], ...], e.g. [[0.7, data/web], [0.3, data/code]]"
    if not isinstance(blend, list | tuple) or not blend:
        raise ValueError(f"data.blend must be a non-empty list: {form}")
    out = []
    for i, entry in enumerate(blend):
        if not isinstance(entry, list | tuple) or len(entry) != 2:
            raise ValueError(f"data.blend[{i}] is {entry!r}, not a [weight, prefix] pair: {form}")
        weight, prefix = entry
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ValueError(f"data.blend[{i}]: the weight must be a positive number, got {weight!r}")
        if not isinstance(prefix, str) or not prefix.strip():
            raise ValueError(
                f"data.blend[{i}]: the prefix must be a non-empty string (the --output of `elastron "
                f"preprocess`), got {prefix!r}"
            )
        out.append([float(weight), prefix])
    return out


def _check_split(split: Any) -> list[float]:
    form = 'write data.split as "949,50,1" or [98, 1, 1] (train, valid, test)'
    if isinstance(split, str):
        try:
            parts = [float(p) for p in split.replace("/", ",").split(",")]
        except ValueError:
            raise ValueError(f"data.split {split!r} is not a list of numbers: {form}") from None
    elif isinstance(split, list | tuple) and all(
        isinstance(p, int | float) and not isinstance(p, bool) for p in split
    ):
        parts = [float(p) for p in split]
    else:
        raise ValueError(f"data.split {split!r} is not a list of numbers: {form}")
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"data.split has {len(parts)} shares: give 1 to 3 (train, valid, test); {form}")
    if any(not math.isfinite(p) or p < 0 for p in parts):
        raise ValueError(f"data.split shares must be non-negative numbers, got {split!r}")
    if parts[0] <= 0:
        raise ValueError(
            f"data.split gives training no documents ({split!r}): the first share must be positive"
        )
    return parts + [0.0] * (3 - len(parts))
