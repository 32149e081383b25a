"""Where each checkpoint tensor goes in a dsjax model: the targets the loader, the converter and the
converted layout's reader share."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsjax.checkpoint import names
from dsjax.config import ModelConfig
from dsjax.model import abstract_state, layer_groups

_QUANTIZED = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.int8))  # FP8 weights, packed FP4 experts


@dataclass
class Target:
    """Where the checkpoint tensor `hf` goes in the dsjax state."""

    hf: str
    path: tuple
    repeat: int | None  # index into the stacked layer axis, None for unstacked variables
    shape: tuple[int, ...]  # one layer's slice of the dsjax variable
    hf_shape: tuple[int, ...]  # the same in the checkpoint's orientation
    transposed: bool
    dtype: np.dtype

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
            out[hf] = Target(hf, path, repeat, per_layer, hf_shape, transposed, np.dtype(sds.dtype))
    return out


def abstract_model(cfg: ModelConfig, dtype=jnp.bfloat16):
    """(graphdef, flat state of ShapeDtypeStructs, HF name → Target) of a `cfg` model, nothing allocated."""
    graphdef, flat = abstract_state(cfg, dtype)
    return graphdef, flat, targets_of(cfg, flat)
