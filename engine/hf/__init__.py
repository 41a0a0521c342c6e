"""Hugging Face checkpoints in and out: the per-family tensor mapping (`families.py`).

The import into a running job and `elastron export` are not wired yet; see families.py for the
pieces they will share.
"""
