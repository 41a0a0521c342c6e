"""`training` and `optimizer`: batch, precision, schedule, recomputation; AdamW and its LR /
weight-decay schedules.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from engine.jobspec.common import NonNegativeInt, PositiveInt, _Section


class TrainingSpec(_Section):
    global_batch_size: PositiveInt = 8
    micro_batch_size: PositiveInt = 1
    train_iters: PositiveInt = 10
    seed: int = Field(1234, ge=0, le=2**63 - 1, strict=True)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    fp8: bool = Field(
        False,
        description="float8 matmuls (e4m3 forward, e5m2 gradients) with per-tensor dynamic scaling for "
        "the transformer layers' linear layers; the embedding and output layer stay in "
        "training.precision. Needs training.precision: bf16; on GPU, compute capability >= 8.9.",
    )
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
    compile: bool = Field(
        False,
        description="torch.compile each transformer layer (fused norms, RoPE and activations; the first "
        "steps pay the compilation). Needs a C++ compiler on CPU; one compiled graph serves every layer.",
    )
    initial_loss_scale: float = Field(2.0**16, gt=0.0, description="fp16: starting dynamic loss scale.")
    min_loss_scale: float = Field(1.0, gt=0.0, description="fp16: the scale never drops below this.")
    loss_scale_window: PositiveInt = Field(
        1000, description="fp16: raise the scale after this many good steps."
    )
    hysteresis: PositiveInt = Field(
        2, description="fp16: overflowing steps tolerated before lowering the scale."
    )
    loggers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Also write each step's record to these tools, from rank 0 (engine/loggers.py; each "
        "needs its extra: pip install 'elastron[tensorboard]', [mlflow], [wandb]; W&B runs offline "
        "without WANDB_API_KEY).",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainingSpec:
        if len(set(self.loggers)) != len(self.loggers):
            raise ValueError(f"training.loggers names a tool twice ({self.loggers}): name each once")
        if self.fp8 and self.precision != "bf16":
            raise ValueError(
                f"training.fp8 needs bf16 activations and weights around its float8 matmuls, not "
                f"training.precision: {self.precision}: set training.precision: bf16 (or training.fp8: false)"
            )
        return self


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
