import pytest

from engine.jobspec import TrainingSpec
from engine.microbatches import MicrobatchCalculator


def test_constant_schedule():
    calc = MicrobatchCalculator(global_batch_size=64, micro_batch_size=2, data_parallel_size=4)
    assert calc.current_global_batch_size == 64
    assert calc.num_microbatches == 8  # 64 / (2 * 4)
    calc.update(10_000)
    assert calc.current_global_batch_size == 64
    assert calc.num_microbatches == 8


def test_resizing_dp_keeps_the_global_batch():
    # The elastic case: DP 4 -> 2 -> 1 doubles the microbatches, never the optimizer's batch.
    for dp, expected in [(4, 4), (2, 8), (1, 16)]:
        calc = MicrobatchCalculator(32, 2, dp)
        assert calc.current_global_batch_size == 32
        assert calc.num_microbatches == expected
        assert calc.num_microbatches * calc.micro_batch_size * dp == 32


def test_rampup_schedule_at_chosen_points():
    # start 16, +16 up to 64: 3 increments over 300 samples -> one every 100 samples.
    calc = MicrobatchCalculator(64, 2, 2, rampup_batch_size=(16, 16, 300))
    per_step = 2 * 2
    expected = {
        0: 16,
        1: 16,
        99: 16,
        100: 32,
        150: 32,
        199: 32,
        200: 48,
        299: 48,
        300: 64,
        301: 64,
        10**6: 64,
    }
    for consumed, gbs in expected.items():
        calc.update(consumed)
        assert calc.current_global_batch_size == gbs, consumed
        assert calc.num_microbatches == gbs // per_step, consumed


def test_rampup_starts_at_start_before_any_update():
    calc = MicrobatchCalculator(48, 1, 4, rampup_batch_size=(8, 8, 1000))
    assert calc.current_global_batch_size == 8
    assert calc.num_microbatches == 2


def test_rampup_non_integer_samples_per_increment():
    # start 4, increment 4, global 32 -> 7 increments, 1000 / 7 = 142.857... samples each.
    calc = MicrobatchCalculator(32, 1, 2, rampup_batch_size=(4, 4, 1000))
    spi = 1000 / 7
    for consumed in [0, 142, 143, 285, 286, 428, 429, 857, 858, 999, 1000]:
        calc.update(consumed)
        # independent reference: count whole intervals of 1000/7 samples (k * 1000/7 is never an integer)
        steps = 0
        while (steps + 1) * spi <= consumed:
            steps += 1
        want = 32 if consumed >= 1000 else min(32, 4 + 4 * steps)
        assert calc.current_global_batch_size == want, consumed
        assert calc.num_microbatches == want // 2, consumed


def test_rampup_goes_down_when_consumed_goes_back():
    # update() is a pure function of consumed samples (what a resume from checkpoint relies on).
    calc = MicrobatchCalculator(64, 2, 2, rampup_batch_size=(16, 16, 300))
    calc.update(250)
    assert calc.current_global_batch_size == 48
    calc.update(50)
    assert calc.current_global_batch_size == 16


def test_rampup_start_equal_to_global_is_constant():
    calc = MicrobatchCalculator(16, 2, 2, rampup_batch_size=(16, 4, 100))
    for consumed in (0, 50, 100, 1000):
        calc.update(consumed)
        assert calc.current_global_batch_size == 16
        assert calc.num_microbatches == 4


def test_from_spec():
    spec = TrainingSpec(global_batch_size=64, micro_batch_size=2, rampup_batch_size=[16, 16, 300])
    calc = MicrobatchCalculator.from_spec(spec, data_parallel_size=2)
    assert calc.rampup_batch_size == (16, 16, 300)
    assert calc.num_microbatches == 4
    calc.update(300)
    assert calc.num_microbatches == 16


def test_global_not_divisible():
    with pytest.raises(
        ValueError,
        match=r"global_batch_size \(30\) is not divisible by micro_batch_size \(2\) x "
        r"data_parallel_size \(4\) = 8",
    ):
        MicrobatchCalculator(30, 2, 4)


def test_start_not_divisible():
    # global 32 splits over 4 x 2 = 8, start 12 does not (32 - 12 = 20 is a multiple of 4).
    with pytest.raises(
        ValueError,
        match=r"rampup start batch size \(12\) is not divisible by micro_batch_size \(4\) x "
        r"data_parallel_size \(2\) = 8",
    ):
        MicrobatchCalculator(32, 4, 2, rampup_batch_size=(12, 4, 100))


def test_increment_not_divisible():
    with pytest.raises(
        ValueError,
        match=r"rampup batch size increment \(12\) is not divisible by micro_batch_size \(4\) x "
        r"data_parallel_size \(2\) = 8",
    ):
        MicrobatchCalculator(40, 4, 2, rampup_batch_size=(16, 12, 100))


def test_global_minus_start_not_multiple_of_increment():
    with pytest.raises(
        ValueError,
        match=r"global_batch_size \(64\) - rampup start batch size \(16\) = 48 is not a multiple of "
        r"the rampup batch size increment \(32\)",
    ):
        MicrobatchCalculator(64, 2, 2, rampup_batch_size=(16, 32, 100))


def test_start_above_global():
    with pytest.raises(
        ValueError, match=r"rampup start batch size \(128\) must not exceed global_batch_size \(64\)"
    ):
        MicrobatchCalculator(64, 2, 2, rampup_batch_size=(128, 16, 100))


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1, 1), r"global_batch_size must be a positive integer, got 0"),
        ((8, 0, 1), r"micro_batch_size must be a positive integer, got 0"),
        ((8, 1, -1), r"data_parallel_size must be a positive integer, got -1"),
    ],
)
def test_non_positive_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        MicrobatchCalculator(*args)


@pytest.mark.parametrize(
    "rampup, match",
    [
        ((8, 8), r"rampup_batch_size must be \(start, increment, ramp_samples\)"),
        ((0, 8, 100), r"rampup start batch size must be a positive integer, got 0"),
        ((8, 0, 100), r"rampup batch size increment must be a positive integer, got 0"),
        ((8, 8, 0), r"rampup ramp_samples must be a positive integer, got 0"),
    ],
)
def test_bad_rampup_values(rampup, match):
    with pytest.raises(ValueError, match=match):
        MicrobatchCalculator(64, 2, 2, rampup_batch_size=rampup)


def test_negative_consumed_samples():
    calc = MicrobatchCalculator(8, 1, 1)
    with pytest.raises(ValueError, match=r"consumed_samples must be >= 0, got -1"):
        calc.update(-1)
