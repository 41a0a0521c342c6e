"""lm-eval's model interface on our engine: `ElastronLM`, a `TemplateLM` over forward.LayoutForward.

It scores as lm-eval's own Hugging Face backend (lm_eval/models/huggingface.py) does, so the two
give the same numbers for the same weights (tests/engine/test_harness.py):
- loglikelihood: the row is (context + continuation)[-(max_length + 1):][:-1]; the continuation's
  tokens are scored by the logits of the row's last len(continuation) positions; `is_greedy`
  when each of them is that position's argmax;
- loglikelihood_rolling: lm-eval's disjoint rolling windows of max_length tokens (the first
  prefixed by the end-of-text token), their loglikelihoods summed per document;
- generate_until: greedy only; the context left-truncated to max_length - max_gen_toks, tokens
  appended until end-of-text, a stop string in the decoded text, or max_gen_toks, then cut at
  the first stop string; decoded from a KV cache where the model is on one pipeline stage
  (forward.LayoutForward.greedy), every row re-read per token otherwise.
Every rank runs the same requests (the world lm-eval sees is one process); the layout's ranks
share the work inside LayoutForward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from engine.harness.forward import LayoutForward

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's Hugging Face backend's default


class ElastronLM(TemplateLM):
    def __init__(
        self, forward: LayoutForward, tokenizer, *, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, kv_cache: bool = True
    ):
        super().__init__()
        self.kv_cache = kv_cache
        self.forward = forward
        self.tok = tokenizer
        self.max_length = forward.seq_length
        self.max_gen_toks = max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)  # our tokenizers add no special tokens

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tok.decode(tokens)

    def _eot_text(self) -> str | None:
        """The end-of-text token as text, a stop string of every generation (as lm-eval's HF
        backend adds it); None for a tokenizer whose ids have no names (bytes)."""
        name = getattr(self.tok, "id_to_token", None)
        return name(self.eot_token_id) if name else None

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows, targets = [], []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.max_length + 1) :]
            if len(continuation) >= len(whole):
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens does not fit the model's seq_length "
                    f"{self.max_length} with its context"
                )
            rows.append(whole[:-1])
            targets.append(torch.as_tensor(continuation, dtype=torch.long))

        def score(i: int, logits: torch.Tensor) -> tuple[float, bool]:
            target = targets[i].to(logits.device)
            logprobs = F.log_softmax(logits[len(rows[i]) - len(target) :], dim=-1)
            greedy = bool((logprobs.argmax(dim=-1) == target).all())
            return float(logprobs.gather(-1, target[:, None]).sum()), greedy

        return self.forward.map_rows(rows, score)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for k, (string,) in enumerate(req.args for req in requests):
            rolling = utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[k] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eot_text = self._eot_text()
        rows, stops, budgets = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("generation kwargs: do_sample is not supported; this backend decodes greedily")
            stops.append(handle_stop_sequences(kwargs.pop("until", None), eos=eot_text))
            budget = kwargs.pop("max_gen_toks")
            if budget >= self.max_length:
                raise ValueError(f"max_gen_toks {budget} must be below the model's seq_length {self.max_length}")
            budgets.append(budget)
            rows.append(self.tok_encode(context)[-(self.max_length - budget) :])

        def finished(i: int, made: list[int]) -> bool:
            return made[-1] == self.eot_token_id or any(s and s in self.tok_decode(made) for s in stops[i])

        made = self.forward.greedy(rows, budgets, finished, kv_cache=self.kv_cache)
        return [
            postprocess_generated_text(self.tok_decode(m), stop, think_end_token=None)
            for m, stop in zip(made, stops, strict=True)
        ]
