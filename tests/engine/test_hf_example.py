"""The README's "Fine-tune a Hugging Face model" path, as a user runs it: the example script,
`elastron train examples/finetune_hf.yaml` (fewer steps) and `elastron export`, then
transformers loads the result and its loss on the chats is clearly below the imported model's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
ELASTRON = str(Path(sys.executable).parent / "elastron")


def _assistant_loss(folder: Path, chats: list[dict]) -> float:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    losses = []
    for chat in chats:
        prompt = tok.apply_chat_template(chat["messages"][:-1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(chat["messages"], tokenize=False)
        ids = tok(full, add_special_tokens=False, return_tensors="pt")["input_ids"]
        start = len(tok(prompt, add_special_tokens=False)["input_ids"])
        labels = ids.clone()
        labels[:, :start] = -100
        with torch.no_grad():
            losses.append(float(model(input_ids=ids, labels=labels).loss))
    return sum(losses) / len(losses)


def train_example(tmp_path: Path, example: str, conversations: int, iters: int) -> tuple[dict, Path, object]:
    """What the README asks of a user: the tiny model and chats from the example script, then
    `elastron train` on the example file pointed at them (fewer steps); the job, the folder of
    the model and chats, and the finished run (checked to have exited 0)."""
    out = tmp_path / "tiny-hf"
    script = [sys.executable, str(ROOT / "examples/make_tiny_hf_model.py"), "--out", str(out)]
    subprocess.run([*script, "--conversations", str(conversations)], check=True)
    job = yaml.safe_load((ROOT / example).read_text())
    job["model"]["init_from"] = str(out / "model")
    job["data"]["path"] = str(out / "chat.jsonl")
    job["checkpoint"] = {"path": str(tmp_path / "ckpt")}
    job["training"]["train_iters"] = iters
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run = subprocess.run([ELASTRON, "train", str(tmp_path / "job.yaml")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return job, out, run


def test_finetune_example_end_to_end(tmp_path):
    """Over 30 s: the README's path as separate user processes (the example script, `elastron
    train`, `elastron export`), each importing torch and transformers, then transformers loads
    the export."""
    job, out, run = train_example(tmp_path, "examples/finetune_hf.yaml", conversations=400, iters=12)
    assert "imported" in run.stdout
    exported = tmp_path / "finetuned"
    run = subprocess.run(
        [
            ELASTRON,
            "export",
            str(tmp_path / "ckpt" / "finetune-hf"),
            "--output",
            str(exported),
            "--dtype",
            "fp32",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= {p.name for p in exported.iterdir()}
    chats = [json.loads(line) for line in (out / "chat.jsonl").read_text().splitlines()[:16]]
    before, after = _assistant_loss(out / "model", chats), _assistant_loss(exported, chats)
    assert after < 0.8 * before, (before, after)  # measured 5.90 -> 4.21 after 12 steps
