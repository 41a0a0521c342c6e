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

import math
import re
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


def expert_grid_size(parallel: ParallelSpec) -> int:
    """Ranks of one expert-parallel x pipeline block, which must divide the ranks: experts are
    whole on their EP rank (expert TP 1), so EP may span TP ranks (Megatron-Core's expert grid)."""
    return parallel.expert * parallel.pipeline


def pipeline_stages(parallel: ParallelSpec) -> int:
    """Model chunks in pipeline order: pipeline x virtual_pipeline."""
    return parallel.pipeline * (parallel.virtual_pipeline or 1)


def describe(ranks: int, parallel: ParallelSpec) -> str:
    """The layout in a few characters, e.g. 'tp2 pp1 cp1 dp4' (the API's job listings)."""
    p = parallel
    return f"tp{p.tensor} pp{p.pipeline} cp{p.context} dp{data_parallel_size(ranks, p)}"


def sequence_parallel_effective(parallel: ParallelSpec) -> bool:
    """Sequence parallelism shards activations between TP regions: a no-op without TP."""
    return parallel.sequence_parallel and parallel.tensor > 1


def seq_length_multiple(parallel: ParallelSpec) -> int:
    """What model.seq_length must be a multiple of under context parallelism: 2 x context equal
    chunks, two per CP rank (causal load balancing); under sequence parallelism each CP rank's
    share splits again over TP. 1 without context parallelism."""
    if parallel.context == 1:
        return 1
    tp = parallel.tensor if sequence_parallel_effective(parallel) else 1
    return parallel.context * math.lcm(2, tp)


def samples_per_microbatch(training: TrainingSpec, data_parallel: int) -> int:
    """Samples one microbatch on every data-parallel rank takes: a global batch (and a rampup's
    start and increment) must be a multiple of it."""
    return training.micro_batch_size * data_parallel


def num_microbatches(training: TrainingSpec, data_parallel: int, global_batch_size: int | None = None) -> int:
    """Microbatches each data-parallel rank runs per step for a global batch (default: the full
    one; a rampup's current one otherwise)."""
    gbs = training.global_batch_size if global_batch_size is None else global_batch_size
    return gbs // samples_per_microbatch(training, data_parallel)


def join_location(root: str, name: str) -> str:
    """`root/name` for a local path or a URI (s3://, file://)."""
    return f"{root.rstrip('/')}/{name}" if "://" in root else str(Path(root) / name)


def job_checkpoint_path(checkpoint_path: str, job_id: str) -> str:
    """The `checkpoint.path` a job submitted through the service runs with: its own folder under
    the configured root, so two jobs of the same name never resume each other's checkpoints."""
    return join_location(checkpoint_path, job_id)


# The folder of one checkpoint under a job's checkpoint location: `iter_` and its iteration, seven
# digits or more (iteration 10,000,000 has eight).
ITERATION_FOLDER = re.compile(r"^iter_(\d{7,})$")


def iteration_folder(iteration: int) -> str:
    """The name of the folder of a job's checkpoint of `iteration` (`iter_0000100`)."""
    return f"iter_{iteration:07d}"


def split_checkpoint_uri(uri: str) -> tuple[str, str]:
    """(storage root, key under it) of a checkpoint a user names: a job's checkpoint root (key
    "": its newest committed checkpoint) or one `iter_NNNNNNN` folder (its parent, its name)."""
    uri = uri.rstrip("/")
    parent, _, last = uri.rpartition("/")
    if ITERATION_FOLDER.match(last):
        return parent or ".", last
    return uri, ""


def checkpoint_location(checkpoint_path: str, job_name: str) -> str:
    """The folder holding a job's `iter_NNNNNNN` checkpoints, given the `checkpoint.path` it ran
    with: the engine writes under the job's name."""
    return join_location(checkpoint_path, job_name)
