"""Supervised fine-tuning samples: chat conversations rendered to token ids with a loss mask.

A data file is JSON lines, one conversation per line: `{"messages": [{"role", "content"}, ...]}`
or the shorthand `{"prompt": ..., "response": ...}` (a user turn, then an assistant turn).

Rendering. With a `chat_template` in the `tokenizer_config.json` beside an `hf:` tokenizer, the
conversation is rendered as transformers' `apply_chat_template` does it: a sandboxed jinja2
environment, `messages`, `add_generation_prompt=False`, `bos_token` / `eos_token` from the config.
Without one the plain template is used: `<|role|>\\ncontent\\n` per message, then EOD.

Which tokens train (the mask). The conversation is rendered once per prefix: messages[:1],
messages[:2], ... Each message owns the text the prefix grew by, and that text is tokenised on its
own; the sample is the concatenation of these pieces, so the mask (1 on an assistant message's
piece) matches the ids exactly. Limits: (1) the template must render a prefix of a conversation
as a textual prefix of the whole (true of Llama-3/ChatML-style templates; a template that rewrites
earlier turns, e.g. drops "thinking" from past assistant turns, is refused with an error);
(2) tokens never merge across a turn boundary, so the ids can differ from tokenising the whole
string at a boundary (harmless with special-token delimiters); (3) an assistant piece contains the
template's own header/footer text for that turn (e.g. `<|start_header_id|>assistant...` and
`<|eot_id|>`), so the model also learns to emit the turn's closing token -- the usual choice.

A sample is `seq_length + 1` tokens: long conversations are truncated (counted, and logged once),
short ones padded with EOD; padding is masked. Samples are addressed by a global index and the
conversations reshuffled per epoch with the job's seed, as `TextSource` does, so a run resumes
exactly from its consumed-sample count.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from engine.data.sources import SampleBatch, TokenSource

IGNORE_INDEX = -100
log = logging.getLogger(__name__)


def _read_text(path: str | Path) -> str:
    """A local file, or an object at s3://bucket/key (read through the checkpoint storage's S3
    client: the same credentials chain and AWS_ENDPOINT_URL)."""
    if isinstance(path, str) and path.startswith("s3://"):
        from engine.checkpointing.backends import open_storage

        folder, _, key = path.rpartition("/")
        if not key or folder == "s3:/":
            raise ValueError(f"data.path {path}: give the object, s3://bucket/prefix/file.jsonl")
        try:
            return open_storage(folder).get_bytes(key).decode("utf-8")
        except FileNotFoundError:
            raise FileNotFoundError(f"data.path: no such object {path}") from None
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"data.path: no such file {path}") from None


def json_lines(path: str | Path, expected: str) -> Iterator[tuple[str, dict]]:
    """(where, object) for each non-blank line of a JSON-lines file (local, or s3://); `where`
    names the file and line for the caller's own field errors, `expected` what an object holds."""
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"data.path {path} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where}: not valid JSON ({err.msg}); each line must be one JSON object"
            ) from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object {expected}")
        yield where, record


