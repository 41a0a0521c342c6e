"""OptimizerParamScheduler against closed-form Megatron-Core curves, on a real AdamW."""

from __future__ import annotations

import io
import math

import pytest
import torch

from engine.jobspec import JobSpec
from engine.optimizer.scheduler import OptimizerParamScheduler

# One layout for the lr curves: warmup 10 steps from INIT to MAX, decay over steps 10..110 to MIN.
INIT, MAX, MIN = 0.02, 1.0, 0.1
WARMUP, DECAY = 10, 110


def make_optimizer(*groups: dict) -> torch.optim.AdamW:
    if not groups:
        groups = ({},)
    param_groups = [{"params": [torch.nn.Parameter(torch.ones(2))], **g} for g in groups]
    # lr / weight_decay here are deliberately wrong: the scheduler must overwrite them at once.
    return torch.optim.AdamW(param_groups, lr=123.0, weight_decay=45.0)


def make(style: str, optimizer: torch.optim.Optimizer | None = None, **overrides) -> OptimizerParamScheduler:
    kwargs = dict(
        init_lr=INIT,
        max_lr=MAX,
        min_lr=MIN,
        lr_warmup_steps=WARMUP,
        lr_decay_steps=DECAY,
        lr_decay_style=style,
        start_wd=0.05,
        end_wd=0.05,
        wd_incr_steps=DECAY,
        wd_incr_style="constant",
    )
    kwargs.update(overrides)
    return OptimizerParamScheduler(optimizer or make_optimizer(), **kwargs)


def lr_at(sched: OptimizerParamScheduler, step: int) -> float:
    """Drive the scheduler to `step` with step() and read what AdamW's group actually holds."""
    sched.step(step - sched.num_steps)
    return sched.optimizer.param_groups[0]["lr"]


# Warmup is shared by every style: INIT + (MAX - INIT) * step / WARMUP.
WARMUP_POINTS = [
    (0, INIT),
    (5, INIT + (MAX - INIT) * 5 / 10),  # 0.51
    (10, MAX),
]


LINEAR_POINTS = [
    (35, MIN + (MAX - MIN) * (1 - 0.25)),  # r = (35 - 10) / 100
    (60, 0.55),  # r = 0.5, written out: 0.1 + 0.9 * 0.5
    (110, MIN),  # r = 1
    (111, MIN),
    (150, MIN),
]

COSINE_POINTS = [
    (35, MIN + (MAX - MIN) * 0.5 * (math.cos(math.pi * 0.25) + 1)),  # ~0.86820
    (60, 0.55),
    (85, MIN + (MAX - MIN) * 0.5 * (math.cos(math.pi * 0.75) + 1)),  # ~0.23180
    (110, MIN),
    (150, MIN),
]

INV_SQRT_POINTS = [
    (40, MAX * math.sqrt(10) / math.sqrt(40)),  # 0.5
    (90, MAX * math.sqrt(10) / math.sqrt(90)),  # 1/3
    (110, MAX * math.sqrt(10) / math.sqrt(110)),
    (111, MIN),  # past the decay length: min_lr, as in Megatron-Core
]

CONSTANT_POINTS = [(60, MAX), (110, MAX), (150, MAX), (10**6, MAX)]


@pytest.mark.parametrize(
    ("style", "points"),
    [
        ("linear", LINEAR_POINTS),
        ("cosine", COSINE_POINTS),
        ("inverse-square-root", INV_SQRT_POINTS),
        ("constant", CONSTANT_POINTS),
    ],
)
def test_lr_styles(style: str, points: list[tuple[int, float]]) -> None:
    sched = make(style)
    for step, expected in WARMUP_POINTS + points:
        assert lr_at(sched, step) == pytest.approx(expected, rel=1e-12, abs=1e-15), (style, step)
        assert sched.get_lr() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_cosine_is_not_linear() -> None:
    # Guards the cosine points above: at r = 0.25 the two styles must differ.
    assert make("cosine").get_lr(35) == pytest.approx(0.868198, abs=1e-6)
    assert make("linear").get_lr(35) == pytest.approx(0.775, abs=1e-12)


