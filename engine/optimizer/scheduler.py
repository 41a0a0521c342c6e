"""Learning-rate and weight-decay schedules, set on the optimizer's param groups every step.

Why our own class rather than `torch.optim.lr_scheduler`: job files written for Megatron-Core name
their schedules (`lr_decay_style: cosine`, `WSD` with `lr_wsd_decay_style: minus_sqrt`,
`weight_decay_incr_style: cosine`, ...) and expect Megatron-Core's exact curves, including a
weight-decay schedule that torch does not have and per-group `lr_mult` / `wd_mult`. This module
implements those styles by name with the same formulas, so such a job ports over and its loss curve
is comparable step for step.

Semantics (step = `num_steps`, the number of completed increments):

- warmup: for 0 < warmup and step <= warmup, lr = init + (max - init) * step / warmup.
- `constant`: max_lr after warmup, for ever.
- past `lr_decay_steps` every other style gives min_lr.
- `linear` / `cosine`: r = (step - warmup) / (decay - warmup); lr = min + (max - min) * coeff with
  coeff = 1 - r, or 0.5 * (cos(pi r) + 1).
- `inverse-square-root`: max * sqrt(max(warmup, 1)) / sqrt(max(step, 1)), floored at min_lr.
- `WSD` (warmup-stable-decay): max_lr until decay - wsd_decay_steps, then an anneal over the last
  wsd_decay_steps with r in [0, 1] and coeff linear 1 - r, cosine 0.5 * (cos(pi r) + 1),
  exponential 2 * 0.5**r - 1, or minus_sqrt 1 - sqrt(r).
- weight decay over wd_incr_steps, r = min(step, wd_incr_steps) / wd_incr_steps: `constant`
  (start must equal end), `linear` start + (end - start) r, `cosine`
  start + (end - start) * 0.5 * (cos(pi (1 - r)) + 1).

Each param group gets `lr = lr * group.get("lr_mult", 1)` and
`weight_decay = wd * group.get("wd_mult", 1)`. The scheduler only needs `param_groups`, so it
drives a plain torch optimizer and our own (distributed, mixed-precision) optimizer wrappers alike.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.jobspec import OptimizerSpec

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# The settings a checkpoint carries besides num_steps; a resumed job must have the same ones.
_SETTINGS = (
    "init_lr",
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
    "wsd_decay_steps",
    "lr_wsd_decay_style",
)


class HasParamGroups(Protocol):
    """Anything with torch-style `param_groups` (a torch optimizer or one of our wrappers)."""

    param_groups: list[dict[str, Any]]


def _check_finite(name: str, value: float, *, allow_negative: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if not allow_negative and value < 0.0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_int(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class OptimizerParamScheduler:
    """Sets lr and weight decay on every param group of `optimizer`, with Megatron-Core's styles.

    The constructor writes step 0's values at once; `step()` advances and writes again.
    """

    def __init__(
        self,
        optimizer: HasParamGroups,
        *,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        wsd_decay_steps: int | None = None,
        lr_wsd_decay_style: str | None = None,
    ) -> None:
        self.optimizer = optimizer

        self.init_lr = _check_finite("init_lr", init_lr)
        self.max_lr = _check_finite("max_lr", max_lr)
        self.min_lr = _check_finite("min_lr", min_lr)
        if self.min_lr > self.max_lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed max_lr ({self.max_lr})")
        if self.init_lr > self.max_lr:
            raise ValueError(
                f"init_lr ({self.init_lr}) must not exceed max_lr ({self.max_lr}): warmup rises to max_lr"
            )

        self.lr_warmup_steps = _check_int("lr_warmup_steps", lr_warmup_steps, 0)
        self.lr_decay_steps = _check_int("lr_decay_steps", lr_decay_steps, 1)
        if self.lr_warmup_steps > self.lr_decay_steps:
            raise ValueError(
                f"lr_warmup_steps ({self.lr_warmup_steps}) exceeds lr_decay_steps ({self.lr_decay_steps}): "
                "warmup is part of the decay length, so shorten warmup or lengthen decay"
            )
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"unknown lr_decay_style {lr_decay_style!r}: choose one of {', '.join(LR_DECAY_STYLES)}"
            )
        self.lr_decay_style = lr_decay_style

        if lr_wsd_decay_style is not None and lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(
                f"unknown lr_wsd_decay_style {lr_wsd_decay_style!r}: choose one of "
                f"{', '.join(WSD_DECAY_STYLES)}"
            )
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None:
                raise ValueError("lr_decay_style WSD needs wsd_decay_steps (the length of the final anneal)")
            if lr_wsd_decay_style is None:
                raise ValueError(
                    f"lr_decay_style WSD needs lr_wsd_decay_style: one of {', '.join(WSD_DECAY_STYLES)}"
                )
            _check_int("wsd_decay_steps", wsd_decay_steps, 0)
            if wsd_decay_steps > self.lr_decay_steps:
                raise ValueError(
                    f"wsd_decay_steps ({wsd_decay_steps}) exceeds lr_decay_steps ({self.lr_decay_steps}): "
                    "the anneal is the last part of the decay length"
                )
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style

        self.start_wd = _check_finite("start_wd", start_wd)
        self.end_wd = _check_finite("end_wd", end_wd)
        if self.end_wd < self.start_wd:
            raise ValueError(
                f"end_wd ({self.end_wd}) is below start_wd ({self.start_wd}): weight decay only increments"
            )
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(
                f"unknown wd_incr_style {wd_incr_style!r}: choose one of {', '.join(WD_INCR_STYLES)}"
            )
        if wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ValueError(
                f"wd_incr_style constant needs start_wd == end_wd, got {self.start_wd} and {self.end_wd}: "
                "use linear or cosine to change weight decay over training"
            )
        self.wd_incr_style = wd_incr_style
        self.wd_incr_steps = _check_int(
            "wd_incr_steps", wd_incr_steps, 0 if wd_incr_style == "constant" else 1
        )

        self.num_steps = 0
        self._apply()

    @classmethod
    def from_spec(
        cls, optimizer: HasParamGroups, spec: OptimizerSpec, train_iters: int
    ) -> OptimizerParamScheduler:
        """Build from a job's `optimizer` section; the decay length defaults to `train_iters`."""
        decay_steps = spec.lr_decay_iters if spec.lr_decay_iters is not None else train_iters
        start_wd = spec.weight_decay if spec.start_weight_decay is None else spec.start_weight_decay
        end_wd = spec.weight_decay if spec.end_weight_decay is None else spec.end_weight_decay
        wsd = spec.lr_decay_style == "WSD"
        return cls(
            optimizer,
            init_lr=spec.lr_warmup_init,
            max_lr=spec.lr,
            min_lr=spec.min_lr,
            lr_warmup_steps=spec.lr_warmup_iters,
            lr_decay_steps=decay_steps,
            lr_decay_style=spec.lr_decay_style,
            start_wd=start_wd,
            end_wd=end_wd,
            wd_incr_steps=decay_steps,
            wd_incr_style=spec.weight_decay_incr_style,
            wsd_decay_steps=spec.lr_wsd_decay_iters if wsd else None,
            lr_wsd_decay_style=spec.lr_wsd_decay_style if wsd else None,
        )

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            return self.num_steps
        return _check_int("step", step, 0)

    def get_lr(self, step: int | None = None) -> float:
        """The base learning rate (before `lr_mult`) at `step`, default the current step."""
        n = self._resolve_step(step)
        warmup, decay = self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (self.max_lr - self.init_lr) * n / warmup
        if self.lr_decay_style == "constant":
            return self.max_lr
        if n > decay:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = self.max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))
            return max(self.min_lr, lr)

        if self.lr_decay_style == "WSD":
            assert self.wsd_decay_steps is not None
            anneal_start = decay - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = (n - anneal_start) / self.wsd_decay_steps
                style = self.lr_wsd_decay_style
                if style == "linear":
                    coeff = 1.0 - r
                elif style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
                elif style == "exponential":
                    coeff = 2.0 * 0.5**r - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(r)
        else:
            # warmup < n <= decay here, so decay - warmup >= 1.
            r = (n - warmup) / (decay - warmup)
            if self.lr_decay_style == "linear":
                coeff = 1.0 - r
            else:  # cosine
                coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
        return self.min_lr + (self.max_lr - self.min_lr) * coeff

    def get_wd(self, step: int | None = None) -> float:
        """The base weight decay (before `wd_mult`) at `step`, default the current step."""
        n = self._resolve_step(step)
        if self.wd_incr_style == "constant" or n >= self.wd_incr_steps:
            return self.end_wd
        r = n / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = r
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - r)) + 1.0)
        return self.start_wd + (self.end_wd - self.start_wd) * coeff

    def _apply(self) -> None:
        lr, wd = self.get_lr(), self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def step(self, increment: int = 1) -> None:
        """Advance by `increment` steps and write the new lr / weight decay to every param group."""
        self.num_steps += _check_int("increment", increment, 0)
        self._apply()

    def state_dict(self) -> dict[str, Any]:
        """`num_steps` and the settings, all plain Python values."""
        state: dict[str, Any] = {name: getattr(self, name) for name in _SETTINGS}
        state["num_steps"] = self.num_steps
        return state

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> list[str]:
        """Resume at the saved step. strict: the saved settings must equal this scheduler's;
        otherwise this job's settings win (a resumed job may train longer or change its
        schedule) and the differences are returned for the caller to report."""
        missing = [k for k in (*_SETTINGS, "num_steps") if k not in state_dict]
        if missing:
            raise ValueError(f"scheduler state dict lacks {', '.join(missing)}: not saved by this scheduler")
        mismatched = [
            f"{name}: checkpoint {state_dict[name]!r}, this job {getattr(self, name)!r}"
            for name in _SETTINGS
            if state_dict[name] != getattr(self, name)
        ]
        if mismatched and strict:
            raise ValueError(
                "the checkpoint's lr / weight-decay schedule differs from this job's; resume with the "
                "job's original optimizer settings or start a new job. Differences: " + "; ".join(mismatched)
            )
        self.num_steps = _check_int("num_steps", state_dict["num_steps"], 0)
        self._apply()
        return mismatched
