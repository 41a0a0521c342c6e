"""The engine's own commands: `train` (the torchrun of this project: a job on N local processes,
no Ray, no service: the quickest way to debug a job), `schema` (the job specification's JSON
Schema), `preprocess` (text files -> the indexed dataset `data.source: indexed` reads), `export`,
`eval` (lm-evaluation-harness tasks on a checkpoint, engine/harness/) and the operator's `checkpoint convert` (old pickled checkpoints -> data, engine/checkpointing/convert.py).

torch is imported only inside the commands that need it, so `elastron --help` and the service's
commands start without it. The `elastron` entry point (elastron/cli.py) composes this app with
the workers' and the service's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from engine.jobspec import JobSpecError, check_local_run, json_schema, load_job, resolve_job

app = typer.Typer()


def fail(message: str, code: int = 2) -> None:
    """One red `error:` line and the exit code: how every engine and workers command ends badly."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


@app.command()
def train(
    job: Annotated[Path, typer.Argument(help="Job file (YAML or JSON).")],
    ranks: Annotated[
        int | None, typer.Option(help="Number of local ranks; overrides resources.ranks.")
    ] = None,
    metrics_out: Annotated[
        Path | None, typer.Option("--metrics-out", help="Write one JSON line per iteration here.")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress lines.")] = False,
    events_out: Annotated[
        Path | None,
        typer.Option(
            "--events-out",
            help="Append the job's events (rerun diagnoses) here; default: events.jsonl beside --metrics-out.",
        ),
    ] = None,
) -> None:
    """Run JOB locally on N processes (gloo on CPU, NCCL on CUDA), without Ray or the service.

    Exit codes: 0 done, 1 a rank failed, 2 bad input, 16 the rerun state machine needs the job
    resumed on other hardware to diagnose a result, 17 a result failed validation (diagnosis in
    the message and the event record)."""
    try:
        resolved = resolve_job(load_job(job))
        if ranks is not None:
            resolved = resolved.with_ranks(ranks)
        spec = resolved.spec
        check_local_run(spec)
    except JobSpecError as err:
        fail(f"{job}:\n{err}")
    from engine.device import resolve_device_type
    from engine.launcher import RankFailure, spawn
    from engine.train_loop import train_rank

    try:
        device_type = resolve_device_type(spec.resources.device)
    except RuntimeError as err:
        fail(str(err))
    n = spec.resources.ranks
    if events_out is None and metrics_out is not None:
        events_out = metrics_out.parent / "events.jsonl"
    try:
        records = spawn(
            train_rank,
            n,
            (
                resolved,  # resolved once here, handed to every rank as it is
                str(metrics_out) if metrics_out else None,
                quiet,
                str(events_out) if events_out else None,
            ),
            device_type=device_type,
            timeout_s=float("inf"),
        )[0]
    except RankFailure as err:
        agreed = err.agreed_exit()
        if agreed is not None:  # the rerun state machine's verdict, the same on every rank
            fail(f"rerun state machine: {agreed[1]}", code=agreed[0])
        fail(str(err), code=1)
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    if records and not quiet:
        first, last = records[0], records[-1]
        typer.echo(
            f"[elastron] done: {len(records)} iterations, loss {first['loss']:.4f} -> {last['loss']:.4f}"
            + (f", metrics in {metrics_out}" if metrics_out else "")
        )


@app.command()
def export(
    checkpoint: Annotated[
        str, typer.Argument(help="A job's checkpoint root (its newest committed checkpoint) or an iter_NNNNNNN folder; local or s3://.")
    ],
    output: Annotated[str, typer.Option("--output", "-o", help="Folder to write (local or s3://).")],
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="Output format: hf (a Hugging Face model folder) or peft (a LoRA job's adapters: "
            "adapter_config.json + adapter_model.safetensors).",
        ),
    ] = "hf",
    dtype: Annotated[str, typer.Option(help="Weights dtype: bf16, fp16 or fp32.")] = "bf16",
    endpoint_url: Annotated[str | None, typer.Option(help="S3 endpoint (default: the boto3 chain).")] = None,
    merge_lora: Annotated[
        bool,
        typer.Option(
            "--merge-lora",
            help="With --format hf, for a LoRA job's checkpoint: its base (model.init_from) with the adapters merged in.",
        ),
    ] = False,
) -> None:
    """Turn a committed checkpoint, saved on any layout, into a Hugging Face model folder:
    config.json, generation_config.json, safetensors shards (at most 5 GB each) with their index,
    and the tokenizer files when the job used an hf: tokenizer; or a LoRA job's adapters into a
    PEFT folder (--format peft). Exit 2 on bad input."""
    if format not in ("hf", "peft"):
        fail(f"--format {format!r} is not supported: use --format hf or --format peft")
    if merge_lora and format != "hf":
        fail("--merge-lora merges the adapters into a Hugging Face model: use it with --format hf")
    from engine.checkpointing.commit import CheckpointCorruptError
    from engine.hf.exporter import export_hf, export_peft

    try:
        if format == "peft":
            report = export_peft(checkpoint, output, dtype=dtype, endpoint_url=endpoint_url)
        else:
            report = export_hf(checkpoint, output, dtype=dtype, endpoint_url=endpoint_url, merge_lora=merge_lora)
    except (ValueError, FileNotFoundError, CheckpointCorruptError) as err:  # ExportError, HFConfigError too
        fail(str(err))
    typer.echo(
        f"exported iteration {report.iteration} of {checkpoint} to {output}: {report.tensors} tensors, "
        f"{report.bytes_written / 2**20:.1f} MiB {dtype}, {report.seconds:.1f} s"
    )