def test_inverse_square_root_floor_and_no_warmup() -> None:
    sched = make("inverse-square-root", lr_decay_steps=5000)
    assert sched.get_lr(1000) == pytest.approx(0.1)  # sqrt(10 / 1000) = 0.1, exactly at the floor
    assert sched.get_lr(250) == pytest.approx(0.2)
    assert sched.get_lr(4000) == MIN  # sqrt(10 / 4000) = 0.05 < min_lr
    no_warmup = make("inverse-square-root", lr_warmup_steps=0, lr_decay_steps=5000, min_lr=0.0)
    assert no_warmup.get_lr(0) == pytest.approx(MAX)  # max(step, 1) and max(warmup, 1)
    assert no_warmup.get_lr(1) == pytest.approx(MAX)
    assert no_warmup.get_lr(4) == pytest.approx(MAX / 2)
    assert no_warmup.get_lr(100) == pytest.approx(MAX / 10)


# WSD: decay 110, anneal over the last 40 steps (70..110); r = (step - 70) / 40.
WSD_COEFF = {
    "linear": lambda r: 1 - r,
    "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1),
    "exponential": lambda r: 2 * 0.5**r - 1,
    "minus_sqrt": lambda r: 1 - math.sqrt(r),
}
# The same coefficients written out as numbers at r = 0.25 and 0.5.
WSD_LITERAL = {
    "linear": (0.75, 0.5),
    "cosine": (0.8535533905932737, 0.5),
    "exponential": (0.6817928305074290, 0.41421356237309515),
    "minus_sqrt": (0.5, 0.2928932188134524),
}


@pytest.mark.parametrize("anneal", sorted(WSD_COEFF))
def test_wsd(anneal: str) -> None:
    sched = make("WSD", wsd_decay_steps=40, lr_wsd_decay_style=anneal)
    coeff = WSD_COEFF[anneal]
    points = [
        *WARMUP_POINTS,
        (40, MAX),  # stable phase
        (70, MAX),  # last stable step, r = 0
        (80, MIN + (MAX - MIN) * coeff(0.25)),
        (90, MIN + (MAX - MIN) * coeff(0.5)),
        (100, MIN + (MAX - MIN) * coeff(0.75)),
        (110, MIN),  # r = 1: every anneal style reaches 0
        (150, MIN),
    ]
    for step, expected in points:
        assert lr_at(sched, step) == pytest.approx(expected, rel=1e-12, abs=1e-15), (anneal, step)
    at_quarter, at_half = WSD_LITERAL[anneal]
    assert sched.get_lr(80) == pytest.approx(MIN + (MAX - MIN) * at_quarter, rel=1e-12)
    assert sched.get_lr(90) == pytest.approx(MIN + (MAX - MIN) * at_half, rel=1e-12)


def test_wsd_anneal_styles_differ() -> None:
    values = {a: make("WSD", wsd_decay_steps=40, lr_wsd_decay_style=a).get_lr(90) for a in sorted(WSD_COEFF)}
    assert len({round(v, 9) for v in values.values()}) == 3  # linear and cosine meet at r = 0.5
    assert values["exponential"] < values["linear"]
    assert values["minus_sqrt"] < values["exponential"]


def test_no_warmup_starts_at_max() -> None:
    sched = make("linear", lr_warmup_steps=0, lr_decay_steps=100)
    assert sched.optimizer.param_groups[0]["lr"] == MAX
    assert sched.get_lr(25) == pytest.approx(MIN + (MAX - MIN) * 0.75)


def test_constructor_applies_step_zero() -> None:
    sched = make("linear")
    group = sched.optimizer.param_groups[0]
    assert sched.num_steps == 0
    assert group["lr"] == INIT
    assert group["weight_decay"] == 0.05


