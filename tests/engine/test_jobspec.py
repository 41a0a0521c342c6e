"""The job specification: every validation rule refuses a bad job with a message that names the
field(s) and the fix; defaults follow the architecture; files load from YAML and JSON.

Expected values (divisor lists, default FFN sizes, data-parallel sizes) are worked out by hand in
the comments, never computed with the code under test.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.jobspec import JobSpec, JobSpecError, json_schema, load_job, parse_job

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def job(**sections) -> dict:
    """A small valid job (1 rank, llama, hidden 64, 4 heads) with sections merged one level deep."""
    spec: dict = {
        "name": "unit",
        "model": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
        "training": {"global_batch_size": 8, "micro_batch_size": 1, "train_iters": 10},
        "resources": {"ranks": 1},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            spec.setdefault(key, {}).update(value)
        else:
            spec[key] = value
    return copy.deepcopy(spec)


def refused(data: dict, pattern: str) -> str:
    """parse_job raises JobSpecError whose message matches `pattern`; returns the message."""
    with pytest.raises(JobSpecError, match=pattern) as info:
        parse_job(data)
    return str(info.value)


def test_base_job_is_valid():
    spec = parse_job(job())
    assert isinstance(spec, JobSpec)
    assert spec.name == "unit"


def test_empty_job_takes_every_default():
    spec = parse_job({})
    assert spec.name == "job"
    assert spec.model.arch == "llama"
    assert spec.parallel.tensor == spec.parallel.pipeline == spec.parallel.context == 1
    assert spec.resources.ranks == 1
    assert spec.data_parallel_size == 1


# --- model section -----------------------------------------------------------------------------


def test_hidden_not_divisible_by_heads():
    # divisors of 64: 1, 2, 4, 8, 16, 32, 64
    refused(
        job(model={"hidden_size": 64, "num_attention_heads": 5}),
        r"^model\.hidden_size \(64\) must be divisible by model\.num_attention_heads \(5\): "
        r"pick heads from 1, 2, 4, 8, 16, 32, 64, or set model\.kv_channels \(the head size\)$",
    )


def test_query_groups_must_divide_heads():
    # divisors of 4: 1, 2, 4
    refused(
        job(model={"num_attention_heads": 4, "num_query_groups": 3}),
        r"^model\.num_query_groups \(3\) must divide model\.num_attention_heads \(4\): pick one of 1, 2, 4$",
    )


def test_query_groups_that_divide_heads_are_accepted():
    assert parse_job(job(model={"num_query_groups": 2})).model.num_query_groups == 2
    assert parse_job(job(model={"num_query_groups": 1})).model.num_query_groups == 1


def test_odd_head_dim_refused_for_llama():
    # hidden 12 / 4 heads = head size 3: rotary embeddings rotate pairs of channels.
    refused(
        job(model={"arch": "llama", "hidden_size": 12, "num_attention_heads": 4}),
        r"model\.hidden_size / model\.num_attention_heads \(the head size\) must be even .*llama.*got 3",
    )


def test_odd_head_dim_allowed_for_gpt2():
    spec = parse_job(job(model={"arch": "gpt2", "hidden_size": 12, "num_attention_heads": 4}))
    assert spec.model.head_dim == 3


# --- layout rules (JobSpec) --------------------------------------------------------------------


def test_heads_not_divisible_by_tensor():
    # hidden 96 / 6 heads (head size 16); tensor 4 on 4 ranks; divisors of 6: 1, 2, 3, 6
    refused(
        job(
            model={"hidden_size": 96, "num_attention_heads": 6},
            parallel={"tensor": 4},
            resources={"ranks": 4},
        ),
        r"^model\.num_attention_heads \(6\) is not divisible by parallel\.tensor \(4\): "
        r"choose parallel\.tensor from 1, 2, 3, 6$",
    )


def test_model_parallel_product_must_divide_ranks():
    # 2 x 2 x 1 = 4 does not divide 6 ranks
    refused(
        job(model={"num_layers": 2}, parallel={"tensor": 2, "pipeline": 2}, resources={"ranks": 6}),
        r"^parallel\.tensor \(2\) x parallel\.pipeline \(2\) x parallel\.context \(1\) = 4 does not divide "
        r"resources\.ranks \(6\): set resources\.ranks to a multiple of 4 or shrink the parallel sizes$",
    )


def test_model_parallel_product_counts_context():
    # tensor 2 alone divides 6 ranks; with context 2 the product is 4, which does not.
    refused(
        job(parallel={"tensor": 2, "context": 2}, resources={"ranks": 6}),
        r"parallel\.tensor \(2\) x parallel\.pipeline \(1\) x parallel\.context \(2\) = 4 does not divide "
        r"resources\.ranks \(6\)",
    )


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    # 4 ranks, all data parallel: per step 2 x 4 = 8, and 12 is not a multiple of 8.
    refused(
        job(training={"global_batch_size": 12, "micro_batch_size": 2}, resources={"ranks": 4}),
        r"^training\.global_batch_size \(12\) is not divisible by training\.micro_batch_size \(2\) x "
        r"data-parallel size \(4\) = 8: use a multiple of 8$",
    )


def test_global_batch_rule_uses_dp_not_ranks():
    # 4 ranks with tensor 2: data parallel is 2, so per step 2 x 2 = 4; 6 is refused, 8 is fine.
    refused(
        job(
            parallel={"tensor": 2},
            training={"global_batch_size": 6, "micro_batch_size": 2},
            resources={"ranks": 4},
        ),
        r"training\.global_batch_size \(6\) .* data-parallel size \(2\) = 4: use a multiple of 4",
    )
    ok = job(
        parallel={"tensor": 2},
        training={"global_batch_size": 4, "micro_batch_size": 2},
        resources={"ranks": 4},
    )
    assert parse_job(ok).data_parallel_size == 2


MOE_MODEL = {
    "arch": "llama",
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "moe": {"num_experts": 12},
}


def test_expert_times_pipeline_must_divide_the_ranks():
    refused(
        job(model=MOE_MODEL, parallel={"expert": 3}, resources={"ranks": 4}),
        r"^parallel\.expert \(3\) x parallel\.pipeline \(1\) = 3 does not divide resources\.ranks \(4\)$",
    )
    # Experts are whole on their rank, so EP may span TP ranks (with SP): 4 ranks, TP 2, EP 4.
    spec = parse_job(
        job(
            model=MOE_MODEL,
            parallel={"tensor": 2, "sequence_parallel": True, "expert": 4},
            resources={"ranks": 4},
        )
    )
    assert spec.data_parallel_size == 2


def test_expert_parallelism_needs_an_moe_model_and_divisible_experts():
    refused(job(parallel={"expert": 2}, resources={"ranks": 2}), r"parallel\.expert > 1 needs an MoE model")
    refused(
        job(model={**MOE_MODEL, "moe": {"num_experts": 3}}, parallel={"expert": 2}, resources={"ranks": 2}),
        r"model\.moe\.num_experts \(3\) must be divisible by parallel\.expert \(2\)",
    )
    refused(
        job(model=MOE_MODEL, parallel={"tensor": 2}, resources={"ranks": 2}),
        r"needs parallel\.sequence_parallel: true",
    )


def test_query_groups_not_divisible_by_tensor():
    # 8 heads, 2 groups, tensor 4: heads split, groups do not; divisors of 2: 1, 2
    refused(
        job(
            model={"hidden_size": 128, "num_attention_heads": 8, "num_query_groups": 2},
            parallel={"tensor": 4},
            resources={"ranks": 4},
        ),
        r"^model\.num_query_groups \(2\) is not divisible by parallel\.tensor \(4\): "
        r"choose parallel\.tensor from 1, 2 or raise num_query_groups$",
    )


def test_ffn_not_divisible_by_tensor():
    # 8 heads over tensor 8 is fine; ffn 100 is not a multiple of 8.
    refused(
        job(
            model={"hidden_size": 128, "num_attention_heads": 8, "ffn_hidden_size": 100},
            parallel={"tensor": 8},
            resources={"ranks": 8},
        ),
        r"^model\.ffn_hidden_size \(100\) is not divisible by parallel\.tensor \(8\): make it a multiple of 8$",
    )


def test_vocab_multiple_not_divisible_by_tensor():
    refused(
        job(model={"make_vocab_size_divisible_by": 127}, parallel={"tensor": 2}, resources={"ranks": 2}),
        r"^model\.make_vocab_size_divisible_by \(127\) must be a multiple of parallel\.tensor \(2\) "
        r"so the embedding table splits evenly$",
    )


def test_seq_length_with_sequence_parallel():
    refused(
        job(
            model={"seq_length": 127},
            parallel={"tensor": 2, "sequence_parallel": True},
            resources={"ranks": 2},
        ),
        r"^model\.seq_length \(127\) must be divisible by parallel\.tensor \(2\) with "
        r"parallel\.sequence_parallel: true$",
    )


def test_seq_length_only_matters_with_sequence_parallel_over_several_ranks():
    # Without sequence parallelism, or with tensor 1 (SP is a no-op), an odd length is fine.
    parse_job(job(model={"seq_length": 127}, parallel={"tensor": 2}, resources={"ranks": 2}))
    parse_job(job(model={"seq_length": 127}, parallel={"tensor": 1, "sequence_parallel": True}))


def test_num_layers_not_divisible_by_pipeline():
    # divisors of 3: 1, 3
    refused(
        job(model={"num_layers": 3}, parallel={"pipeline": 2}, resources={"ranks": 2}),
        r"^model\.num_layers \(3\) is not divisible by parallel\.pipeline \(2\): "
        r"choose parallel\.pipeline from 1, 3$",
    )


def test_virtual_pipeline_needs_pipeline():
    refused(
        job(parallel={"virtual_pipeline": 2}),
        r"^parallel\.virtual_pipeline needs parallel\.pipeline > 1: remove it or raise pipeline$",
    )


def test_num_layers_not_divisible_by_pipeline_times_virtual():
    # 4 layers over pipeline 2 is fine; 2 x 4 = 8 virtual stages is not.
    refused(
        job(model={"num_layers": 4}, parallel={"pipeline": 2, "virtual_pipeline": 4}, resources={"ranks": 2}),
        r"^model\.num_layers \(4\) must be divisible by parallel\.pipeline x parallel\.virtual_pipeline \(8\)$",
    )


def test_uneven_pipeline_split_is_accepted_when_it_adds_up():
    spec = parse_job(
        job(
            model={"num_layers": 3},
            parallel={"pipeline": 2, "pipeline_layers": [1, 2]},
            resources={"ranks": 2},
        )
    )
    assert spec.parallel.pipeline_layers == [1, 2]


@pytest.mark.parametrize(
    "layers", [[1, 1], [1, 1, 1], [3, 0]], ids=["short-sum", "too-many-stages", "empty-stage"]
)
def test_pipeline_layers_must_list_every_stage_and_add_up(layers):
    with pytest.raises(JobSpecError, match=r"parallel\.pipeline_layers"):
        parse_job(
            job(
                model={"num_layers": 3},
                parallel={"pipeline": 2, "pipeline_layers": layers},
                resources={"ranks": 2},
            )
        )


def test_interleaved_schedule_needs_microbatches_multiple_of_pipeline():
    # 3 microbatches (global 3, micro 1, dp 1) over pipeline 2 with virtual stages
    refused(
        job(
            model={"num_layers": 4},
            parallel={"pipeline": 2, "virtual_pipeline": 2},
            training={"global_batch_size": 3},
            resources={"ranks": 2},
        ),
        r"^the interleaved schedule needs the number of microbatches .* = 3\) to be a multiple of "
        r"parallel\.pipeline \(2\)$",
    )


def test_virtual_pipeline_accepted_when_layers_split():
    spec = parse_job(
        job(model={"num_layers": 8}, parallel={"pipeline": 2, "virtual_pipeline": 2}, resources={"ranks": 2})
    )
    assert spec.parallel.virtual_pipeline == 2


# --- rampup ------------------------------------------------------------------------------------

RAMPUP_STEP = r"must be multiples of micro_batch_size x data-parallel size \(2\)$"


@pytest.mark.parametrize("rampup", [[3, 2, 100], [2, 3, 100]], ids=["start", "increment"])
def test_rampup_start_and_increment_must_be_whole_steps(rampup):
    # 2 ranks, micro batch 1: every batch size must be a multiple of 2.
    start, incr, _ = rampup
    refused(
        job(training={"rampup_batch_size": rampup}, resources={"ranks": 2}),
        rf"^training\.rampup_batch_size start \({start}\) and increment \({incr}\) " + RAMPUP_STEP,
    )


def test_rampup_must_reach_global_batch_in_whole_increments():
    # 8 - 2 = 6 is not a multiple of 4
    refused(
        job(training={"global_batch_size": 8, "rampup_batch_size": [2, 4, 100]}, resources={"ranks": 2}),
        r"^training\.rampup_batch_size: global_batch_size \(8\) - start \(2\) must be a non-negative "
        r"multiple of the increment \(4\)$",
    )


def test_rampup_start_above_global_batch():
    # 8 - 12 = -4 is a multiple of 4 but negative
    refused(
        job(training={"global_batch_size": 8, "rampup_batch_size": [12, 4, 100]}, resources={"ranks": 2}),
        r"training\.rampup_batch_size: global_batch_size \(8\) - start \(12\) must be a non-negative multiple",
    )


def test_rampup_needs_three_values():
    refused(job(training={"rampup_batch_size": [2, 2]}), r"training\.rampup_batch_size")


def test_valid_rampup_accepted():
    spec = parse_job(
        job(training={"global_batch_size": 8, "rampup_batch_size": [2, 2, 100]}, resources={"ranks": 2})
    )
    assert spec.training.rampup_batch_size == (2, 2, 100)


# --- optimizer ---------------------------------------------------------------------------------


def test_min_lr_above_lr():
    refused(
        job(optimizer={"lr": 0.001, "min_lr": 0.002}),
        r"^optimizer\.min_lr \(0\.002\) must not exceed optimizer\.lr \(0\.001\)$",
    )


def test_min_lr_equal_to_lr_is_fine():
    assert parse_job(job(optimizer={"lr": 0.001, "min_lr": 0.001})).optimizer.min_lr == 0.001


def test_wsd_needs_decay_iters():
    refused(
        job(optimizer={"lr_decay_style": "WSD"}),
        r"^optimizer\.lr_wsd_decay_iters is required when optimizer\.lr_decay_style is WSD$",
    )
    spec = parse_job(job(optimizer={"lr_decay_style": "WSD", "lr_wsd_decay_iters": 4}))
    assert spec.optimizer.lr_wsd_decay_iters == 4


@pytest.mark.parametrize(
    "given", [{"start_weight_decay": 0.0}, {"end_weight_decay": 0.1}], ids=["start-only", "end-only"]
)
def test_start_and_end_weight_decay_go_together(given):
    refused(
        job(optimizer={"weight_decay_incr_style": "linear", **given}),
        r"^optimizer\.start_weight_decay and optimizer\.end_weight_decay go together: set both or neither$",
    )


def test_start_and_end_weight_decay_both_set():
    spec = parse_job(
        job(
            optimizer={
                "start_weight_decay": 0.0,
                "end_weight_decay": 0.1,
                "weight_decay_incr_style": "linear",
            }
        )
    )
    assert (spec.optimizer.start_weight_decay, spec.optimizer.end_weight_decay) == (0.0, 0.1)


def test_warmup_longer_than_train_iters():
    refused(
        job(training={"train_iters": 10}, optimizer={"lr_warmup_iters": 11}),
        r"^optimizer\.lr_warmup_iters \(11\) exceeds the decay length "
        r"\(optimizer\.lr_decay_iters or training\.train_iters\)$",
    )


def test_warmup_checked_against_lr_decay_iters_when_set():
    # decay 5 < warmup 6 <= train_iters 10: refused because the decay length is 5, not 10.
    refused(
        job(training={"train_iters": 10}, optimizer={"lr_warmup_iters": 6, "lr_decay_iters": 5}),
        r"optimizer\.lr_warmup_iters \(6\) exceeds the decay length",
    )
    # decay 20 > train_iters 10: a warmup of 15 fits the decay length.
    parse_job(job(training={"train_iters": 10}, optimizer={"lr_warmup_iters": 15, "lr_decay_iters": 20}))


def test_warmup_equal_to_decay_length_is_fine():
    assert (
        parse_job(
            job(training={"train_iters": 10}, optimizer={"lr_warmup_iters": 10})
        ).optimizer.lr_warmup_iters
        == 10
    )


# Jobs OptimizerParamScheduler.from_spec (engine/optimizer/scheduler.py) would refuse at start-up
# must be refused by the job spec already (a 422 / exit 2, not a crash on the ranks).
@pytest.mark.parametrize(
    "optimizer",
    [
        # scheduler: "end_wd (0.01) is below start_wd (0.1): weight decay only increments"
        {"start_weight_decay": 0.1, "end_weight_decay": 0.01, "weight_decay_incr_style": "linear"},
        # scheduler: "wd_incr_style constant needs start_wd == end_wd"
        {"start_weight_decay": 0.0, "end_weight_decay": 0.1},
        # scheduler: "wsd_decay_steps (100) exceeds lr_decay_steps (10)"
        {"lr_decay_style": "WSD", "lr_wsd_decay_iters": 100},
    ],
    ids=["end-wd-below-start", "constant-style-with-changing-wd", "wsd-longer-than-decay"],
)
def test_jobs_the_scheduler_refuses_are_refused_up_front(optimizer):
    try:
        parse_job(job(training={"train_iters": 10}, optimizer=optimizer))
    except JobSpecError:
        return
    raise AssertionError(f"parse_job accepted optimizer={optimizer}")


# --- names, unknown keys, types ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["Bad Name", "UPPER", "-leading-dash", "", "a" * 64, "job\n"],
    ids=["space", "upper", "leading-dash", "empty", "64-chars", "trailing-newline"],
)
def test_bad_name(name):
    refused(job(name=name), r"^name: String should match pattern '\^\[a-z0-9\]")


@pytest.mark.parametrize("name", ["a", "gpt2-small", "run_1.v2", "0" + "a" * 62])
def test_good_name(name):
    assert parse_job(job(name=name)).name == name


def test_unknown_top_level_key():
    refused(
        job(tensor_paralel=2),
        r"^tensor_paralel: unknown key: did you mean 'parallel'\? known keys here: name, model, parallel, data, training, optimizer, "
        r"checkpoint, resilience, resources, scheduling, evaluation$",
    )


def test_misspelt_key_inside_a_section():
    # The reason the rule exists: `tensor_paralel: 2` must not silently train with tensor 1.
    refused(
        job(parallel={"tensor_paralel": 2}, resources={"ranks": 2}),
        r"^parallel\.tensor_paralel: unknown key: did you mean 'tensor'\? known keys here: tensor, pipeline, "
        r"virtual_pipeline, context, expert, sequence_parallel, pipeline_layers, distributed_optimizer, "
        r"data_parallel_sharding, data_parallel_shard_size, "
        r"grad_reduce_in_fp32, overlap_grad_reduce, grad_bucket_size$",
    )
    refused(
        job(optimizer={"learning_rate": 0.1}),
        r"^optimizer\.learning_rate: unknown key: .*known keys here: type, lr, ",
    )


def test_yaml_boolean_is_not_an_integer():
    refused(job(parallel={"tensor": True}), r"^parallel\.tensor: Input should be a valid integer$")


def test_wrong_type_for_an_integer():
    refused(job(parallel={"tensor": "two"}), r"^parallel\.tensor: Input should be a valid integer")


def test_wrong_type_for_a_section():
    refused(job(model=3), r"^model: Input should be a valid dictionary")


def test_literal_lists_the_allowed_values():
    refused(
        job(training={"precision": "fp64"}),
        r"^training\.precision: Input should be 'fp32', 'bf16' or 'fp16'$",
    )


def test_out_of_range_value():
    refused(job(parallel={"tensor": 0}), r"^parallel\.tensor: Input should be greater than or equal to 1$")
    refused(job(model={"hidden_dropout": 1.0}), r"^model\.hidden_dropout: Input should be less than 1")


def test_every_field_error_is_listed_one_per_line():
    message = refused(
        job(parallel={"tensor": 0}, training={"precision": "fp64"}, resources={"ranks": "many"}),
        r"parallel\.tensor",
    )
    lines = message.splitlines()
    assert len(lines) == 3, message
    assert lines[0].startswith("parallel.tensor: ")
    assert lines[1].startswith("training.precision: ")
    assert lines[2].startswith("resources.ranks: ")


# --- derived values and architecture defaults --------------------------------------------------


def test_gpt2_defaults():
    m = parse_job(job(model={"arch": "gpt2", "hidden_size": 64, "num_attention_heads": 4})).model
    assert m.ffn_hidden_size == 256  # 4 x 64
    assert m.tie_embeddings is True
    assert m.num_query_groups == 4  # one per head


@pytest.mark.parametrize(
    ("hidden", "heads", "ffn"),
    [
        (64, 4, 192),  # 8*64/3 = 170.7 -> 192
        (96, 6, 256),  # 8*96/3 = 256 exactly -> 256, not 320
        (128, 8, 384),  # 341.3 -> 384
        (256, 8, 704),  # 682.7 -> 704
    ],
)
def test_llama_defaults(hidden, heads, ffn):
    m = parse_job(job(model={"arch": "llama", "hidden_size": hidden, "num_attention_heads": heads})).model
    assert m.ffn_hidden_size == ffn
    assert m.tie_embeddings is False
    assert m.num_query_groups == heads
    assert m.head_dim == hidden // heads


def test_explicit_values_override_arch_defaults():
    m = parse_job(
        job(model={"arch": "llama", "ffn_hidden_size": 200, "tie_embeddings": True, "num_query_groups": 2})
    ).model
    assert (m.ffn_hidden_size, m.tie_embeddings, m.num_query_groups) == (200, True, 2)
    m = parse_job(job(model={"arch": "gpt2", "tie_embeddings": False})).model
    assert m.tie_embeddings is False


@pytest.mark.parametrize(
    ("ranks", "parallel", "dp"),
    [
        (1, {}, 1),
        (8, {}, 8),
        (8, {"tensor": 2}, 4),
        (8, {"tensor": 2, "pipeline": 2}, 2),
        (16, {"tensor": 2, "pipeline": 2, "context": 2}, 2),
        (8, {"tensor": 2, "context": 2}, 2),
    ],
)
def test_data_parallel_size(ranks, parallel, dp):
    spec = parse_job(job(parallel=parallel, training={"global_batch_size": 16}, resources={"ranks": ranks}))
    assert spec.data_parallel_size == dp


# --- files and schema --------------------------------------------------------------------------

YAML_JOB = """\
name: from-yaml
model:
  arch: gpt2
  hidden_size: 32
  num_attention_heads: 2
