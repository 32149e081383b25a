"""Loading a DeepSeek-V4.1 checkpoint in the release's layout (nested `config.json`, release tensor names,
FP8 weights in 32 × 32 blocks, FP4 experts, FP8 Engram tables) or the same names in a float dtype, as the
CPU reference writes one."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsjax.checkpoint import names_v41
from dsjax.checkpoint.stored import (check_kind, check_shape, dense_values, np_dtype, pair_scales,
                                     put_expert_dense, put_expert_stored, stored_scale, stored_weight)
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors, read_json
from dsjax.config_v41 import V41Config
from dsjax.engram_hash import EngramHasher, tokenizer_token_map
from dsjax.layers.ngram_hash import NgramHash, default_token_map
from dsjax.model_v41 import DeepseekV41
from dsjax.quant import dequantize_fp8

_QUANTIZED = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(np.int8))



def scale_path(path: str) -> str:
    """The dsjax variable holding the scales of the quantized variable `path`."""
    if path.endswith(".table"):
        return path + "_scale"
    if path.endswith(".weight"):
        return path + "_scale_inv"
    return path + "_scale_inv"  # merged experts: gate_up_proj_scale_inv, down_proj_scale_inv


def abstract_v41(cfg: V41Config, dtype, token_map=None) -> tuple[nnx.GraphDef, list, dict]:
    """(graphdef, flat state of ShapeDtypeStructs, dotted path → variable) of a `cfg` model."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DeepseekV41(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                                   token_map=token_map)))
    flat = list(nnx.to_flat_state(state))
    return graphdef, flat, {".".join(str(p) for p in path): var for path, var in flat}


def load_v41(folder: str, cfg_path: str, dtype=jnp.float32, weights: str = "keep") -> DeepseekV41:
    """A DeepseekV41 from a release-layout folder (see `dsjax.load_model`, which calls this for V4.1
    configs). Tensors of parts dsjax does not run yet (`names_v41.KEPT_PREFIXES`: DSpark's `mtp.*`, the
    image encoder) are kept as host arrays in `model.kept_weights`."""
    stored = V41Config.from_hf(cfg_path)
    cfg = stored if weights == "keep" else stored.replace(quantization=None)
    token_map = token_map_of(folder, cfg)
    if token_map is None:
        token_map = default_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    graphdef, flat, variables = abstract_v41(cfg, dtype, token_map)
    arrays: dict[str, np.ndarray] = {}
    filled: set = set()
    kept: dict[str, np.ndarray] = {}

    def dest(path: str) -> np.ndarray:
        if path not in arrays:
            sds = variables[path].get_value()
            arrays[path] = np.zeros(sds.shape, np_dtype(sds.dtype))
        return arrays[path]

    tensors, scales = pair_scales({name: (file, value) for name, file, value in iter_tensors(folder)})
    if scales and stored.quantization is None:
        weight, (name, file, _) = next(iter(scales.items()))
        raise CheckpointError(f"{file}: {name!r} scales {weight!r}, but {cfg_path} declares no quantization_config")
    for name, (file, value) in tensors.items():
        if names_v41.is_kept(name):
            kept[name] = np.asarray(value)
            if name in scales:
                kept[scales[name][0]] = np.asarray(scales[name][2])
            continue
        target = names_v41.to_dsjax(name)
        if target is None or (not isinstance(target, names_v41.ExpertPart) and target not in variables):
            raise CheckpointError(f"{file}: unexpected tensor {name!r}; it belongs to no DeepSeek-V4.1 parameter "
                                  "of this config")
        if isinstance(target, names_v41.ExpertPart):
            _put_expert(stored, name, file, value, scales.get(name), target, variables, dest, filled)
            continue
        if target in filled:
            raise CheckpointError(f"{file}: tensor {name!r} appears twice")
        want = variables[target].get_value()
        if np.dtype(want.dtype) in _QUANTIZED:
            check_shape(file, name, value, want.shape)
            dest(target)[...] = stored_weight(file, name, value, scales.get(name), np.dtype(want.dtype))
            sp = scale_path(target)
            sc = scales[name]
            check_shape(sc[1], sc[0], sc[2], variables[sp].get_value().shape)
            dest(sp)[...] = stored_scale(sc, np.dtype(variables[sp].get_value().dtype))
            filled.add(sp)
        else:
            value = _dense_v41(stored, file, name, value, scales.get(name))
            check_shape(file, name, value, want.shape)
            check_kind(file, name, value, np.dtype(want.dtype))
            dest(target)[...] = value
        filled.add(target)
    missing = sorted(p for p in set(variables) - filled if not p.startswith(DERIVED))
    if missing:
        shown = [_release_name(p) for p in missing[:8]]
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"{folder}: checkpoint lacks {len(missing)} tensor(s): {', '.join(shown)}{more}")
    for path, arr in arrays.items():
        variables[path].set_value(jnp.asarray(arr))
        arrays[path] = None
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if cfg.engram_layer_ids:  # the hash tables come from the tokenizer, not the checkpoint
        model.ngram_hash = NgramHash(EngramHasher.from_config(cfg, token_map))
    model.kept_weights = KeptWeights(kept)
    return model


