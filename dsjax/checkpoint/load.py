"""`load_model`: a Hugging Face DeepSeek-V4 folder (any of the three namings, single or sharded) → DeepseekV4."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsjax.checkpoint import names
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors
from dsjax.config import ModelConfig
from dsjax.model import DeepseekV4

@dataclass
class _Target:
    path: tuple
    repeat: int | None  # index into the stacked layer axis, None for unstacked variables
    hf_shape: tuple[int, ...]
    transposed: bool


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def _targets(model_abs: DeepseekV4, flat: list) -> dict[str, _Target]:
    """HF name → where its value goes in the dsjax state."""
    out = {}
    for path, var in flat:
        shape = tuple(var.get_value().shape)
        for hf, repeat in names.hf_names_for(model_abs.groups_meta, path):
            per_layer = shape if repeat is None else shape[1:]
            transposed = hf.endswith(names.TRANSPOSED_LEAVES)
            hf_shape = (per_layer[0], per_layer[2], per_layer[1]) if transposed else per_layer
            out[hf] = _Target(path, repeat, hf_shape, transposed)
    return out


def load_model(path: str | os.PathLike, dtype=jnp.float32) -> DeepseekV4:
    """Load a DeepSeek-V4 model from a Hugging Face folder (`config.json` + safetensors).

    Accepts HF module names, the original DeepSeek names and the hybrid that `save_pretrained()` writes.
    Weights take `dtype` (float32 or bfloat16) except those the reference keeps in fp32 (norms, mHC,
    sinks, position biases, the router's correction bias). Unknown, missing or mis-shaped tensors raise
    a CheckpointError naming the tensor and its file.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is not a folder")
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{folder} has no config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    if raw.get("quantization_config"):
        raise CheckpointError(f"{cfg_path} declares a quantization_config: FP8/FP4 checkpoints are not "
                              "supported by this version of dsjax; dequantize them first")
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dtype must be jnp.float32 or jnp.bfloat16, got {dtype}")
    cfg = ModelConfig.from_hf(raw)

    model_abs = nnx.eval_shape(lambda: DeepseekV4(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(model_abs)
    flat = list(nnx.to_flat_state(state))
    variables = dict(flat)
    targets = _targets(model_abs, flat)
    arrays: dict[tuple, np.ndarray] = {}
    filled: set = set()

    def dest(t: _Target) -> np.ndarray:
        if t.path not in arrays:
            sds = variables[t.path].get_value()
            arrays[t.path] = np.zeros(sds.shape, _np_dtype(sds.dtype))
        return arrays[t.path] if t.repeat is None else arrays[t.path][t.repeat]

    for name, file, value in iter_tensors(folder):
        hf = names.to_hf(name)
        if hf is None:  # MTP weights: the reference drops them too.
            continue
        if isinstance(hf, names.ExpertSlice):
            _put_expert_slice(cfg, name, file, value, hf, targets, dest, filled)
            continue
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding
        t = targets.get(hf)
        if t is None:
            raise CheckpointError(f"{file}: unexpected tensor {name!r} (read as {hf!r}); it belongs to no "
                                  "DeepSeek-V4 parameter of this config")
        if hf in filled:
            raise CheckpointError(f"{file}: tensor {name!r} duplicates {hf!r} already read")
        if tuple(value.shape) != t.hf_shape:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {list(value.shape)}, "
                                  f"expected {list(t.hf_shape)} for this config")
        _check_values(cfg, hf, name, file, value)
        d = dest(t)
        d[...] = np.transpose(value, (0, 2, 1)) if t.transposed else value
        filled.add(hf)

    expected = set(targets)
    done = {k for k in filled if isinstance(k, str)}
    for hf, t in targets.items():
        if t.transposed and hf not in done:
            parts = ("w2",) if hf.endswith("down_proj") else ("w1", "w3")
            if all((hf, e, p) in filled for e in range(cfg.n_routed_experts) for p in parts):
                done.add(hf)
    missing = sorted(expected - done)
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"{folder}: checkpoint lacks {len(missing)} tensor(s): {missing[:8]}{more}")

    for p, arr in arrays.items():
        variables[p].set_value(jnp.asarray(arr))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _put_expert_slice(cfg, name, file, value, s: names.ExpertSlice, targets, dest, filled) -> None:
    t = targets.get(s.hf_name)
    if t is None:
        raise CheckpointError(f"{file}: unexpected tensor {name!r}; its layer does not exist in this config")
    e, inter, hidden = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if not 0 <= s.expert < e:
        raise CheckpointError(f"{file}: tensor {name!r} names expert {s.expert}, but the config has {e}")
    want = (hidden, inter) if s.part == "w2" else (inter, hidden)
    if tuple(value.shape) != want:
        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(value.shape)}, expected {list(want)}")
    key = (s.hf_name, s.expert, s.part)
    if key in filled:
        raise CheckpointError(f"{file}: tensor {name!r} appears twice")
    d = dest(t)[s.expert]  # [H, 2I] for gate_up, [I, H] for down
    if s.part == "w1":
        d[:, :inter] = value.T
    elif s.part == "w3":
        d[:, inter:] = value.T
    else:
        d[...] = value.T
    filled.add(key)


def _check_values(cfg: ModelConfig, hf: str, name: str, file: str, value: np.ndarray) -> None:
    if hf.endswith("mlp.gate.tid2eid"):
        lo, hi = int(value.min()), int(value.max())
        if lo < 0 or hi >= cfg.n_routed_experts:
            raise CheckpointError(f"{file}: tensor {name!r} routes to expert ids in [{lo}, {hi}], outside "
                                  f"[0, {cfg.n_routed_experts})")
