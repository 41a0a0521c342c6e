"""The job specification: the one contract shared by the CLI, the REST API and the workers.

It is pure pydantic (no torch) so the control plane can validate a job on a machine without
torch. Every rule that can be checked before a single process starts is checked here, and each
error names the field and says how to fix it; anything a running engine would trip over later
(heads that do not split over tensor ranks, a batch that does not divide) belongs here, not in
the engine.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Strict: YAML's `true` or `yes` in an integer field is an error, not a silent 1. Bounded by
# what the store's integer columns hold (and far beyond any real size): the spec is validated
# on the API's request path, where an unbounded number could cost unbounded work.
INT_MAX = 2**31 - 1
PositiveInt = Annotated[int, Field(ge=1, le=INT_MAX, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, le=INT_MAX, strict=True)]


class _Section(BaseModel):
    # Unknown keys are an error: a misspelt `tensor_paralel` must not silently train on TP=1.
    # Floats are finite: an infinite learning rate or loss scale is no setting.
    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)


def _divisors(n: int, most: int = 24) -> str:
    """The divisors of n for a 'pick one of' hint: O(sqrt n), and at most `most` of them (n comes
    from the request being validated, so this must stay cheap whatever it is)."""
    small, large, d = [], [], 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    found = small + large[::-1]
    shown = ", ".join(str(x) for x in found[:most])
    return shown if len(found) <= most else f"{shown}, ... ({len(found)} in all)"


class MoESpec(_Section):
    """Mixture of Experts in the decoder's feed-forward blocks (Megatron-Core's names)."""

    num_experts: PositiveInt
    top_k: PositiveInt = 2
    layer_freq: PositiveInt = Field(1, description="Every N-th layer is MoE (1: all), counting from layer 0.")
    layer_pattern: list[Annotated[int, Field(ge=0, le=1, strict=True)]] | None = Field(
        None, description="One 0/1 per layer (1: MoE); overrides layer_freq."
    )
    ffn_hidden_size: PositiveInt | None = Field(
        None, description="Per expert; default: model.ffn_hidden_size."
    )
    shared_expert_ffn_hidden_size: PositiveInt | None = Field(
        None, description="A dense expert every token also goes through; default: none."
    )
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    aux_loss_coeff: float = Field(1e-2, ge=0.0, description="Load-balancing loss weight, per micro-batch.")
    z_loss_coeff: float = Field(0.0, ge=0.0, description="Router z-loss weight.")
    expert_bias: bool = Field(False, description="Aux-loss-free balancing: a per-expert bias on the pick.")
    expert_bias_update_rate: float = Field(1e-3, gt=0.0)
    capacity_factor: float | None = Field(
        None, gt=0.0, description="Tokens per expert at most capacity_factor x the even share; extra dropped."
    )

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) is larger than model.moe.num_experts ({self.num_experts})"
            )
        return self


class ModelSpec(_Section):
    """Architecture, with Megatron-Core's names. `arch` picks the family defaults."""

    arch: Literal["gpt2", "llama"] = "llama"
    num_layers: PositiveInt = 2
    hidden_size: PositiveInt = 64
    num_attention_heads: PositiveInt = 4
    num_query_groups: PositiveInt | None = Field(
        None, description="Grouped-query attention groups; default: one per head (plain multi-head)."
    )
    ffn_hidden_size: PositiveInt | None = Field(
        None, description="Default: 4*hidden (gpt2), or 8/3*hidden rounded up to 64 (llama, SwiGLU)."
    )
    vocab_size: PositiveInt | None = Field(None, description="Default: the tokenizer's vocabulary size.")
    make_vocab_size_divisible_by: PositiveInt = Field(
        128,
        description="Pad the embedding table to a multiple of this (must be divisible by parallel.tensor).",
    )
    seq_length: PositiveInt = 128
    tie_embeddings: bool | None = Field(None, description="Default: true for gpt2, false for llama.")
    hidden_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    norm_epsilon: float = Field(1e-5, gt=0.0)
    rotary_base: float = Field(10000.0, gt=0.0)
    init_method_std: float = Field(0.02, gt=0.0)
    moe: MoESpec | None = Field(None, description="Mixture of Experts feed-forward layers; default: dense.")

    @model_validator(mode="after")
    def _arch_defaults(self) -> ModelSpec:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.arch == "gpt2":
                self.ffn_hidden_size = 4 * self.hidden_size
            else:
                self.ffn_hidden_size = 64 * math.ceil(8 * self.hidden_size / 3 / 64)
        if self.tie_embeddings is None:
            self.tie_embeddings = self.arch == "gpt2"
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_attention_heads "
                f"({self.num_attention_heads}): pick heads from {_divisors(self.hidden_size)}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups ({self.num_query_groups}) must divide model.num_attention_heads "
                f"({self.num_attention_heads}): pick one of {_divisors(self.num_attention_heads)}"
            )
        if (
            self.moe is not None
            and self.moe.layer_pattern is not None
            and len(self.moe.layer_pattern) != self.num_layers
        ):
            raise ValueError(
                f"model.moe.layer_pattern has {len(self.moe.layer_pattern)} entries for model.num_layers "
                f"({self.num_layers}): give one 0/1 per layer"
            )
        if self.arch == "llama" and (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                "model.hidden_size / model.num_attention_heads (the head size) must be even for rotary "
                f"embeddings (llama), got {self.hidden_size // self.num_attention_heads}"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class ParallelSpec(_Section):
    """Parallel layout. Data parallel size is derived: ranks / (tensor*pipeline*context)."""

    tensor: PositiveInt = 1
    pipeline: PositiveInt = 1
    virtual_pipeline: PositiveInt | None = None
    context: PositiveInt = 1
    expert: PositiveInt = 1
    sequence_parallel: bool = Field(
        False, description="Shard activations along the sequence between TP regions (no-op when tensor=1)."
    )
    pipeline_layers: list[PositiveInt] | None = Field(
        None,
        description="Layers per (virtual) pipeline stage, in stage order; default: an even split. "
        "Length pipeline x virtual_pipeline, sum model.num_layers.",
    )
    distributed_optimizer: bool = Field(
        False,
        description="ZeRO-1: each data-parallel rank keeps optimizer state for its slice of the params.",
    )
    grad_reduce_in_fp32: bool = Field(
        True, description="Accumulate and reduce gradients in fp32 even when params are bf16/fp16."
    )
    overlap_grad_reduce: bool = Field(
        True, description="Launch each gradient bucket's reduction during backward."
    )
    grad_bucket_size: PositiveInt = Field(
        40_000_000, description="Gradient elements per data-parallel communication bucket."
    )


class DataSpec(_Section):
    """Where samples come from. Shapes are checked here; files are opened on the ranks, at start."""

    source: Literal["text", "synthetic", "indexed", "blend"] = Field(
        "text",
        description="text: a UTF-8 file tokenised at start; indexed: a dataset written by `elastron "
        "preprocess` (data.path = its PREFIX); blend: several of those (data.blend); synthetic: seeded "
        "random tokens (benchmarks).",
    )
    path: str | None = Field(
        None,
        description="source=text: a UTF-8 file (default: the corpus shipped with elastron); "
        "source=indexed: the PREFIX of PREFIX.bin/PREFIX.idx.",
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
            from engine.data.tokenizer import parse_tokenizer_spec  # no torch, no tokenizer packages

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


class TrainingSpec(_Section):
    global_batch_size: PositiveInt = 8
    micro_batch_size: PositiveInt = 1
    train_iters: PositiveInt = 10
    seed: int = Field(1234, ge=0, le=2**63 - 1, strict=True)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    rampup_batch_size: tuple[PositiveInt, PositiveInt, PositiveInt] | None = Field(
        None,
        description="[start, increment, ramp_samples]: grow the global batch step-wise (Megatron-Core's rampup).",
    )
    log_interval: PositiveInt = 1
    eval_interval: PositiveInt | None = Field(
        None,
        description="Evaluate on the validation split every N iterations (needs data.split with a valid share).",
    )
    eval_iters: PositiveInt = Field(10, description="Global batches of validation data per evaluation.")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation: selective = attention core only; full = whole layers."
    )
    initial_loss_scale: float = Field(2.0**16, gt=0.0, description="fp16: starting dynamic loss scale.")
    min_loss_scale: float = Field(1.0, gt=0.0, description="fp16: the scale never drops below this.")
    loss_scale_window: PositiveInt = Field(
        1000, description="fp16: raise the scale after this many good steps."
    )
    hysteresis: PositiveInt = Field(
        2, description="fp16: overflowing steps tolerated before lowering the scale."
    )


class OptimizerSpec(_Section):
    type: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0.0)
    min_lr: float = Field(0.0, ge=0.0)
    weight_decay: float = Field(0.01, ge=0.0)
    start_weight_decay: float | None = Field(None, ge=0.0)
    end_weight_decay: float | None = Field(None, ge=0.0)
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.95, ge=0.0, lt=1.0)
    adam_eps: float = Field(1e-8, gt=0.0)
    clip_grad: float = Field(1.0, ge=0.0, description="Global grad-norm clip; 0 disables clipping.")
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "cosine"
    lr_warmup_iters: NonNegativeInt = 0
    lr_warmup_init: float = Field(0.0, ge=0.0)
    lr_decay_iters: PositiveInt | None = Field(None, description="Default: training.train_iters.")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    lr_wsd_decay_iters: NonNegativeInt | None = Field(
        None, description="Anneal length for WSD (required for WSD)."
    )

    @model_validator(mode="after")
    def _check(self) -> OptimizerSpec:
        if self.min_lr > self.lr:
            raise ValueError(f"optimizer.min_lr ({self.min_lr}) must not exceed optimizer.lr ({self.lr})")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None:
            raise ValueError("optimizer.lr_wsd_decay_iters is required when optimizer.lr_decay_style is WSD")
        if self.lr_warmup_init > self.lr:
            raise ValueError(
                f"optimizer.lr_warmup_init ({self.lr_warmup_init}) must not exceed optimizer.lr ({self.lr})"
            )
        if (self.start_weight_decay is None) != (self.end_weight_decay is None):
            raise ValueError(
                "optimizer.start_weight_decay and optimizer.end_weight_decay go together: set both or neither"
            )
        if self.start_weight_decay is not None:
            start, end = self.start_weight_decay, self.end_weight_decay
            if end < start:
                raise ValueError(
                    f"optimizer.end_weight_decay ({end}) is below optimizer.start_weight_decay ({start}): "
                    "weight decay can only increase over the run"
                )
            if start != end and self.weight_decay_incr_style == "constant":
                raise ValueError(
                    "optimizer.start_weight_decay and optimizer.end_weight_decay differ but "
                    "optimizer.weight_decay_incr_style is constant: set it to linear or cosine"
                )
        return self