def test_get_lr_for_a_given_step_does_not_move() -> None:
    sched = make("cosine")
    sched.step(3)
    assert sched.get_lr(60) == pytest.approx(0.55)
    assert sched.num_steps == 3
    assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(INIT + (MAX - INIT) * 0.3)


def test_lr_mult_and_wd_mult_reach_adamw() -> None:
    opt = make_optimizer({}, {"lr_mult": 0.5, "wd_mult": 0.0}, {"lr_mult": 2.0, "wd_mult": 3.0})
    sched = make(
        "linear",
        optimizer=opt,
        start_wd=0.01,
        end_wd=0.1,
        wd_incr_steps=100,
        wd_incr_style="linear",
    )
    sched.step(60)
    lr, wd = 0.55, 0.01 + 0.09 * 0.6
    plain, no_decay, boosted = opt.param_groups
    assert plain["lr"] == pytest.approx(lr) and plain["weight_decay"] == pytest.approx(wd)
    assert no_decay["lr"] == pytest.approx(lr * 0.5) and no_decay["weight_decay"] == 0.0
    assert boosted["lr"] == pytest.approx(lr * 2.0) and boosted["weight_decay"] == pytest.approx(wd * 3.0)

    # AdamW with zero gradients moves a parameter only by decoupled weight decay: p *= 1 - lr * wd.
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    got = [g["params"][0].detach()[0].item() for g in opt.param_groups]
    assert got[0] == pytest.approx(1 - lr * wd, rel=1e-6)
    assert got[1] == 1.0
    assert got[2] == pytest.approx(1 - (2 * lr) * (3 * wd), rel=1e-6)


@pytest.mark.parametrize(
    ("style", "points"),
    [
        ("linear", [(0, 0.01), (25, 0.01 + 0.09 * 0.25), (50, 0.055), (100, 0.1), (400, 0.1)]),
        (
            "cosine",
            [
                (0, 0.01),
                (25, 0.01 + 0.09 * 0.5 * (math.cos(math.pi * 0.75) + 1)),  # ~0.023180
                (50, 0.055),
                (75, 0.01 + 0.09 * 0.5 * (math.cos(math.pi * 0.25) + 1)),  # ~0.086820
                (100, 0.1),
                (400, 0.1),
            ],
        ),
    ],
)
def test_weight_decay_styles(style: str, points: list[tuple[int, float]]) -> None:
    sched = make("constant", start_wd=0.01, end_wd=0.1, wd_incr_steps=100, wd_incr_style=style)
    group = sched.optimizer.param_groups[0]
    for step, expected in points:
        sched.step(step - sched.num_steps)
        assert group["weight_decay"] == pytest.approx(expected, rel=1e-12), (style, step)
        assert sched.get_wd() == pytest.approx(expected, rel=1e-12)


def test_weight_decay_cosine_starts_slow() -> None:
    sched = make("constant", start_wd=0.0, end_wd=1.0, wd_incr_steps=100, wd_incr_style="cosine")
    assert sched.get_wd(25) == pytest.approx(0.1464466094, abs=1e-9)  # below linear's 0.25
    assert sched.get_wd(75) == pytest.approx(0.8535533906, abs=1e-9)


