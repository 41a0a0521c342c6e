"""Model families built from engine.transformer blocks, on one base (language_model.py), and the
registry that picks a family by `model.arch`."""

from engine.models.bert import BertModel
from engine.models.gpt import GPTModel
from engine.models.language_model import LanguageModel
from engine.models.t5 import T5Model

# model.arch -> its family (engine/jobspec/model.py lists the archs; a test keeps the two equal).
MODEL_FAMILIES: dict[str, type[LanguageModel]] = {
    "gpt2": GPTModel,
    "llama": GPTModel,
    "bert": BertModel,
    "t5": T5Model,
}


def model_family(arch: str) -> type[LanguageModel]:
    """The class that builds a model of `arch` (a validated job's model.arch)."""
    return MODEL_FAMILIES[arch]


__all__ = ["MODEL_FAMILIES", "BertModel", "GPTModel", "LanguageModel", "T5Model", "model_family"]
