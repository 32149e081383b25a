"""A DeepseekV41 → the release's layout: nested `config.json`, release tensor names, per-expert tensors,
FP8/FP4 weights with their scales as `X.scale` (F8_E8M0), float weights in their own dtype; the weights
kept beside the model (`kept_weights`) are written back as read."""

from __future__ import annotations

import json
import os
from typing import Iterator

import ml_dtypes
import numpy as np

from dsjax.checkpoint import names_v41
from dsjax.checkpoint.shards import ShardWriter
from dsjax.model import stored_variables


def _scale_value(value: np.ndarray) -> np.ndarray:
    return value.view(ml_dtypes.float8_e8m0fnu) if value.dtype == np.uint8 else value


def release_names(cfg, key: str, value: np.ndarray, first_expert: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """(release name, array) for one dsjax variable `key` holding `value`: merged experts (or a block of
    them starting at `first_expert`) split per expert, scales typed F8_E8M0; a weight kept beside the model
    (`names_v41.is_kept`) passes as it is."""
    if names_v41.is_kept(key):
        yield key, value
        return
    if key.endswith(names_v41.MERGED_EXPERTS):
        inter = cfg.moe_intermediate_size
        prefix = key.split(".ffn.experts.")[0] + ".ffn.experts."
        leaf = key.rsplit(".", 1)[1]
        kind = "scale" if leaf.endswith("_scale_inv") else "weight"
        quantized = cfg.quantization is not None
        for i in range(value.shape[0]):
            e, v = first_expert + i, value[i]
            if kind == "scale":
                v = _scale_value(v)
            if leaf.startswith("down_proj"):
                yield f"{prefix}{e}.w2.{kind}", v if quantized else np.ascontiguousarray(v.T)
            elif quantized:  # [2I, in'] rows: w1 then w3 (scale rows likewise)
                half = v.shape[0] // 2
                yield f"{prefix}{e}.w1.{kind}", v[:half]
                yield f"{prefix}{e}.w3.{kind}", v[half:]
            else:  # [H, 2I] columns: w1 then w3
                yield f"{prefix}{e}.w1.{kind}", np.ascontiguousarray(v[:, :inter].T)
                yield f"{prefix}{e}.w3.{kind}", np.ascontiguousarray(v[:, inter:].T)
    elif key.endswith("_scale_inv"):
        yield names_v41.to_release(key[: -len("_scale_inv")])[: -len("weight")] + "scale", _scale_value(value)
    elif key.endswith(".table_scale"):
        yield names_v41.to_release(key[: -len("_scale")])[: -len("weight")] + "scale", _scale_value(value)
    else:
        yield names_v41.to_release(key), value


def release_tensors(model) -> Iterator[tuple[str, np.ndarray]]:
    """(release name, numpy array) for every variable of `model`, experts split per expert, then the
    weights kept beside it."""
    for path, value in stored_variables(model):
        dotted = ".".join(str(p) for p in path)
        if not dotted.startswith(names_v41.DERIVED):  # derived from the tokenizer, not part of the weights
            yield from release_names(model.cfg, dotted, value)
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
