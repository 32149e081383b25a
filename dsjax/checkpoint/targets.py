"""Where each checkpoint tensor goes in a dsjax model: the targets the loaders, the converter and the
converted layout's reader share, for DeepSeek-V4 (keyed by HF name, layers stacked) and DeepSeek-V4.1
(keyed by dsjax path, one variable per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsjax.checkpoint import names, names_v41
from dsjax.config import ModelConfig
from dsjax.model import abstract_state, layer_groups
from dsjax.model_v41 import abstract_state as abstract_state_v41

_QUANTIZED = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.int8))  # FP8 weights, packed FP4 experts


@dataclass
class Target:
    """Where the checkpoint tensor `hf` goes in the dsjax state. `hf` is also the tensor's key in the
    converted layout: the HF name (V4), the dsjax path (V4.1), or the release name of a weight kept
    beside the model (V4.1's `kept_weights`, `path` None)."""

    hf: str
    path: tuple | None
    repeat: int | None  # index into the stacked layer axis, None for unstacked variables
    shape: tuple[int, ...]  # one layer's slice of the dsjax variable
    hf_shape: tuple[int, ...]  # the same in the checkpoint's orientation
    transposed: bool
    dtype: np.dtype
    scale: bool = False  # the scales of a quantized weight (stored in the config's scale format)

    @property
    def quantized(self) -> bool:
        return self.dtype in _QUANTIZED


def targets_of(cfg: ModelConfig, flat: list) -> dict[str, Target]:
    """HF name → where its value goes in the dsjax state."""
    out = {}
    groups = layer_groups(cfg.layer_kinds)
    for path, var in flat:
        sds = var.get_value()
        shape = tuple(sds.shape)
        for hf, repeat in names.hf_names_for(groups, path):
            per_layer = shape if repeat is None else shape[1:]
            # dsjax holds float experts [E, in, out]; quantized ones keep the checkpoint's [E, out, in].
            transposed = hf.endswith(names.TRANSPOSED_LEAVES) and np.dtype(sds.dtype) not in _QUANTIZED
            hf_shape = (per_layer[0], per_layer[2], per_layer[1]) if transposed else per_layer
            out[hf] = Target(hf, path, repeat, per_layer, hf_shape, transposed, np.dtype(sds.dtype),
                             hf.endswith("_scale_inv"))
    return out


def abstract_model(cfg: ModelConfig, dtype=jnp.bfloat16):
    """(graphdef, flat state of ShapeDtypeStructs, HF name → Target) of a `cfg` model, nothing allocated."""
    graphdef, flat = abstract_state(cfg, dtype)
    return graphdef, flat, targets_of(cfg, flat)


def abstract_model_v41(cfg, dtype=jnp.bfloat16, token_map=None):
    """(graphdef, flat state of ShapeDtypeStructs, dsjax path → Target) of a DeepSeek-V4.1 `cfg` model,
    nothing allocated; the variables derived from the tokenizer (`names_v41.DERIVED`) have no target."""
    graphdef, flat = abstract_state_v41(cfg, dtype, token_map)
    shapes = {".".join(str(p) for p in path): (path, var.get_value()) for path, var in flat}
    scales = {names_v41.scale_path(k) for k, (_, sds) in shapes.items() if np.dtype(sds.dtype) in _QUANTIZED}
    targets = {}
    for key, (path, sds) in shapes.items():
        if not key.startswith(names_v41.DERIVED):
            shape = tuple(sds.shape)
            targets[key] = Target(key, path, None, shape, shape, False, np.dtype(sds.dtype), key in scales)
    return graphdef, flat, targets


def kept_target(name: str, shape, dtype) -> Target:
    """A tensor kept beside the model as read, under its own name (V4.1's DSpark and image encoder)."""
    return Target(name, None, None, tuple(shape), tuple(shape), False, np.dtype(dtype))