DERIVED = ("ngram_hash.",)  # variables computed from the tokenizer, not read from the checkpoint


def token_map_of(folder: str, cfg: V41Config) -> np.ndarray | None:
    """Engram's compressed token map from the folder's `tokenizer.json`; None when there is none (a model of
    random weights: `ngram_hash.default_token_map`)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    token_map, size = tokenizer_token_map(read_json(path, "tokenizer"))
    if size != cfg.engram_compressed_vocab_size:
        raise CheckpointError(f"{path}: its vocabulary compresses to {size} Engram ids, but the config's "
                              f"engram_compressed_vocab_size is {cfg.engram_compressed_vocab_size}; Engram's hashes "
                              "depend on this size, so this tokenizer does not belong to these weights")
    return token_map


class KeptWeights:
    """Host arrays of the checkpoint's tensors dsjax does not run yet, by release name. Static model data:
    compared and hashed by identity, so a jitted model never hashes the arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays)

    def names(self) -> list[str]:
        return sorted(self.arrays)


def _release_name(path: str) -> str:
    if ".experts." in path and path.endswith(("gate_up_proj", "down_proj", "_proj_scale_inv")):
        return path.rsplit(".experts.", 1)[0] + ".experts.*"
    if path.endswith("_scale_inv"):
        return names_v41.to_release(path[: -len("_scale_inv")])[: -len("weight")] + "scale"
    if path.endswith(".table_scale"):
        return names_v41.to_release(path[: -len("_scale")])[: -len("weight")] + "scale"
    return names_v41.to_release(path)


def _dense_v41(stored: V41Config, file, name, value, scale) -> np.ndarray:
    """fp32 values of a tensor; an Engram table's scales are per row (32 values each), not 32 × 32 blocks."""
    if scale is not None and name.endswith("engram.embed.weight"):
        return np.asarray(dequantize_fp8(value, stored_scale(scale, np.dtype(np.float32)), jnp.float32, (1, 32)))
    return np.asarray(dense_values(stored, file, name, value, scale))


def _put_expert(stored: V41Config, name, file, value, scale, t: names_v41.ExpertPart, variables, dest,
                filled) -> None:
    if t.path not in variables:
        raise CheckpointError(f"{file}: unexpected tensor {name!r}; its layer does not exist in this config")
    e, inter, hidden = stored.n_routed_experts, stored.moe_intermediate_size, stored.hidden_size
    if not 0 <= t.expert < e:
        raise CheckpointError(f"{file}: tensor {name!r} names expert {t.expert}, but the config has {e}")
    key = (t.path, t.expert, t.part)
    if key in filled:
        raise CheckpointError(f"{file}: tensor {name!r} appears twice")
    want = variables[t.path].get_value()
    if np.dtype(want.dtype) in _QUANTIZED:  # kept as stored: [2I, in'] rows [w1 | w3], and so its scale rows
        sp = scale_path(t.path)
        put_expert_stored(t.part, dest(t.path)[t.expert], dest(sp)[t.expert],
                          stored_weight(file, name, value, scale, np.dtype(want.dtype)),
                          stored_scale(scale, np.dtype(variables[sp].get_value().dtype)), (name, file),
                          (scale[0], scale[1]))
    else:
        put_expert_dense(t.part, dest(t.path)[t.expert], _dense_v41(stored, file, name, value, scale), name, file,
                         inter, hidden)
    filled.add(key)
    parts = ("w2",) if t.part == "w2" else ("w1", "w3")
    if all((t.path, x, p) in filled for x in range(e) for p in parts):
        filled.add(t.path)
        if np.dtype(want.dtype) in _QUANTIZED:
            filled.add(scale_path(t.path))


def is_v41_folder(folder: str) -> bool:
    """Whether `folder/config.json` describes a DeepSeek-V4.1 model (an unreadable one is not)."""
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            raw = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in ("deepseek_v41", "deepseek_v41_text")
