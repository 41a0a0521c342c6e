"""Parameter placement (engine/parallel_placement.py): the type, what the model's layers record in
it, and the proof that no code outside the placement module uses the untyped parameter
attributes it replaced."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.jobspec import parse_job
from engine.models.gpt import GPTModel
from engine.parallel_placement import ParamPlacement, placement_of, set_placement
from engine.transformer.config import TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
PLACEMENT_MODULE = ROOT / "engine" / "parallel_placement.py"

# The attributes parameters used to carry. Some names are only ever parameter attributes; the
# others are also the names of config fields, layer flags or modules (`config.sequence_parallel`,
# `self.shared_expert`), so for those only parameter-looking receivers count.
ONLY_ON_PARAMS = {
    "global_shape", "partition_dim", "partition_stride", "tensor_model_parallel",
    "shared_embedding", "embedding_copy", "_parallel_placement",
}
ALSO_ELSEWHERE = {"sequence_parallel", "init_std", "expert", "shared_expert", "allreduce"}
OLD = ONLY_ON_PARAMS | ALSO_ELSEWHERE
PARAM_NAMES = {"param", "parameter", "weight", "bias", "w"}


def _looks_like_param(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in PARAM_NAMES
    return isinstance(node, ast.Attribute) and node.attr in {"weight", "bias", "data"}


def _old_attribute_uses(path: Path) -> list[str]:
    """`file:line: what` for every use of an old placement attribute in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        what = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id in {"getattr", "setattr", "hasattr", "delattr"} and len(args) >= 2:
                if isinstance(args[1], ast.Constant) and args[1].value in OLD:
                    what = f"{node.func.id}(..., {args[1].value!r})"
        elif isinstance(node, ast.Attribute) and node.attr in OLD:
            receiver_is_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if node.attr in ONLY_ON_PARAMS:
                what = f".{node.attr}"
            elif isinstance(node.ctx, ast.Store) and not receiver_is_self:
                what = f".{node.attr} = (on a parameter?)"
            elif _looks_like_param(node.value):
                what = f"{ast.unparse(node)}"
        if what:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {what}")
    return found


def test_no_old_placement_attribute_is_used_outside_the_placement_module():
    """The issue's proof: placement_of / set_placement are the only way to where a parameter
    lives. (`main_grad` is DataParallel's gradient view, not placement: see the next test.)"""
    sources = [p for p in (ROOT / "engine").rglob("*.py") if p != PLACEMENT_MODULE]
    sources += list((ROOT / "tests").rglob("*.py")) + list((ROOT / "bench").rglob("*.py"))
    uses = [use for path in sources if path != Path(__file__).resolve() for use in _old_attribute_uses(path)]
    assert not uses, "use engine.parallel_placement instead:\n" + "\n".join(uses)


def test_the_scan_finds_each_old_way_of_reading_and_writing(tmp_path):
    """The check above can fail: each idiom the old code used is reported."""
    sample = ROOT / "engine" / "_placement_scan_sample.py"
    sample.write_text(
        "def f(p, param, layer, config):\n"
        "    a = getattr(p, 'partition_dim', None)\n"
        "    param.sequence_parallel = True\n"
        "    p.expert = True\n"
        "    b = layer.weight.init_std\n"
        "    c = p.global_shape\n"
        "    d = config.sequence_parallel\n"  # a config field: not a parameter attribute
        "    setattr(p, 'embedding_copy', True)\n"
    )
    try:
        uses = _old_attribute_uses(sample)
    finally:
        sample.unlink()
    assert [u.split(": ", 1)[1] for u in uses] == [
        "getattr(..., 'partition_dim')",
        ".sequence_parallel = (on a parameter?)",
        ".expert = (on a parameter?)",
        "layer.weight.init_std",
        ".global_shape",
        "setattr(..., 'embedding_copy')",
    ]


def test_main_grad_stays_inside_data_parallelism():
    """`main_grad` is the view of a parameter's gradient into DataParallel's flat buffer: its
    lifetime is the buffer's, so DataParallel keeps it as its own and nothing outside
    engine/distributed reads it (the optimizer and checkpoints take DataParallel's views)."""
    outside = []
    for path in (ROOT / "engine").rglob("*.py"):
        if (ROOT / "engine" / "distributed") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "main_grad":
                outside.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not outside, outside


