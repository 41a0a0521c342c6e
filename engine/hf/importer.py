"""`model.init_from`: load a Hugging Face model's weights into this rank's model chunks.

Each parameter knows where it sits in the global tensor (its placement's `tp_dim`, `tp_stride`,
its TP rank) and its global name; families.segments says which HF rows make up that global
tensor. So a rank reads exactly the rows (or columns) its TP/PP/EP position holds, from the
safetensors files straight into memory (reader.py), and nothing else: no rank builds the whole
model, and no whole file is downloaded per rank.

Everything is checked before a parameter is written: every tensor we need exists with the shape
we expect and a floating dtype, and (over all ranks) every HF tensor is used by some rank, so a
wrong folder fails with the tensor's name rather than loading partially.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine import parallel_state as ps
from engine.hf.families import NOT_WEIGHTS, resolve_lengths, segments
from engine.hf.reader import HFCheckpointError, HFFolder
from engine.hf.segment import Segment, Shapes
from engine.hf.t5 import UNREAD as T5_UNREAD
from engine.jobspec.hf_config import read_hf_config
from engine.parallel_placement import placement_of

# HF tensors no model of ours holds, safe to leave unread.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", *T5_UNREAD)


@dataclass(frozen=True)
class ImportReport:
    tensors: int  # parameters this rank filled
    bytes_read: int  # bytes this rank requested from storage
    file_bytes: int  # size of the folder's weight files
    seconds: float


def _span(param: nn.Parameter) -> tuple[int | None, list[tuple[int, int]]]:
    """(partition dim, [(start, stop) along it for each stride chunk]) of this rank's shard; dim
    None for a tensor held whole."""
    placement = placement_of(param)
    dim, stride = placement.tp_dim, placement.tp_stride
    if dim is None:
        return None, []
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    chunk = placement.shape[dim] // stride
    per = chunk // world
    return dim, [(k * chunk + rank * per, k * chunk + (rank + 1) * per) for k in range(stride)]


class _Loader:
    def __init__(self, folder: HFFolder, arch: str, shapes: Shapes):
        self.folder, self.arch, self.shapes = folder, arch, shapes
        self.used: set[str] = set()

    def plan(self, name: str, global_shape: tuple[int, ...]) -> list[Segment]:
        """Segments of our global tensor `name`, checked against the folder's tensors."""
        try:
            segs = resolve_lengths(segments(self.arch, name, self.shapes), global_shape[0])
        except KeyError:
            raise HFCheckpointError(
                f"model.init_from: our tensor {name} has no counterpart in a {self.arch} checkpoint"
            ) from None
        for seg in segs:
            if seg.name is None:
                continue
            info = self.folder.tensors.get(seg.name)
            if info is None:
                raise HFCheckpointError(
                    f"model.init_from: {self.folder.uri} has no tensor {seg.name} (needed for our {name})"
                )
            if not info.dtype.is_floating_point:
                raise HFCheckpointError(f"model.init_from: tensor {seg.name} is {info.dtype}, not a float")
            rows_at = 1 if seg.transposed else 0
            rest = list(global_shape[1:])
            hf_rest = list(info.shape[:rows_at] + info.shape[rows_at + 1 :])
            if (
                len(info.shape) != len(global_shape)
                or hf_rest != rest
                or info.shape[rows_at] < seg.start + seg.length
            ):
                raise HFCheckpointError(
                    f"model.init_from: tensor {seg.name} has shape {list(info.shape)}, which does not fit our "
                    f"{name} of shape {list(global_shape)} (check config.json against the weights)"
                )
            self.used.add(seg.name)
        return segs

    def fill(self, segs: list[Segment], r0: int, cols: tuple[int, int] | None, dst: torch.Tensor) -> None:
        """Write rows r0:r0+len(dst) (and columns `cols`) of our global tensor into `dst`, segment
        by segment; a plain row range of the same dtype is read straight into `dst`'s memory."""
        r1, at = r0 + dst.shape[0], 0
        for seg in segs:
            a, b = max(r0, at), min(r1, at + seg.length)
            if a < b:
                lo, hi = seg.start + a - at, seg.start + b - at
                part = dst.narrow(0, a - r0, b - a)
                c = slice(*cols) if cols else None
                if seg.name is None:
                    part.zero_()
                elif seg.order is not None:  # a permuted block (interleaved RoPE rows): read it whole
                    block = self.folder.read(seg.name, slice(seg.start, seg.start + seg.length), c)
                    part.copy_(block[list(seg.order)][a - at : b - at])
                elif seg.transposed:
                    part.copy_(self.folder.read(seg.name, c or slice(None), slice(lo, hi)).t())
                elif c is None and part.is_contiguous() and part.dtype == self.folder.tensors[seg.name].dtype:
                    self.folder.read(seg.name, slice(lo, hi), out=part)
                else:
                    part.copy_(self.folder.read(seg.name, slice(lo, hi), c))
            at += seg.length
        if at < r1:
            raise HFCheckpointError(f"model.init_from: the segments cover {at} rows, {r1} needed")

    @torch.no_grad()
    def load(self, name: str, param: nn.Parameter) -> None:
        global_shape = placement_of(param).shape
        segs = self.plan(name, global_shape)
        dim, spans = _span(param)
        if dim is None:
            self.fill(segs, 0, None, param.data)
        elif dim == 0:  # each stride chunk's rows, one after the other
            at = 0
            for a, b in spans:
                self.fill(segs, a, None, param.data.narrow(0, at, b - a))
                at += b - a
        else:  # split along the input dimension: all rows, this rank's columns
            ((a, b),) = spans
            self.fill(segs, 0, (a, b), param.data)


