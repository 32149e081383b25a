"""Loading a DeepSeek-V4.1 checkpoint in the release's layout (nested `config.json`, release tensor names,
FP8 weights in 32 × 32 blocks, FP4 experts, FP8 Engram tables) or the same names in a float dtype, as the
CPU reference writes one."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.checkpoint import converted, names_v41
from dsjax.checkpoint.names_v41 import scale_path
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors, read_json
from dsjax.checkpoint.save_v41 import release_tensors
from dsjax.checkpoint.stored import (check_kind, check_scales_declared, check_shape, dense_values, pair_scales,
                                     put_expert_dense, put_expert_stored, stored_scale, stored_weight)
from dsjax.checkpoint.targets import Target, abstract_model_v41, kept_target
from dsjax.config_v41 import V41Config
from dsjax.engram_hash import EngramHasher, tokenizer_token_map
from dsjax.layers.ngram_hash import NgramHash, default_token_map
from dsjax.model_v41 import DeepseekV41
from dsjax.parallel.shard import on_mesh
from dsjax.quant import dequantize_fp8


def load_v41(folder: str, cfg_path: str, dtype=jnp.float32, weights: str = "keep",
             drafter: bool = True) -> DeepseekV41:
    """A DeepseekV41 from a release-layout folder (see `dsjax.load_model`, which calls this for V4.1
    configs). Release tensors dsjax does not use (`names_v41.KEPT_PREFIXES`) are kept as host arrays in
    `model.kept_weights`. `drafter=False` leaves DSpark's stages out (`without_drafter`)."""
    return _from_tensors(folder, V41Config.from_hf(cfg_path), iter_tensors(folder), cfg_path, dtype, weights,
                         drafter)


def without_drafter(cfg: V41Config) -> V41Config:
    """`cfg` without DSpark's stages: the model a run that does not draft loads (7.4 GiB less at V4.1-Flash's
    sizes), its `mtp.*` tensors left unread."""
    return cfg.replace(num_nextn_predict_layers=0)


def _from_tensors(folder: str, stored: V41Config, tensors, cfg_path: str, dtype, weights: str,
                  drafter: bool = True) -> DeepseekV41:
    """A DeepseekV41 from release tensors `(name, file, value)` of a checkpoint declaring `stored`."""
    cfg = stored if weights == "keep" else stored.replace(quantization=None)
    if not drafter:
        cfg = without_drafter(cfg)
        tensors = ((name, file, value) for name, file, value in tensors if not names_v41.is_draft(name))
    token_map = _token_map(folder, cfg)
    graphdef, flat, targets = abstract_model_v41(cfg, dtype, token_map)
    arrays: dict[str, np.ndarray] = {}
    kept: dict[str, np.ndarray] = {}
    filled: set = set()

    def dest(t: Target, _source_dtype) -> np.ndarray:
        if t.path is None:
            kept[t.hf] = np.empty(t.shape, t.dtype)
            return kept[t.hf]
        if t.hf not in arrays:
            arrays[t.hf] = np.zeros(t.shape, t.dtype)
        return arrays[t.hf]

    tensors, scales = pair_scales({name: (file, value) for name, file, value in tensors})
    check_scales_declared(stored, scales, cfg_path)
    for name, (file, value) in tensors.items():
        place_v41(stored, cfg, name, file, value, scales.get(name), targets, dest, filled)
    check_complete_v41(folder, cfg, targets, filled)
    variables = dict(flat)
    for key, arr in arrays.items():
        variables[targets[key].path].set_value(jnp.asarray(arr))
        arrays[key] = None  # free the host copy as soon as it is on the device
    return _finish(graphdef, flat, cfg, token_map, kept)


def load_converted_v41(folder: str, dtype=jnp.float32, weights: str = "keep", drafter: bool = True,
                       mesh=None) -> DeepseekV41:
    """A DeepseekV41 from a `dsjax convert` folder (`converted.py`'s layout, keyed by dsjax path; the kept
    weights by release name, on the host), on one device or read straight onto `mesh` by the rules table
    (`converted.fill`). `weights="bf16"` over FP8/FP4 storage dequantizes as `load_v41` does, from the
    release tensors the stored arrays are (then placed on `mesh`). `drafter=False` leaves DSpark's stages
    out."""
    man = converted.read_manifest(folder)
    cfg_path = os.path.join(folder, "config.json")
    stored = V41Config.from_hf(cfg_path)
    if weights == "bf16" and stored.quantization is not None:
        keep = load_converted_v41(folder, dtype, "keep", drafter)
        return on_mesh(_from_tensors(folder, keep.cfg, ((n, folder, v) for n, v in release_tensors(keep)), cfg_path,
                                     dtype, weights), mesh)
    token_map = _token_map(folder, stored)
    if not drafter:
        stored = without_drafter(stored)
    graphdef, flat, targets = abstract_model_v41(stored, dtype, token_map)
    pieces = converted.pieces_of(man)
    if not drafter:
        pieces = {k: p for k, p in pieces.items() if not names_v41.is_draft(p.hf)}
    kept = {k: p for k, p in pieces.items() if names_v41.is_kept(p.hf)}
    converted.fill(folder, {k: p for k, p in pieces.items() if k not in kept}, flat, targets, mesh)
    return _finish(graphdef, flat, stored, token_map, converted.read_whole(folder, list(kept.values())))