class CheckpointSpec(_Section):
    path: str | None = Field(
        None,
        description="Checkpoint root: a local path, file://path or s3://bucket/prefix. Jobs write <root>/<name>/.",
    )
    interval: PositiveInt | None = Field(
        None, description="Save every N iterations (and at the end of training)."
    )
    resume: Literal["auto", "never"] = Field(
        "auto", description="auto: continue from the newest committed checkpoint under path, if any."
    )
    resume_from: str | None = Field(
        None,
        description="Load another job's checkpoint instead: its root (newest) or one iter_NNNNNNN folder.",
    )
    keep: PositiveInt = Field(
        3, description="Committed checkpoints kept; older ones are deleted after a newer commits."
    )
    async_save: bool = Field(False, description="Write shards in the background while training continues.")
    endpoint_url: str | None = Field(
        None, description="S3 endpoint (default: the boto3 chain, e.g. AWS_ENDPOINT_URL)."
    )
    region: str | None = Field(None, description="S3 region (default: the boto3 chain).")


class ResilienceSpec(_Section):
    """Restarts, and the rerun state machine that tells a flaky device from a real bug."""

    max_restarts: NonNegativeInt = Field(0, description="Worker-group restarts allowed before the job fails.")
    rerun_mode: Literal["disabled", "validate_results", "report_determinism_stats"] = Field(
        "validate_results",
        description="validate_results: re-run a step whose loss or grad norm is rejected and diagnose it; "
        "report_determinism_stats: re-run every step once and report how far the two runs differ; "
        "disabled: a NaN/Inf loss fails the job at once.",
    )
    rerun_tolerance: float = Field(
        0.0, ge=0.0, description="Relative difference under which a re-run counts as reproducing the result."
    )
    spike_threshold: float | None = Field(
        None,
        gt=1.0,
        description="Reject a loss at least this many times the largest of the first spike_window losses "
        "(non-fatal: a reproducible spike is trained on). Default: no spike check.",
    )
    spike_window: PositiveInt = Field(100, description="Losses sampled before spike detection starts.")
    error_injection_rate: NonNegativeInt = Field(
        0, description="Drills: inject a rejected result with probability 1/N per validation (0: never)."
    )
    error_injection_type: Literal["correct_result", "transient_error", "persistent_error"] = Field(
        "transient_error", description="What an injected rejection turns out to be when re-run."
    )
    skip_bad_batches: bool = Field(
        False,
        description="When a re-run on other hardware reproduces a rejected result (the data or the code "
        "produces it), skip that global batch and go on instead of failing the job.",
    )
    step_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="A rank whose step (plus the checkpoint save after it) makes no progress for this long "
        "is failed with the step and phase it hangs in, and the job restarts from its last checkpoint.",
    )


