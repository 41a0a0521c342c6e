"""model.init_from without I/O in validation (engine/jobspec/hf_config.py): config.json is read
once by `resolve_hf_config` (run by `parse_job`), its fields and sha256 are stored in the spec,
and every later validation of that spec (a rank's, an elastic resize's, a checkpoint record's)
reads nothing. And one registry of Hugging Face families (engine/jobspec/hf_families.py)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import boto3
import pytest
from pydantic import ValidationError

from engine.jobspec import JobSpec, JobSpecError, hf_config, parse_job, resolve_hf_config, resolve_job
from engine.jobspec.hf_families import FAMILIES, family_with
from engine.jobspec.hf_fields import hf_model_fields

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}


def _job(folder: str, **model) -> dict:
    return {
        "name": "hf",
        "model": {"init_from": folder, "seq_length": 64, **model},
        "training": {"global_batch_size": 4},
        "resources": {"ranks": 2, "min_ranks": 1, "max_ranks": 4},
    }


@pytest.fixture
def folder(tmp_path) -> tuple[str, bytes]:
    raw = json.dumps(CONFIG).encode()
    (tmp_path / "config.json").write_bytes(raw)
    return str(tmp_path), raw


@pytest.fixture
def no_reads(monkeypatch):
    """Any read of a config.json (local or S3) from here on fails the test."""

    def refuse(*args):
        raise AssertionError(f"config.json read during validation: {args}")

    monkeypatch.setattr(hf_config, "_read_config_bytes", refuse)
    monkeypatch.setattr(hf_config, "_s3_get", refuse)


def test_resolving_merges_the_fields_and_records_the_digest(folder):
    path, raw = folder
    data = _job(path)
    before = copy.deepcopy(data)
    resolved = resolve_hf_config(data)
    assert data == before, "the caller's dict is left as it was"
    model = resolved["model"]
    assert model["hf_config_digest"] == hashlib.sha256(raw).hexdigest()
    assert {k: model[k] for k in hf_model_fields(CONFIG)} == hf_model_fields(CONFIG)
    assert model["seq_length"] == 64 and model["qk_layernorm"] is True
    assert "data" not in resolved  # no tokenizer.json in the folder: data.tokenizer keeps its default
    assert resolve_hf_config(resolved) is resolved  # resolved already: nothing to read
    assert resolve_hf_config({"model": {"hidden_size": 64}}) == {"model": {"hidden_size": 64}}


def test_a_resolved_spec_validates_with_no_reads(folder, no_reads):
    path, _ = folder
    spec = parse_job(_resolved_without_no_reads(path))
    assert spec.model.kv_channels == 16 and spec.model.hf_config_digest
    again = JobSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec
    job = resolve_job(spec.model_dump(mode="json"))
    assert [job.with_ranks(n).data_parallel_size for n in (1, 4)] == [1, 4]  # elastic sizes


def _resolved_without_no_reads(path: str) -> dict:
    """The spec as the submission stored it (computed before `no_reads` is in force)."""
    raw = (Path(path) / "config.json").read_bytes()
    data = _job(path)
    data["model"] = {
        **hf_model_fields(json.loads(raw)),
        **data["model"],
        "hf_config_digest": hashlib.sha256(raw).hexdigest(),
    }
    return data


def test_validation_never_reads_and_says_what_to_do(folder, no_reads):
    path, _ = folder
    with pytest.raises(ValidationError, match="are not merged into this section .*parse_job"):
        JobSpec.model_validate(_job(path))
    with pytest.raises(ValidationError, match="model.hf_config_digest is the digest of model.init_from"):
        JobSpec.model_validate({"model": {"hf_config_digest": "0" * 64}})


def test_an_s3_spec_validates_with_s3_unreachable_once_merged(s3_bucket, monkeypatch):
    raw = json.dumps(CONFIG).encode()
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="m/config.json", Body=raw)
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="m/tokenizer_config.json", Body=b"{}")
    uri = f"s3://{s3_bucket}/m"
    stored = parse_job(_job(uri)).model_dump(mode="json")
    assert stored["model"]["hf_config_digest"] == hashlib.sha256(raw).hexdigest()
    assert stored["data"]["tokenizer"] == f"hf:{uri}"  # the folder's own tokenizer
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing answers there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(JobSpecError, match="cannot read"):  # S3 is really unreachable
        parse_job(_job(uri))
    spec = parse_job(stored)
    assert JobSpec.model_validate(stored) == spec
    assert resolve_job(stored).with_ranks(4).spec.model.hidden_size == 32


def test_a_record_saved_before_digests_still_loads(folder):
    """Checkpoints' job records and the service's rows written before this change carry the
    merged fields but no digest: parse_job reads config.json once for them, as it used to."""
    path, raw = folder
    legacy = parse_job(_job(path)).model_dump(mode="json")
    del legacy["model"]["hf_config_digest"]
    spec = parse_job(legacy)
    assert spec.model.hf_config_digest == hashlib.sha256(raw).hexdigest()
    assert spec.model.hidden_size == 32


def test_a_spec_without_init_from_dumps_as_before():
    dumped = parse_job({"name": "plain"}).model_dump(mode="json")
    assert "hf_config_digest" not in dumped["model"]


def test_messages_for_a_bad_config_are_unchanged(folder, tmp_path):
    path, _ = folder
    with pytest.raises(JobSpecError, match=r"^model.init_from: /nowhere has no config.json\nparallel.tensor"):
        parse_job({"model": {"init_from": "/nowhere"}, "parallel": {"tensor": "x"}})
    with pytest.raises(JobSpecError, match="model.hidden_size=64 conflicts with the Hugging Face config.json value 32"):
        parse_job(_job(path, hidden_size=64))
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "sliding_window": 32}))
    with pytest.raises(JobSpecError, match="^model: config.json sliding_window=32 is smaller than model.seq_length=64"):
        parse_job(_job(path))


def test_one_registry_names_the_families():
    """No module but the registry lists Hugging Face architectures."""
    names = re.compile("|".join(re.escape(a) for a in FAMILIES))
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "engine").rglob("*.py")
        if p.name != "hf_families.py" and names.search(p.read_text())
    ]
    assert not offenders, offenders
    for fam in FAMILIES.values():  # every family that is not an alias exports as itself
        if fam.same_as is None:
            traits = dict(qkv_bias=fam.qkv_bias, qk_layernorm=fam.qk_layernorm, moe=fam.moe, binary_head=fam.binary_head)
            assert family_with(fam.layout, **traits) is fam
        else:
            assert FAMILIES[fam.same_as].same_as is None
