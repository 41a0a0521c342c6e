"""Facts derived from a job's layout, each computed here and nowhere else.

The job spec says how many ranks and how the model is cut (tensor, pipeline, context); the
rest follows, and every layer (the API's validation, the workers' elastic sizes, the ranks'
grid, the model's sequence parallelism) used to derive it again. A reader looking for "the
data-parallel size" finds it in this module, with its test in tests/engine/test_jobspec_layout.py.

The checkpoint location is here too: the service names a job's checkpoints for `resume_from:
job:ID`, the workers namespace a job by its id, and the engine writes under the job's name; all
three compose the same path from these two functions.
"""

from __future__ import annotations

from pathlib import Path

from engine.jobspec.parallel import ParallelSpec
from engine.jobspec.training import TrainingSpec


def model_parallel_size(parallel: ParallelSpec) -> int:
    """Ranks that hold one copy of the model: tensor x pipeline x context (experts are laid over
    these ranks, so expert parallelism does not add to it)."""
    return parallel.tensor * parallel.pipeline * parallel.context


def data_parallel_size(ranks: int, parallel: ParallelSpec) -> int:
    """Model replicas on `ranks` ranks: the only size that changes when an elastic job resizes."""
    return ranks // model_parallel_size(parallel)


def sequence_parallel_effective(parallel: ParallelSpec) -> bool:
    """Sequence parallelism shards activations between TP regions: a no-op without TP."""
    return parallel.sequence_parallel and parallel.tensor > 1


def num_microbatches(training: TrainingSpec, data_parallel: int, global_batch_size: int | None = None) -> int:
    """Microbatches each data-parallel rank runs per step for a global batch (default: the full
    one; a rampup's current one otherwise)."""
    gbs = training.global_batch_size if global_batch_size is None else global_batch_size
    return gbs // (training.micro_batch_size * data_parallel)


def join_location(root: str, name: str) -> str:
    """`root/name` for a local path or a URI (s3://, file://)."""
    return f"{root.rstrip('/')}/{name}" if "://" in root else str(Path(root) / name)


def job_checkpoint_path(checkpoint_path: str, job_id: str) -> str:
    """The `checkpoint.path` a job submitted through the service runs with: its own folder under
    the configured root, so two jobs of the same name never resume each other's checkpoints."""
    return join_location(checkpoint_path, job_id)


def checkpoint_location(checkpoint_path: str, job_name: str) -> str:
    """The folder holding a job's `iter_NNNNNNN` checkpoints, given the `checkpoint.path` it ran
    with: the engine writes under the job's name."""
    return join_location(checkpoint_path, job_name)
