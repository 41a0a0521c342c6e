"""Write a tiny Hugging Face Llama folder and a small chat file, for examples/finetune_hf.yaml.

Nothing is downloaded: the tokenizer (byte-level BPE with Llama 3's chat special tokens and its
chat template) is trained here on the chats themselves, the weights are random (seeded) and
written as safetensors with the tensor names and config.json transformers uses, so the folder
is exactly what `model.init_from` reads for a published Llama, only small.

    python examples/make_tiny_hf_model.py [--out runs/tiny-hf]

writes OUT/model/ (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) and
OUT/chat.jsonl (arithmetic questions and answers: a task whose loss visibly falls in a minute).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|endoftext|>"]
# Llama 3's chat template, shortened (no system-prompt date logic).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MODEL = dict(
    hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)


def chats(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-"])
        answer = a + b if op == "+" else a - b
        out.append(
            {
                "messages": [
                    {"role": "system", "content": "You are a careful calculator."},
                    {"role": "user", "content": f"What is {a} {op} {b}?"},
                    {"role": "assistant", "content": f"{a} {op} {b} = {answer}."},
                ]
            }
        )
    return out


def write_tokenizer(folder: Path, texts: list[str], vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size()


def write_model(folder: Path, vocab: int, seed: int) -> None:
    h, f, n = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    heads, groups = MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    d = h // heads
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.02

    tensors = {
        "model.embed_tokens.weight": normal(vocab, h),
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": normal(vocab, h),
    }
    for i in range(n):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": torch.ones(h),
            f"{p}.post_attention_layernorm.weight": torch.ones(h),
            f"{p}.self_attn.q_proj.weight": normal(heads * d, h),
            f"{p}.self_attn.k_proj.weight": normal(groups * d, h),
            f"{p}.self_attn.v_proj.weight": normal(groups * d, h),
            f"{p}.self_attn.o_proj.weight": normal(h, heads * d),
            f"{p}.mlp.gate_proj.weight": normal(f, h),
            f"{p}.mlp.up_proj.weight": normal(f, h),
            f"{p}.mlp.down_proj.weight": normal(h, f),
        }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        **MODEL,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 0,
        "eos_token_id": 3,
        "dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/tiny-hf"))
    ap.add_argument("--conversations", type=int, default=2000)
    args = ap.parse_args()
    model = args.out / "model"
    model.mkdir(parents=True, exist_ok=True)
    conversations = chats(args.conversations, seed=0)
    with open(args.out / "chat.jsonl", "w") as f:
        for c in conversations:
            f.write(json.dumps(c) + "\n")
    texts = [m["content"] for c in conversations for m in c["messages"]] + ["system user assistant"]
    vocab = write_tokenizer(model, texts, vocab_size=384)
    write_model(model, vocab, seed=0)
    print(
        f"wrote {model} (Llama, {vocab}-token vocabulary) and {args.out / 'chat.jsonl'} ({len(conversations)} chats)"
    )


if __name__ == "__main__":
    main()