# --- the type ----------------------------------------------------------------------------------


def test_an_unplaced_parameter_is_whole_and_replicated():
    p = nn.Parameter(torch.empty(3, 4))
    assert placement_of(p) == ParamPlacement(shape=(3, 4))
    assert not placement_of(p).tensor_parallel and placement_of(p).init_std is None


def test_set_placement_merges_changes_and_survives_a_new_storage():
    p = nn.Parameter(torch.empty(2, 4))
    set_placement(p, shape=(4, 4), tp_dim=0, init_std=0.02)
    set_placement(p, tp_partial_grad=True)  # later layers add to what the layer set
    got = placement_of(p)
    assert got == ParamPlacement(shape=(4, 4), tp_dim=0, init_std=0.02, tp_partial_grad=True)
    assert got.tensor_parallel
    p.data = torch.zeros(8)[:8].view(2, 4)  # data parallelism moves params into its buffers
    assert placement_of(p) is got
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.expert = True  # type: ignore[misc]
    assert set_placement(p, ParamPlacement(shape=(2, 4))) == placement_of(p) == ParamPlacement(shape=(2, 4))


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"shape": (4,), "tp_dim": 1}, "not a dimension"),
        ({"shape": (4,), "tp_stride": 0}, "tp_stride"),
        ({"shape": (4,), "tied_copy": True}, "tied copy"),
    ],
)
def test_an_impossible_placement_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ParamPlacement(**fields)


# --- what the model records --------------------------------------------------------------------


def _config(**model) -> TransformerConfig:
    spec = {"name": "p", "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, **model}}
    return TransformerConfig.from_job(parse_job(spec), vocab_size=128)


def _placements(model: nn.Module) -> dict[str, ParamPlacement]:
    return {name: placement_of(p) for name, p in model.named_parameters()}


def test_the_model_records_placements_and_no_loose_attribute():
    config = _config(
        moe={"num_experts": 4, "top_k": 2},
        attention="mla",
        mla={"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
        mtp_num_layers=1,
    )
    last_stage = GPTModel(config, pre_process=False, post_process=True)
    got = _placements(last_stage)
    experts = {n for n, pl in got.items() if pl.expert}
    assert experts and all(".experts.local_experts." in n for n in experts)
    assert all(".experts.local_experts." not in n for n, pl in got.items() if not pl.expert)
    # The last stage's MTP embedding is a copy of the first stage's embedding.
    assert got["mtp_embedding.weight"] == ParamPlacement(
        shape=(config.padded_vocab_size, 32), tp_dim=0, tied_embedding=True, tied_copy=True,
        init_std=config.init_method_std,
    )
    assert got["output_layer.weight"].tp_dim == 0 and not got["output_layer.weight"].tied_embedding
    others = (GPTModel(_config(activation="swiglu", qk_layernorm=True)), GPTModel(_config(arch="gpt2")))
    for model in (last_stage, *others):
        for name, p in model.named_parameters():
            loose = (OLD - {"_parallel_placement"}) & set(vars(p))
            assert not loose, f"{name} carries {loose}"


def test_swiglu_and_tied_stages_record_their_layout():
    llama = _placements(GPTModel(_config(activation="swiglu")))
    fc1 = llama["decoder.layers.0.mlp.linear_fc1.weight"]
    assert (fc1.tp_dim, fc1.tp_stride) == (0, 2)
    assert llama["decoder.layers.0.self_attention.linear_proj.weight"].tp_dim == 1
    gpt2 = _config(arch="gpt2")
    first = _placements(GPTModel(gpt2, pre_process=True, post_process=False))
    last = _placements(GPTModel(gpt2, pre_process=False, post_process=True))
    assert first["embedding.weight"].tied_embedding and not first["embedding.weight"].tied_copy
    assert last["output_layer.weight"].tied_copy
    assert first["position_embeddings.weight"].init_std == gpt2.init_method_std
    whole = _placements(GPTModel(gpt2))  # one stage: nothing to keep equal
    assert not any(pl.tied_embedding for pl in whole.values())