def import_hf_weights(
    chunks: list[nn.Module],
    uri: str,
    arch: str | None,
    config,
    initialize: Callable[[nn.Module, Callable[[str], bool]], None] | None = None,
) -> ImportReport:
    """Fill every parameter of this rank's `chunks` (GPTModels) from the HF folder at `uri`.
    MTP depths the checkpoint does not have (a job may train more than it imports) are handed
    to `initialize(chunk, only=name filter)` instead; without it they are an error. `arch`:
    which naming table the tensors follow (None: the folder's `architectures[0]`, from the one
    read of its config.json the import makes). A collective when torch.distributed is
    initialised (the unused-tensor check)."""
    start = time.perf_counter()
    folder = HFFolder(uri)
    hf_config = read_hf_config(uri)
    arch = arch or hf_config["architectures"][0]
    shapes = dataclasses.replace(Shapes.of(config), rope_interleave=hf_config.get("rope_interleave", True))
    loader = _Loader(folder, arch, shapes)
    count = 0

    def missing(name: str) -> bool:
        return initialize is not None and _mtp_depth_missing(name, folder, shapes)

    for chunk in chunks:
        if initialize is not None:
            initialize(chunk, missing)
        for local_name, param in chunk.named_parameters():
            name = chunk.global_param_name(local_name)
            if not missing(name):
                loader.load(name, param)
                count += 1
        for local_name, buffer in chunk.named_buffers():
            name = chunk.global_param_name(local_name)
            if missing(name):
                continue
            if name.endswith(NOT_WEIGHTS) and _maps(arch, name, loader.shapes):
                loader.load(name, buffer)
                count += 1
    used = [loader.used]
    if dist.is_initialized() and dist.get_world_size() > 1:
        used = [None] * dist.get_world_size()
        dist.all_gather_object(used, loader.used)
    unused = sorted(
        n
        for n in set(folder.tensors) - set().union(*used)
        if not n.endswith(IGNORED_SUFFIXES) and not _tied_head(n, config) and not _nextn_layer(n, hf_config)
    )
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise HFCheckpointError(
            f"model.init_from: {folder.uri} has tensors this model does not use: {shown} "
            "(an architecture option config.json sets that the model does not have?)"
        )
    return ImportReport(count, folder.bytes_read, folder.file_bytes(), time.perf_counter() - start)


def _maps(arch: str, name: str, shapes: Shapes) -> bool:
    try:
        segments(arch, name, shapes)
        return True
    except KeyError:
        return False


def _mtp_depth_missing(name: str, folder: HFFolder, shapes: Shapes) -> bool:
    """One of our MTP depth's tensors, the checkpoint having no such depth (DeepSeek-V3 stores
    depth k as layer num_layers + k; its config's num_nextn_predict_layers is 1 even in folders
    transformers saved without one, so the tensors decide)."""
    match = re.match(r"mtp\.layers\.(\d+)\.", name)
    return match is not None and f"model.layers.{shapes.num_layers + int(match.group(1))}.eh_proj.weight" not in folder.tensors


def _nextn_layer(name: str, hf_config: dict) -> bool:
    """DeepSeek-V3's multi-token-prediction modules, stored as the layers after the last one
    (`num_nextn_predict_layers` of them): what a job without as many MTP depths does not read
    (transformers reads none of it), and their copies of the embedding and output layer."""
    extra = int(hf_config.get("num_nextn_predict_layers") or 0)
    match = re.match(r"model\.layers\.(\d+)\.", name)
    first = int(hf_config.get("num_hidden_layers") or 0)
    return extra > 0 and match is not None and first <= int(match.group(1)) < first + extra


def _tied_head(name: str, config) -> bool:
    """A tied model's checkpoint may still carry lm_head.weight (a copy of the embedding)."""
    from engine.hf.bert_tensors import TIED_COPIES  # the BERT MLM decoder's stored copies

    return (name == "lm_head.weight" or name in TIED_COPIES) and config.tie_embeddings
