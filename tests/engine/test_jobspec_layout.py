"""The layout facts derived from a job spec (engine/jobspec/layout.py): each computed in one
place, and the resolved job that carries them (engine/jobspec/resolved.py)."""

from __future__ import annotations

import pytest

from engine.jobspec import JobSpecError, check_local_run, layout, parse_job, resolve_job


def spec(ranks=8, **parallel):
    model = {"num_layers": 4, "num_attention_heads": 4, "hidden_size": 64, "seq_length": 64}
    return parse_job(
        {"model": model, "parallel": parallel, "resources": {"ranks": ranks}, "training": {"global_batch_size": 16}}
    )


@pytest.mark.parametrize(
    "ranks, parallel, mp, dp",
    [
        (8, {}, 1, 8),
        (8, {"tensor": 2}, 2, 4),
        (8, {"tensor": 2, "pipeline": 2}, 4, 2),
        (8, {"tensor": 2, "context": 2}, 4, 2),
        (8, {"pipeline": 2, "context": 2, "tensor": 2}, 8, 1),
    ],
)
def test_model_and_data_parallel_sizes(ranks, parallel, mp, dp):
    s = spec(ranks, **parallel)
    assert layout.model_parallel_size(s.parallel) == mp
    assert layout.data_parallel_size(ranks, s.parallel) == dp == s.data_parallel_size
    job = resolve_job(s)
    assert (job.model_parallel_size, job.data_parallel_size) == (mp, dp)
    assert job.num_microbatches == 16 // dp  # micro batch 1


def test_sequence_parallel_is_effective_only_with_tensor_parallelism():
    assert not layout.sequence_parallel_effective(spec(8, sequence_parallel=True).parallel)
    assert layout.sequence_parallel_effective(spec(8, tensor=2, sequence_parallel=True).parallel)
    assert not resolve_job(spec(8, tensor=2)).sequence_parallel


def test_the_resolved_job_is_immutable_and_resizes_by_validating_again():
    job = resolve_job(spec(8, tensor=2))
    with pytest.raises(AttributeError):
        job.data_parallel_size = 3  # type: ignore[misc]
    assert job.with_ranks(4).data_parallel_size == 2
    with pytest.raises(JobSpecError, match="resources.ranks"):
        job.with_ranks(3)


def test_checkpoint_location_is_composed_in_one_place():
    assert layout.job_checkpoint_path("s3://b/ck/", "job-1") == "s3://b/ck/job-1"
    assert layout.checkpoint_location("/ck/job-1", "tiny") == "/ck/job-1/tiny"
    job = resolve_job({"name": "tiny", "checkpoint": {"path": "/ck", "interval": 5}})
    assert job.checkpoint_location == "/ck/tiny"
    assert resolve_job({}).checkpoint_location is None


def test_a_local_run_needs_a_checkpoint_path_but_the_spec_alone_does_not():
    """Over REST the service fills in its checkpoint root; `elastron train` has none to offer."""
    s = parse_job({"checkpoint": {"interval": 5}})  # valid: the service will choose the path
    with pytest.raises(JobSpecError, match="checkpoint.interval needs checkpoint.path.*elastron train"):
        check_local_run(s)
    check_local_run(parse_job({"checkpoint": {"interval": 5, "path": "runs/ck"}}))


def test_the_grid_arithmetic_of_validation_lives_in_layout():
    p = spec(16, tensor=2, pipeline=2, virtual_pipeline=2, expert=1).parallel
    assert layout.pipeline_stages(p) == 4 == resolve_job(spec(16, tensor=2, pipeline=2, virtual_pipeline=2)).pipeline_stages
    assert layout.expert_grid_size(p) == 2
    assert layout.describe(16, p) == "tp2 pp2 cp1 dp4"
    assert layout.seq_length_multiple(p) == 1  # no context parallelism
    assert layout.seq_length_multiple(spec(8, context=2).parallel) == 4
    assert layout.seq_length_multiple(spec(8, context=2, tensor=4, sequence_parallel=True).parallel) == 8
    assert layout.seq_length_multiple(spec(8, context=2, tensor=2, sequence_parallel=False).parallel) == 4
    s = spec(8, tensor=2)
    assert layout.samples_per_microbatch(s.training, 4) == 4
    assert layout.num_microbatches(s.training, 4) == 16 // 4