@app.command("eval")
def eval_checkpoint(
    checkpoint: Annotated[
        str, typer.Argument(help="A job's checkpoint root (its newest committed checkpoint) or an iter_NNNNNNN folder; local or s3://.")
    ],
    tasks: Annotated[
        str, typer.Option(help="Comma-separated lm-eval tasks: shipped ones (elastron_mc, elastron_ppl, elastron_gen), yours, or the registry's over local files.")
    ],
    ranks: Annotated[int, typer.Option(min=1, help="Local ranks; those --tensor x --pipeline leave are data-parallel replicas.")] = 1,
    tensor: Annotated[int, typer.Option(min=1, help="Tensor-parallel size.")] = 1,
    pipeline: Annotated[int, typer.Option(min=1, help="Pipeline-parallel size.")] = 1,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help="Sequence parallelism with --tensor > 1.")] = False,
    limit: Annotated[float | None, typer.Option(help="At most this many documents per task (a fraction below 1).")] = None,
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples per prompt (default: the task's).")] = None,
    include_path: Annotated[
        list[str] | None, typer.Option("--include-path", help="A folder of your own task YAMLs; repeat for more.")
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write the results here as JSON.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows per forward pass.")] = 8,
    device: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "auto",
    endpoint_url: Annotated[str | None, typer.Option(help="S3 endpoint (default: the boto3 chain).")] = None,
    timeout_s: Annotated[float, typer.Option(min=1.0, help="Stop (exit 1) after this many seconds.")] = 3600.0,
    run_name: Annotated[
        str | None,
        typer.Option("--run", help="The training run whose loggers get the scores (default: the job's name; the service passes the job id)."),
    ] = None,
    print_json: Annotated[
        bool, typer.Option("--print-json", help="End with one line `eval-result {JSON}` (how the service reads the scores).")
    ] = False,
) -> None:
    """Score a committed checkpoint with lm-evaluation-harness tasks where it is: no export, on
    the layout asked for (whatever layout saved it). Prints one line per task and metric.
    Exit 2 on bad input (an unknown task, one that would need a hub download, a model that is
    not a decoder), 1 when a rank fails."""
    if limit is not None and limit <= 0:
        fail("--limit must be above 0 (a count, or a fraction below 1)")
    if sequence_parallel and tensor == 1:
        fail("--sequence-parallel needs --tensor > 1")
    from engine.checkpointing.commit import CheckpointCorruptError
    from engine.device import resolve_device_type
    from engine.harness.checkpoint_eval import EvalError, Layout, evaluate_checkpoint
    from engine.harness.tasks import TaskError, resolve_tasks
    from engine.jobspec.evaluation import metric_scores
    from engine.launcher import RankFailure

    try:
        device_type = resolve_device_type(device)
    except RuntimeError as err:  # no CUDA here
        fail(f"--device {device}: {err}")
    try:
        resolved = resolve_tasks([t.strip() for t in tasks.split(",") if t.strip()], include_path)
        layout = Layout(ranks, tensor, pipeline, sequence_parallel)
        result = evaluate_checkpoint(
            checkpoint,
            resolved,
            layout,
            device=device_type,
            limit=int(limit) if limit is not None and limit >= 1 else limit,
            num_fewshot=num_fewshot,
            rows_per_pass=batch_size,
            endpoint_url=endpoint_url,
            timeout_s=timeout_s,
            run_name=run_name,
        )
    except (TaskError, EvalError, JobSpecError, FileNotFoundError, CheckpointCorruptError) as err:
        fail(str(err))
    except RankFailure as err:
        fail(str(err), code=1)
    for task, metrics in metric_scores(result["results"]).items():
        for name, value in metrics.items():
            typer.echo(f"{task}  {name}  {value:.6g}")
    typer.echo(
        f"evaluated iteration {result['iteration']} of {checkpoint} on {ranks} rank(s): "
        f"{result['tokens']} tokens in {result['seconds']:.1f} s"
    )
    if output is not None:
        output.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if print_json:
        typer.echo("eval-result " + json.dumps(result, default=str, separators=(",", ":")))


@app.command()
def schema() -> None:
    """Print the job specification's JSON Schema."""
    json.dump(json_schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")


@app.command()
def preprocess(
    inputs: Annotated[
        list[str],
        typer.Option(
            "--input",
            help="A file or glob pattern; repeat for more. *.jsonl/*.json/*.ndjson: one JSON object per "
            "line (the --json-key field); anything else: UTF-8 text, one document per paragraph.",
        ),
    ],
    output: Annotated[Path, typer.Option(help="PREFIX: writes PREFIX.bin and PREFIX.idx.")],
    tokenizer: Annotated[
        str, typer.Option(help="byte | hf:PATH | sentencepiece:PATH (the job's data.tokenizer).")
    ] = "byte",
    workers: Annotated[int, typer.Option(help="Tokenising processes.")] = 1,
    json_key: Annotated[str, typer.Option("--json-key", help="The text field of JSON lines.")] = "text",
    text_mode: Annotated[
        str, typer.Option("--text-mode", help="Plain text: paragraph (a document per paragraph) or file.")
    ] = "paragraph",
    batch_bytes: Annotated[
        int, typer.Option("--batch-bytes", help="Text per batch handed to a worker (bounds memory).")
    ] = 1 << 20,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Tokenise text files into an indexed dataset for `data.source: indexed` (or `data.blend`)."""
    import glob

    from engine.data.preprocess import preprocess as run_preprocess

    files: list[str] = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matches:
            fail(f"--input: no file matches {pattern}")
        files.extend(matches)
    try:
        stats = run_preprocess(
            files,
            tokenizer,
            output,
            workers=workers,
            json_key=json_key,
            text_mode=text_mode,
            batch_bytes=batch_bytes,
            progress=None if quiet else sys.stderr,
        )
    except (OSError, ValueError, ImportError) as err:  # bad input, unwritable output
        fail(str(err).replace("data.tokenizer", "--tokenizer (data.tokenizer)", 1))
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    typer.echo(
        f"[elastron] preprocess: {stats.documents:,} documents, {stats.tokens:,} tokens, "
        f"{stats.bytes / 1e6:.1f} MB in {stats.seconds:.2f} s ({stats.tokens_per_s:,.0f} tokens/s, "
        f"{stats.mb_per_s:.1f} MB/s) -> {output}.bin, {output}.idx"
    )


checkpoint_commands = typer.Typer(
    no_args_is_help=True,
    help="Operator commands on committed checkpoints (run by an admin, never by a job).",
)
app.add_typer(checkpoint_commands, name="checkpoint")


@checkpoint_commands.command("convert")
def checkpoint_convert(
    path: Annotated[
        str,
        typer.Argument(
            help="A job's checkpoint root (every committed checkpoint in it) or one iter_NNNNNNN folder; "
            "local or s3://."
        ),
    ],
    endpoint_url: Annotated[str | None, typer.Option(help="S3 endpoint (default: the boto3 chain).")] = None,
) -> None:
    """Rewrite checkpoints saved in the old pickled format (raw-v1) as data (raw-v2), which every
    load path then reads; no job loads a raw-v1 checkpoint. Only DCP metadata classes, torch.Size
    and dtypes are unpickled (a payload is refused, never run). Run it only on checkpoints you
    trust the origin of. Exit 2 when a checkpoint is refused."""
    from engine.checkpointing.commit import CheckpointCorruptError
    from engine.checkpointing.convert import convert_checkpoints

    try:
        report = convert_checkpoints(path, endpoint_url=endpoint_url)
    except (ValueError, OSError, CheckpointCorruptError) as err:  # ConvertError; StorageOutsideRoots
        fail(str(err))
    done = ", ".join(map(str, report.converted)) or "none"
    typer.echo(
        f"converted {len(report.converted)} checkpoint(s) of {path} to raw-v2 (iterations: {done}); "
        f"{len(report.already)} already raw-v2"
    )