def _finish(graphdef, flat, cfg: V41Config, token_map: np.ndarray, kept: dict) -> DeepseekV41:
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if cfg.engram_layer_ids:  # the hash tables come from the tokenizer, not the checkpoint
        model.ngram_hash = NgramHash(EngramHasher.from_config(cfg, token_map))
    model.kept_weights = KeptWeights(kept)
    return model


def place_v41(stored: V41Config, cfg: V41Config, name: str, file: str, value: np.ndarray, scale, targets: dict,
              dest, filled: set) -> None:
    """Check one release tensor (with its scale, if quantized) and write it where it belongs; the V4.1 form of
    `load.place`, with the same `dest(target, source_dtype)` and `filled` (dsjax paths, and (path, expert,
    part) for per-expert tensors). A tensor of a part dsjax does not run is written to a `kept_target`."""
    if names_v41.is_kept(name):
        for n, f, v in ((name, file, value),) + ((scale,) if scale is not None else ()):
            if n in filled:
                raise CheckpointError(f"{f}: tensor {n!r} appears twice")
            dest(kept_target(n, v.shape, v.dtype), v.dtype)[...] = v
            filled.add(n)
        return
    path = names_v41.to_dsjax(name)
    if isinstance(path, names_v41.ExpertPart):
        _put_expert(stored, name, file, value, scale, path, targets, dest, filled)
        return
    t = targets.get(path)
    if t is None:
        raise CheckpointError(f"{file}: unexpected tensor {name!r}; it belongs to no DeepSeek-V4.1 parameter "
                              "of this config")
    if path in filled:
        raise CheckpointError(f"{file}: tensor {name!r} appears twice")
    if t.quantized:
        check_shape(file, name, value, t.shape)
        dest(t, value.dtype)[...] = stored_weight(file, name, value, scale, t.dtype)
        st = targets[scale_path(path)]
        check_shape(scale[1], scale[0], scale[2], st.shape)
        dest(st, scale[2].dtype)[...] = stored_scale(scale, st.dtype)
        filled.add(st.hf)
    else:
        source_dtype = value.dtype
        value = _dense_v41(stored, file, name, value, scale)
        check_shape(file, name, value, t.shape)
        check_kind(file, name, value, t.dtype)
        dest(t, source_dtype)[...] = value
    filled.add(path)


def check_complete_v41(folder: str, cfg: V41Config, targets: dict, filled: set) -> None:
    """Raise naming, in release names, the tensors `filled` lacks."""
    missing = sorted(set(targets) - filled)
    if missing:
        shown = [_release_name(p) for p in missing[:8]]
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"{folder}: checkpoint lacks {len(missing)} tensor(s): {', '.join(shown)}{more}")


def _token_map(folder: str, cfg: V41Config) -> np.ndarray:
    token_map = token_map_of(folder, cfg)
    return default_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size) if token_map is None else token_map


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
    """Host arrays of the checkpoint's tensors dsjax does not use, by release name. Static model data:
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


def _put_expert(stored: V41Config, name, file, value, scale, part: names_v41.ExpertPart, targets, dest,
                filled) -> None:
    t = targets.get(part.path)
    if t is None:
        raise CheckpointError(f"{file}: unexpected tensor {name!r}; its layer does not exist in this config")
    e, inter, hidden = t.shape[0], stored.moe_intermediate_size, stored.hidden_size  # a layer's or a stage's experts
    if not 0 <= part.expert < e:
        raise CheckpointError(f"{file}: tensor {name!r} names expert {part.expert}, but the config has {e}")
    key = (t.hf, part.expert, part.part)
    if key in filled:
        raise CheckpointError(f"{file}: tensor {name!r} appears twice")
    parts = ("w2",) if part.part == "w2" else ("w1", "w3")
    done = [t.hf]
    if t.quantized:  # kept as stored: [2I, in'] rows [w1 | w3], and so its scale rows
        st = targets[scale_path(t.hf)]
        weight = stored_weight(file, name, value, scale, t.dtype)
        put_expert_stored(part.part, dest(t, value.dtype)[part.expert], dest(st, scale[2].dtype)[part.expert],
                          weight, stored_scale(scale, st.dtype), (name, file), (scale[0], scale[1]))
        filled.add((st.hf, part.expert, part.part))
        done.append(st.hf)
    else:
        put_expert_dense(part.part, dest(t, value.dtype)[part.expert], _dense_v41(stored, file, name, value, scale),
                         name, file, inter, hidden)
    filled.add(key)
    if all((t.hf, x, p) in filled for x in range(e) for p in parts):
        filled.update(done)


def is_v41_folder(folder: str) -> bool:
    """Whether `folder/config.json` describes a DeepSeek-V4.1 model (an unreadable one is not)."""
    try:
        with open(os.path.join(folder, "config.json"), "rb") as f:
            raw = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in ("deepseek_v41", "deepseek_v41_text")
