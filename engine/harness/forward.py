"""Forward-only passes of a Trainer's model on its layout, for scoring.

Every rank of the job calls `map_rows` with the same rows (lm-eval runs the same requests on
every rank: backend.py reports a world of one to it). Inside:
- data-parallel replicas split the rows (longest first, dealt round-robin) and trade their
  results at the end, so DP=2 scores twice the rows per pass;
- a replica's tensor-parallel ranks gather the vocabulary shards of a row's logits (the engine's
  head is column-parallel over the padded vocabulary; the padding is cut off here);
- under pipeline parallelism the rows go through the Trainer's own schedule, forward only, one
  row per microbatch, each row's logits reduced on the last stage as they come out, and the
  reductions sent to every stage.
Greedy decoding (`greedy`) keeps each row's keys and values in a KV cache
(engine/transformer/kv_cache.py) where the whole model is on one stage: a prefill of the rows,
then one token per row per pass (under sequence parallelism a pass feeds each row's last TP
tokens, the new one last, so the step divides over TP). Under pipeline parallelism, or without
the cache, every pass reads each row whole again through `map_rows`.
Rows are right-padded: causal attention leaves a row's logits untouched by what follows it (the
way lm-eval's Hugging Face backend pads, without a mask). Without pipelining a pass is padded to
its longest row (rounded up to a multiple of TP under sequence parallelism); with it every pass is
[rows_per_pass, seq_length], the one shape torch's pipeline stages infer. Context parallelism
would need every row cut into CP chunks: refused here (the caller's error names the field).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.transformer.kv_cache import KVCache

# reduce(row index, that row's logits [row length, vocab] in fp32) -> a small picklable result
RowReduce = Callable[[int, torch.Tensor], Any]
# finished(row index, the tokens generated so far) -> whether the row stops growing
Finished = Callable[[int, list[int]], bool]


class LayoutForward:
    """Scores rows of token ids with a Trainer's model, on the layout the Trainer was built on."""

    def __init__(self, trainer, rows_per_pass: int = 8, pad_id: int = 0):
        if ps.get_size_of("cp") > 1:
            raise ValueError("parallel.context_parallel: evaluation runs without context parallelism; set it to 1")
        self.chunks = trainer.model_chunks
        for chunk in self.chunks:
            chunk.eval()  # no dropout
        self.pipeline = trainer.pipeline
        self.seq_length = trainer.config.seq_length
        self.vocab = trainer.config.true_vocab_size
        self.device = trainer.device
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        # torch's 1F1B runs at least one microbatch per stage
        self.rows_per_pass = max(rows_per_pass, ps.get_pipeline_model_parallel_world_size())
        self.pad_id = pad_id
        self.step_width = self.tp if trainer.config.sequence_parallel else 1
        self.caches = self.pipeline is None and trainer.config.mla is None
        self.tokens_read = 0  # real (unpadded) tokens fed to the model by this replica: throughput

    @torch.no_grad()
    def map_rows(self, rows: Sequence[Sequence[int]], reduce: RowReduce) -> list:
        """`reduce(i, logits)` of every row i, in row order, on every rank (a collective)."""
        for i, row in enumerate(rows):
            if not 0 < len(row) <= self.seq_length:
                raise ValueError(f"row {i} holds {len(row)} tokens: the model reads 1 to {self.seq_length}")
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        mine = order[self.dp_rank :: self.dp]
        found: dict[int, Any] = {}
        for start in range(0, len(mine), self.rows_per_pass):
            self._pass(rows, mine[start : start + self.rows_per_pass], reduce, found)
        if self.pipeline is not None:  # the last stage reduced every row: it tells the others
            box = [found]
            dist.broadcast_object_list(box, src=ps.get_group_ranks("pp")[-1], group=ps.get_group("pp"))
            found = box[0]
        if self.dp > 1:
            parts: list = [None] * self.dp
            dist.all_gather_object(parts, found, group=ps.get_group("dp"))
            found = {i: r for part in parts for i, r in part.items()}
        return [found[i] for i in range(len(rows))]

    @torch.no_grad()
    def greedy(self, rows: Sequence[Sequence[int]], budgets: Sequence[int], finished: Finished, kv_cache: bool = True):
        """Greedy continuations of every row, in row order, on every rank (a collective): row i
        grows by its argmax token until `finished(i, tokens so far)` or budgets[i] tokens. The
        caller keeps len(rows[i]) + budgets[i] within seq_length."""
        for i, row in enumerate(rows):
            if not 0 < len(row) <= self.seq_length - budgets[i]:
                raise ValueError(f"row {i}: {len(row)} tokens and {budgets[i]} more do not fit seq_length {self.seq_length}")
        if not (kv_cache and self.caches):
            return self._greedy_rereading(rows, budgets, finished)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        mine = [i for i in order[self.dp_rank :: self.dp] if budgets[i] > 0]
        made: dict[int, list[int]] = {i: [] for i in range(len(rows)) if budgets[i] == 0}
        for start in range(0, len(mine), self.rows_per_pass):
            made.update(self._greedy_cached(rows, mine[start : start + self.rows_per_pass], budgets, finished))
        if self.dp > 1:
            parts: list = [None] * self.dp
            dist.all_gather_object(parts, made, group=ps.get_group("dp"))
            made = {i: r for part in parts for i, r in part.items()}
        return [made[i] for i in range(len(rows))]

    def _greedy_rereading(self, rows, budgets, finished: Finished) -> list[list[int]]:
        made: list[list[int]] = [[] for _ in rows]
        active = [i for i, b in enumerate(budgets) if b > 0]
        while active:
            picks = self.map_rows([list(rows[i]) + made[i] for i in active], lambda _, logits: int(logits[-1].argmax()))
            for i, token in zip(active, picks, strict=True):
                made[i].append(token)
            active = [i for i in active if not finished(i, made[i]) and len(made[i]) < budgets[i]]
        return made

    def _greedy_cached(self, rows, picked: list[int], budgets, finished: Finished) -> dict[int, list[int]]:
        """One pass's rows: a prefill, then one token per row per step, from the cache."""
        model, b, w = self.chunks[0], len(picked), self.step_width
        seqs = [list(rows[i]) for i in picked]
        cache = KVCache(b, self.seq_length, self.device)
        width = math.ceil(max(len(r) for r in seqs) / w) * w
        logits = model(self._right_padded(seqs, width, b), kv_cache=cache)
        at = [len(r) - 1 for r in seqs]  # where each row's next token is read, in the step
        made: dict[int, list[int]] = {i: [] for i in picked}
        active = set(range(b))
        while True:
            picks = self._whole_vocab(logits[torch.arange(b), torch.as_tensor(at)]).argmax(dim=-1).tolist()
            for j in sorted(active):
                i = picked[j]
                made[i].append(picks[j])
                seqs[j].append(picks[j])
                if finished(i, made[i]) or len(made[i]) >= budgets[i]:
                    active.discard(j)
            if not active:
                return made
            # Each row's last w tokens (the new one last) at their positions: only the new one's
            # keys and values are new; a done row feeds its last window again.
            starts = [max(0, len(r) - w) for r in seqs]
            step = self._right_padded([row[s : s + w] for row, s in zip(seqs, starts, strict=True)], w, b, count_read=False)
            cache.starts = torch.as_tensor(starts, device=self.device)
            self.tokens_read += len(active)
            at = [len(r) - 1 - s for r, s in zip(seqs, starts, strict=True)]
            logits = model(step, kv_cache=cache)

    def _right_padded(self, rows, width: int, count: int, count_read: bool = True) -> torch.Tensor:
        """[count, width] tokens on the device: each row from the left, pad_id after it (and in
        the rows past len(rows)); the real tokens count in tokens_read unless count_read is off."""
        tokens = torch.full((count, width), self.pad_id, dtype=torch.long)
        for j, row in enumerate(rows):
            tokens[j, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            if count_read:
                self.tokens_read += len(row)
        return tokens.to(self.device)

    def _pass(self, rows, picked: list[int], reduce: RowReduce, found: dict) -> None:
        runner = self.pipeline
        if runner is None:
            width = math.ceil(max(len(rows[i]) for i in picked) / self.step_width) * self.step_width
            count = len(picked)
        else:
            width, count = self.seq_length, self.rows_per_pass
        tokens = self._right_padded([rows[i] for i in picked], width, count)

        def keep(j: int, logits: torch.Tensor) -> None:  # logits [width, vocab / tp] of pass row j
            if j < len(picked):  # the rest pad a pipelined pass
                i = picked[j]
                found[i] = reduce(i, self._whole_vocab(logits[: len(rows[i])]))

        if runner is None:
            out = self.chunks[0](tokens)
            for j in range(count):
                keep(j, out[j])
            return
        slots = torch.arange(count, device=self.device).reshape(count, 1)

        def loss_fn(out: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:  # one row per microbatch
            keep(int(slot[0, 0]), out[0])
            return out.new_zeros(())

        runner.evaluate(count, tokens if runner.has_first else None, slots if runner.has_last else None, loss_fn)

    def _whole_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.vocab].float()
