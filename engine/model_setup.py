"""Build what one rank trains: its model chunks (one per virtual pipeline stage it holds),
initialised or imported from Hugging Face, wrapped for data parallelism, and the optimizer,
learning-rate schedule, fp16 loss scaler and pipeline runner over them.

The Trainer asks for it once (`build_model_and_optimizer`) and only steps what it gets; the
choices of process groups for the gradient norm live here, beside the optimizer they feed.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine import parallel_state as ps
from engine.compile import compile_layers
from engine.distributed.data_parallel import DataParallel
from engine.distributed.deferred_init import DeferredInit, buffers_to, materialize_rest, params_on_meta
from engine.hf.importer import ImportReport, import_hf_weights
from engine.hf.peft import load_adapters, read_adapter
from engine.jobspec import JobSpec
from engine.models import LanguageModel, model_family
from engine.optimizer.grad_scaler import DynamicGradScaler
from engine.optimizer.optimizer import TrainingOptimizer
from engine.optimizer.scheduler import OptimizerParamScheduler
from engine.pipeline_parallel import PipelineRunner, stage_layer_ranges, virtual_stages_of
from engine.transformer.config import TransformerConfig
from engine.transformer.initialization import global_names, initialize_param, initialize_weights
from engine.transformer.lora import attach_lora


@dataclass
class ModelAndOptimizer:
    model_chunks: list[LanguageModel]
    ddp_chunks: list[DataParallel]
    stage_indices: list[int]  # the global pipeline stages of model_chunks, in order
    num_stages: int
    optimizer: TrainingOptimizer
    scheduler: OptimizerParamScheduler
    grad_scaler: DynamicGradScaler | None
    pipeline: PipelineRunner | None
    hf_import: ImportReport | None  # what model.init_from's import read, when it ran


def build_model_chunks(
    spec: JobSpec, config: TransformerConfig, device: torch.device, initialize: bool = True, deferred: bool = False
) -> tuple[list[LanguageModel], list[int], int]:
    """This rank's model chunks: one per virtual pipeline stage it holds (one without PP), with
    their global stage indices and the number of stages. `deferred`: parameters stay on the meta
    device (buffers are real, on `device`); data parallelism materialises and initialises them
    where it keeps them (`deferred_init_of`), so the model is never whole on a rank."""
    p = spec.parallel
    vp = p.virtual_pipeline or 1
    num_stages = p.pipeline * vp
    stage_indices = virtual_stages_of(ps.get_pipeline_model_parallel_rank(), p.pipeline, vp)
    model_class = model_family(spec.model.arch)
    if model_class.splits_layers_over_stages:
        ranges = stage_layer_ranges(config.num_layers, num_stages, p.pipeline_layers)
    else:
        ranges = [(0, None)] * num_stages
    chunks = []
    for idx in stage_indices:
        offset, count = ranges[idx]
        with params_on_meta() if deferred else nullcontext():
            chunk = model_class(
                config,
                pre_process=idx == 0,
                post_process=idx == num_stages - 1,
                layer_offset=offset,
                num_layers=count,
            )
        if deferred:
            buffers_to(chunk, device)
        else:
            chunk.to(device)
        if initialize and not deferred:
            initialize_weights(chunk, spec.training.seed)
        if spec.training.compile:
            compile_layers(chunk)
        chunks.append(chunk)
    return chunks, stage_indices, num_stages


def norm_group(spec: JobSpec) -> dist.ProcessGroup | None:
    """The ranks whose squared gradients add up to the global norm once each: the
    model-parallel group when DP replicas hold the same gradients; every rank under the
    distributed optimizer (each DP rank holds its own slice); under hybrid sharding, the
    ranks of one replica (a new group, made on every rank in the same order)."""
    p = spec.parallel
    if not p.distributed_optimizer:
        return ps.get_group("mp")
    if not ps.has_group("dp_shard"):
        return None
    # Replica r: every rank whose DP index lies in the r-th block of data_parallel_shard_size.
    grid, size, mine = ps.get_grid(), p.data_parallel_shard_size, None
    members: dict[int, list[int]] = {}
    for rank in range(grid.world_size):
        members.setdefault(grid.coords(rank)["dp"] // size, []).append(rank)
    for key in sorted(members):
        group = dist.new_group(members[key])
        if dist.get_rank() in members[key]:
            mine = group
    return mine


def expert_norm_group(spec: JobSpec, config: TransformerConfig) -> dist.ProcessGroup | None:
    """The ranks whose squared expert gradients add up to the experts' share of the norm once
    each: one of every expert (expert TP x EP x PP); with sharded optimizer state each expert
    is also split over the expert data-parallel group, so every rank (the world group)."""
    if not config.moe:
        return None
    if spec.parallel.distributed_optimizer and dist.get_world_size(ps.get_group("edp")) > 1:
        return dist.group.WORLD
    return ps.get_group("emp")


def deferred_init_of(spec: JobSpec, chunk: LanguageModel, device: torch.device) -> DeferredInit:
    """How a chunk built on the meta device is filled: the layout-independent initialisation,
    parameter by parameter, where data parallelism materialises each."""
    names, seed = global_names(chunk), spec.training.seed
    return DeferredInit(device, lambda p: initialize_param(p, names[id(p)], seed))


def wrap_data_parallel(
    spec: JobSpec, config: TransformerConfig, chunks: list[LanguageModel], deferred: list[DeferredInit] | None = None
) -> list[DataParallel]:
    """Each chunk under the job's data-parallel sharding level (`deferred`: per chunk, how its
    meta parameters are filled; the ones data parallelism does not hold are materialised here)."""
    p = spec.parallel
    grad_dtype = torch.float32 if p.grad_reduce_in_fp32 else config.params_dtype
    # Weights are replicated over context parallelism as well: gradients are averaged over
    # DP x CP and the distributed optimizer shards over it (Megatron-Core's dp_cp group).
    grad_group = ps.get_group("dp_cp") if p.context > 1 else ps.get_group("dp")
    # Hybrid sharding: shard within groups of data_parallel_shard_size, all-reduce across them.
    hybrid = ps.has_group("dp_shard")
    deferred = deferred or [None] * len(chunks)
    wrapped = [
        DataParallel(
            chunk,
            grad_group,
            grad_dtype=grad_dtype,
            bucket_size=p.grad_bucket_size,
            overlap=p.overlap_grad_reduce,
            sharding=p.data_parallel_sharding,
            expert_group=ps.get_group("edp") if config.moe else None,
            shard_group=ps.get_group("dp_shard") if hybrid else None,
            replica_group=ps.get_group("dp_replica") if hybrid else None,
            deferred=init,
        )
        for chunk, init in zip(chunks, deferred, strict=True)
    ]
    for chunk, init in zip(chunks, deferred, strict=True):
        if init is not None:
            materialize_rest(chunk, init)
    return wrapped


def build_model_and_optimizer(
    spec: JobSpec, config: TransformerConfig, device: torch.device, import_hf: bool
) -> ModelAndOptimizer:
    """Everything a rank steps. `import_hf`: load model.init_from's weights (before the optimizer
    copies them into its fp32 masters, and instead of a random init: the import writes every
    element, the vocabulary padding included)."""
    p, t = spec.parallel, spec.training
    # A fresh model is built on the meta device and initialised where data parallelism keeps
    # it; an imported one is built whole (the importer writes whole parameters), and so is a
    # LoRA base (frozen: data parallelism holds none of it, every rank keeps it whole).
    defer = not import_hf and spec.model.lora is None
    chunks, stage_indices, num_stages = build_model_chunks(
        spec, config, device, initialize=not import_hf, deferred=defer
    )
    deferred = [deferred_init_of(spec, chunk, device) for chunk in chunks] if defer else None
    hf_import = None
    if import_hf:
        uri = spec.model.init_from
        hf_import = import_hf_weights(
            chunks,
            uri,
            None,  # the folder's own architecture: the import reads config.json once
            config,
            # what the checkpoint has no weights for (MTP depths it lacks)
            initialize=lambda chunk, only: initialize_weights(chunk, t.seed, only=only),
        )
    if spec.model.lora is not None:  # adapters on the base as it now is; the base is frozen
        lora = spec.model.lora
        targets = attach_lora(chunks, lora, config, t.seed)
        if lora.init_from is not None:  # a PEFT folder's adapters over the drawn ones
            load_adapters(chunks, read_adapter(lora.init_from, lora, targets), lora.init_from)
    ddp_chunks = wrap_data_parallel(spec, config, chunks, deferred)
    grad_scaler = None
    if t.precision == "fp16":
        grad_scaler = DynamicGradScaler(
            t.initial_loss_scale,
            t.min_loss_scale,
            growth_interval=t.loss_scale_window,
            hysteresis=t.hysteresis,
        )
    optimizer = TrainingOptimizer(
        ddp_chunks,
        spec.optimizer,
        # Replicas over DP hold the same grads unless the distributed optimizer split them.
        norm_group=norm_group(spec),
        grad_scaler=grad_scaler,
        expert_norm_group=expert_norm_group(spec, config),
    )
    scheduler = OptimizerParamScheduler.from_spec(optimizer, spec.optimizer, t.train_iters)
    pipeline = None
    if p.pipeline > 1:
        pipeline = PipelineRunner(ddp_chunks, stage_indices, num_stages, ps.get_group("pp"), device)
    return ModelAndOptimizer(
        chunks, ddp_chunks, stage_indices, num_stages, optimizer, scheduler, grad_scaler, pipeline, hf_import
    )
