"""`save_model`: a DeepseekV4 → a Hugging Face folder (config.json + sharded safetensors), with HF module
names or DeepSeek's original ones; `load_model` and transformers read both."""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from dsjax.checkpoint.names import TRANSPOSED_LEAVES, hf_names_for, to_original
from dsjax.checkpoint.shards import ShardWriter
from dsjax.config import ModelConfig
from dsjax.model import DeepseekV4, stored_variables

Tensors = Iterable[tuple[str, np.ndarray]]


def hf_value(name: str, value: np.ndarray, float_experts: bool) -> np.ndarray:
    """A dsjax variable as the HF tensor `name`: float experts back to [E, out, in] (quantized ones are
    stored that way already), ue8m0 scales typed F8_E8M0 as DeepSeek writes them."""
    if float_experts and name.endswith(TRANSPOSED_LEAVES):
        value = np.ascontiguousarray(np.transpose(value, (0, 2, 1)))
    if name.endswith("_scale_inv") and value.dtype == np.uint8:
        value = value.view(ml_dtypes.float8_e8m0fnu)
    return value


def hf_tensors(model: DeepseekV4) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, numpy array) for every variable, layers unstacked, scales as `*_scale_inv`."""
    float_experts = model.cfg.quantization is None
    for path, value in stored_variables(model):
        for name, repeat in hf_names_for(model.groups_meta, path):
            yield name, hf_value(name, value if repeat is None else value[repeat], float_experts)


def original_names(cfg: ModelConfig, tensors: Tensors, first_expert: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named tensors → the original DeepSeek names: per-expert `w1`/`w3`/`w2` `[out, in]`, int64
    `tid2eid`, and for quantized weights their scales as `X.scale` next to `X.weight`. Merged expert
    tensors may be a block of experts starting at `first_expert`."""
    inter = cfg.moe_intermediate_size
    for name, value in tensors:
        expert_leaf = next((leaf for leaf in TRANSPOSED_LEAVES if name.endswith((leaf, leaf + "_scale_inv"))), None)
        if expert_leaf is not None:
            prefix = f"layers.{name.split('.')[2]}.ffn.experts."
            kind = "scale" if name.endswith("_scale_inv") else "weight"
            # gate_up rows are [w1 | w3]; a scale grid splits at the row block where w3 starts.
            split = inter
            if kind == "scale" and value.shape[1] != 2 * inter:
                split = _block_split(cfg, inter)
            for i in range(value.shape[0]):
                e = first_expert + i
                if expert_leaf.endswith("down_proj"):
                    yield f"{prefix}{e}.w2.{kind}", value[i]
                else:
                    yield f"{prefix}{e}.w1.{kind}", np.ascontiguousarray(value[i, :split])
                    yield f"{prefix}{e}.w3.{kind}", np.ascontiguousarray(value[i, split:])
        elif name.endswith(".weight_scale_inv"):
            yield to_original(name[: -len("_scale_inv")])[: -len("weight")] + "scale", value
        else:
            yield to_original(name), value.astype(np.int64) if name.endswith("tid2eid") else value


def original_tensors(model: DeepseekV4) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (original DeepSeek name, numpy array) for every tensor of `model`."""
    return original_names(model.cfg, hf_tensors(model))


def _block_split(cfg: ModelConfig, inter: int) -> int:
    block = cfg.quantization.weight_block_size[0]
    if inter % block:
        raise ValueError(f"FP8 experts with moe_intermediate_size {inter} (not a multiple of the {block}-row "
                         "block) cannot be split into per-expert w1/w3 tensors; save with naming='hf'")
    return inter // block


def save_model(model: DeepseekV4, folder: str | os.PathLike, max_shard_bytes: int = 4 << 30,
               naming: str = "hf") -> None:
    """Write `model` as config.json + model-00001-of-0000N.safetensors shards + index (bf16 stays bf16).

    `naming`: "hf" (HF module names, merged experts) or "original" (DeepSeek's release names).
    """
    tensors = {"hf": hf_tensors, "original": original_tensors}.get(naming)
    if tensors is None:
        raise ValueError(f"naming must be 'hf' or 'original', got {naming!r}")
    writer = ShardWriter(folder, max_shard_bytes)
    for name, value in tensors(model):
        writer.add(name, value)
    writer.close()
    with open(os.path.join(writer.folder, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf(), f, indent=1)
