"""`load_model`: a Hugging Face DeepSeek-V4 folder (any of the three namings, single or sharded) → DeepseekV4;
a DeepSeek-V4.1 release folder, or its `dsjax convert` output, → DeepseekV41 (`load_v41`)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsjax.checkpoint import converted, load_v41, names
from dsjax.checkpoint.safetensors_io import CheckpointError, iter_tensors
from dsjax.checkpoint.stored import (check_kind, check_scales_declared, check_shape, dense_values, np_dtype,
                                     pair_scales, put_expert_dense, put_expert_stored, stored_scale, stored_weight)
from dsjax.checkpoint.targets import Target, abstract_model
from dsjax.config import ModelConfig
from dsjax.model import DeepseekV4
from dsjax.parallel.shard import on_mesh
from dsjax.run_config import WEIGHTS, check_choice





def load_model(path: str | os.PathLike, dtype=jnp.float32, weights: str = "keep", mesh=None,
               drafter: bool = True) -> DeepseekV4:
    """Load a DeepSeek-V4 model from a Hugging Face folder (`config.json` + safetensors).

    Accepts HF module names, the original DeepSeek names and the hybrid that `save_pretrained()` writes.
    Float weights take `dtype` (float32 or bfloat16) except those the reference keeps in fp32 (norms, mHC,
    sinks, position biases, the router's correction bias). A checkpoint with a `quantization_config`
    (FP8 blocks, FP4 experts) keeps that storage on the device with `weights="keep"`, dequantized layer by
    layer inside each step; `weights="bf16"` dequantizes it once at load into `dtype` instead. Unknown,
    missing or mis-shaped tensors and unreadable weight files raise a CheckpointError naming the tensor
    and its file; a bad config.json a ConfigError naming the file and the field. A folder made
    by `dsjax convert` (Orbax) is read layer by layer straight onto the devices: onto `mesh` (a
    jax Mesh with axes dp/ep/tp, or a spec such as "ep=8", see `dsjax.parallel`) each device receiving only
    its slice of each array; a safetensors folder is loaded onto one device and then placed on `mesh`.
    DeepSeek-V4.1 loads the same ways; `drafter=False` leaves its DSpark stages (`mtp.*`) unread, for a run
    that does not draft.
    """
    check_choice("weights", weights, WEIGHTS)
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder} is not a folder")
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} is a folder, not a file" if os.path.isdir(cfg_path)
                              else f"{folder} has no config.json")
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"dtype must be jnp.float32 or jnp.bfloat16, got {dtype}")
    if isinstance(mesh, str):
        from dsjax.parallel.mesh import make_mesh

        mesh = make_mesh(mesh)
    if load_v41.is_v41_folder(folder):
        if converted.is_converted(folder):
            return load_v41.load_converted_v41(folder, dtype, weights, drafter, mesh)
        # whole on one device first, as for V4
        return on_mesh(load_v41.load_v41(folder, cfg_path, dtype, weights, drafter), mesh)
    if converted.is_converted(folder):
        return converted.load_converted(folder, dtype, weights, mesh)
    if mesh is not None:  # whole on one device first: fine for small models; convert large ones
        return on_mesh(load_model(folder, dtype, weights), mesh)
    stored = ModelConfig.from_hf(cfg_path)  # from the path, so that its errors name the file
    cfg = stored if weights == "keep" else stored.replace(quantization=None)

    graphdef, flat, targets = abstract_model(cfg, dtype)
    variables = dict(flat)
    arrays: dict[tuple, np.ndarray] = {}
    filled: set = set()

    def dest(t: Target, _source_dtype) -> np.ndarray:
        if t.path not in arrays:
            sds = variables[t.path].get_value()
            arrays[t.path] = np.zeros(sds.shape, np_dtype(sds.dtype))
        return arrays[t.path] if t.repeat is None else arrays[t.path][t.repeat]

    tensors, scales = pair_scales({name: (file, value) for name, file, value in iter_tensors(folder)})
    check_scales_declared(stored, scales, cfg_path)
    for name, (file, value) in tensors.items():
        place(stored, cfg, name, file, value, scales.get(name), targets, dest, filled)

    check_complete(folder, cfg, targets, filled)

    for p, arr in arrays.items():
        variables[p].set_value(jnp.asarray(arr))
        arrays[p] = None  # free the host copy as soon as it is on the device
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def check_complete(folder: str, cfg: ModelConfig, targets: dict, filled: set) -> None:
    """Raise naming the tensors `filled` lacks, in HF and original names (per expert where the checkpoint
    has per-expert tensors)."""
    done = {k for k in filled if isinstance(k, str)}
    missing = []
    for hf in sorted(set(targets) - done):
        leaf = next((x for x in names.TRANSPOSED_LEAVES if hf.endswith((x, x + "_scale_inv"))), None)
        parts = ("w2",) if leaf and leaf.endswith("down_proj") else ("w1", "w3")
        absent = [(e, p) for e in range(cfg.n_routed_experts) for p in parts if (hf, e, p) not in filled]
        if not leaf or len(absent) == cfg.n_routed_experts * len(parts):
            missing.append(f"{hf} ({_original_name(hf)})")
        elif absent:
            kind = "scale" if hf.endswith("_scale_inv") else "weight"
            layer = hf.split(".")[2]
            missing += [f"layers.{layer}.ffn.experts.{e}.{p}.{kind}" for e, p in absent]
    if missing:
        more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"{folder}: checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:8])}{more}")


def _original_name(hf: str) -> str:
    if hf.endswith(names.TRANSPOSED_LEAVES + tuple(x + "_scale_inv" for x in names.TRANSPOSED_LEAVES)):
        return f"layers.{hf.split('.')[2]}.ffn.experts.*"
    if hf.endswith(".weight_scale_inv"):
        return names.to_original(hf[: -len("_scale_inv")])[: -len("weight")] + "scale"
    return names.to_original(hf)


def place(stored: ModelConfig, cfg: ModelConfig, name: str, file: str, value: np.ndarray, scale, targets: dict,
          dest, filled: set) -> None:
    """Check one checkpoint tensor (with its scale, if quantized) and write it where it belongs.

    `dest(target, source_dtype)` gives the array to fill (per layer; the merged experts indexable by expert);
    `filled` collects what has been written: HF names, and (HF name, expert, part) for per-expert tensors.
    `stored` is the config the checkpoint declares, `cfg` the one being built (no quantization for bf16).
    """
    hf = names.to_hf(name)
    if hf is None:  # MTP weights: the reference drops them too.
        return
    if isinstance(hf, names.ExpertSlice):
        _put_expert_slice(stored, name, file, value, scale, hf, targets, dest, filled)
        return
    if hf == "lm_head.weight" and cfg.tie_word_embeddings:
        return  # tied: the head is the embedding
    t = targets.get(hf)
    if t is None:
        raise CheckpointError(f"{file}: unexpected tensor {name!r} (read as {hf!r}); it belongs to no "
                              "DeepSeek-V4 parameter of this config")
    if hf in filled:
        raise CheckpointError(f"{file}: tensor {name!r} duplicates {hf!r} already read")
    if t.quantized:
        st = targets[_scale_hf(hf)]
        check_shape(file, name, value, t.hf_shape)
        dest(t, value.dtype)[...] = stored_weight(file, name, value, scale, t.dtype)
        check_shape(scale[1], scale[0], scale[2], st.hf_shape)
        dest(st, scale[2].dtype)[...] = stored_scale(scale, st.dtype)
        filled.add(_scale_hf(hf))
    else:
        source_dtype = value.dtype
        value = dense_values(stored, file, name, value, scale)
        check_shape(file, name, value, t.hf_shape)
        check_kind(file, name, value, t.dtype)
        _check_values(cfg, hf, name, file, value)
        dest(t, source_dtype)[...] = np.transpose(value, (0, 2, 1)) if t.transposed else value
    filled.add(hf)


def _scale_hf(hf: str) -> str:
    return hf + "_scale_inv"














def _put_expert_slice(stored, name, file, value, scale, s: names.ExpertSlice, targets, dest, filled) -> None:
    t = targets.get(s.hf_name)
    if t is None:
        raise CheckpointError(f"{file}: unexpected tensor {name!r}; its layer does not exist in this config")
    e, inter, hidden = stored.n_routed_experts, stored.moe_intermediate_size, stored.hidden_size
    if not 0 <= s.expert < e:
        raise CheckpointError(f"{file}: tensor {name!r} names expert {s.expert}, but the config has {e}")
    key = (s.hf_name, s.expert, s.part)
    if key in filled:
        raise CheckpointError(f"{file}: tensor {name!r} appears twice")
    if t.quantized:
        # [2I, in'] / [H, in'] rows as stored; gate_up's rows are [w1 | w3], and so are its scale rows.
        st = targets[_scale_hf(s.hf_name)]
        w, sc = dest(t, value.dtype)[s.expert], dest(st, scale[2].dtype)[s.expert]
        value = stored_weight(file, name, value, scale, t.dtype)
        block = stored.quantization.weight_block_size[0]
        if s.part != "w2" and stored.quantization.expert_dtype == "fp8" and inter % block:
            raise CheckpointError(f"{file}: {name!r}: per-expert FP8 w1/w3 cannot be merged when "
                                  f"moe_intermediate_size ({inter}) is not a multiple of the {block}-row block")
        put_expert_stored(s.part, w, sc, value, stored_scale(scale, st.dtype), (name, file), (scale[0], scale[1]))
        filled.add((_scale_hf(s.hf_name), s.expert, s.part))
    else:
        source_dtype = value.dtype
        put_expert_dense(s.part, dest(t, source_dtype)[s.expert], dense_values(stored, file, name, value, scale),
                         name, file, inter, hidden)
    filled.add(key)

def _check_values(cfg: ModelConfig, hf: str, name: str, file: str, value: np.ndarray) -> None:
    if hf.endswith("mlp.gate.tid2eid"):
        lo, hi = int(value.min()), int(value.max())
        if lo < 0 or hi >= cfg.n_routed_experts:
            raise CheckpointError(f"{file}: tensor {name!r} routes to expert ids in [{lo}, {hi}], outside "
                                  f"[0, {cfg.n_routed_experts})")
