"""How a checkpoint tensor is checked and turned into what a dsjax variable stores: scales paired with
their weights, shapes and kinds checked, quantized weights kept as stored or dequantized. Shared by the
V4 and V4.1 loaders and the converter."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsjax.checkpoint.safetensors_io import CheckpointError
from dsjax.quant import dequantize_fp4, dequantize_fp8, float_to_ue8m0, ue8m0_to_float


def np_dtype(dtype) -> np.dtype:
    """A jnp dtype as the numpy dtype host arrays of it take (bf16 through ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def pair_scales(tensors: dict):
    """{name: (file, x)} → (the same without scales, {weight name: (scale name, file, x)}): the FP8/FP4
    scales, keyed by the weight they scale: `X.scale` (original names) goes with `X.weight`,
    `Y_scale_inv` (HF names) with `Y`. A `.scale` without its `.weight` (e.g. HF's `attn_hc.scale`) is
    an ordinary tensor. `x` is a lazy array or a header entry; only names are looked at."""
    tensors = dict(tensors)
    scales = {}
    for name in list(tensors):
        if name.endswith("_scale_inv"):
            weight = name[: -len("_scale_inv")]
        elif name.endswith(".scale") and name[: -len("scale")] + "weight" in tensors:
            weight = name[: -len("scale")] + "weight"
        else:
            continue
        file, value = tensors.pop(name)
        if weight not in tensors:
            raise CheckpointError(f"{file}: scale tensor {name!r} has no weight {weight!r} in the checkpoint")
        scales[weight] = (name, file, value)
    return tensors, scales


def check_scales_declared(stored, scales: dict, cfg_path: str) -> None:
    """Scale tensors need a `quantization_config` that says how to read them."""
    if scales and stored.quantization is None:
        weight, (name, file, _) = next(iter(scales.items()))
        raise CheckpointError(f"{file}: {name!r} scales {weight!r}, but {cfg_path} declares no "
                              "quantization_config")


def check_shape(file, name, value, want) -> None:
    if tuple(value.shape) != tuple(want):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(value.shape)}, "
                              f"expected {list(want)} for this config")


def is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16)


def check_kind(file, name, value, want: np.dtype) -> None:
    """Float parameters take float tensors, integer tables integer ones (any width)."""
    if is_float(value.dtype) != is_float(want) or (not is_float(want) and value.dtype.kind not in "iu"):
        kind = "a float" if is_float(want) else "an integer"
        raise CheckpointError(f"{file}: tensor {name!r} is {value.dtype}, but the parameter it fills holds {kind} "
                              "type")


def stored_weight(file, name, value, scale, want: np.dtype) -> np.ndarray:
    """A quantized weight as it is kept: e4m3 bytes, or int8 holding two e2m1 codes."""
    if scale is None:
        raise CheckpointError(f"{file}: tensor {name!r} ({value.dtype}) has no scale, but this config keeps "
                              f"it quantized ({want}); expected {name[:-len('weight')]}scale or a "
                              "*_scale_inv tensor next to it")
    if value.dtype == np.uint8 and want == np.int8:
        value = value.view(np.int8)
    if value.dtype != want:
        kind = "FP4 (int8, two e2m1 codes per byte)" if want == np.int8 else "FP8 (float8_e4m3fn)"
        raise CheckpointError(f"{file}: tensor {name!r} is {value.dtype}, but the quantization_config makes "
                              f"it {kind}")
    return value


def stored_scale(scale, want: np.dtype) -> np.ndarray:
    """Scales in the storage the config asks for: ue8m0 bytes (uint8) or fp32."""
    name, file, value = scale
    if value.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        value = value.view(np.uint8)
    if want == np.uint8 and value.dtype != np.uint8:
        as_bytes = np.asarray(float_to_ue8m0(value))
        if not np.array_equal(np.asarray(ue8m0_to_float(as_bytes)), value.astype(np.float32)):
            raise CheckpointError(f"{file}: scale {name!r} holds values that are not powers of two, but the "
                                  "quantization_config says scale_fmt 'ue8m0'")
        return as_bytes
    if want == np.float32 and value.dtype == np.uint8:
        return np.asarray(ue8m0_to_float(value))
    return value.astype(want)


def dense_values(stored: ModelConfig, file, name, value, scale) -> np.ndarray:
    """A tensor as fp32 values: quantized weights are dequantized with their scale."""
    if scale is None:
        if value.dtype == np.dtype(ml_dtypes.float8_e4m3fn) or (value.dtype == np.int8 and name.endswith("weight")):
            raise CheckpointError(f"{file}: tensor {name!r} is {value.dtype} but has no scale tensor")
        return value
    s = stored_scale(scale, np.dtype(np.float32))
    try:
        if value.dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            return np.asarray(dequantize_fp8(value, s, jnp.float32, tuple(stored.quantization.weight_block_size)))
        if value.dtype in (np.dtype(np.int8), np.dtype(np.uint8)):
            return np.asarray(dequantize_fp4(value, s, jnp.float32))
    except ValueError as e:
        raise CheckpointError(f"{file}: tensor {name!r} and its scale {scale[0]!r} do not fit: {e}") from None
    raise CheckpointError(f"{file}: tensor {name!r} is {value.dtype} but has a scale {scale[0]!r}; only FP8 "
                          "(float8_e4m3fn) and FP4 (int8) weights are scaled")


def put_expert_stored(part: str, weight_rows: np.ndarray, scale_rows: np.ndarray, weight, scale, where: tuple,
                      scale_where: tuple) -> None:
    """One release per-expert tensor kept as stored: its rows (and its scale's) into the merged expert's
    `[2I, in']` gate_up (rows `[w1 | w3]`) or `[H, in']` down arrays, shapes checked; `where` and
    `scale_where` are each tensor's (name, file), for messages."""
    for d, v, (n, f) in ((weight_rows, weight, where), (scale_rows, scale, scale_where)):
        rows = d.shape[0] if part == "w2" else d.shape[0] // 2
        check_shape(f, n, v, (rows,) + d.shape[1:])
        d[rows if part == "w3" else 0:][:rows] = v


def put_expert_dense(part: str, merged: np.ndarray, value: np.ndarray, name: str, file: str, inter: int,
                     hidden: int) -> None:
    """One release per-expert tensor as fp32 values into the merged float expert: `[H, 2I]` gate_up (columns
    `[w1 | w3]`) or `[I, H]` down (dsjax holds them `[in, out]`)."""
    check_shape(file, name, value, (hidden, inter) if part == "w2" else (inter, hidden))
    if part == "w1":
        merged[:, :inter] = value.T
    elif part == "w3":
        merged[:, inter:] = value.T
    else:
        merged[...] = value.T