def resolved(**sections):
    base = {"model": {"num_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "seq_length": 64}}
    return resolve_job(parse_job({**base, **sections}))


def test_warm_restart_follows_in_memory_checkpoints_unless_the_job_says():
    assert resolved().warm_restart is False
    assert resolved(checkpoint={"interval": 10}).warm_restart is False
    assert resolved(checkpoint={"local_interval": 1}).warm_restart is True
    assert resolved(checkpoint={"local_interval": 1}, resilience={"warm_restart": False}).warm_restart is False
    assert resolved(resilience={"warm_restart": True}).warm_restart is True


@pytest.mark.parametrize(
    "step_timeout_s, setup_s, process_group_s, quorum_s",
    [
        (30.0, 600.0, 600, 30.0),  # a short step timeout: setup keeps its floor
        (300.0, 600.0, 600, 60.0),  # the default
        (400.0, 600.0, 800, 60.0),  # the process group outlasts two steps
        (900.0, 900.0, 1800, 60.0),  # a step timeout above the floor sets the setup's too
    ],
)
def test_the_timeouts_every_rank_uses_are_derived_from_the_step_timeout_once(step_timeout_s, setup_s, process_group_s, quorum_s):
    """The driver, the ranks' watchdog, the replica group and the quorum read these, not a rule of their own."""
    job = resolved(resilience={"step_timeout_s": step_timeout_s})
    assert (job.setup_timeout_s, job.process_group_timeout_s, job.quorum_timeout_s) == (
        setup_s,
        process_group_s,
        quorum_s,
    )
    # The backstop never fires before the watchdog: not during setup, not in a step.
    assert job.process_group_timeout_s >= max(job.setup_timeout_s, job.spec.resilience.step_timeout_s)


def test_a_job_derived_from_a_job_is_validated_again():
    from engine.jobspec import derive_job

    elastic = parse_job({**spec(8, tensor=2).model_dump(mode="json"), "resources": {"ranks": 8, "min_ranks": 4}})
    smaller = derive_job(elastic, resources={"ranks": 4, "min_ranks": None})
    assert (smaller.resources.ranks, smaller.resources.min_ranks) == (4, None)
    assert elastic.resources.ranks == 8  # the original is untouched
    with pytest.raises(JobSpecError, match="data-parallel size \\(3\\)"):
        derive_job(elastic, resources={"ranks": 6})  # 6 ranks over tensor 2: DP 3 does not split batch 16
    with pytest.raises(JobSpecError, match="resources"):
        derive_job(elastic, resources={"rank_count": 4})  # a field the section does not have
    with pytest.raises(ValueError, match="not a section"):
        derive_job(elastic, ranks=4)


@pytest.mark.parametrize(
    "uri, root, key",
    [
        ("s3://bucket/ckpt/job", "s3://bucket/ckpt/job", ""),  # a job's root: its newest checkpoint
        ("s3://bucket/ckpt/job/iter_0000100/", "s3://bucket/ckpt/job", "iter_0000100"),
        ("/data/ckpt/job/iter_12000000", "/data/ckpt/job", "iter_12000000"),  # eight digits
        ("iter_0000005", ".", "iter_0000005"),
        ("/data/ckpt/iter_5", "/data/ckpt/iter_5", ""),  # not a checkpoint folder's name
    ],
)
def test_a_checkpoint_uri_splits_into_its_storage_root_and_folder(uri, root, key):
    assert layout.split_checkpoint_uri(uri) == (root, key)


def test_the_iteration_folder_name_round_trips():
    for iteration in (0, 100, 12_000_000):
        name = layout.iteration_folder(iteration)
        assert int(layout.ITERATION_FOLDER.match(name).group(1)) == iteration
    assert layout.iteration_folder(100) == "iter_0000100"