def load_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """Each line of a JSON-lines file (local, or s3://) as a list of messages; errors name the
    file, line and field."""
    out: list[list[dict[str, str]]] = []
    for where, record in json_lines(path, "with 'messages' or 'prompt' and 'response'"):
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError(
                    f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects"
                )
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    raise ValueError(f"{where}: field 'messages[{i}].role' is missing or not a string")
                if not isinstance(m.get("content"), str):
                    raise ValueError(f"{where}: field 'messages[{i}].content' is missing or not a string")
            msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        elif "prompt" in record or "response" in record:
            for field in ("prompt", "response"):
                if not isinstance(record.get(field), str):
                    raise ValueError(f"{where}: field '{field}' is missing or not a string")
            msgs = [
                {"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["response"]},
            ]
        else:
            raise ValueError(f"{where}: field 'messages' is missing (or give 'prompt' and 'response')")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: field 'messages' has no assistant turn: nothing would train")
        out.append(msgs)
    if not out:
        raise ValueError(f"data.path {path}: no conversations (the file is empty)")
    return out


def read_chat_template(tokenizer_spec_path: str | Path) -> tuple[str | None, str, str]:
    """(chat_template or None, bos_token, eos_token) from the tokenizer_config.json beside a tokenizer."""
    path = Path(tokenizer_spec_path)
    config_file = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    if not config_file.is_file():
        return None, "", ""
    config = json.loads(config_file.read_text(encoding="utf-8"))

    def token(value) -> str:
        if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
            value = value.get("content")
        return value if isinstance(value, str) else ""

    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template, token(config.get("bos_token")), token(config.get("eos_token"))


class ChatRenderer:
    """Conversation -> (ids, mask) where mask is 1 on the tokens of assistant turns."""

    def __init__(self, tokenizer, chat_template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.tokenizer = tokenizer
        self._template = None
        if chat_template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(f"chat template: {message}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(chat_template)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render_text(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return self._template.render(
            messages=messages, add_generation_prompt=False, bos_token=self.bos_token, eos_token=self.eos_token
        )

    def render(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        mask: list[int] = []
        previous = ""
        for i, m in enumerate(messages):
            text = self.render_text(messages[: i + 1])
            if not text.startswith(previous):
                raise ValueError(
                    "chat template renders a conversation's prefix differently from the whole "
                    f"(message {i}): per-turn loss masks need a prefix-stable template"
                )
            piece = self.tokenizer.encode(text[len(previous) :])
            ids.extend(piece)
            mask.extend([1 if m["role"] == "assistant" else 0] * len(piece))
            previous = text
        tail = self.render_text(messages)[len(previous) :]  # nothing with a prefix-stable template
        if tail:
            piece = self.tokenizer.encode(tail)
            ids.extend(piece)
            mask.extend([0] * len(piece))
        if self._template is None:  # the plain template ends a conversation with EOD, trained
            ids.append(self.tokenizer.eod)
            mask.append(1 if messages[-1]["role"] == "assistant" else 0)
        return ids, mask


def render_samples(
    conversations: list[list[dict[str, str]]], renderer: ChatRenderer, width: int, where: str | Path
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(ids, mask) of each conversation, cut to `width` tokens, and how many were cut (logged once)."""
    out, truncated = [], 0
    for messages in conversations:
        ids, mask = renderer.render(messages)
        if len(ids) > width:
            truncated += 1
            ids, mask = ids[:width], mask[:width]
        out.append((ids, mask))
    if truncated:
        log.warning(
            "data.path %s: %d of %d conversations are longer than model.seq_length + 1 = %d tokens "
            "and were truncated",
            where,
            truncated,
            len(conversations),
            width,
        )
    return out, truncated


class SFTSource(TokenSource):
    """Samples of seq_length + 1 token ids with a loss mask, one conversation each.

    `conversations`: already loaded (a split of the file); default: all of `path`."""

    def __init__(
        self,
        path: str | Path,
        tokenizer,
        seq_length: int,
        seed: int,
        renderer: ChatRenderer | None = None,
        conversations: list[list[dict[str, str]]] | None = None,
    ):
        samples, width = self._render(path, tokenizer, seq_length, seed, renderer, conversations)
        self.tokens = torch.full((len(samples), width), self.pad, dtype=torch.long)
        self.mask = torch.zeros((len(samples), width), dtype=torch.bool)
        for row, (ids, mask) in enumerate(samples):
            self.tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            self.mask[row, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
        self.num_samples = len(samples)
        self._perm_epoch, self._perm = -1, torch.arange(0)

    def _render(self, path, tokenizer, seq_length, seed, renderer, conversations) -> tuple[list, int]:
        """Every conversation rendered to (ids, mask), at most seq_length + 1 tokens (the width)."""
        self.renderer = renderer or ChatRenderer(tokenizer)
        self.seq_length, self.seed, self.pad = seq_length, seed, tokenizer.eod
        conversations = load_conversations(path) if conversations is None else conversations
        width = seq_length + 1
        samples, self.truncated = render_samples(conversations, self.renderer, width, path)
        return samples, width

    def _row(self, index: int) -> int:
        epoch, i = divmod(index, self.num_samples)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.num_samples, generator=g), epoch
        return int(self._perm[i])

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[self._row(index)]

    def loss_mask(self, index: int) -> torch.Tensor:
        """[seq_length + 1] bool: which of the sample's tokens train (as a label)."""
        return self.mask[self._row(index)]

    def micro_batch(
        self, consumed_samples: int, microbatch: int, micro_batch_size: int, dp_size: int, dp_rank: int
    ) -> SampleBatch:
        return SampleBatch(*sft_micro_batch(self, consumed_samples, microbatch, micro_batch_size, dp_size, dp_rank))

    def label_tokens(self, start: int, count: int) -> int:
        """Unmasked label tokens of samples [start, start + count): a global batch's loss divisor."""
        return int(sum(int(self.loss_mask(i)[1:].sum()) for i in range(start, start + count)))


def sft_micro_batch(
    source: SFTSource,
    consumed_samples: int,
    microbatch: int,
    micro_batch_size: int,
    dp_size: int,
    dp_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, labels) as `sources.micro_batch`, labels IGNORE_INDEX where the mask is 0."""
    base = consumed_samples + microbatch * micro_batch_size * dp_size + dp_rank * micro_batch_size
    rows = torch.stack([source[base + j] for j in range(micro_batch_size)])
    masks = torch.stack([source.loss_mask(base + j) for j in range(micro_batch_size)])
    labels = rows[:, 1:].masked_fill(~masks[:, 1:], IGNORE_INDEX)
    return rows[:, :-1], labels
