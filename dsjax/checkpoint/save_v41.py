"""A DeepseekV41 → the release's layout: nested `config.json`, release tensor names, per-expert tensors,
FP8/FP4 weights with their scales as `X.scale` (F8_E8M0), float weights in their own dtype; the weights
kept beside the model (`kept_weights`: DSpark, the image encoder) are written back as read."""

from __future__ import annotations

import json
import os
from typing import Iterator

import ml_dtypes
import numpy as np
from flax import nnx

from dsjax.checkpoint import names_v41
from dsjax.checkpoint.shards import ShardWriter


def _scale_value(value: np.ndarray) -> np.ndarray:
    return value.view(ml_dtypes.float8_e8m0fnu) if value.dtype == np.uint8 else value


def release_tensors(model) -> Iterator[tuple[str, np.ndarray]]:
    """(release name, numpy array) for every variable of `model`, experts split per expert."""
    cfg = model.cfg
    inter = cfg.moe_intermediate_size
    quantized_experts = cfg.quantization is not None
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        dotted = ".".join(str(p) for p in path)
        if dotted.startswith("ngram_hash."):  # derived from the tokenizer, not part of the weights
            continue
        value = np.asarray(var.get_value())
        if ".ffn.experts." in dotted:
            layer_prefix = dotted.split(".ffn.experts.")[0] + ".ffn.experts."
            leaf = dotted.rsplit(".", 1)[1]
            kind = "scale" if leaf.endswith("_scale_inv") else "weight"
            for e in range(value.shape[0]):
                v = value[e]
                if kind == "scale":
                    v = _scale_value(v)
                if leaf.startswith("down_proj"):
                    yield f"{layer_prefix}{e}.w2.{kind}", v if quantized_experts else np.ascontiguousarray(v.T)
                elif quantized_experts:  # [2I, in'] rows: w1 then w3 (scale rows likewise)
                    half = v.shape[0] // 2
                    yield f"{layer_prefix}{e}.w1.{kind}", v[:half]
                    yield f"{layer_prefix}{e}.w3.{kind}", v[half:]
                else:  # [H, 2I] columns: w1 then w3
                    yield f"{layer_prefix}{e}.w1.{kind}", np.ascontiguousarray(v[:, :inter].T)
                    yield f"{layer_prefix}{e}.w3.{kind}", np.ascontiguousarray(v[:, inter:].T)
            continue
        if dotted.endswith("_scale_inv"):
            yield names_v41.to_release(dotted[: -len("_scale_inv")])[: -len("weight")] + "scale", _scale_value(value)
        elif dotted.endswith(".table_scale"):
            yield names_v41.to_release(dotted[: -len("_scale")])[: -len("weight")] + "scale", _scale_value(value)
        else:
            yield names_v41.to_release(dotted), value
    kept = getattr(model, "kept_weights", None)
    for name in ([] if kept is None else kept.names()):
        yield name, kept.arrays[name]


def save_v41(model, folder: str | os.PathLike, max_shard_bytes: int = 4 << 30) -> None:
    """Write `model` as the release does: config.json + model-0000k-of-0000N.safetensors + index."""
    writer = ShardWriter(folder, max_shard_bytes)
    for name, value in release_tensors(model):
        writer.add(name, value)
    writer.close()
    with open(os.path.join(writer.folder, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf(), f, indent=1)