parallel:
  tensor: 2
training:
  global_batch_size: 4
  micro_batch_size: 2
resources:
  ranks: 4
"""


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_load_yaml(tmp_path, suffix):
    path = tmp_path / f"job{suffix}"
    path.write_text(YAML_JOB)
    spec = load_job(path)
    assert spec.name == "from-yaml"
    assert spec.model.ffn_hidden_size == 128
    assert spec.parallel.tensor == 2
    assert spec.data_parallel_size == 2


def test_load_json(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"name": "from-json", "parallel": {"tensor": 2}, "resources": {"ranks": 2}}))
    spec = load_job(str(path))
    assert spec.name == "from-json"
    assert spec.parallel.tensor == 2


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(JobSpecError, match=rf"^cannot read job file {re.escape(str(path))}: No such file"):
        load_job(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", ""], ids=["list", "scalar", "empty"])
def test_load_non_mapping_yaml(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(JobSpecError, match=r"a job file is a mapping with sections name, model, parallel"):
        load_job(path)


def test_load_invalid_yaml(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: {arch: gpt2\n")
    with pytest.raises(JobSpecError, match=r"is not valid YAML"):
        load_job(path)


def test_load_invalid_json(tmp_path):
    path = tmp_path / "job.json"
    path.write_text('{"name": "x",')
    with pytest.raises(JobSpecError, match=r"job\.json"):
        load_job(path)


def test_load_job_reports_validation_errors_as_job_spec_errors(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("parallel:\n  tensor_paralel: 2\n")
    with pytest.raises(
        JobSpecError, match=r"^parallel\.tensor_paralel: unknown key: did you mean 'tensor'\?"
    ):
        load_job(path)


def test_json_schema_has_the_eleven_sections():
    schema = json_schema()
    assert list(schema["properties"]) == [
        "name",
        "model",
        "parallel",
        "data",
        "training",
        "optimizer",
        "checkpoint",
        "resilience",
        "resources",
        "scheduling",
        "evaluation",
    ]
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["ParallelSpec"]["additionalProperties"] is False


def test_examples_load():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    # finetune_hf.yaml reads a model folder the example script writes: test_hf_example.py runs it.
    # deepseek_tiny.yaml is checked by test_deepseek.py; finetune_lora.yaml by test_lora_example.py.
    # bert_tiny.yaml is run by test_bert_example.py.
    assert names == [
        "bert_tiny.yaml",
        "deepseek_tiny.yaml",
        "finetune_hf.yaml",
        "finetune_lora.yaml",
        "gpt2_small_dp.yaml",
        "llama_tiny_tp2.yaml",
        "sweep_lora.yaml",  # a sweep file, not a job: tests/service/test_sweep_space.py checks it
        "t5_tiny.yaml",  # checked by test_t5_example.py
    ]

    gpt2 = load_job(EXAMPLES / "gpt2_small_dp.yaml")
    assert gpt2.name == "gpt2-small"
    assert gpt2.model.ffn_hidden_size == 1024  # 4 x 256
    assert gpt2.model.tie_embeddings is True
    assert gpt2.data_parallel_size == 1

    llama = load_job(EXAMPLES / "llama_tiny_tp2.yaml")
    assert llama.name == "llama-tiny-tp2"
    assert llama.model.ffn_hidden_size == 384  # 8*128/3 = 341.3 -> 384
    assert llama.model.num_query_groups == 4
    assert llama.parallel.tensor == 2 and llama.parallel.sequence_parallel is True
    assert llama.data_parallel_size == 1  # 2 ranks / tensor 2


def test_import_does_not_pull_in_torch():
    code = "import sys, engine.jobspec; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing engine.jobspec imported {done.stdout.strip()}"


def test_huge_or_infinite_numbers_are_refused_cheaply():
    """The spec is validated on the API's request path: a number a client makes up must cost a
    bounded amount of work (a divisor hint over 10**12 once hung the API) and infinities are
    no setting. An O(n) hint over 2**31 - 1 would run into pytest's timeout here."""
    with pytest.raises(JobSpecError) as err:
        parse_job({"model": {"hidden_size": 2**31 - 1, "num_attention_heads": 2}})
    assert "model.hidden_size" in str(err.value) and "pick heads from 1, 2147483647" in str(err.value)
    with pytest.raises(JobSpecError, match="parallel.pipeline"):
        parse_job({"parallel": {"pipeline": 10**12}})
    with pytest.raises(JobSpecError, match="optimizer.lr"):
        parse_job({"optimizer": {"lr": float("inf")}})
    with pytest.raises(JobSpecError, match="training.initial_loss_scale"):
        parse_job({"training": {"initial_loss_scale": float("nan")}})


