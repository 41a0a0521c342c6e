"""The whole job: its sections, the rules that span them, and parsing with messages that name
the field and the fix.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from engine.jobspec import layout
from engine.jobspec.checkpoint import CheckpointSpec
from engine.jobspec.common import _divisors, _Section
from engine.jobspec.data import DataSpec
from engine.jobspec.evaluation import EvaluationSpec
from engine.jobspec.hf_config import HFConfigError, resolve_hf_config
from engine.jobspec.model import HF_CONFIG_ERROR, ModelSpec
from engine.jobspec.parallel import ParallelSpec
from engine.jobspec.resilience import ResilienceSpec
from engine.jobspec.resources import ResourcesSpec
from engine.jobspec.scheduling import SchedulingSpec
from engine.jobspec.t5 import check_t5_job
from engine.jobspec.training import OptimizerSpec, TrainingSpec


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
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)

    @property
    def data_parallel_size(self) -> int:
        return layout.data_parallel_size(self.resources.ranks, self.parallel)

    @property
    def live_resize(self) -> bool:
        """Whether the scheduler resizes this job by releasing and adding replica groups inside its
        running attempt (resilience.resize: live on an elastic replace_replica job) rather than by a
        save, a stop and a relaunch."""
        return self.resilience.resize == "live" and self.resources.elastic

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
        return self

    @model_validator(mode="after")
    def _check_not_supported_yet(self) -> JobSpec:
        """Valid settings this engine version cannot run yet, each with what to use instead: the
        one place these rules live (the API refuses them at submission, not a rank at start)."""
        check_t5_job(self)  # model.arch t5's layouts and data sources (engine/jobspec/t5.py)
        m, p = self.model, self.parallel
        if m.moe is not None and p.context > 1:
            raise ValueError("MoE with parallel.context > 1 is not supported yet: use context 1")
        if self.data.packing and p.context > 1:
            raise ValueError(
                "data.packing is not supported with parallel.context > 1 yet (context-parallel attention has "
                "no per-sample mask): set parallel.context: 1 or data.packing: false"
            )
        if m.mtp_num_layers and (p.context > 1 or self.data.source == "sft"):
            raise ValueError(
                "model.mtp_num_layers with parallel.context > 1 or data.source sft is not supported yet "
                "(the depths read their tokens from whole, unmasked label rows): set model.mtp_num_layers: 0"
            )
        if m.mtp_num_layers and self.resilience.lost_replica_share == "redistribute":
            raise ValueError(
                "resilience.lost_replica_share: redistribute is not supported with model.mtp_num_layers yet (the "
                "depths' loss weights are set once per step, for one share of the batch): set "
                "resilience.lost_replica_share: skip or model.mtp_num_layers: 0"
            )
        if m.attention == "mla" and m.attention_dropout > 0:
            raise ValueError("model.attention_dropout is not available with model.attention: mla yet: set it to 0")
        if m.arch == "bert" or self.data.source == "mlm":
            from engine.jobspec.bert import check_bert_job  # the encoder's cross-section rules

            check_bert_job(m, p, self.data)
        if p.context > 1 and m.attention_dropout > 0:
            raise ValueError(
                "model.attention_dropout: attention dropout is not available with parallel.context > 1; "
                "set model.attention_dropout: 0"
            )
        if self.training.compile and (m.moe is not None or p.context > 1 or p.data_parallel_sharding == "optim_grads_params"):
            raise ValueError(
                "training.compile is not supported yet with model.moe, parallel.context > 1 or "
                "parallel.data_parallel_sharding: optim_grads_params (their collectives and data-dependent "
                "shapes sit inside the layer a compiled graph would hold): set training.compile: false"
            )
        return self

    @model_validator(mode="after")
    def _check_elastic(self) -> JobSpec:
        """Every size an elastic job may run on keeps the model-parallel layout and the global batch:
        min_ranks and max_ranks are multiples of tensor x pipeline x context, and the global batch
        (and a rampup's start and increment) splits into micro batches at both ends."""
        r, p, t = self.resources, self.parallel, self.training
        if r.min_ranks is None and r.max_ranks is None:
            return self
        mp = layout.model_parallel_size(p)
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
            dp, shard = layout.data_parallel_size(size, p), p.data_parallel_shard_size
            if shard is not None and dp % shard:
                raise ValueError(
                    f"parallel.data_parallel_shard_size ({shard}) must divide the data-parallel size at {field} "
                    f"({dp}): a resize keeps the shard groups"
                )
            per_step = layout.samples_per_microbatch(t, dp)
            batches = {"training.global_batch_size": t.global_batch_size}
            if t.rampup_batch_size is not None:
                batches["training.rampup_batch_size start"] = t.rampup_batch_size[0]
                batches["training.rampup_batch_size increment"] = t.rampup_batch_size[1]
            for name, value in batches.items():
                if value % per_step:
                    raise ValueError(
                        f"{name} ({value}) is not divisible by training.micro_batch_size "
                        f"({t.micro_batch_size}) x the data-parallel size at {field} ({dp}) = "
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
        model_parallel = layout.model_parallel_size(p)
        if ranks % model_parallel:
            raise ValueError(
                f"parallel.tensor ({p.tensor}) x parallel.pipeline ({p.pipeline}) x parallel.context ({p.context}) "
                f"= {model_parallel} does not divide resources.ranks ({ranks}): set resources.ranks to a multiple "
                f"of {model_parallel} or shrink the parallel sizes"
            )
        dp = layout.data_parallel_size(ranks, p)
        if ranks % layout.expert_grid_size(p):
            raise ValueError(
                f"parallel.expert ({p.expert}) x parallel.pipeline ({p.pipeline}) = {layout.expert_grid_size(p)} "
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
        sequence_parallel = layout.sequence_parallel_effective(p)
        if sequence_parallel and m.seq_length % tp:
            raise ValueError(
                f"model.seq_length ({m.seq_length}) must be divisible by parallel.tensor ({tp}) with "
                "parallel.sequence_parallel: true"
            )
        if p.context > 1:
            multiple = layout.seq_length_multiple(p)
            why = (
                f", each rank's share split again over parallel.tensor ({tp}) by sequence parallelism"
                if sequence_parallel
                else ""
            )
            if m.seq_length % multiple:
                lower = m.seq_length // multiple * multiple
                hint = f"{lower} or {lower + multiple}" if lower else str(multiple)
                raise ValueError(
                    f"model.seq_length ({m.seq_length}) must be a multiple of {multiple} with parallel.context "
                    f"({p.context}): each sequence is cut into 2 x parallel.context equal chunks, two per "
                    f"context-parallel rank{why}; use model.seq_length {hint}"
                )
        if p.data_parallel_shard_size is not None:
            if p.data_parallel_sharding == "none":
                raise ValueError(
                    "parallel.data_parallel_shard_size needs parallel.data_parallel_sharding other than none "
                    "(there is nothing to shard)"
                )
            if dp % p.data_parallel_shard_size:
                raise ValueError(
                    f"parallel.data_parallel_shard_size ({p.data_parallel_shard_size}) must divide the "
                    f"data-parallel size ({dp}): choose it from {_divisors(dp)}"
                )
        if p.virtual_pipeline is not None and p.pipeline == 1:
            raise ValueError(
                "parallel.virtual_pipeline needs parallel.pipeline > 1: remove it or raise pipeline"
            )
        stages = layout.pipeline_stages(p)
        if p.pipeline_layers is not None:
            if len(p.pipeline_layers) != stages or sum(p.pipeline_layers) != m.num_layers:
                raise ValueError(
                    f"parallel.pipeline_layers {p.pipeline_layers} must list {stages} stages (pipeline x "
                    f"virtual_pipeline) adding up to model.num_layers ({m.num_layers})"
                )
        elif m.arch == "t5":
            pass  # the encoder on one stage, the decoder on the other (engine/jobspec/t5.py)
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
        per_step = layout.samples_per_microbatch(t, dp)
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
    """A job spec from its dict: `model.init_from`'s config.json read and merged first (the one
    I/O of parsing, skipped for a spec resolved already: see hf_config.resolve_hf_config), then
    validated; every problem in one JobSpecError, a line each."""
    context = {}
    try:
        data = resolve_hf_config(data)
    except HFConfigError as err:  # reported by ModelSpec, among the other sections' problems
        context[HF_CONFIG_ERROR] = err
    try:
        return JobSpec.model_validate(data, context=context)
    except ValidationError as err:
        raise JobSpecError(format_validation_error(err)) from None


def derive_job(spec: JobSpec, **sections: dict[str, Any]) -> JobSpec:
    """`spec` with some fields of some sections replaced (`resources={"ranks": 4}`; None puts a
    field back to unset), validated again as a whole: the one way the service and the workers
    make a job from a job (a resize, a replica's share, the service's defaults, paths made
    absolute), so every derived job passes the rules a submitted one does."""
    data = spec.model_dump(mode="json")
    for section, fields in sections.items():
        if not isinstance(data.get(section), dict):
            raise ValueError(f"derive_job: {section!r} is not a section of a job spec")
        data[section].update(fields)
    return parse_job(data)


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

        from engine.jobspec.yaml_text import load_yaml

        try:
            data = load_yaml(text)
        except yaml.YAMLError as err:
            raise JobSpecError(f"{where} is not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise JobSpecError(f"{where}: a job file is a mapping with sections name, model, parallel, ...")
    return parse_job(data)


def check_local_run(spec: JobSpec) -> None:
    """Rules for a job run without the service (`elastron train`): the service fills in a
    checkpoint root for a job that names none; a local run has no such default."""
    if spec.checkpoint.interval is not None and spec.checkpoint.path is None:
        raise JobSpecError(
            "checkpoint.interval needs checkpoint.path: a local run (`elastron train`) has no service to "
            "choose one (jobs submitted over REST get ELASTRON_CHECKPOINT_DIR); say where to write "
            "checkpoints, e.g. checkpoint.path: runs/checkpoints"
        )


def json_schema() -> dict[str, Any]:
    return JobSpec.model_json_schema()
