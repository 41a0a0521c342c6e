"""Hugging Face checkpoints in and out: the per-family tensor mapping (`families.py`, with BERT's
and T5's in `bert_tensors.py` and `t5.py`), the import of `model.init_from` into a job's ranks
(`importer.py`, reading safetensors through `reader.py`), and `elastron export` of a committed
checkpoint to a transformers folder (`exporter.py`) or, for LoRA, to PEFT adapters
(`lora_export.py`, `peft.py`).
"""