@pytest.mark.parametrize(
    "sections",
    [
        {"model": {"moe": {"num_experts": 4}}},
        {"parallel": {"context": 2}, "resources": {"ranks": 2}},
        {"parallel": {"data_parallel_sharding": "optim_grads_params"}, "resources": {"ranks": 2}},
    ],
    ids=["moe", "context", "zero3"],
)
def test_compile_is_refused_where_a_layer_holds_collectives_or_dynamic_shapes(sections):
    assert parse_job(job(**sections)).training.compile is False  # the layout itself is valid
    refused(job(training={"compile": True}, **sections), r"training\.compile is not supported yet.*set training\.compile: false")
    assert parse_job(job(training={"compile": True})).training.compile


def test_lost_replica_share_is_refused_where_it_cannot_apply():
    """resilience.lost_replica_share: redistribute belongs to replace_replica, and not yet to
    multi-token prediction (its depths' weights are set once per step); skip is the default."""
    assert parse_job(job()).resilience.lost_replica_share == "skip"
    msg = refused(job(resilience={"lost_replica_share": "redistribute"}), r"resilience\.lost_replica_share")
    assert "on_rank_failure: replace_replica" in msg
    ok = {"on_rank_failure": "replace_replica", "lost_replica_share": "redistribute"}
    assert parse_job(job(resilience=ok, resources={"ranks": 2})).resilience.lost_replica_share == "redistribute"
    refused(job(resilience=ok, resources={"ranks": 2}, model={"mtp_num_layers": 1}), r"lost_replica_share.*mtp_num_layers")
    refused(job(resilience={"lost_replica_share": "share"}), r"lost_replica_share")
