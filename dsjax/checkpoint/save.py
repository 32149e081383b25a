"""`save_model`: a DeepseekV4 → a Hugging Face folder (config.json + sharded safetensors), with HF module
names or DeepSeek's original ones; `load_model` and transformers read both."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from dsjax.checkpoint.names import TRANSPOSED_LEAVES, hf_names_for, to_original
from dsjax.model import DeepseekV4


def hf_tensors(model: DeepseekV4):
    """Yields (HF name, numpy array) for every variable, layers unstacked, float experts back to
    [E, out, in] (quantized ones are stored that way already), scales as `*_scale_inv`."""
    float_experts = model.cfg.quantization is None
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Variable)):
        value = np.asarray(var.get_value())
        for name, repeat in hf_names_for(model.groups_meta, path):
            v = value if repeat is None else value[repeat]
            if float_experts and name.endswith(TRANSPOSED_LEAVES):
                v = np.ascontiguousarray(np.transpose(v, (0, 2, 1)))
            if name.endswith("_scale_inv") and v.dtype == np.uint8:
                v = v.view(ml_dtypes.float8_e8m0fnu)  # ue8m0 bytes, written as F8_E8M0 as DeepSeek does
            yield name, v


def original_tensors(model: DeepseekV4):
    """Yields (original DeepSeek name, numpy array): per-expert `w1`/`w3`/`w2` `[out, in]`, int64 `tid2eid`,
    and for quantized weights their scales as `X.scale` next to `X.weight`."""
    cfg = model.cfg
    inter = cfg.moe_intermediate_size
    for name, value in hf_tensors(model):
        expert_leaf = next((leaf for leaf in TRANSPOSED_LEAVES if name.endswith((leaf, leaf + "_scale_inv"))), None)
        if expert_leaf is not None:
            prefix = f"layers.{name.split('.')[2]}.ffn.experts."
            kind = "scale" if name.endswith("_scale_inv") else "weight"
            # gate_up rows are [w1 | w3]; a scale grid splits at the row block where w3 starts.
            split = inter
            if kind == "scale" and value.shape[1] != 2 * inter:
                split = _block_split(cfg, inter, value.shape[1])
            for e in range(value.shape[0]):
                if expert_leaf.endswith("down_proj"):
                    yield f"{prefix}{e}.w2.{kind}", value[e]
                else:
                    yield f"{prefix}{e}.w1.{kind}", np.ascontiguousarray(value[e, :split])
                    yield f"{prefix}{e}.w3.{kind}", np.ascontiguousarray(value[e, split:])
        elif name.endswith(".weight_scale_inv"):
            yield to_original(name[: -len("_scale_inv")])[: -len("weight")] + "scale", value
        else:
            yield to_original(name), value.astype(np.int64) if name.endswith("tid2eid") else value


def _block_split(cfg, inter: int, rows: int) -> int:
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
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors(model):
        if size and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(folder, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model.cfg.to_hf(), f, indent=1)