def test_constant_weight_decay() -> None:
    sched = make("constant", start_wd=0.3, end_wd=0.3, wd_incr_steps=0, wd_incr_style="constant")
    for step in (0, 1, 1000):
        assert sched.get_wd(step) == 0.3


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"lr_decay_style": "cosin"}, r"unknown lr_decay_style 'cosin'.*cosine"),
        ({"lr_warmup_steps": 200}, r"lr_warmup_steps \(200\) exceeds lr_decay_steps \(110\)"),
        ({"min_lr": 2.0}, r"min_lr \(2\.0\) must not exceed max_lr \(1\.0\)"),
        ({"init_lr": 1.5}, r"init_lr \(1\.5\) must not exceed max_lr"),
        ({"max_lr": -1.0, "min_lr": -2.0, "init_lr": -3.0}, r"init_lr must be >= 0"),
        ({"max_lr": float("nan")}, r"max_lr must be a finite number"),
        ({"lr_decay_steps": 0, "lr_warmup_steps": 0}, r"lr_decay_steps must be >= 1"),
        ({"lr_warmup_steps": -1}, r"lr_warmup_steps must be >= 0"),
        ({"lr_warmup_steps": 2.5}, r"lr_warmup_steps must be an integer"),
        ({"lr_decay_style": "WSD"}, r"WSD needs wsd_decay_steps"),
        ({"lr_decay_style": "WSD", "wsd_decay_steps": 10}, r"WSD needs lr_wsd_decay_style"),
        (
            {"lr_decay_style": "WSD", "wsd_decay_steps": 10, "lr_wsd_decay_style": "exp"},
            r"unknown lr_wsd_decay_style 'exp'.*minus_sqrt",
        ),
        (
            {"lr_decay_style": "WSD", "wsd_decay_steps": 111, "lr_wsd_decay_style": "linear"},
            r"wsd_decay_steps \(111\) exceeds lr_decay_steps \(110\)",
        ),
        ({"start_wd": 0.0, "end_wd": 0.1}, r"wd_incr_style constant needs start_wd == end_wd"),
        ({"wd_incr_style": "exponential"}, r"unknown wd_incr_style 'exponential'"),
        (
            {"start_wd": 0.2, "end_wd": 0.1, "wd_incr_style": "linear"},
            r"end_wd \(0\.1\) is below start_wd \(0\.2\)",
        ),
        ({"wd_incr_style": "linear", "wd_incr_steps": 0}, r"wd_incr_steps must be >= 1"),
    ],
)
def test_validation(overrides: dict, match: str) -> None:
    style = overrides.pop("lr_decay_style", "linear")
    with pytest.raises(ValueError, match=match):
        make(style, **overrides)


def test_warmup_equal_to_decay_is_allowed() -> None:
    sched = make("cosine", lr_warmup_steps=110)
    assert sched.get_lr(110) == MAX
    assert sched.get_lr(111) == MIN


def test_step_and_get_reject_negative() -> None:
    sched = make("linear")
    with pytest.raises(ValueError, match=r"increment must be >= 0"):
        sched.step(-1)
    with pytest.raises(ValueError, match=r"step must be >= 0"):
        sched.get_lr(-5)


def test_state_dict_round_trip() -> None:
    kwargs = dict(
        wsd_decay_steps=40, lr_wsd_decay_style="minus_sqrt", start_wd=0.0, end_wd=0.1, wd_incr_style="cosine"
    )
    first = make("WSD", **kwargs)
    for _ in range(37):
        first.step()
    first.step(40)  # step 77, inside the anneal

    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)  # weights_only: the state is plain Python values
    assert state["num_steps"] == 77

    second = make("WSD", optimizer=make_optimizer({"lr_mult": 0.1}), **kwargs)
    assert second.num_steps == 0
    second.load_state_dict(state)
    assert second.num_steps == 77
    expected_lr = MIN + (MAX - MIN) * (1 - math.sqrt(7 / 40))
    expected_wd = 0.1 * 0.5 * (math.cos(math.pi * (1 - 77 / 110)) + 1)
    group = second.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(expected_lr * 0.1, rel=1e-12)  # applied on load, lr_mult kept
    assert group["weight_decay"] == pytest.approx(expected_wd, rel=1e-12)
    for _ in range(50):
        first.step()
        second.step()
        assert second.get_lr() == first.get_lr() and second.get_wd() == first.get_wd()


def test_load_state_dict_rejects_other_settings() -> None:
    state = make("cosine").state_dict()
    other = make("cosine", max_lr=2.0)
    with pytest.raises(ValueError, match=r"max_lr: checkpoint 1\.0, this job 2\.0"):
        other.load_state_dict(state)
    assert other.num_steps == 0
    with pytest.raises(ValueError, match=r"lr_decay_style: checkpoint 'cosine', this job 'linear'"):
        make("linear").load_state_dict(state)
    del state["min_lr"]
    with pytest.raises(ValueError, match=r"lacks min_lr"):
        make("cosine").load_state_dict(state)


