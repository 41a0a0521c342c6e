"""Model families built from engine.transformer blocks."""

from engine.models.gpt import GPTModel

__all__ = ["GPTModel"]
