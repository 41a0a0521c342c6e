"""`model.init_from`: load a Hugging Face model's weights into this rank's model chunks.

Each parameter knows where it sits in the global tensor (`partition_dim`, `partition_stride`,
its TP rank) and its global name; families.segments says which HF rows make up that global
tensor. So a rank reads exactly the rows (or columns) its TP/PP/EP position holds, from the
safetensors files straight into memory (reader.py), and nothing else: no rank builds the whole
model, and no whole file is downloaded per rank.

Everything is checked before a parameter is written: every tensor we need exists with the shape
we expect and a floating dtype, and (over all ranks) every HF tensor is used by some rank, so a
wrong folder fails with the tensor's name rather than loading partially.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine import parallel_state as ps
from engine.hf.families import Segment, Shapes, resolve_lengths, segments
from engine.hf.reader import HFCheckpointError, HFFolder
from engine.jobspec.hf_config import read_hf_config

# HF tensors no model of ours holds, safe to leave unread.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class ImportReport:
    tensors: int  # parameters this rank filled
    bytes_read: int  # bytes this rank requested from storage
    file_bytes: int  # size of the folder's weight files
    seconds: float


def _span(param: nn.Parameter) -> tuple[int | None, list[tuple[int, int]]]:
    """(partition dim, [(start, stop) along it for each stride chunk]) of this rank's shard; dim
    None for a tensor held whole."""
    dim = getattr(param, "partition_dim", None)
    if dim is None:
        return None, []
    stride = getattr(param, "partition_stride", 1)
    world, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    chunk = param.global_shape[dim] // stride
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

    def rows(
        self,
        segs: list[Segment],
        r0: int,
        r1: int,
        cols: tuple[int, int] | None,
        out_cols: int | None,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Rows r0:r1 (and columns `cols`) of our global tensor, put together from its segments."""
        pieces, at = [], 0
        for seg in segs:
            a, b = max(r0, at), min(r1, at + seg.length)
            if a < b:
                lo, hi = seg.start + a - at, seg.start + b - at
                if seg.name is None:
                    pieces.append(
                        torch.zeros((b - a, *([out_cols] if out_cols is not None else [])), dtype=dtype)
                    )
                elif seg.transposed:
                    c = slice(*cols) if cols else slice(None)
                    pieces.append(self.folder.read(seg.name, c, slice(lo, hi)).t())
                else:
                    pieces.append(self.folder.read(seg.name, slice(lo, hi), slice(*cols) if cols else None))
            at += seg.length
        return torch.cat([p.to(dtype) for p in pieces], dim=0)

    @torch.no_grad()
    def load(self, name: str, param: nn.Parameter) -> None:
        global_shape = tuple(getattr(param, "global_shape", param.shape))
        segs = self.plan(name, global_shape)
        dim, spans = _span(param)
        cols_total = global_shape[1] if len(global_shape) > 1 else None
        if dim is None:
            value = self.rows(segs, 0, global_shape[0], None, cols_total, param.dtype)
        elif dim == 0:
            value = torch.cat([self.rows(segs, a, b, None, cols_total, param.dtype) for a, b in spans])
        else:  # split along the input dimension: all rows, this rank's columns
            ((a, b),) = spans
            value = self.rows(segs, 0, global_shape[0], (a, b), b - a, param.dtype)
        if value.shape != param.shape:
            raise HFCheckpointError(
                f"model.init_from: built {list(value.shape)} for {name}, expected {list(param.shape)}"
            )
        param.copy_(value)


def hf_architecture(uri: str) -> str:
    """The folder's `architectures[0]` (which naming table its tensors follow)."""
    return read_hf_config(uri)["architectures"][0]


def import_hf_weights(chunks: list[nn.Module], uri: str, arch: str, config) -> ImportReport:
    """Fill every parameter of this rank's `chunks` (GPTModels) from the HF folder at `uri`.
    A collective when torch.distributed is initialised (the unused-tensor check)."""
    start = time.perf_counter()
    folder = HFFolder(uri)
    loader = _Loader(folder, arch, Shapes.of(config))
    count = 0
    for chunk in chunks:
        for local_name, param in chunk.named_parameters():
            loader.load(chunk.global_param_name(local_name), param)
            count += 1
    used = [loader.used]
    if dist.is_initialized() and dist.get_world_size() > 1:
        used = [None] * dist.get_world_size()
        dist.all_gather_object(used, loader.used)
    unused = sorted(
        n
        for n in set(folder.tensors) - set().union(*used)
        if not n.endswith(IGNORED_SUFFIXES) and not _tied_head(n, config)
    )
    if unused:
        shown = ", ".join(unused[:8]) + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        raise HFCheckpointError(
            f"model.init_from: {folder.uri} has tensors this model does not use: {shown} "
            "(an architecture option config.json sets that the model does not have?)"
        )
    return ImportReport(count, folder.bytes_read, folder.file_bytes(), time.perf_counter() - start)


def _tied_head(name: str, config) -> bool:
    """A tied model's checkpoint may still carry lm_head.weight (a copy of the embedding)."""
    return name == "lm_head.weight" and config.tie_embeddings