def test_from_spec_defaults_to_train_iters() -> None:
    job = JobSpec.model_validate(
        {
            "training": {"train_iters": 100},
            "optimizer": {
                "lr": 1e-3,
                "min_lr": 1e-4,
                "lr_warmup_iters": 10,
                "lr_warmup_init": 1e-5,
                "lr_decay_style": "cosine",
                "weight_decay": 0.1,
            },
        }
    )
    opt = make_optimizer({}, {"wd_mult": 0.0})
    sched = OptimizerParamScheduler.from_spec(opt, job.optimizer, job.training.train_iters)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    assert sched.get_lr(5) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5)
    assert sched.get_lr(55) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # r = 45 / 90
    assert sched.get_lr(100) == pytest.approx(1e-4)
    assert sched.get_lr(101) == 1e-4
    assert sched.get_wd(0) == sched.get_wd(100) == 0.1
    assert opt.param_groups[0]["weight_decay"] == 0.1
    assert opt.param_groups[1]["weight_decay"] == 0.0


def test_from_spec_decay_iters_wd_increment_and_wsd() -> None:
    job = JobSpec.model_validate(
        {
            "training": {"train_iters": 1000},
            "optimizer": {
                "lr": 2e-3,
                "min_lr": 0.0,
                "lr_warmup_iters": 0,
                "lr_decay_iters": 200,
                "lr_decay_style": "WSD",
                "lr_wsd_decay_style": "linear",
                "lr_wsd_decay_iters": 50,
                "start_weight_decay": 0.0,
                "end_weight_decay": 0.2,
                "weight_decay_incr_style": "linear",
            },
        }
    )
    sched = OptimizerParamScheduler.from_spec(make_optimizer(), job.optimizer, job.training.train_iters)
    assert sched.get_lr(0) == 2e-3
    assert sched.get_lr(150) == 2e-3
    assert sched.get_lr(175) == pytest.approx(1e-3)  # halfway through the 50-step anneal
    assert sched.get_lr(200) == pytest.approx(0.0, abs=1e-18)
    assert sched.get_lr(500) == 0.0
    # wd increments over the lr decay length (200), not train_iters (1000).
    assert sched.get_wd(50) == pytest.approx(0.05)
    assert sched.get_wd(200) == pytest.approx(0.2)
    assert sched.get_wd(999) == 0.2


def test_from_spec_ignores_wsd_fields_for_other_styles() -> None:
    job = JobSpec.model_validate(
        {"optimizer": {"lr_decay_style": "linear", "lr_wsd_decay_iters": 10**6, "lr": 1.0, "min_lr": 0.0}}
    )
    sched = OptimizerParamScheduler.from_spec(make_optimizer(), job.optimizer, 20)
    assert sched.lr_decay_steps == 20
    assert sched.get_lr(5) == pytest.approx(0.75)


def test_lenient_load_keeps_this_jobs_schedule_and_reports_the_differences() -> None:
    """A resumed job that trains longer: the step comes from the checkpoint, the settings from
    the job, and the caller learns what changed."""
    first = make("cosine")
    for _ in range(30):
        first.step()
    longer = make("cosine", lr_decay_steps=first.lr_decay_steps * 2)
    changed = longer.load_state_dict(first.state_dict(), strict=False)
    assert longer.num_steps == 30
    assert changed and all("lr_decay_steps" in c for c in changed), changed
    assert longer.get_lr() == pytest.approx(longer.get_lr(30))
    assert longer.get_lr() != pytest.approx(first.get_lr())
    with pytest.raises(ValueError, match="lr_decay_steps: checkpoint"):
        make("cosine", lr_decay_steps=first.lr_decay_steps * 2).load_state_dict(first.state_dict())