class ResourcesSpec(_Section):
    ranks: PositiveInt = 1
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    min_ranks: PositiveInt | None = Field(
        None,
        description="Elastic jobs on Ray: the fewest ranks the job runs on (default: ranks). Only the "
        "data-parallel size changes, so sizes are multiples of tensor x pipeline x context.",
    )
    max_ranks: PositiveInt | None = Field(
        None, description="Elastic jobs on Ray: the most ranks the job grows to (default: ranks)."
    )

    @model_validator(mode="after")
    def _check_range(self) -> ResourcesSpec:
        lo = self.min_ranks if self.min_ranks is not None else self.ranks
        hi = self.max_ranks if self.max_ranks is not None else self.ranks
        if not lo <= self.ranks <= hi:
            raise ValueError(
                f"resources.min_ranks ({lo}) <= resources.ranks ({self.ranks}) <= resources.max_ranks ({hi}) "
                "does not hold: ranks is where an elastic job starts, between its min and max"
            )
        return self

    @property
    def elastic(self) -> bool:
        """Whether the rank count may change while the job runs (min_ranks < max_ranks)."""
        lo = self.min_ranks if self.min_ranks is not None else self.ranks
        hi = self.max_ranks if self.max_ranks is not None else self.ranks
        return lo < hi


class JobSpec(_Section):
    name: str = Field("job", pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$", description="Lowercase, digits, . _ -")
    model: ModelSpec = Field(default_factory=ModelSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.resources.ranks // (p.tensor * p.pipeline * p.context)

    @model_validator(mode="after")
    def _check_moe(self) -> JobSpec:
        m, p = self.model.moe, self.parallel
        if m is None:
            if p.expert > 1:
                raise ValueError(
                    "parallel.expert > 1 needs an MoE model: set model.moe.num_experts, or use 1"
                )
            return self
        if m.num_experts % p.expert:
            raise ValueError(
                f"model.moe.num_experts ({m.num_experts}) must be divisible by parallel.expert ({p.expert})"
            )
        if p.tensor > 1 and not p.sequence_parallel:
            raise ValueError(
                "an MoE model with parallel.tensor > 1 needs parallel.sequence_parallel: true (each TP rank "
                "then routes its own tokens)"
            )
        if p.context > 1:
            raise ValueError("MoE with parallel.context > 1 is not supported yet: use context 1")
        if p.distributed_optimizer:
            raise ValueError("MoE with parallel.distributed_optimizer is not supported yet: set it to false")
        return self

    @model_validator(mode="after")
    def _check_elastic(self) -> JobSpec:
        """Every size an elastic job may run on keeps the model-parallel layout and the global batch:
        min_ranks and max_ranks are multiples of tensor x pipeline x context, and the global batch
        (and a rampup's start and increment) splits into micro batches at both ends."""
        r, p, t = self.resources, self.parallel, self.training
        if r.min_ranks is None and r.max_ranks is None:
            return self
        mp = p.tensor * p.pipeline * p.context
        for field, size in (("resources.min_ranks", r.min_ranks), ("resources.max_ranks", r.max_ranks)):
            if size is None:
                continue
            if size % mp:
                lower = size // mp * mp
                hint = f"{lower} or {lower + mp}" if lower else str(mp)
                raise ValueError(
                    f"{field} ({size}) is not a multiple of parallel.tensor x pipeline x context ({mp}): a "
                    f"resize changes only the data-parallel size; use {hint}"
                )
            per_step = t.micro_batch_size * (size // mp)
            batches = {"training.global_batch_size": t.global_batch_size}
            if t.rampup_batch_size is not None:
                batches["training.rampup_batch_size start"] = t.rampup_batch_size[0]
                batches["training.rampup_batch_size increment"] = t.rampup_batch_size[1]
            for name, value in batches.items():
                if value % per_step:
                    raise ValueError(
                        f"{name} ({value}) is not divisible by training.micro_batch_size "
                        f"({t.micro_batch_size}) x the data-parallel size at {field} ({size // mp}) = "
                        f"{per_step}: the global batch stays the same on every size the job may run on"
                    )
        return self

    @model_validator(mode="after")
    def _check_eval(self) -> JobSpec:
        t, d = self.training, self.data
        if t.eval_interval is not None and (d.split is None or d.split[1] <= 0):
            raise ValueError(
                "training.eval_interval needs validation data: set data.split with a valid share, "
                'e.g. data.split: "949,50,1"'
            )
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> JobSpec:
        m, p, t, ranks = self.model, self.parallel, self.training, self.resources.ranks
        tp = p.tensor
        model_parallel = p.tensor * p.pipeline * p.context
        if ranks % model_parallel:
            raise ValueError(
                f"parallel.tensor ({p.tensor}) x parallel.pipeline ({p.pipeline}) x parallel.context ({p.context}) "
                f"= {model_parallel} does not divide resources.ranks ({ranks}): set resources.ranks to a multiple "
                f"of {model_parallel} or shrink the parallel sizes"
            )
        dp = ranks // model_parallel
        if ranks % (p.expert * p.pipeline):
            # Experts are whole on their EP rank (expert TP 1), so EP may span TP ranks: only
            # EP x PP has to divide the ranks (Megatron-Core's rule for the expert grid).
            raise ValueError(
                f"parallel.expert ({p.expert}) x parallel.pipeline ({p.pipeline}) = {p.expert * p.pipeline} "
                f"does not divide resources.ranks ({ranks})"
            )
        if m.num_attention_heads % tp:
            raise ValueError(
                f"model.num_attention_heads ({m.num_attention_heads}) is not divisible by parallel.tensor ({tp}): "
                f"choose parallel.tensor from {_divisors(m.num_attention_heads)}"
            )
        if m.num_query_groups % tp:
            raise ValueError(
                f"model.num_query_groups ({m.num_query_groups}) is not divisible by parallel.tensor ({tp}): "
                f"choose parallel.tensor from {_divisors(m.num_query_groups)} or raise num_query_groups"
            )
        if m.ffn_hidden_size % tp:
            raise ValueError(
                f"model.ffn_hidden_size ({m.ffn_hidden_size}) is not divisible by parallel.tensor ({tp}): "
                f"make it a multiple of {tp}"
            )
        if m.make_vocab_size_divisible_by % tp:
            raise ValueError(
                f"model.make_vocab_size_divisible_by ({m.make_vocab_size_divisible_by}) must be a multiple of "
                f"parallel.tensor ({tp}) so the embedding table splits evenly"
            )
        if p.sequence_parallel and tp > 1 and m.seq_length % tp:
            raise ValueError(
                f"model.seq_length ({m.seq_length}) must be divisible by parallel.tensor ({tp}) with "
                "parallel.sequence_parallel: true"
            )
        if p.context > 1:
            # Context parallelism: 2 x context equal chunks, two per CP rank (causal load
            # balancing); under SP each CP rank's seq_length / context tokens split again over TP.
            multiple, why = 2 * p.context, ""
            if p.sequence_parallel and tp > 1:
                multiple = p.context * math.lcm(2, tp)
                why = f", each rank's share split again over parallel.tensor ({tp}) by sequence parallelism"
            if m.seq_length % multiple:
                lower = m.seq_length // multiple * multiple
                hint = f"{lower} or {lower + multiple}" if lower else str(multiple)
                raise ValueError(
                    f"model.seq_length ({m.seq_length}) must be a multiple of {multiple} with parallel.context "
                    f"({p.context}): each sequence is cut into 2 x parallel.context equal chunks, two per "
                    f"context-parallel rank{why}; use model.seq_length {hint}"
                )
        if p.virtual_pipeline is not None and p.pipeline == 1:
            raise ValueError(
                "parallel.virtual_pipeline needs parallel.pipeline > 1: remove it or raise pipeline"
            )
        stages = p.pipeline * (p.virtual_pipeline or 1)
        if p.pipeline_layers is not None:
            if len(p.pipeline_layers) != stages or sum(p.pipeline_layers) != m.num_layers:
                raise ValueError(
                    f"parallel.pipeline_layers {p.pipeline_layers} must list {stages} stages (pipeline x "
                    f"virtual_pipeline) adding up to model.num_layers ({m.num_layers})"
                )
        elif m.num_layers % p.pipeline:
            raise ValueError(
                f"model.num_layers ({m.num_layers}) is not divisible by parallel.pipeline ({p.pipeline}): "
                f"choose parallel.pipeline from {_divisors(m.num_layers)}"
            )
        elif m.num_layers % stages:
            raise ValueError(
                f"model.num_layers ({m.num_layers}) must be divisible by parallel.pipeline x "
                f"parallel.virtual_pipeline ({stages})"
            )
        per_step = t.micro_batch_size * dp
        if t.global_batch_size % per_step:
            raise ValueError(
                f"training.global_batch_size ({t.global_batch_size}) is not divisible by "
                f"training.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp}) = {per_step}: "
                f"use a multiple of {per_step}"
            )
        if p.virtual_pipeline is not None and (t.global_batch_size // per_step) % p.pipeline:
            raise ValueError(
                f"the interleaved schedule needs the number of microbatches (training.global_batch_size / "
                f"(micro_batch_size x data-parallel size) = {t.global_batch_size // per_step}) to be a multiple "
                f"of parallel.pipeline ({p.pipeline})"
            )
        if t.rampup_batch_size is not None:
            start, incr, _ = t.rampup_batch_size
            if start % per_step or incr % per_step:
                raise ValueError(
                    f"training.rampup_batch_size start ({start}) and increment ({incr}) must be multiples of "
                    f"micro_batch_size x data-parallel size ({per_step})"
                )
            if (t.global_batch_size - start) % incr or start > t.global_batch_size:
                raise ValueError(
                    f"training.rampup_batch_size: global_batch_size ({t.global_batch_size}) - start ({start}) "
                    f"must be a non-negative multiple of the increment ({incr})"
                )
        decay_iters = self.optimizer.lr_decay_iters or t.train_iters
        wsd = self.optimizer.lr_wsd_decay_iters
        if self.optimizer.lr_decay_style == "WSD" and wsd is not None and wsd > decay_iters:
            raise ValueError(
                f"optimizer.lr_wsd_decay_iters ({wsd}) exceeds the decay length ({decay_iters}, "
                "optimizer.lr_decay_iters or training.train_iters): the anneal is the end of the decay"
            )
        if self.checkpoint.interval is not None and self.checkpoint.path is None:
            raise ValueError("checkpoint.interval needs checkpoint.path: say where to write checkpoints")
        if self.optimizer.lr_warmup_iters > decay_iters:
            raise ValueError(
                f"optimizer.lr_warmup_iters ({self.optimizer.lr_warmup_iters}) exceeds the decay length "
                f"(optimizer.lr_decay_iters or training.train_iters)"
            )
        return self


class JobSpecError(ValueError):
    """A job file that cannot run: the message lists each bad field and the fix, one per line."""


def _known_keys(loc: tuple) -> list[str]:
    """Field names of the section that holds the key at `loc` (for 'did you mean' messages)."""
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            known, key = _known_keys(e["loc"]), str(e["loc"][-1])
            # Megatron-style long names (tensor_model_parallel_size) and suffix typos
            # (tensor_paralel) start with the key meant; otherwise the closest spelling.
            head = key.split("_")[0]
            close = [head] if head in known else difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            msg = f"unknown key: {hint}known keys here: {', '.join(known)}"
        lines.append(f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg)
    return "\n".join(lines)


def parse_job(data: dict[str, Any]) -> JobSpec:
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise JobSpecError(format_validation_error(err)) from None


def load_job(path: str | Path) -> JobSpec:
    """Read a YAML or JSON job file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise JobSpecError(f"cannot read job file {path}: {err.strerror}") from None
    return parse_job_text(text, str(path), "json" if path.suffix == ".json" else "yaml")


def parse_job_text(text: str, where: str, fmt: str = "yaml") -> JobSpec:
    """A job spec from JSON or YAML text; `where` (a file, an environment variable) names the
    source in the error."""
    if fmt == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise JobSpecError(f"{where} is not valid JSON: {err}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise JobSpecError(f"{where} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise JobSpecError(f"{where}: a job file is a mapping with sections name, model, parallel, ...")
    return parse_job(data)


def json_schema() -> dict[str, Any]:
    return JobSpec.model_json_schema()
